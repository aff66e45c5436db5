"""The authors' released PyTorch Lightning checkpoint (docs/SPEC.md 5) <-> our Hamburger params.

The release's LightningModule holds `model` (transformers' LlamaForCausalLM), `comp_embedder`
(whose `embedding` IS the base's embed_tokens module) and `micro_step_decoder`. Its state dict
therefore lists the embedding three times (embed_tokens, the tied lm_head, comp_embedder.embedding):
we load it once and check that the copies agree, and write all three on export so the authors'
`HAMburgerLlama.load_from_checkpoint` accepts our file. q/k weights are in transformers'
rotate-half order, as ours are: no RoPE permutation here (the release's gpt-fast converter applies
one; that is a different file format).

torch is not a dependency of this library; only the two functions touching .ckpt files import it.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from hamburger_jax import files
from hamburger_jax.config import ConfigError, GraftConfig, HamburgerConfig, LlamaConfig
from hamburger_jax.convert import hf, mapping
from hamburger_jax.convert.mapping import Rule, Table, WeightsError, linear
from hamburger_jax.model.abstract import abstract
from hamburger_jax.model.hamburger import Hamburger, without_adapters

RELEASE_MERGER_HEADS = 64  # hard-coded in the release's CompositionalEmbedder
RELEASE_FEATURE_LAYERS = (3, 7, 11, 15)  # hard-coded in the release's micro-step decoder
RELEASE_MICRO_LAYERS = 4

EMBED = "model.model.embed_tokens.weight"
LM_HEAD = "model.lm_head.weight"
COMP_EMBED = "comp_embedder.embedding.weight"
# transformers versions before 4.3x stored RoPE frequencies as persistent buffers; they are
# recomputed from the config, so such keys carry no weights.
_ROTARY_SUFFIX = "rotary_emb.inv_freq"
# A version at or above every Lightning checkpoint migration, so loading runs none of them.
_LIGHTNING_VERSION = "2.5.0"
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def release_table(cfg: HamburgerConfig) -> Table:
  """Release state-dict names -> param paths of a `Hamburger`, each tensor exactly once.

  The tied copies (`model.lm_head.weight` when the base ties its head, and
  `comp_embedder.embedding.weight` always) are not in the table: see `tied_keys`.
  """
  b, g = cfg.base, cfg.graft
  # model.model.* and (untied only) model.lm_head.weight, as transformers names them.
  table = hf.llama_table(b, target_prefix=("base",), hf_prefix="model.")
  table["comp_embedder.merger.pos"] = Rule(("embedder", "pos"))
  for name, prefix in (("q_proj", "comp_embedder.merger."), ("k_proj", "comp_embedder.merger."),
                       ("v_proj", "comp_embedder.merger."), ("out_proj", "comp_embedder.")):
    # k/v weights are [D, D + D/2]: columns 0..D-1 read the embedding, D.. the in-group
    # position, matching our kernel rows for the input [e ; pos].
    table[f"{prefix}{name}.weight"] = linear(("embedder", name, "kernel"))
    table[f"{prefix}{name}.bias"] = Rule(("embedder", name, "bias"))
  table.update(hf.layer_table("micro_step_decoder.decoders.", ("micro", "decoder"),
                              g.micro_layers))
  # nn.Sequential(Linear, SiLU, Linear, SiLU, Linear): the Linears are entries 0, 2, 4.
  for index, ours in ((0, "fc1"), (2, "fc2"), (4, "out")):
    table[f"micro_step_decoder.stop_head.{index}.weight"] = linear(
        ("micro", "stop_head", ours, "kernel"))
    table[f"micro_step_decoder.stop_head.{index}.bias"] = Rule(
        ("micro", "stop_head", ours, "bias"))
  return table


def tied_keys(cfg: HamburgerConfig) -> tuple[str, ...]:
  """State-dict names that must hold a bit-identical copy of the embedding matrix."""
  return ((LM_HEAD,) if cfg.base.tie_word_embeddings else ()) + (COMP_EMBED,)


def check_release_compatible(cfg: HamburgerConfig) -> None:
  """The merger's head count is invisible in tensor shapes, so a wrong config would load silently
  and compute a different merge: check it against the release's fixed 64 heads."""
  d, dh = cfg.base.hidden_size, cfg.graft.merger_head_dim
  if dh * RELEASE_MERGER_HEADS != d:
    raise ConfigError(
        f"the release's merger has {RELEASE_MERGER_HEADS} heads, i.e. merger_head_dim="
        f"{d / RELEASE_MERGER_HEADS:g} at hidden_size={d}, but the config has merger_head_dim="
        f"{dh}; build the GraftConfig with graft_config_from_hparams, or pass "
        f"check_heads=False for a file written from a model with another head count")


