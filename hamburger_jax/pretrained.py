"""Loading real models: a base from GGUF or an HF directory, a HAMburger on it from a graft
checkpoint (its on-disk format: hamburger_jax/graft_checkpoint.py), a run config's model.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax import assets, cache, files
from hamburger_jax import micro_vocab as micro_vocab_lib
from hamburger_jax.config import (KNOWN_ARCHITECTURES, ConfigError, GraftConfig,
                                  HamburgerConfig, LlamaConfig, from_dict, to_dict)
from hamburger_jax.convert import gguf, hf, mapping
from hamburger_jax.convert.mapping import WeightsError
from hamburger_jax.graft_checkpoint import (BASE, GRAFT, META_FILE, base_table, graft_table,
                                            read_meta, read_tensors, tensors_source)
from hamburger_jax.model.abstract import abstract
from hamburger_jax.model.hamburger import Hamburger, copy_top_layers_into_micro
from hamburger_jax.model.llama import Llama
from hamburger_jax.tokenizer import Tokenizer

DEFAULT_BASE = "smollm2"
DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "checkpoints", "smollm2-135m-hamburger")
UNTRAINED = "untrained"  # load_hamburger's name for a freshly grafted, untrained model


def resolve_base(source: str) -> tuple[str, str]:
  """'smollm2' | path/to/model.gguf | HF directory -> (kind, path)."""
  if source in (DEFAULT_BASE, "default"):
    return "gguf", assets.smollm2_gguf()
  # The GGUF reader and the HF loader open files: a bucket's copy is kept in the cache.
  source = files.mirror(source, os.path.join(cache.cache_root(), "buckets"))
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
    model = abstract(lambda rngs: Llama(cfg, rngs=rngs))  # filled below, no random init
    gguf.load_into(model, converted, cfg)
    return model, Tokenizer.from_gguf(converted)
  cfg = dataclasses.replace(hf.read_config(path), **overrides)
  model = abstract(lambda rngs: Llama(cfg, rngs=rngs))
  hf.load_into(model, path, cfg)
  return model, Tokenizer.from_hf_dir(path)


def load_tokenizer(source: str = DEFAULT_BASE) -> Tokenizer:
  """A base model's tokenizer (`resolve_base`'s sources), without its weights; a graft's is
  its base's."""
  kind, path = resolve_base(source)
  return Tokenizer.from_gguf(path) if kind == "gguf" else Tokenizer.from_hf_dir(path)


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
    return gguf.read_config(path).vocab_size
  return hf.read_config(path).vocab_size


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
  model = abstract(lambda rngs: Hamburger(cfg, rngs=rngs), seed)
  nnx.update(model.base, nnx.state(base))
  load_graft(model, resolved)
  return model, tok


# What `load` loads for: a decode mode (decode/step.py: MODES), or "both": one HAMburger model,
# decoded in any mode.
MODES = ("base", "hamburger", "verify", "both")


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

  "base": the base model alone (`base`, default SmolLM2; `checkpoint` unused). "hamburger",
  "verify" and "both": the graft checkpoint (default: the shipped one) on its own base or on
  `base`; an engine decodes such a model in any mode. With no checkpoint given nor shipped, an untrained
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
  if _graft_config(meta, checkpoint) != model.cfg.graft:
    raise WeightsError(f"checkpoint {checkpoint} has graft config {meta['graft']} but the model "
                       f"has {to_dict(model.cfg.graft)}: build the model from the run's config")
  tables = [(GRAFT, graft_table(model))]
  if meta.get("include_base"):
    tables.append((BASE, base_table(model)))
  for name, table in tables:
    mapping.load(model, read_tensors(checkpoint, name, meta), table,
                 tensors_source(checkpoint, name, meta))


def _graft_config(meta: Mapping[str, Any], checkpoint: str) -> GraftConfig:
  """A checkpoint's graft config; options it predates take their defaults (what it trained)."""
  try:
    return from_dict(GraftConfig, meta["graft"])
  except ConfigError as e:
    raise WeightsError(f"{checkpoint}: {e}; the checkpoint's metadata is damaged, re-export "
                       "it") from None


# Graft options a run may add to the graft it starts from (train.init_from): each starts as the
# identity (a zero projection, adapters acting at more entries, zero-initialised extra rank), or
# from what it has (a drafter: the micro decoder's first layers and its stop head), so the new
# graft starts as the old one, or near it.
# A graft moved to another merge layer (graft.merge_layer, merge_pooling) keeps its micro decoder
# and stop head, and its merged-entry adapters start again at zero: they were fitted to entries
# of another kind, so the moved graft starts as the untrained merge at its layer.
GROWABLE = ("adapter_scope", "contextual_entry", "base_lora_rank", "base_lora_alpha",
            "drafter_layers", "drafter_init", "merge_layer", "merge_pooling")


