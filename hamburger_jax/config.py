"""Model configuration as frozen dataclasses, built from YAML, HF config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from typing import Any, Mapping

import yaml

# The inference rule's default: a group continues while the stop head's P(continue) >= this
# (docs/method.md, section 3). The engine, the CLIs and training's generation probes use it.
DEFAULT_CONFIDENCE = 0.8
# Verify mode's micro decoder drafts while its stop head's P(continue) >= this (0: every micro
# step drafts, up to K - 1 drafts a step; 1: none: with lookups off, the base one token a
# forward). Measured in docs/results/decode_speed.md (verify mode).
DEFAULT_DRAFT_CONFIDENCE = 0.0
# Verify mode's lookup drafts (decode/lookup.py): a row whose last tokens (at least this many)
# occurred before in its prompt or answer drafts what followed them there, at no model cost and
# whatever the draft confidence (0: off). 1 is the fastest at the default draft confidence on a
# CPU at batch 1 (1.23x the base against 1.00x without, docs/results/decode_speed.md).
DEFAULT_DRAFT_LOOKUP = 1
# The longest suffix a lookup matches: the longest match found is used (a longer one predicts
# the next tokens better: on the base's answers to the judge's suite, 2- and 3-token matches
# keep ~1.0 of their drafts a step, single tokens ~0.4).
LOOKUP_MAX_N = 3
# The engine's prefix cache capacity, in KV entries (hamburger_jax/decode/prefix_cache.py;
# SmolLM2 in fp32: 46 KB each, so ~94 MB): a hundred system turns, or a few long histories.
DEFAULT_PREFIX_CACHE_TOKENS = 2048


# How a scanned decoder stack may rematerialise (model/llama.py: DecoderStack.remat).
REMAT = ("none", "layers")
# The kernel of packed rows' attention in the train step (model/attention.py): "xla" the dense
# masked softmax, "cudnn" cuDNN's fused kernel over the rows' segments (a GPU, bf16/fp16), "auto"
# cudnn where it applies, passes its check against xla and is the faster at the step's row shape
# (timed when the trainer starts), else xla.
ATTENTION = ("auto", "xla", "cudnn")
# float32 matmul precisions (hamburger_jax/precision.py states the policy).
PRECISIONS = ("default", "highest")


class ConfigError(ValueError):
  """A configuration value or key is invalid; the message says which and what to do."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency scaling ("rope_type": "llama3" in HF configs)."""
  factor: float = 32.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """A Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU)."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int = 0  # 0 means hidden_size // num_heads
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = True
  max_position_embeddings: int = 8192
  param_dtype: str = "float32"
  dtype: str = "float32"  # compute dtype of activations and matmuls
  # The layout of the weights, not the architecture: q|k|v and gate|up each one kernel
  # (hamburger_jax/model/decode_layout.py makes it from the separate projections that
  # checkpoints, converters and training use).
  fused_projections: bool = False

  def __post_init__(self):
    if self.head_dim == 0:
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"{name}={getattr(self, name)!r}: use float32, bfloat16 or float16")

  @classmethod
  def from_hf_config(cls, cfg: Mapping[str, Any], **overrides) -> "LlamaConfig":
    """From a transformers LlamaConfig dict (config.json)."""
    arch = cfg.get("model_type", "llama")
    if arch != "llama":
      raise ConfigError(f"config.json has model_type={arch!r}; only 'llama' models are supported")
    scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or None)
    rope_scaling = None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
      rope_scaling = RopeScaling(
          factor=float(scaling["factor"]),
          low_freq_factor=float(scaling["low_freq_factor"]),
          high_freq_factor=float(scaling["high_freq_factor"]),
          original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    elif scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
      raise ConfigError(f"rope scaling {scaling!r} is not supported (only llama3 or none)")
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    kwargs = dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or 0, rope_theta=float(theta), rope_scaling=rope_scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)))
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_hf_config(self) -> dict[str, Any]:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim, "rope_theta": self.rope_theta,
        "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": self.param_dtype,
        "rope_scaling": None,
    }
    if self.rope_scaling is not None:
      cfg["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
    return cfg

  @classmethod
  def from_gguf_metadata(cls, meta: Mapping[str, Any], **overrides) -> "LlamaConfig":
    """From GGUF key/values (``llama.*``); see hamburger_jax.convert.gguf."""
    arch = meta.get("general.architecture")
    if arch != "llama":
      raise ConfigError(
          f"GGUF architecture is {arch!r}; only 'llama' GGUF files can be loaded")
    p = "llama."
    n_heads = int(meta[p + "attention.head_count"])
    kwargs = dict(
        vocab_size=int(meta.get(p + "vocab_size") or meta["tokenizer.ggml.vocab_size"]),
        hidden_size=int(meta[p + "embedding_length"]),
        intermediate_size=int(meta[p + "feed_forward_length"]),
        num_layers=int(meta[p + "block_count"]), num_heads=n_heads,
        num_kv_heads=int(meta.get(p + "attention.head_count_kv", n_heads)),
        head_dim=int(meta.get(p + "rope.dimension_count", 0)),
        rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(meta.get(p + "context_length", 8192)),
        tie_word_embeddings=True)
    if p + "rope.scaling.type" in meta and meta[p + "rope.scaling.type"] not in ("none", "linear"):
      raise ConfigError(f"GGUF rope scaling {meta[p + 'rope.scaling.type']!r} is not supported")
    kwargs.update(overrides)
    return cls(**kwargs)


# Published architectures, by the name of the model's HF directory (its hub name): a config may
# name a base that is not on this machine (configs/llama3_2_1b.yaml), and what needs only its
# shapes (random weights, FLOP counts) reads them here. Llama-3.2-1B(-Instruct): its config.json.
LLAMA_3_2_1B = LlamaConfig(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
    num_kv_heads=8, head_dim=64, rope_theta=500000.0,
    rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), tie_word_embeddings=True,
    max_position_embeddings=131072)
KNOWN_ARCHITECTURES = {"Llama-3.2-1B-Instruct": LLAMA_3_2_1B, "Llama-3.2-1B": LLAMA_3_2_1B}


# Where a graft's merged-entry adapters act (GraftConfig.adapter_scope).
ADAPTER_SCOPES = ("merged", "after_merge")
MERGE_POOLINGS = ("last", "attention")
DRAFTER_INITS = ("micro", "base_top")
# The widths a verify step's forward is compiled in (decode/step.py: verify_step): "two", 1 (no
# live row drafted) and K; "each", every width 1..K, the step running the narrowest that holds
# its rows' drafts (K copies of the base's forward in the program, for a forward whose cost
# grows with its width: precision.DECODE_VERIFY_WIDTHS).
VERIFY_WIDTHS = ("two", "each")


@dataclasses.dataclass(frozen=True)
class GraftConfig:
  """The two HAMburger modules grafted around the base (docs/SPEC.md 1.1-1.4)."""
  max_group: int = 4  # K: tokens per macro step at most
  num_features: int = 4  # F
  feature_layers: tuple[int, ...] = ()  # empty: F evenly spaced layers ending at the last
  micro_layers: int = 4
  merger_head_dim: int = 32  # release: 64 heads of 32 at D = 2048
  position_offset: int = 0  # 0: docs/SPEC.md 1.2 (training); 1: the release's HF generate path
  micro_init: str = "fresh"  # fresh (release) | copy_top (the base's top layers)
  base_lora_rank: int = 0  # > 0: low-rank adapters on the base's projections (frozen-base runs)
  base_lora_alpha: float = 32.0
  # Where those adapters act (ADAPTER_SCOPES): "merged", at merged entries only; "after_merge",
  # at merged entries and at every later entry of the same answer (the entries whose context
  # holds a merged one read it through adapted weights). Nothing merged, nothing adapted: a
  # confidence of 1.0 decodes the base exactly either way.
  adapter_scope: str = "merged"
  # A contextual merged entry: the compositional embedder also reads the micro decoder's hidden
  # states of the group's tokens (they saw the base's features), normed and projected, added to
  # the tokens' embeddings (model/compositional_embedder.py).
  contextual_entry: bool = False
  # Layers of a second micro decoder (with its stop head) that drafts for verify mode (0:
  # none, verify drafts with the micro decoder): trained on plain contexts, where verify drafts
  # (train.trainable "drafter"); HAMburger mode keeps the first. EAGLE drafts with one layer.
  drafter_layers: int = 0
  # How a drafter grown onto a graft starts (DRAFTER_INITS): "micro", as the micro decoder's
  # first layers and its stop head; "base_top", as the base's top layers (the stop head still
  # the micro decoder's).
  drafter_init: str = "micro"
  # Merge at layer L (model/layer_merge.py): a group's tokens run the base's first L layers one
  # entry each (exact keys and values there), and ONE entry, the last token's layer-L state (or
  # merge_pooling's pooling of the group's), goes on through layers L..N-1. 0: the paper's
  # merge at the input (the compositional embedder).
  merge_layer: int = 0
  # How the group's layer-L states become its entry at merge_layer > 0 (MERGE_POOLINGS):
  # "last", the last token's; "attention", the last token's plus a learned attention over the
  # group's states (its output projection zero at init, so it starts as "last").
  merge_pooling: str = "last"

  def __post_init__(self):
    if self.max_group < 1:
      raise ConfigError(f"max_group={self.max_group} must be >= 1")
    if self.micro_init not in ("fresh", "copy_top"):
      raise ConfigError(f"micro_init={self.micro_init!r}: use 'fresh' or 'copy_top'")
    if self.position_offset not in (0, 1):
      raise ConfigError(f"position_offset={self.position_offset} must be 0 or 1")
    if not 0 <= self.drafter_layers:
      raise ConfigError(f"drafter_layers={self.drafter_layers} must be >= 0 (0: no drafter)")
    if self.adapter_scope not in ADAPTER_SCOPES:
      raise ConfigError(f"adapter_scope={self.adapter_scope!r}: use one of "
                        f"{', '.join(ADAPTER_SCOPES)}")
    if self.drafter_init not in DRAFTER_INITS:
      raise ConfigError(f"drafter_init={self.drafter_init!r}: use one of "
                        f"{', '.join(DRAFTER_INITS)}")
    if self.merge_layer < 0:
      raise ConfigError(f"merge_layer={self.merge_layer} must be >= 0 (0: merge at the input)")
    if self.merge_pooling not in MERGE_POOLINGS:
      raise ConfigError(f"merge_pooling={self.merge_pooling!r}: use one of "
                        f"{', '.join(MERGE_POOLINGS)}")
    if self.merge_layer and self.contextual_entry:
      raise ConfigError("contextual_entry feeds the compositional embedder, which a merge at "
                        f"layer {self.merge_layer} does not use: set merge_layer=0 or "
                        "contextual_entry=false")
    if self.merge_pooling != "last" and not self.merge_layer:
      raise ConfigError(f"merge_pooling={self.merge_pooling!r} pools the group's layer-L states: "
                        "it needs merge_layer > 0")
    if self.adapter_scope != "merged" and not self.base_lora_rank:
      raise ConfigError(f"adapter_scope={self.adapter_scope!r} places merged-entry adapters, but "
                        "base_lora_rank is 0 (no adapters): set base_lora_rank > 0")

  def check_merge_layer(self, num_layers: int) -> None:
    """Refuses a merge layer the base does not have."""
    if self.merge_layer > num_layers:
      raise ConfigError(f"merge_layer={self.merge_layer} exceeds the base's {num_layers} layers: "
                        f"use 0..{num_layers}")

  def resolved_feature_layers(self, num_layers: int) -> tuple[int, ...]:
    """0-based base layer indices whose outputs feed the micro decoder; the last is normed."""
    layers = self.feature_layers or tuple(
        (i + 1) * num_layers // self.num_features - 1 for i in range(self.num_features))
    if len(layers) != self.num_features or layers[-1] != num_layers - 1:
      raise ConfigError(
          f"feature_layers={layers} must list num_features={self.num_features} layers and end "
          f"with the last layer {num_layers - 1}")
    if any(not 0 <= l < num_layers for l in layers) or list(layers) != sorted(set(layers)):
      raise ConfigError(f"feature_layers={layers} must be increasing indices in [0, {num_layers})")
    return tuple(layers)


@dataclasses.dataclass(frozen=True)
class HamburgerConfig:
  base: LlamaConfig
  graft: GraftConfig = GraftConfig()


# ----------------------------------------------------------------------------- YAML / dicts


def from_dict(cls, data: Mapping[str, Any] | None, where: str = ""):
  """Builds a (nested) frozen dataclass from a dict; unknown keys are errors naming valid keys."""
  data = dict(data or {})
  hints = typing.get_type_hints(cls)  # resolves string annotations in cls's own module
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - set(fields))
  if unknown:
    raise ConfigError(
        f"unknown config key {where + unknown[0]!r}; valid keys of "
        f"{where[:-1] or cls.__name__} are: {', '.join(sorted(fields))}")
  kwargs = {}
  for name, value in data.items():
    kwargs[name] = _coerce(hints[name], value, f"{where}{name}.")
  try:
    return cls(**kwargs)
  except TypeError as e:
    raise ConfigError(f"config section {where or cls.__name__}: {e}") from None


def _coerce(tp, value, where):
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if value is None:
      return None
    return _coerce(args[0], value, where)
  if dataclasses.is_dataclass(tp):
    if not isinstance(value, Mapping):
      raise ConfigError(f"config key {where[:-1]!r} must be a mapping, got {value!r}")
    return from_dict(tp, value, where)
  if origin is tuple:
    return tuple(value)
  if tp is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
    try:  # YAML 1.1 reads "1e-5" (no dot) as a string
      return float(value)
    except ValueError:
      raise ConfigError(f"config key {where[:-1]!r} must be a number, got {value!r}") from None
  if tp is int and isinstance(value, bool):
    raise ConfigError(f"config key {where[:-1]!r} must be an int, got {value!r}")
  if tp in (int, str, bool) and not isinstance(value, tp):
    raise ConfigError(f"config key {where[:-1]!r} must be {tp.__name__}, got {value!r}")
  return value


def to_dict(obj) -> dict[str, Any]:
  return json.loads(json.dumps(dataclasses.asdict(obj)))


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
  if not os.path.exists(path):
    raise ConfigError(f"config file {path} does not exist")
  if os.path.isdir(path):
    raise ConfigError(f"config file {path} is a directory; pass a YAML file, e.g. "
                      "configs/tiny.yaml")
  try:
    with open(path, encoding="utf-8") as f:
      data = yaml.safe_load(f) or {}
  except UnicodeDecodeError as e:
    raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                      f"offset {e.start}); save it as UTF-8") from None
  except yaml.YAMLError as e:
    where = getattr(e, "problem_mark", None)
    at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    raise ConfigError(f"config file {path} is not valid YAML{at}: {problem}; fix the "
                      "file") from None
  if not isinstance(data, dict):
    raise ConfigError(f"config file {path} must hold a mapping at the top level")
  return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
  """Applies ``--set a.b=value`` overrides (values parsed as YAML scalars)."""
  data = json.loads(json.dumps(data))
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.steps=100")
    key, raw = item.split("=", 1)
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
      node = node.setdefault(part, {})
      if not isinstance(node, dict):
        raise ConfigError(f"--set {item!r}: {part!r} is not a section")
    try:
      node[parts[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as e:
      problem = getattr(e, "problem", None) or str(e).splitlines()[0]
      raise ConfigError(f"--set {item!r}: the value is not valid YAML ({problem}); quote a "
                        "value meant as text") from None
  return data
