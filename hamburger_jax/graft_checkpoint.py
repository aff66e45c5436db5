"""A graft checkpoint on disk: writing one from a model's params, reading its tables back.

A graft checkpoint (the params-only export of a training run, what `infer.generate --checkpoint`
reads) is a directory holding `hamburger.json` (configs + base source) and `graft.safetensors`
(grafted weights under their dotted param paths), plus `base.safetensors` when the base was
trained too. Written with `max_shard_mb`, each of those is instead a series of files of at most
that size (`graft-00001-of-00003.safetensors`, ...), listed with their sizes and sha256 in
`hamburger.json` (`shards`); a tensor larger than a file is split across files. Loading reads
either form.

A checkpoint is written whole in a temporary directory that then replaces the old one
(files.write_dir_atomic): a run killed mid-export, or a full disk, leaves the previous checkpoint
(or none), never a directory whose metadata, tables and shards come from two exports or stop
halfway, which would only fail (or load wrong weights) when someone reads it later. On a bucket
(`gs://...`), where nothing renames atomically, the directory is finished by a marker written
last, and reading refuses a checkpoint without it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from hamburger_jax import files
from hamburger_jax import micro_vocab as micro_vocab_lib
from hamburger_jax.config import to_dict
from hamburger_jax.convert import mapping
from hamburger_jax.convert.mapping import Rule, WeightsError
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import GraftParam

GRAFT_FILE, BASE_FILE, META_FILE = "graft.safetensors", "base.safetensors", "hamburger.json"
GRAFT, BASE = "graft", "base"  # the tables a checkpoint holds: `<name>.safetensors` or its shards
# The smallest shard limit: a shard must hold its safetensors header and some tensor bytes.
MIN_SHARD_BYTES = 4096


def graft_table(model: Hamburger) -> dict[str, Rule]:
  """Dotted param path -> the grafted param (what graft.safetensors holds)."""
  return {".".join(map(str, p)): Rule(tuple(p))
          for p, _ in nnx.to_flat_state(nnx.state(model, GraftParam))}


def base_table(model: Hamburger) -> dict[str, Rule]:
  return {".".join(map(str, p)): Rule(tuple(p))
          for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
          if not isinstance(v, GraftParam)}


def save_graft(model: Hamburger, path: str, base_source: str, *, dtype: str = "bfloat16",
               include_base: bool = False, extra: dict | None = None,
               max_shard_mb: float | None = None, micro_vocab_from: str | None = None) -> None:
  """Writes a graft checkpoint atomically (temp dir + rename).

  `max_shard_mb`: write each table in files of at most this many MiB (e.g. 16 where files move
  through transfers capped per file); None: one file per table. `micro_vocab_from`: the
  checkpoint the graft was trained from (train.init_from), whose micro-step vocabulary the export
  carries where it is for this model's vocabulary (micro_vocab.carried): without it the entry
  points would decode the trained graft with the full head and its init with the list, and a
  judge could not set one beside the other."""
  check_shard_limit(max_shard_mb)  # before any export work
  mapping.check_training_layout(model)  # before any export work
  np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
              "float16": np.float16}[dtype]
  tables = {GRAFT: graft_table(model)}
  if include_base:
    tables[BASE] = base_table(model)
  tensors = {name: {k: np.ascontiguousarray(v.astype(np_dtype))
                    for k, v in mapping.export(model, table).items()}
             for name, table in tables.items()}
  # The base's architecture; the layout key (always the separate projections here) is left out,
  # so exports read as they always have.
  base_config = {k: v for k, v in to_dict(model.cfg.base).items() if k != "fused_projections"}
  meta = {"format": "hamburger-jax/graft-v1", "base_source": base_source,
          "base_config": base_config, "graft": to_dict(model.cfg.graft),
          "dtype": dtype, "include_base": include_base, **(extra or {})}
  keep = micro_vocab_lib.carried(micro_vocab_from, model.cfg.base.vocab_size)
  _write_checkpoint(path, meta, tensors, max_shard_mb, keep=[keep] if keep else [])


def reshard_graft(path: str, out: str | None = None, *, max_shard_mb: float | None) -> str:
  """Rewrites the graft checkpoint at `path` (sharded or not) in files of at most `max_shard_mb`
  MiB (None: one file per table), at `out` or in place, atomically; returns where. The tensors
  are copied bit for bit."""
  check_shard_limit(max_shard_mb)
  meta = read_meta(path)
  names = [GRAFT] + ([BASE] if meta.get("include_base") else [])
  tensors = {name: read_tensors(path, name, meta) for name in names}
  meta = {k: v for k, v in meta.items() if k != "shards"}
  out = out or path
  # Same tensors, so the checkpoint's micro-step vocabulary still belongs to it.
  keep = [files.join(path, micro_vocab_lib.FILE)]
  _write_checkpoint(out, meta, tensors, max_shard_mb,
                    keep=[f for f in keep if files.isfile(f)])
  return out


def check_shard_limit(max_shard_mb: float | None) -> None:
  if max_shard_mb is not None and not max_shard_mb * 2**20 >= MIN_SHARD_BYTES:
    raise ValueError(f"max_shard_mb={max_shard_mb} is too small: a shard must hold at least "
                     f"{MIN_SHARD_BYTES} bytes ({MIN_SHARD_BYTES / 2**20:g} MiB)")


def shard_file(name: str, index: int, count: int) -> str:
  """The file of shard `index` (1-based) of `count` of table `name`."""
  return f"{name}-{index:05d}-of-{count:05d}.safetensors"


def _part_key(name: str, i: int) -> str:
  return f"{name}@{i}"  # dotted param paths hold no '@'


def _header_bytes(key: str, arr: np.ndarray) -> int:
  """An upper bound on what `key` adds to a safetensors header (its JSON entry: dtype, shape,
  offsets of up to 20 digits each, quoting)."""
  return len(json.dumps(key)) + 96 + 21 * arr.ndim


def _plan_shards(tensors: Mapping[str, np.ndarray], limit: int
                 ) -> tuple[list[dict[str, np.ndarray]], dict[str, list[int]]]:
  """Packs `tensors` (in name order) into shards of at most `limit` bytes each, header included.
  A tensor goes whole into the current shard, else whole into a new one, else (larger than a
  shard) flattened and split over as many shards as it fills, as parts `name@0`, `name@1`, ...
  Returns the shards and the shape of each split tensor."""
  capacity = limit - 24  # the 8-byte header length, the header's braces, its padding to 8
  shards: list[dict[str, np.ndarray]] = [{}]
  split: dict[str, list[int]] = {}
  room = capacity

  def add(key: str, arr: np.ndarray) -> None:
    nonlocal room
    shards[-1][key] = arr
    room -= arr.nbytes + _header_bytes(key, arr)

  def new_shard() -> None:
    nonlocal room
    shards.append({})
    room = capacity

  for name in sorted(tensors):
    arr = tensors[name]
    need = arr.nbytes + _header_bytes(name, arr)
    if need > room and need <= capacity:
      new_shard()
    if need <= room:
      add(name, arr)
      continue
    flat, start, parts = arr.reshape(-1), 0, 0
    while start < flat.size:
      key = _part_key(name, parts)
      fit = (room - _header_bytes(key, flat[:1])) // arr.itemsize
      if fit < 1:
        if not shards[-1]:
          raise ValueError(f"a shard of {limit} bytes cannot hold any part of tensor {name!r}")
        new_shard()
        continue
      add(key, flat[start:start + fit])
      start, parts = start + fit, parts + 1
    split[name] = list(arr.shape)
  return [s for s in shards if s], split


def _write_tables(directory: str, meta: dict[str, Any],
                  tensors: Mapping[str, Mapping[str, np.ndarray]],
                  max_shard_mb: float | None) -> dict[str, Any]:
  """Writes each table of `tensors` into `directory`; returns `meta` with the shard index."""
  if max_shard_mb is None:
    for name, table in tensors.items():
      save_file(dict(table), os.path.join(directory, f"{name}.safetensors"))
    return meta
  limit = int(max_shard_mb * 2**20)
  meta["shards"] = {}
  for name, table in tensors.items():
    shards, split = _plan_shards(table, limit)
    entries = []
    for i, shard in enumerate(shards, start=1):
      file = shard_file(name, i, len(shards))
      path = os.path.join(directory, file)
      save_file(shard, path)
      size = os.path.getsize(path)
      if size > limit:  # the plan's header bound is wrong: never ship an oversized shard
        raise RuntimeError(f"internal: shard {file} is {size} bytes, over the {limit}-byte limit")
      entries.append({"file": file, "bytes": size, "sha256": files.sha256(path)})
    meta["shards"][name] = {"files": entries, "split": split}
  return meta


def _write_checkpoint(path: str, meta: dict[str, Any],
                      tensors: Mapping[str, Mapping[str, np.ndarray]],
                      max_shard_mb: float | None, keep: Sequence[str] = ()) -> None:
  """Writes `meta` and each table of `tensors` into a checkpoint directory at `path`, with
  copies of the files `keep`; a previous checkpoint there is replaced whole."""
  def write(tmp: str) -> None:
    full = _write_tables(tmp, dict(meta), tensors, max_shard_mb)
    with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
      json.dump(full, f, indent=2)
    for name in keep:
      files.download(name, os.path.join(tmp, os.path.basename(name)))
  files.write_dir_atomic(path, write)


def read_meta(path: str) -> dict[str, Any]:
  meta_path = files.join(path, META_FILE)
  if not files.exists(meta_path):
    why = files.missing_bucket(path) or f"no {META_FILE}"
    raise WeightsError(f"{path} is not a HAMburger checkpoint ({why}); pass the "
                       "directory written by train.main's export or "
                       "hamburger_jax.graft_checkpoint.save_graft")
  if not files.is_complete(path):
    raise WeightsError(f"{path} is an unfinished export (no {files.COMMIT_MARKER}: its writer "
                       "stopped, or is still writing, before the end); export it again")
  try:
    meta = json.loads(files.read_text(meta_path))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise WeightsError(f"{meta_path} is not valid JSON ({e}): the checkpoint is damaged; "
                       "re-export it (train.main writes it at the end of a run)") from None
  missing = [k for k in ("base_source", "base_config", "graft")
             if not isinstance(meta, dict) or k not in meta]
  if missing:
    raise WeightsError(f"{meta_path} lacks {', '.join(missing)}: it is not a HAMburger "
                       "checkpoint's metadata, or it is damaged; re-export the checkpoint")
  return meta


def _shard_entry(checkpoint: str, name: str, meta: Mapping[str, Any]) -> Any:
  """Table `name`'s entry in the shard index (None: the table is one file)."""
  shards = meta.get("shards")
  if shards is not None and not isinstance(shards, Mapping):
    raise WeightsError(f"{os.path.join(checkpoint, META_FILE)}: the shard index is damaged; "
                       "re-export the checkpoint")
  return (shards or {}).get(name)