def warm_start(model: Hamburger, checkpoint: str) -> list[str]:
  """Loads a graft checkpoint into a model whose graft may add GROWABLE options to it: what the
  checkpoint holds is loaded (adapters of a smaller rank into the leading rank, rescaled so that
  their change is the same), the rest keeps its initialisation. Returns what was grown
  (empty: the same graft, loaded strictly)."""
  meta = read_meta(checkpoint)
  old, new = _graft_config(meta, checkpoint), model.cfg.graft
  if old == new:
    load_graft(model, checkpoint)
    return []
  fixed = {f.name for f in dataclasses.fields(GraftConfig)} - set(GROWABLE)
  differs = sorted(n for n in fixed if getattr(old, n) != getattr(new, n))
  if differs or new.base_lora_rank < old.base_lora_rank or (old.base_lora_rank and
                                                           not new.base_lora_rank):
    raise WeightsError(
        f"train.init_from={checkpoint} has graft config {to_dict(old)}; this run's "
        f"{to_dict(new)} differs in {', '.join(differs) or 'a smaller adapter rank'}: a run may "
        f"only add to the graft it starts from ({', '.join(GROWABLE)}, a larger rank)")
  if meta.get("include_base"):
    raise WeightsError(f"train.init_from={checkpoint} trained the base too; grow a graft of a "
                       "frozen base only")
  tensors = read_tensors(checkpoint, GRAFT, meta)
  table = graft_table(model)
  params = mapping.flat_params(model)
  unknown = sorted(set(tensors) - set(table))
  if unknown:
    raise WeightsError(f"{checkpoint}: unexpected tensor {unknown[0]!r}; it is not a graft this "
                       "model can grow from")
  grown = []
  ratio = ((old.base_lora_alpha / old.base_lora_rank) / (new.base_lora_alpha / new.base_lora_rank)
           if old.base_lora_rank else 1.0)
  if old.merge_layer != new.merge_layer:
    ratio = 0.0  # every adapter's b, so its change, starts at zero (GROWABLE)
  for name, rule in table.items():
    var = params[rule.target]
    if name not in tensors and name.startswith("drafter.") and "micro." + name[8:] in tensors:
      name_in = "micro." + name[8:]  # a new drafter starts as the micro decoder drafted before
      var.set_value(jnp.asarray(np.asarray(tensors[name_in], np.float32), dtype=var.dtype))
      grown.append(name)
      continue
    if name not in tensors:
      grown.append(name)
      continue
    value = np.asarray(tensors[name], np.float32)
    if value.shape != tuple(var.shape):
      leaf = rule.target[-1]
      if leaf not in ("a", "b") or value.ndim != 2:
        raise WeightsError(f"{checkpoint}: tensor {name!r} has shape {value.shape}, the model "
                           f"{tuple(var.shape)}")
      full = np.asarray(var[...], np.float32).copy()
      if leaf == "a":  # [in, r]: the old columns first; the new ones keep their random init
        full[:, :value.shape[1]] = value
      else:  # [r, out]: the new rows stay zero, so the adapter's change is the old one
        full[:value.shape[0]] = value * ratio
        full[value.shape[0]:] = 0
      value = full
      grown.append(name)
    elif rule.target[-1] == "b" and ratio != 1.0:
      value = value * ratio
    var.set_value(jnp.asarray(value, dtype=var.dtype))
  if new.drafter_layers and not old.drafter_layers and new.drafter_init == "base_top":
    copy_top_layers_into_micro(model, model.drafter)
  return grown


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
    warm_start(model, cfg.train.init_from)
  if cfg.train.micro_vocab:
    model.set_micro_vocab(micro_vocab_ids(cfg.train.init_from, cfg.train.micro_vocab,
                                          model.cfg.base.vocab_size))
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
  base = gguf.read_config(path) if kind == "gguf" else hf.read_config(path)
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
  graphdef, state = _abstract_model(HamburgerConfig(architecture(cfg.model), cfg.graft),
                                    cfg.train.seed)
  return nnx.merge(graphdef, state, copy=True)  # its own variables: callers may set them


@functools.lru_cache(maxsize=4)
def _abstract_model(hcfg: HamburgerConfig, seed: int) -> tuple[Any, Any]:
  """The shapes of Hamburger(hcfg) as (graphdef, state), traced once per process for each
  config: a run's stages, its teacher pass and a check of many configs each build the same model
  (~0.35 s a SmolLM2 trace; lowering its staged config for a TPU 12.5 -> 11.7 s); each caller
  merges its own module from them."""
  return nnx.split(abstract(lambda rngs: Hamburger(hcfg, rngs=rngs), seed))


def load_run(config: str, checkpoint: str | None = None, micro_vocab: int | None = None
             ) -> tuple[Hamburger, Tokenizer | None]:
  """A run config's model (its base, e.g. a random tiny one rebuilt from its seed, and the
  graft as the run builds it), with a graft checkpoint of that run loaded over it and micro
  steps on the checkpoint's first `micro_vocab` ids: what evaluating or answering with a run's
  model needs when its base cannot be reloaded by name."""
  from hamburger_jax.run_config import load_run_config  # pylint: disable=import-outside-toplevel
  cfg = load_run_config(config, ["train.init_from=''"], shared_only=True)
  ids = None
  if micro_vocab is not None:  # checked before the weights load
    vocab = architecture(cfg.model).vocab_size
    ids = micro_vocab_ids(checkpoint, micro_vocab, vocab)
  model, tok = build_run_model(cfg)
  if checkpoint:
    load_graft(model, checkpoint)
  if ids is not None:
    model.set_micro_vocab(ids)
  return model, tok


def check_init_from(cfg) -> None:
  """A stage that starts from its predecessor's export fails early, and says how to make it."""
  path = cfg.train.init_from
  if not path:
    return
  if files.exists(files.join(path, META_FILE)):
    if not files.is_complete(path):
      raise ConfigError(f"train.init_from={path} is an unfinished export (no "
                        f"{files.COMMIT_MARKER}: its writer stopped before the end); export it "
                        "again")
    return
  what = f"train.init_from={path}"
  if cfg.stage:
    what = f"stage {cfg.stage!r} starts from the previous stage's export {path}, which"
    raise ConfigError(f"{what} does not exist yet: run the previous stage to its end first "
                      "(python -m train.main --config CONFIG --stage PREVIOUS)")
  why = files.missing_bucket(path) or f"no {META_FILE}"
  raise ConfigError(f"{what} is not a graft export ({why}); point it at the "
                    "export directory a run wrote")
