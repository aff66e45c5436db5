"""The work of a dataset preparation, in shards that processes share without talking to each
other: the plan every process derives from the same inputs, a lock per process, a done marker
per shard, and the join's lock.

The kept samples, in source order, are cut into shards of `shard_size` consecutive samples.
Process I of N computes the shards k with k % N == I (strided: sources are often read one after
another, long ShareGPT answers then short arithmetic, so contiguous ranges would load one
process far more than another). Every process reads and tokenises all the sources (cheap next
to the forward passes) and so knows the whole plan (shards, validation split) without talking
to the others. A shard is a small tfds dataset `OUT.shards/shard-KKKKK/` plus its done marker
`shard-KKKKK.json`, written (atomically) only after the dataset is complete; the join links the
shards' files into OUT. A shard packs its samples into rows on its own, exactly as one process
did with its chunks of the same size, and every device runs the same per-device batch
(`batch_tokens` per device), so the records do not depend on how many processes or devices
made them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
from typing import Any, Iterator, Mapping, Sequence

from hamburger_jax.files import write_json_atomic

SHARDS_SUFFIX = ".shards"
PLAN_FILE = "plan.json"
PLAN_FORMAT = 1
JOIN_LOCK = ".join.lock"


class ShardsError(ValueError):
  """A shards directory that does not fit this run, or is not complete (named, with the fix)."""


def shards_dir_of(out_dir: str) -> str:
  """Where the shards of the dataset `out_dir` are written until they are joined."""
  return os.path.abspath(out_dir) + SHARDS_SUFFIX


def shard_owner(shard: int, num_processes: int) -> int:
  return shard % num_processes


def shard_name(k: int) -> str:
  return f"shard-{k:05d}"


def canonical(obj: Any) -> Any:
  """`obj` as it reads back from JSON (tuples become lists, keys strings)."""
  return json.loads(json.dumps(obj, sort_keys=True))


def plan_id(plan: Mapping[str, Any]) -> str:
  return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


def read_json(path: str) -> Any:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (FileNotFoundError, json.JSONDecodeError):
    return None


def plan_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
  out = []
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key), new.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      out += [f"{key}.{d}" for d in plan_differences(a, b)]
    elif a != b:
      out.append("inputs (the kept samples or their split)" if key == "inputs" else
                 f"{key} ({a!r} there, {b!r} here)")
  return out


@contextlib.contextmanager
def process_lock(shards: str, process_id: int) -> Iterator[None]:
  """Held while process `process_id` works in `shards`: a second copy of it is refused, and a
  run that finds no live holder may discard shards of another plan."""
  fd = os.open(os.path.join(shards, f"process-{process_id:05d}.lock"), os.O_CREAT | os.O_RDWR,
               0o600)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise ShardsError(f"process {process_id} is already running on {shards} (another "
                        "train.prepare_data with the same --out and --process-id)") from None
    yield
  finally:
    os.close(fd)


def open_plan(shards: str, plan: dict[str, Any], may_discard: bool) -> None:
  """Writes `plan` to `shards`, or checks it against the one there. A different plan is an error
  (a different process count always); a single process (`may_discard`) replaces the other
  plan's shards instead, as a killed run's work is redone."""
  path = os.path.join(shards, PLAN_FILE)
  old = read_json(path)
  if old is None:
    tmp = f"{path}.tmp-{os.getpid()}"
    write_json_atomic(tmp, plan, sort_keys=True)
    try:
      os.link(tmp, path)  # fails if another process wrote its plan first
    except FileExistsError:
      old = read_json(path)
    except OSError:  # a filesystem without hard links: the last writer's plan stands
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
    if old is None:
      return
  if old == plan:
    return
  if old.get("num_processes") != plan["num_processes"]:
    raise ShardsError(
        f"{shards} holds the shards of a run of {old.get('num_processes')} processes but this "
        f"run has --num-processes {plan['num_processes']}: the process counts must match (each "
        f"process resumes its own shards). Rerun with --num-processes "
        f"{old.get('num_processes')}, or remove {shards} to start over")
  diff = "; ".join(plan_differences(old, plan))
  if not may_discard:
    raise ShardsError(f"{shards} holds the shards of a run with other inputs or settings ({diff})"
                      f": rerun with the same sources and flags, or remove {shards} to start over")
  print(f"note: discarding the shards in {shards}, made with other inputs or settings ({diff})",
        file=sys.stderr)
  for entry in os.listdir(shards):
    if entry.startswith(("shard-", ".shard-")) or entry == PLAN_FILE:
      if os.path.isdir(os.path.join(shards, entry)):
        shutil.rmtree(os.path.join(shards, entry))
      else:
        os.remove(os.path.join(shards, entry))
  open_plan(shards, plan, may_discard=False)


def shard_marker(shards: str, k: int, plan_id: str) -> dict[str, Any] | None:
  """Shard k's done marker if the shard is complete for this plan, else None."""
  marker = read_json(os.path.join(shards, shard_name(k) + ".json"))
  if (not isinstance(marker, dict) or marker.get("plan") != plan_id
      or not os.path.isdir(os.path.join(shards, shard_name(k)))):
    return None
  return marker


def ranges(ks: Sequence[int]) -> str:
  """[1, 2, 3, 7] -> "1-3, 7"."""
  out, i = [], 0
  while i < len(ks):
    j = i
    while j + 1 < len(ks) and ks[j + 1] == ks[j] + 1:
      j += 1
    out.append(str(ks[i]) if i == j else f"{ks[i]}-{ks[j]}")
    i = j + 1
  return ", ".join(out)
