"""HF safetensors import/export for Llama-family models (single file or sharded index)."""

from __future__ import annotations

import json
import os
from typing import Mapping

import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from hamburger_jax import files
from hamburger_jax.config import LlamaConfig
from hamburger_jax.convert import mapping
from hamburger_jax.convert.mapping import Rule, Table, WeightsError, linear

_LAYER = {
    "self_attn.q_proj.weight": ("self_attn", "q_proj", "kernel"),
    "self_attn.k_proj.weight": ("self_attn", "k_proj", "kernel"),
    "self_attn.v_proj.weight": ("self_attn", "v_proj", "kernel"),
    "self_attn.o_proj.weight": ("self_attn", "o_proj", "kernel"),
    "mlp.gate_proj.weight": ("mlp", "gate_proj", "kernel"),
    "mlp.up_proj.weight": ("mlp", "up_proj", "kernel"),
    "mlp.down_proj.weight": ("mlp", "down_proj", "kernel"),
    "input_layernorm.weight": ("input_layernorm", "weight"),
    "post_attention_layernorm.weight": ("post_attention_layernorm", "weight"),
}


def layer_table(source_prefix: str, target_prefix: tuple, num_layers: int) -> Table:
  """Tensor names of HF Llama decoder layers -> params of a DecoderStack at `target_prefix`."""
  table = {}
  for i in range(num_layers):
    for name, path in _LAYER.items():
      target = (*target_prefix, "layers", i, *path)
      src = f"{source_prefix}{i}.{name}"
      table[src] = linear(target) if path[-1] == "kernel" else Rule(target)
  return table


def llama_table(cfg: LlamaConfig, target_prefix: tuple = (), hf_prefix: str = "") -> Table:
  """transformers' LlamaForCausalLM state-dict names -> our Llama param paths."""
  t = (*target_prefix,)
  table = {
      f"{hf_prefix}model.embed_tokens.weight": Rule((*t, "embed_tokens")),
      f"{hf_prefix}model.norm.weight": Rule((*t, "norm", "weight")),
  }
  table.update(layer_table(f"{hf_prefix}model.layers.", (*t, "decoder"), cfg.num_layers))
  if not cfg.tie_word_embeddings:
    table[f"{hf_prefix}lm_head.weight"] = linear((*t, "lm_head"))
  return table


def read_config(path: str) -> LlamaConfig:
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise WeightsError(f"{path} has no config.json; pass an HF model directory")
  with open(cfg_path) as f:
    return LlamaConfig.from_hf_config(json.load(f))


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of an HF directory: model.safetensors or model.safetensors.index.json shards."""
  index = os.path.join(path, "model.safetensors.index.json")
  single = os.path.join(path, "model.safetensors")
  if os.path.exists(index):
    with open(index) as f:
      shards = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for shard in shards:
      shard_path = os.path.join(path, shard)
      if not os.path.exists(shard_path):
        raise WeightsError(f"{index} lists shard {shard} but {shard_path} does not exist")
      tensors.update(load_file(shard_path))
    return tensors
  if os.path.exists(single):
    return load_file(single)
  raise WeightsError(f"{path} has neither model.safetensors nor model.safetensors.index.json")


def load_into(model: nnx.Module, path: str, cfg: LlamaConfig, target_prefix: tuple = ()) -> None:
  tensors = read_safetensors(path)
  ignore = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
  ignore |= {k for k in tensors if k.endswith("rotary_emb.inv_freq")}
  mapping.load(model, tensors, llama_table(cfg, target_prefix), f"safetensors in {path}", ignore)


def save(model: nnx.Module, cfg: LlamaConfig, path: str, target_prefix: tuple = (),
         extra: Mapping[str, object] | None = None) -> None:
  """Writes config.json + model.safetensors loadable by transformers' LlamaForCausalLM.

  Written to a temporary directory and renamed, so a failure leaves no half-written export. A
  decoding layout is refused (mapping.check_training_layout).
  """
  mapping.check_training_layout(model)
  if os.path.exists(path) and os.listdir(path):
    raise FileExistsError(f"{path} exists and is not empty; choose a new directory")
  tensors = mapping.export(model, llama_table(cfg, target_prefix))

  def write(tmp: str) -> None:
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
      json.dump({**cfg.to_hf_config(), **(extra or {})}, f, indent=2)
  files.write_dir_atomic(path, write)