def tensors_source(checkpoint: str, name: str, meta: Mapping[str, Any]) -> str:
  """What errors about table `name`'s tensors call its file(s)."""
  entry = _shard_entry(checkpoint, name, meta)
  if not entry:
    return os.path.join(checkpoint, f"{name}.safetensors")
  return os.path.join(checkpoint, f"{name}-*-of-{len(entry['files']):05d}.safetensors")


def _read_file(path: str, local: str | None = None) -> dict[str, np.ndarray]:
  """The tensors of file `path`, read from `local` (its local copy) when given."""
  try:
    if local is not None:
      return load_file(local)
    with files.local_copy(path) as copy:
      return load_file(copy)
  except FileNotFoundError:
    raise WeightsError(f"{path} is missing: the checkpoint is incomplete; re-export it") from None
  except files.StorageError:
    raise  # a bucket that cannot be read says so itself
  except Exception as e:  # pylint: disable=broad-except  # safetensors' SafetensorError & co.
    raise WeightsError(f"{path} cannot be read ({e}): the file is truncated or corrupted; "
                       "re-export the checkpoint or restore the file") from None


def read_tensors(checkpoint: str, name: str, meta: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Table `name` (graft or base) of a checkpoint whose metadata is `meta`: one file, or its
  shards checked against the index (size and sha256) and split tensors joined again."""
  entry = _shard_entry(checkpoint, name, meta)
  if entry is None:
    return _read_file(files.join(checkpoint, f"{name}.safetensors"))
  meta_path = files.join(checkpoint, META_FILE)
  try:
    shards = [(str(f["file"]), int(f["bytes"]), str(f["sha256"])) for f in entry["files"]]
    split = {str(k): tuple(int(d) for d in v) for k, v in entry["split"].items()}
  except (KeyError, TypeError, ValueError, AttributeError):
    raise WeightsError(f"{meta_path}: the shard index of {name!r} is damaged; re-export the "
                       "checkpoint") from None
  tensors: dict[str, np.ndarray] = {}
  for file, size, digest in shards:
    if os.path.basename(file) != file or not file.endswith(".safetensors"):
      raise WeightsError(f"{meta_path}: shard {file!r} is not a file name in the checkpoint "
                         "directory; re-export the checkpoint")
    path = files.join(checkpoint, file)
    if not files.isfile(path):
      raise WeightsError(f"{path} is missing: the checkpoint is incomplete (hamburger.json lists "
                         f"{len(shards)} shards of {name!r}); copy every shard, or re-export it")
    with files.local_copy(path) as local:  # a shard on a bucket is downloaded once
      if (got := os.path.getsize(local)) != size:
        raise WeightsError(f"{path} has {got} bytes but the index lists {size}: "
                           "the file is truncated or was not copied whole; copy it again")
      if files.sha256(local) != digest:
        raise WeightsError(f"{path} is corrupted (its sha256 differs from the index's); copy it "
                           "again or re-export the checkpoint")
      table = _read_file(path, local)
    for key, value in table.items():
      if key in tensors:
        raise WeightsError(f"{path}: tensor {key!r} is in two shards; re-export the checkpoint")
      tensors[key] = value
  for tensor, shape in split.items():
    parts = []
    while _part_key(tensor, len(parts)) in tensors:
      parts.append(tensors.pop(_part_key(tensor, len(parts))).reshape(-1))
    flat = np.concatenate(parts) if parts else np.zeros((0,), np.float32)
    if flat.size != int(np.prod(shape, dtype=np.int64)):
      raise WeightsError(f"{tensors_source(checkpoint, name, meta)}: the parts of tensor "
                         f"{tensor!r} hold {flat.size} values, not the {shape} it was split "
                         "from; a shard is missing or from another export")
    tensors[tensor] = flat.reshape(shape)
  return tensors
