"""The calls that carry a transfer's folders, and `build`, which writes the folders and plans the
calls."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

from train.transfers.common import (ANSWERS, ANSWERS_OUT, BASE, GGUF_FILE, GRAFT_OUT, KINDS, MIB,
                                    SUITE, SUITE_OUT, WHEELS, TransferError,
                                    mib)
from train.transfers.manifest import MANIFEST
from train.transfers.packing import (Item, corpus_items, dir_items, graft_items, pack_with_manifest,
                                     tree_bytes, write_folders)
from train.transfers.tree import CODE_LEFT_OUT, check_out, code_tree
from train.transfers.wheels import WHEELS_CACHE, WINDOW_WHEELS, wheels_for

LIMIT_MIB = 64.0  # what one call carries, code included
MARGIN_MIB = 1.0  # for code edited between the build and the calls, and the copy's overhead
MAX_FOLDERS = 5  # 4 calls that only carry a folder, then the training call
# install's destinations in the printed command
SITE, CORPUS_OUT = "/tmp/site", "/tmp/corpus"
# A command there is stopped at 10 minutes: the install and the start take ~30 s of what the
# window's budget leaves; its scratch files stay outside $OUT (at most 8 files come back).
TRAIN_COMMAND = ("PYTHONUNBUFFERED=1 python -m train.window --config "
                 f"configs/smollm2_135m_window.yaml --corpus {CORPUS_OUT} --budget-minutes 8.4 "
                 "--out $OUT/window --work /tmp/window-work")
COMMAND_MAX = 2000  # characters of one call's command


@dataclasses.dataclass(frozen=True)
class Plan:
  """The folders written and the calls that carry them."""
  out: str  # as carried: relative to the repository's root
  code_bytes: int
  code_files: int
  limit: int
  capacity: int  # bytes of one folder, its manifest included
  folder_bytes: list[int]
  folder_kinds: list[dict[str, int]]  # per folder: prefix -> bytes
  train_command: str
  graft: bool = False  # a graft export travels (--init-from)

  def install_command(self) -> str:
    graft = f" --graft-out {GRAFT_OUT}" if self.graft else ""
    return (f"python3 -m train.transfers install --from {self.out} --site {SITE} "
            f"--corpus-out {CORPUS_OUT}{graft} && export PYTHONPATH={SITE}:$PWD && "
            f"{self.train_command}")

  def calls(self) -> list[tuple[list[str], str]]:
    """Each call's carry list and command."""
    n = len(self.folder_bytes)
    return [([f"{self.out}/{k}"], self.install_command() if k == n else f"du -sh {self.out}/*")
            for k in range(1, n + 1)]

  def lines(self) -> list[str]:
    n = len(self.folder_bytes)
    out = [f"code that travels with every call (without {CODE_LEFT_OUT}): "
           f"{mib(self.code_bytes)} ({self.code_files} files)",
           f"each folder at most {mib(self.capacity)}: {mib(self.limit)} a call - "
           f"{mib(self.code_bytes)} code - {mib(MARGIN_MIB * MIB)} margin"]
    for k, (size, kinds) in enumerate(zip(self.folder_bytes, self.folder_kinds), 1):
      what = ", ".join(f"{kind.rstrip('/')} {mib(b)}" for kind, b in kinds.items())
      out.append(f"  {self.out}/{k}  {mib(size)}  ({what}, {MANIFEST})")
    out += ["",
            "The calls, from the repository's root, one right after another (the machine keeps",
            "the folders of earlier calls only while it stays up, about 30 s after a call):",
            f"  before, here: mv {CODE_LEFT_OUT.rstrip('/')} ../checkpoints.aside"
            "   (the shipped graft must not travel with every call)"]
    for k, (carry, command) in enumerate(self.calls(), 1):
      out.append(f"  call {k}{' (training)' if k == n else ''}: carry {json.dumps(carry)}")
      out.append(f"    {command}")
    out += [f"  after, here: mv ../checkpoints.aside {CODE_LEFT_OUT.rstrip('/')}",
            "If the install names a missing or damaged part, repeat the call of its folder, "
            "then the last."]
    return out


