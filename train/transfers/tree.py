"""The repository's code, which every call carries (git's view of it), and the folder a transfer
is written to inside it."""

from __future__ import annotations

import os
import subprocess

from train.transfers.common import TransferError
from train.transfers.manifest import MANIFEST

CODE_LEFT_OUT = "checkpoints/"  # moved out of the tree for the calls: the shipped graft, 41 MiB


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


def check_out(out: str, corpus: str, cache: str, overwrite: bool,
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
