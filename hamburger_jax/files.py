"""Writing a file so that a reader, or a run killed mid-write, finds the old one or the new one,
never half of one."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json_atomic(path: str, obj: Any, **dump_kwargs: Any) -> None:
  """json.dump(obj) to `path` through a temporary file of this process, synced, then renamed."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, **dump_kwargs)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
