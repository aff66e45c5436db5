"""Writing a file so that a reader, or a run killed mid-write, finds the old one or the new one,
never half of one."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable


def write_atomic(path: str, write: Callable[[str], None]) -> None:
  """`write(tmp)` writes the file's content to the temporary path `tmp` (of this process);
  it is then synced and renamed to `path`. A failure leaves `path` as it was and no
  temporary file behind."""
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    write(tmp)
    with open(tmp, "rb+") as f:
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_text_atomic(path: str, text: str) -> None:
  def write(tmp: str) -> None:
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
  write_atomic(path, write)


def write_json_atomic(path: str, obj: Any, **dump_kwargs: Any) -> None:
  """json.dump(obj) to `path` through a temporary file of this process, synced, then renamed."""
  write_text_atomic(path, json.dumps(obj, **dump_kwargs))


def write_dir_atomic(path: str, write: Callable[[str], None]) -> None:
  """`write(tmp)` fills a fresh directory `tmp` beside `path`, which then takes `path`'s place.
  A directory already at `path` moves aside first and is removed after, so that `path` is
  missing only between two renames; a failure leaves `path` as it was. Work directories left by
  a killed writer (`path`.tmp, `path`.old) are removed first: one writer per directory."""
  path = path.rstrip("/") or path
  tmp, old = path + ".tmp", path + ".old"
  for stale in (tmp, old):
    if os.path.exists(stale):
      shutil.rmtree(stale)
  os.makedirs(tmp)
  try:
    write(tmp)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  if os.path.exists(path):
    os.replace(path, old)
  os.replace(tmp, path)
  if os.path.exists(old):
    shutil.rmtree(old)