def load_release_state_dict(model: Hamburger, state_dict: Mapping[str, np.ndarray],
                            source: str = "release checkpoint", check_heads: bool = True) -> None:
  """Loads a release state dict (numpy arrays, torch layout) into `model` in place, strictly.

  Unknown, missing and mis-shaped tensors raise `WeightsError` naming the tensor; each tensor is
  cast to the dtype of the param it fills. `model` may be abstract (`nnx.eval_shape`): the table
  covers every param. `check_heads=False` skips the check that the merger has the release's 64
  heads (for files written from a model with another head count).
  """
  cfg = model.cfg
  if check_heads:
    check_release_compatible(cfg)
  for key in tied_keys(cfg):
    _check_tied(state_dict, key, source)
  ignore = set(tied_keys(cfg)) | {k for k in state_dict if k.endswith(_ROTARY_SUFFIX)}
  mapping.load(model, state_dict, release_table(cfg), source, ignore)


def _check_tied(state_dict: Mapping[str, np.ndarray], key: str, source: str) -> None:
  if EMBED not in state_dict:
    raise WeightsError(f"{source}: missing tensor {EMBED!r}; this is not a release checkpoint")
  if key not in state_dict:
    raise WeightsError(f"{source}: missing tensor {key!r} (the release stores the tied copy of "
                       f"{EMBED!r} under this name); the checkpoint is incomplete")
  ref, copy = np.asarray(state_dict[EMBED]), np.asarray(state_dict[key])
  if copy.shape != ref.shape or copy.dtype != ref.dtype or not np.array_equal(copy, ref):
    diff = (float(np.max(np.abs(copy.astype(np.float32) - ref.astype(np.float32))))
            if copy.shape == ref.shape else None)
    raise WeightsError(
        f"{source}: tensor {key!r} ({copy.shape}, {copy.dtype}) must be identical to {EMBED!r} "
        f"({ref.shape}, {ref.dtype}) because the release ties them, but it differs"
        f"{'' if diff is None else f' (max abs difference {diff:g})'}; "
        + ("if the base has its own LM head, build the config with tie_word_embeddings=False"
           if key == LM_HEAD else "the checkpoint was edited or is not the release's format"))


def export_release_state_dict(model: Hamburger,
                              fold_adapters: bool = False) -> dict[str, np.ndarray]:
  """Our params -> a release state dict (numpy, torch layout, each param's dtype).

  The tied copies are included (the same array object as embed_tokens), so the authors'
  `load_state_dict(strict=True)` finds every key it expects. Merged-entry adapters have no
  release key and the release applies one set of base weights everywhere, so a model with
  adapters exports only with `fold_adapters=True`: their deltas are folded into the kernels and
  then act at every position, prompt and single tokens included (no longer the exact base there).
  A decoding layout is refused (mapping.check_training_layout), folded or not.
  """
  mapping.check_training_layout(model)  # before without_adapters reads its adapters
  if model.cfg.graft.base_lora_rank:
    if not fold_adapters:
      raise ValueError(
          "this model has merged-entry base adapters (graft.base_lora_rank="
          f"{model.cfg.graft.base_lora_rank}), which the release format cannot express: pass "
          "fold_adapters=True to fold them into the base kernels (they then act at every "
          "position, so prompt and single-token steps no longer run the exact base)")
    model = without_adapters(model, merge=True)
  tensors = mapping.export(model, release_table(model.cfg))
  for key in tied_keys(model.cfg):
    tensors[key] = tensors[EMBED]
  return tensors