def build(corpus: str, out: str, *, pins: Sequence[str] = WINDOW_WHEELS,
          cache: str = WHEELS_CACHE, download: bool = True, gguf: str | None = None,
          limit_mib: float = LIMIT_MIB, overwrite: bool = False,
          train_command: str = TRAIN_COMMAND, init_from: str | None = None,
          suite: str | None = None, answers_in: Sequence[str] = ()) -> Plan:
  """Writes the folders under `out` (inside the repository, ignored by git) and returns the
  plan of the calls. Everything is checked before anything is written; a failure leaves `out`
  as it was. `init_from`: a graft export that travels too; the training command continues it
  (`--init-from GRAFT_OUT`). `suite`: the judge's suite (`--suite SUITE_OUT`); `answers_in`:
  earlier windows' answers/ directories (`--answers-in ANSWERS_OUT/K`)."""
  from hamburger_jax import assets, files  # pylint: disable=import-outside-toplevel
  out = os.path.abspath(out)
  root, rel = check_out(out, corpus, cache, overwrite, init_from)

  code_bytes, code_files, code_paths = code_tree(root)
  corpus_files = corpus_items(corpus)
  travelling = [os.path.relpath(os.path.realpath(i.source), root).replace(os.sep, "/")
                for i in corpus_files]
  if any(p in code_paths for p in travelling):
    raise TransferError(f"the corpus {corpus} lies in the repository and git does not ignore it: "
                        "every call would carry it; move it under runs/ or data/ (ignored)")
  limit = int(limit_mib * MIB)
  capacity = limit - code_bytes - int(MARGIN_MIB * MIB)

  gguf = gguf or assets.smollm2_gguf()
  items = [Item(WHEELS + os.path.basename(w), w, os.path.getsize(w))
           for w in wheels_for(pins, cache, download)]
  items.append(Item(BASE + GGUF_FILE, gguf, os.path.getsize(gguf)))
  items += corpus_files
  if init_from:
    items += graft_items(init_from)
    train_command = f"{train_command} --init-from {GRAFT_OUT}"
  if suite:
    items += dir_items(SUITE, suite, "suite.json", "--suite",
                       "write one with python -m infer.eval --write-suite DIR")
    train_command = f"{train_command} --suite {SUITE_OUT}"
  for k, d in enumerate(answers_in, 1):
    items += dir_items(f"{ANSWERS}{k}/", d, "answers-00001.npz", "--answers-in",
                       "give the answers/ directory of an earlier window's --out")
    train_command = f"{train_command} --answers-in {ANSWERS_OUT}/{k}"
  folders, reserve = pack_with_manifest(items, capacity)
  if len(folders) > MAX_FOLDERS:
    kinds = {k: b for k in KINDS if (b := sum(i.size for i in items if i.name.startswith(k)))}
    raise TransferError(
        f"the transfer needs {len(folders)} folders of at most {mib(capacity)} ({mib(limit)} a "
        f"call - {mib(code_bytes)} code - {mib(MARGIN_MIB * MIB)} margin) for "
        + ", ".join(f"{k.rstrip('/')} {mib(b)}" for k, b in kinds.items())
        + f" = {mib(sum(kinds.values()))}; at most {MAX_FOLDERS} fit ({MAX_FOLDERS - 1} calls "
        "that carry a folder, then the training call): make the corpus smaller "
        "(train.token_corpus), the code lighter, or leave out --init-from")

  plan = Plan(rel, code_bytes, code_files, limit, capacity,
              [sum(p.size for p in f) + reserve for f in folders],
              [{k: b for k in KINDS
                if (b := sum(p.size for p in f if p.item.name.startswith(k)))} for f in folders],
              train_command, graft=bool(init_from))
  if any(len(c) > COMMAND_MAX for _, c in plan.calls()):
    raise TransferError(f"the training call's command is over {COMMAND_MAX} characters: "
                        "shorten --train-command")
  files.write_dir_atomic(out, lambda tmp: write_folders(tmp, folders, items))
  sizes = [tree_bytes(os.path.join(out, str(k))) for k in range(1, len(folders) + 1)]
  if max(sizes) > capacity:  # the packing's own arithmetic, checked on what was written
    raise TransferError(f"a folder came out at {mib(max(sizes))}, over {mib(capacity)}: a bug in "
                        f"train/transfers/; the folders under {out} must not be sent")
  return dataclasses.replace(plan, folder_bytes=sizes)
