"""Loading real models: a base from GGUF or an HF directory, and HAMburger graft checkpoints.

A graft checkpoint (the params-only export of a training run, what `infer.generate --checkpoint`
reads) is a directory holding `hamburger.json` (configs + base source) and `graft.safetensors`
(grafted weights under their dotted param paths), plus `base.safetensors` when the base was
trained too. Written with `max_shard_mb`, each of those is instead a series of files of at most
that size (`graft-00001-of-00003.safetensors`, ...), listed with their sizes and sha256 in
`hamburger.json` (`shards`); a tensor larger than a file is split across files. Loading reads
either form.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from typing import Any, Mapping, Sequence

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from hamburger_jax import assets
from hamburger_jax import micro_vocab as micro_vocab_lib
from hamburger_jax.config import (KNOWN_ARCHITECTURES, ConfigError, GraftConfig,
                                  HamburgerConfig, LlamaConfig, from_dict, to_dict)
from hamburger_jax.convert import gguf, hf, mapping
from hamburger_jax.convert.mapping import Rule, WeightsError
from hamburger_jax.model.hamburger import Hamburger, copy_top_layers_into_micro
from hamburger_jax.model.llama import GraftParam, Llama
from hamburger_jax.tokenizer import Tokenizer

DEFAULT_BASE = "smollm2"
GRAFT_FILE, BASE_FILE, META_FILE = "graft.safetensors", "base.safetensors", "hamburger.json"
GRAFT, BASE = "graft", "base"  # the tables a checkpoint holds: `<name>.safetensors` or its shards
# The smallest shard limit: a shard must hold its safetensors header and some tensor bytes.
MIN_SHARD_BYTES = 4096
DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "checkpoints", "smollm2-135m-hamburger")
UNTRAINED = "untrained"  # load_hamburger's name for a freshly grafted, untrained model


def resolve_base(source: str) -> tuple[str, str]:
  """'smollm2' | path/to/model.gguf | HF directory -> (kind, path)."""
  if source in (DEFAULT_BASE, "default"):
    return "gguf", assets.smollm2_gguf()
  if source.endswith(".gguf"):
    if not os.path.exists(source):
      raise FileNotFoundError(f"GGUF file {source} does not exist")
    return "gguf", source
  if os.path.isdir(source):
    return "hf", source
  raise FileNotFoundError(
      f"base model {source!r} is neither 'smollm2', a .gguf file nor an HF model directory")


def load_llama(source: str = DEFAULT_BASE, **overrides: Any) -> tuple[Llama, Tokenizer]:
  """Loads a base model and its tokenizer. `overrides` set LlamaConfig fields (e.g. dtype)."""
  kind, path = resolve_base(source)
  if kind == "gguf":
    converted = gguf.read_converted(path)  # from the converted-weights cache when it can
    cfg = converted.config(**overrides)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))  # filled below, no random init
    gguf.load_into(model, converted, cfg)
    return model, Tokenizer.from_gguf(converted)
  cfg = dataclasses.replace(hf.read_config(path), **overrides)
  model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  hf.load_into(model, path, cfg)
  return model, Tokenizer.from_hf_dir(path)


def vocab_size(checkpoint: str | None = None, base_source: str | None = None) -> int:
  """The vocabulary of the model that load_hamburger(checkpoint, base_source) (checkpoint None:
  load_llama(base_source)) would build, from metadata only: for argument checks that must not
  wait for the weights."""
  if checkpoint == UNTRAINED:
    checkpoint = None  # fresh modules on the base: the base's vocabulary
  if checkpoint is not None and base_source is None:
    meta = read_meta(checkpoint)
    try:
      return int(meta["base_config"]["vocab_size"])
    except (KeyError, TypeError, ValueError):
      raise WeightsError(f"{os.path.join(checkpoint, META_FILE)}: base_config has no valid "
                         "vocab_size; the checkpoint's metadata is damaged, re-export it") from None
  kind, path = resolve_base(base_source or DEFAULT_BASE)
  if kind == "gguf":
    return gguf.GGUFFile(path).config().vocab_size
  return hf.read_config(path).vocab_size


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
               max_shard_mb: float | None = None) -> None:
  """Writes a graft checkpoint atomically (temp dir + rename).

  `max_shard_mb`: write each table in files of at most this many MiB (e.g. 16 where files move
  through transfers capped per file); None: one file per table."""
  check_shard_limit(max_shard_mb)  # before any export work
  if model.cfg.base.fused_projections:
    raise WeightsError("this model is in the decoding layout (fused projections, folded "
                       "adapters: model/decode_layout.py); export the model it was made from")
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
  _write_checkpoint(path, meta, tensors, max_shard_mb)


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
  keep = [os.path.join(path, micro_vocab_lib.FILE)]
  _write_checkpoint(out, meta, tensors, max_shard_mb,
                    keep=[f for f in keep if os.path.isfile(f)])
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


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return h.hexdigest()


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
    files = []
    for i, shard in enumerate(shards, start=1):
      file = shard_file(name, i, len(shards))
      path = os.path.join(directory, file)
      save_file(shard, path)
      size = os.path.getsize(path)
      if size > limit:  # the plan's header bound is wrong: never ship an oversized shard
        raise RuntimeError(f"internal: shard {file} is {size} bytes, over the {limit}-byte limit")
      files.append({"file": file, "bytes": size, "sha256": _sha256(path)})
    meta["shards"][name] = {"files": files, "split": split}
  return meta


def _write_checkpoint(path: str, meta: dict[str, Any],
                      tensors: Mapping[str, Mapping[str, np.ndarray]],
                      max_shard_mb: float | None, keep: Sequence[str] = ()) -> None:
  """Writes `meta` and each table of `tensors` into a temp dir beside `path`, with copies of the
  files `keep`, then swaps it in."""
  path = path.rstrip("/") or path
  tmp, old = path + ".tmp", path + ".old"
  for stale in (tmp, old):  # left by a run killed mid-export
    if os.path.exists(stale):
      shutil.rmtree(stale)
  os.makedirs(tmp)
  try:
    meta = _write_tables(tmp, dict(meta), tensors, max_shard_mb)
    with open(os.path.join(tmp, META_FILE), "w") as f:
      json.dump(meta, f, indent=2)
    for f in keep:
      shutil.copy2(f, tmp)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  # The previous checkpoint moves aside rather than being deleted first: `path` is missing only
  # between two renames.
  if os.path.exists(path):
    os.replace(path, old)
  os.replace(tmp, path)
  if os.path.exists(old):
    shutil.rmtree(old)


def read_meta(path: str) -> dict[str, Any]:
  meta_path = os.path.join(path, META_FILE)
  if not os.path.exists(meta_path):
    raise WeightsError(f"{path} is not a HAMburger checkpoint (no {META_FILE}); pass the "
                       f"directory written by train.main's export or hamburger_jax.pretrained.save_graft")
  try:
    with open(meta_path, encoding="utf-8") as f:
      meta = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise WeightsError(f"{meta_path} is not valid JSON ({e}): the checkpoint is damaged; "
                       "re-export it (train.main writes it at the end of a run)") from None
  missing = [k for k in ("base_source", "base_config", "graft")
             if not isinstance(meta, dict) or k not in meta]
  if missing:
    raise WeightsError(f"{meta_path} lacks {', '.join(missing)}: it is not a HAMburger "
                       "checkpoint's metadata, or it is damaged; re-export the checkpoint")
  return meta


def _same_architecture(a: LlamaConfig, b: LlamaConfig) -> bool:
  ignore = {"param_dtype", "dtype", "max_position_embeddings", "fused_projections"}
  return all(getattr(a, f.name) == getattr(b, f.name)
             for f in dataclasses.fields(LlamaConfig) if f.name not in ignore)


def resolve_checkpoint(checkpoint: str | None) -> str | None:
  """The graft checkpoint a caller means: `checkpoint` as given, or for None the shipped one
  (DEFAULT_CHECKPOINT), or None when nothing is given and nothing is shipped (a wheel without
  the repository's checkpoints/)."""
  if checkpoint is not None:
    return checkpoint
  return DEFAULT_CHECKPOINT if os.path.isdir(DEFAULT_CHECKPOINT) else None


def load_hamburger(checkpoint: str | None = None, base_source: str | None = None,
                   graft: GraftConfig | None = None, seed: int = 0,
                   **overrides: Any) -> tuple[Hamburger, Tokenizer]:
  """A HAMburger on a real base, from a graft checkpoint directory: by default the shipped one
  (DEFAULT_CHECKPOINT, trained on SmolLM2-135M-Instruct).

  `checkpoint=UNTRAINED` ("untrained") grafts fresh, randomly initialised modules (`graft`, else
  GraftConfig(), seeded by `seed`) onto the base instead: their multi-token groups mean nothing,
  but confidence 1.0 still decodes the base exactly. `base_source` defaults to the checkpoint's
  own base (UNTRAINED: SmolLM2); `overrides` set LlamaConfig fields (e.g. dtype).
  """
  if checkpoint == UNTRAINED:
    base, tok = load_llama(base_source or DEFAULT_BASE, **overrides)
    model = Hamburger(HamburgerConfig(base.cfg, graft or GraftConfig()), rngs=nnx.Rngs(seed),
                      base=base)
    return model, tok
  resolved = resolve_checkpoint(checkpoint)
  if resolved is None:
    raise WeightsError(f"no HAMburger checkpoint is shipped at {DEFAULT_CHECKPOINT}: pass a "
                       f"checkpoint directory, or load_hamburger({UNTRAINED!r}) for an untrained "
                       "graft")
  if graft is not None:
    raise ValueError("`graft` configures an untrained graft only; a checkpoint brings its own "
                     f"(pass checkpoint={UNTRAINED!r} to graft fresh modules)")
  meta = read_meta(resolved)
  try:  # before the base loads: a damaged hamburger.json should not cost a model load
    ckpt_base = from_dict(LlamaConfig, meta["base_config"])
    graft_cfg = from_dict(GraftConfig, meta["graft"])
  except ConfigError as e:
    raise WeightsError(f"{os.path.join(resolved, META_FILE)}: {e}; the checkpoint's metadata is "
                       "damaged, re-export it") from None
  source = base_source or meta["base_source"]
  base, tok = load_llama(source, **overrides)
  if not _same_architecture(ckpt_base, base.cfg):
    raise WeightsError(
        f"checkpoint {resolved} was trained on a different base ({ckpt_base}) than "
        f"{source!r} ({base.cfg}); pass the matching --base or checkpoint")
  cfg = HamburgerConfig(base.cfg, graft_cfg)
  # Built abstract, not randomly initialised (seconds of eager init on a CPU): the base's arrays
  # are moved in and the checkpoint fills every grafted param; load_graft's loader refuses a
  # model left with any param unset.
  model = nnx.eval_shape(lambda: Hamburger(cfg, rngs=nnx.Rngs(seed)))
  nnx.update(model.base, nnx.state(base))
  load_graft(model, resolved)
  return model, tok


MODES = ("base", "hamburger", "both")  # "both": one HAMburger model, decoded in either mode


def default_mode(checkpoint: str | None = None, *, both: bool = False) -> str:
  """The mode a caller means when it names none: HAMburger ("both" where the caller compares it
  with the base) when a graft checkpoint is given or shipped, else the base alone."""
  if resolve_checkpoint(checkpoint) is None:
    return "base"
  return "both" if both else "hamburger"


def load(mode: str = "hamburger", checkpoint: str | None = None, base: str | None = None, *,
         untrained_ok: bool = False, micro_vocab: int | None = None,
         **overrides: Any) -> tuple[Llama | Hamburger, Tokenizer]:
  """The model and tokenizer an Engine serves in `mode`; the one load sequence of every entry
  point.

  "base": the base model alone (`base`, default SmolLM2; `checkpoint` unused). "hamburger" and
  "both": the graft checkpoint (default: the shipped one) on its own base or on `base`; an
  engine decodes such a model in either mode. With no checkpoint given nor shipped, an untrained
  graft where `untrained_ok` (smoke tests: its groups mean nothing), else a WeightsError.
  `micro_vocab` N: micro steps choose among the first N ids of the checkpoint's stored list
  (hamburger_jax/micro_vocab.py), checked before the weights load. `overrides` set LlamaConfig
  fields (e.g. dtype)."""
  if mode not in MODES:
    raise ValueError(f"mode={mode!r}: use one of {', '.join(MODES)}")
  if mode == "base":
    if micro_vocab is not None:
      raise micro_vocab_lib.MicroVocabError("a micro vocabulary applies to HAMburger's micro "
                                            "steps: the base alone has none (drop it)")
    return load_llama(base or DEFAULT_BASE, **overrides)
  resolved = resolve_checkpoint(checkpoint)
  if resolved is None and not untrained_ok:
    raise WeightsError(f"mode {mode!r} needs a trained graft checkpoint and none is shipped at "
                       f"{DEFAULT_CHECKPOINT}: pass a checkpoint directory (--checkpoint DIR)")
  ids = None
  if micro_vocab is not None:  # checked before the weights load
    ids = micro_vocab_ids(resolved, micro_vocab, vocab_size(resolved, base))
  model, tok = load_hamburger(resolved or UNTRAINED, base, **overrides)
  if ids is not None:
    model.set_micro_vocab(ids)
  return model, tok


def micro_vocab_ids(checkpoint: str | None, size: int, vocab: int) -> np.ndarray:
  """The first `size` ids of a graft checkpoint's micro-step vocabulary, checked against a
  vocabulary of `vocab` tokens (hamburger_jax/micro_vocab.py; a MicroVocabError says what is
  wrong)."""
  if checkpoint is None:
    raise micro_vocab_lib.MicroVocabError("a micro vocabulary is stored with a trained graft "
                                          "checkpoint, and none is given or shipped")
  return micro_vocab_lib.load(checkpoint, size, vocab)


def describe(mode: str, checkpoint: str | None = None, base: str | None = None) -> str:
  """What `load(mode, checkpoint, base)` loads, in words (progress lines, results files)."""
  if mode == "base":
    return f"base {base or DEFAULT_BASE}"
  resolved = resolve_checkpoint(checkpoint)
  return (f"HAMburger {resolved or 'untrained graft'}" + (f" on {base}" if base else ""))


def load_graft(model: Hamburger, checkpoint: str) -> None:
  """Loads a graft checkpoint's weights into `model` (its base too when the run trained it).

  Also serves models built from a run config (e.g. a random tiny base rebuilt from its seed),
  which `load_hamburger` cannot reload by name.
  """
  meta = read_meta(checkpoint)
  if meta["graft"] != to_dict(model.cfg.graft):
    raise WeightsError(f"checkpoint {checkpoint} has graft config {meta['graft']} but the model "
                       f"has {to_dict(model.cfg.graft)}: build the model from the run's config")
  tables = [(GRAFT, graft_table(model))]
  if meta.get("include_base"):
    tables.append((BASE, base_table(model)))
  for name, table in tables:
    mapping.load(model, read_tensors(checkpoint, name, meta), table,
                 _tensors_source(checkpoint, name, meta))


def _shard_entry(checkpoint: str, name: str, meta: Mapping[str, Any]) -> Any:
  """Table `name`'s entry in the shard index (None: the table is one file)."""
  shards = meta.get("shards")
  if shards is not None and not isinstance(shards, Mapping):
    raise WeightsError(f"{os.path.join(checkpoint, META_FILE)}: the shard index is damaged; "
                       "re-export the checkpoint")
  return (shards or {}).get(name)


def _tensors_source(checkpoint: str, name: str, meta: Mapping[str, Any]) -> str:
  """What errors about table `name`'s tensors call its file(s)."""
  entry = _shard_entry(checkpoint, name, meta)
  if not entry:
    return os.path.join(checkpoint, f"{name}.safetensors")
  return os.path.join(checkpoint, f"{name}-*-of-{len(entry['files']):05d}.safetensors")


def _read_file(path: str) -> dict[str, np.ndarray]:
  try:
    return load_file(path)
  except FileNotFoundError:
    raise WeightsError(f"{path} is missing: the checkpoint is incomplete; re-export it") from None
  except Exception as e:  # pylint: disable=broad-except  # safetensors' SafetensorError & co.
    raise WeightsError(f"{path} cannot be read ({e}): the file is truncated or corrupted; "
                       "re-export the checkpoint or restore the file") from None


def read_tensors(checkpoint: str, name: str, meta: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Table `name` (graft or base) of a checkpoint whose metadata is `meta`: one file, or its
  shards checked against the index (size and sha256) and split tensors joined again."""
  entry = _shard_entry(checkpoint, name, meta)
  if entry is None:
    return _read_file(os.path.join(checkpoint, f"{name}.safetensors"))
  meta_path = os.path.join(checkpoint, META_FILE)
  try:
    files = [(str(f["file"]), int(f["bytes"]), str(f["sha256"])) for f in entry["files"]]
    split = {str(k): tuple(int(d) for d in v) for k, v in entry["split"].items()}
  except (KeyError, TypeError, ValueError, AttributeError):
    raise WeightsError(f"{meta_path}: the shard index of {name!r} is damaged; re-export the "
                       "checkpoint") from None
  tensors: dict[str, np.ndarray] = {}
  for file, size, digest in files:
    if os.path.basename(file) != file or not file.endswith(".safetensors"):
      raise WeightsError(f"{meta_path}: shard {file!r} is not a file name in the checkpoint "
                         "directory; re-export the checkpoint")
    path = os.path.join(checkpoint, file)
    if not os.path.isfile(path):
      raise WeightsError(f"{path} is missing: the checkpoint is incomplete (hamburger.json lists "
                         f"{len(files)} shards of {name!r}); copy every shard, or re-export it")
    if os.path.getsize(path) != size:
      raise WeightsError(f"{path} has {os.path.getsize(path)} bytes but the index lists {size}: "
                         "the file is truncated or was not copied whole; copy it again")
    if _sha256(path) != digest:
      raise WeightsError(f"{path} is corrupted (its sha256 differs from the index's); copy it "
                         "again or re-export the checkpoint")
    for key, value in _read_file(path).items():
      if key in tensors:
        raise WeightsError(f"{path}: tensor {key!r} is in two shards; re-export the checkpoint")
      tensors[key] = value
  for tensor, shape in split.items():
    parts = []
    while _part_key(tensor, len(parts)) in tensors:
      parts.append(tensors.pop(_part_key(tensor, len(parts))).reshape(-1))
    flat = np.concatenate(parts) if parts else np.zeros((0,), np.float32)
    if flat.size != int(np.prod(shape, dtype=np.int64)):
      raise WeightsError(f"{_tensors_source(checkpoint, name, meta)}: the parts of tensor "
                         f"{tensor!r} hold {flat.size} values, not the {shape} it was split "
                         "from; a shard is missing or from another export")
    tensors[tensor] = flat.reshape(shape)
  return tensors


def load_base_for_run(model_cfg, seed: int = 0) -> tuple[Llama, Tokenizer | None]:
  """The base of a run config's `model:` section (a RunConfig.model); a random base (tests,
  synthetic data) has no tokenizer."""
  overrides = {"dtype": model_cfg.dtype, "param_dtype": model_cfg.param_dtype}
  if model_cfg.base != "random":
    return load_llama(model_cfg.base, **overrides)
  return Llama(dataclasses.replace(model_cfg.random, **overrides), rngs=nnx.Rngs(seed)), None


def build_run_model(cfg) -> tuple[Hamburger, Tokenizer | None]:
  """A run config's model (a RunConfig): its base, the graft freshly initialised (or copied
  from the base's top layers) or from train.init_from. The one builder, for training and
  evaluation."""
  check_init_from(cfg)
  base, tok = load_base_for_run(cfg.model, cfg.train.seed)
  model = Hamburger(HamburgerConfig(base.cfg, cfg.graft), rngs=nnx.Rngs(cfg.train.seed), base=base)
  if cfg.graft.micro_init == "copy_top":
    copy_top_layers_into_micro(model)
  if cfg.train.init_from:
    load_graft(model, cfg.train.init_from)
  return model, tok


def architecture(model_cfg) -> LlamaConfig:
  """The base architecture of a run config's `model:` section (a RunConfig.model), with the
  run's dtypes, read without any weights: the random config itself, a GGUF file's metadata
  ("smollm2" or a .gguf path), an HF directory's config.json, or, for a directory that does not
  exist here, the published architecture its name gives (config.KNOWN_ARCHITECTURES)."""
  dtypes = {"dtype": model_cfg.dtype, "param_dtype": model_cfg.param_dtype}
  source = model_cfg.base
  if source == "random":
    return dataclasses.replace(model_cfg.random, **dtypes)
  try:
    kind, path = resolve_base(source)
  except FileNotFoundError:
    name = os.path.basename(os.path.normpath(source))
    if name in KNOWN_ARCHITECTURES:
      return dataclasses.replace(KNOWN_ARCHITECTURES[name], **dtypes)
    raise ConfigError(
        f"model.base {source!r} does not exist here and its name is none of the known "
        f"architectures ({', '.join(sorted(KNOWN_ARCHITECTURES))}): point it at the model's "
        "GGUF file or HF directory (config.json is enough for --random-weights)") from None
  base = gguf.GGUFFile(path).config() if kind == "gguf" else hf.read_config(path)
  return dataclasses.replace(base, **dtypes)


def random_run_config(cfg):
  """`cfg` (a RunConfig) with its base replaced by random weights of the same architecture:
  what the benches' --random-weights build (no weight files needed)."""
  model = dataclasses.replace(cfg.model, base="random", random=architecture(cfg.model))
  return dataclasses.replace(cfg, model=model)


def abstract_run_model(cfg) -> Hamburger:
  """A run config's model (a RunConfig) as shapes only (nnx.eval_shape: nothing is loaded,
  initialised or allocated): its base architecture read from metadata (`architecture`),
  the run's graft and dtypes. What compiling the run's programs ahead of time needs."""
  hcfg = HamburgerConfig(architecture(cfg.model), cfg.graft)
  return nnx.eval_shape(lambda: Hamburger(hcfg, rngs=nnx.Rngs(cfg.train.seed)))


def check_init_from(cfg) -> None:
  """A stage that starts from its predecessor's export fails early, and says how to make it."""
  path = cfg.train.init_from
  if not path or os.path.exists(os.path.join(path, META_FILE)):
    return
  what = f"train.init_from={path}"
  if cfg.stage:
    what = f"stage {cfg.stage!r} starts from the previous stage's export {path}, which"
    raise ConfigError(f"{what} does not exist yet: run the previous stage to its end first "
                      "(python -m train.main --config CONFIG --stage PREVIOUS)")
  raise ConfigError(f"{what} is not a graft export (no {META_FILE}); point it at the "
                    "export directory a run wrote")