def graft_config_from_hparams(hparams: Mapping[str, Any], base: LlamaConfig,
                              **overrides: Any) -> GraftConfig:
  """The GraftConfig that computes what the release does for its `hyper_parameters`.

  The release fixes what its hparams do not say: 64 merger heads, 4 micro-decoder layers and
  feature layers 3, 7, 11, 15 (its base has 16 layers; other depths get our evenly spaced
  default, which is what the release would have to be changed to anyway).
  """
  if "max_steps" not in hparams:
    raise WeightsError(f"hyper_parameters {sorted(hparams)} have no 'max_steps' (K, the tokens "
                       f"per macro step); is this a HAMburger Lightning checkpoint?")
  # distill_kl, when present, only adds a training loss against a teacher that is not saved.
  d = base.hidden_size
  if d % RELEASE_MERGER_HEADS:
    raise ConfigError(f"hidden_size={d} is not a multiple of the release's "
                      f"{RELEASE_MERGER_HEADS} merger heads; this base cannot hold its weights")
  kwargs: dict[str, Any] = dict(
      max_group=int(hparams["max_steps"]), micro_layers=RELEASE_MICRO_LAYERS,
      merger_head_dim=d // RELEASE_MERGER_HEADS, num_features=len(RELEASE_FEATURE_LAYERS))
  if base.num_layers == 16:
    kwargs["feature_layers"] = RELEASE_FEATURE_LAYERS
  kwargs.update(overrides)
  return GraftConfig(**kwargs)


# ----------------------------------------------------------------------------- .ckpt files


def _import_torch():
  # torch is a test oracle, not a dependency of the library: only reading or writing a release
  # checkpoint (a torch pickle) needs it.
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ImportError(
        "reading or writing a Lightning .ckpt needs PyTorch, which hamburger-jax does not depend "
        "on; install it (pip install torch --index-url https://download.pytorch.org/whl/cpu) "
        "or convert the checkpoint on a machine that has it") from None
  return torch


def read_lightning_checkpoint(path: str | os.PathLike) -> tuple[dict[str, np.ndarray],
                                                                dict[str, Any]]:
  """A Lightning .ckpt -> (state dict as numpy arrays, hyper_parameters).

  bfloat16 tensors become `ml_dtypes.bfloat16` arrays bit for bit. This unpickles the file
  (`weights_only=False`, Lightning stores Python objects in it): only open files you trust.
  """
  torch = _import_torch()
  if not os.path.exists(path):
    raise FileNotFoundError(f"Lightning checkpoint {path} does not exist")
  ckpt = torch.load(path, map_location="cpu", weights_only=False)
  if not isinstance(ckpt, Mapping) or "state_dict" not in ckpt:
    keys = sorted(ckpt) if isinstance(ckpt, Mapping) else type(ckpt).__name__
    raise WeightsError(f"{path} is not a Lightning checkpoint (no 'state_dict'; it holds "
                       f"{keys}); pass the .ckpt file the release's training wrote")
  state = {name: _to_numpy(torch, t) for name, t in ckpt["state_dict"].items()}
  return state, dict(ckpt.get("hyper_parameters") or {})


def _to_numpy(torch, t) -> np.ndarray:
  t = t.detach().cpu().contiguous()
  if t.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return t.numpy()


def write_lightning_checkpoint(model: Hamburger, path: str | os.PathLike, base_model_name: str,
                               dtype: str | None = None, check_heads: bool = True,
                               fold_adapters: bool = False) -> None:
  """Writes `model` as a release checkpoint the authors' `HAMburgerLlama.load_from_checkpoint`
  reads: {"state_dict", "hyper_parameters": {base_model_name, max_steps}}. `fold_adapters`: see
  export_release_state_dict (a model with merged-entry adapters needs it).

  `dtype` casts every tensor (e.g. "bfloat16" like the release's base); None keeps each param's
  dtype. The tied copies share storage with embed_tokens, as in a torch state dict. Written to a
  temporary file and renamed, so a failure leaves no half-written checkpoint.
  """
  mapping.check_training_layout(model)  # before torch loads or the heads are checked
  torch = _import_torch()
  if check_heads:  # the authors' code would merge with 64 heads whatever our config says
    check_release_compatible(model.cfg)
  if dtype is not None and dtype not in _NP_DTYPES:
    raise ValueError(f"dtype={dtype!r}: use one of {sorted(_NP_DTYPES)} or None")
  converted: dict[int, Any] = {}  # id(array) -> tensor, so tied copies stay one storage
  state = {}
  for name, array in export_release_state_dict(model, fold_adapters).items():
    if id(array) not in converted:
      converted[id(array)] = _to_torch(torch, array, dtype)
    state[name] = converted[id(array)]
  ckpt = {"state_dict": state,
          "hyper_parameters": {"base_model_name": base_model_name,
                               "max_steps": model.cfg.graft.max_group},
          "pytorch-lightning_version": _LIGHTNING_VERSION}
  files.write_atomic(os.fspath(path), lambda tmp: torch.save(ckpt, tmp))


def _to_torch(torch, array: np.ndarray, dtype: str | None):
  a = np.asarray(array)
  if dtype is not None:
    a = a.astype(_NP_DTYPES[dtype])
  a = np.ascontiguousarray(a)
  if a.dtype == ml_dtypes.bfloat16:
    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
  return torch.from_numpy(a.copy())


def load_lightning_checkpoint(path: str | os.PathLike, base: LlamaConfig,
                              **graft_overrides: Any) -> Hamburger:
  """A release .ckpt -> a Hamburger on `base` (the config of hyper_parameters' base_model_name,
  e.g. `hf.read_config(dir)`), without a random initialisation of the 1.5 B params."""
  state, hparams = read_lightning_checkpoint(path)
  cfg = HamburgerConfig(base, graft_config_from_hparams(hparams, base, **graft_overrides))
  model = abstract(lambda rngs: Hamburger(cfg, rngs=rngs))
  load_release_state_dict(model, state, f"Lightning checkpoint {path}")
  return model


__all__ = [
    "RELEASE_MERGER_HEADS", "release_table", "tied_keys", "load_release_state_dict",
    "export_release_state_dict", "graft_config_from_hparams", "read_lightning_checkpoint",
    "write_lightning_checkpoint", "load_lightning_checkpoint", "check_release_compatible",
]
