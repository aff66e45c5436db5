"""GGUF import (llama.cpp files): metadata -> config, dequantised tensors -> our params."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
from flax import nnx

from hamburger_jax.config import ConfigError, LlamaConfig
from hamburger_jax.convert import hf, mapping
from hamburger_jax.convert.mapping import WeightsError

_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFFile:
  """A GGUF file opened lazily (memory-mapped); metadata as plain Python values."""

  def __init__(self, path: str):
    if not os.path.exists(path):
      raise FileNotFoundError(f"GGUF file {path} does not exist")
    from gguf import GGUFReader  # pylint: disable=import-outside-toplevel
    try:
      self.reader = GGUFReader(path)
    except Exception as e:  # gguf raises bare ValueErrors on foreign files
      raise WeightsError(f"{path} is not a readable GGUF file: {e}") from None
    self.path = path
    self.metadata: dict[str, Any] = {}
    for key, field in self.reader.fields.items():
      try:
        self.metadata[key] = field.contents()
      except Exception:  # pylint: disable=broad-except
        continue  # exotic field types we never read

  def config(self, **overrides) -> LlamaConfig:
    try:
      return LlamaConfig.from_gguf_metadata(self.metadata, **overrides)
    except ConfigError as e:
      raise ConfigError(f"{self.path}: {e}") from None

  def hf_tensors(self, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Dequantised float32 tensors under transformers' names, q/k in rotate-half order."""
    from gguf.quants import dequantize  # pylint: disable=import-outside-toplevel
    out = {}
    for t in self.reader.tensors:
      name = hf_name(t.name)
      w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
      if name.endswith("q_proj.weight"):
        w = unpermute(w, cfg.num_heads)
      elif name.endswith("k_proj.weight"):
        w = unpermute(w, cfg.num_kv_heads)
      out[name] = w
    return out


def hf_name(gguf_name: str) -> str:
  if gguf_name == "token_embd.weight":
    return "model.embed_tokens.weight"
  if gguf_name == "output_norm.weight":
    return "model.norm.weight"
  if gguf_name == "output.weight":
    return "lm_head.weight"
  m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
  if m and m.group(2) in _NAMES:
    return f"model.layers.{m.group(1)}.{_NAMES[m.group(2)]}.weight"
  return gguf_name  # left unmapped: the strict loader names it


def unpermute(w_oi: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's interleaved-pair RoPE row permutation of q/k weights [out, in]."""
  half = w_oi.shape[0] // n_heads // 2
  return w_oi.reshape(n_heads, half, 2, *w_oi.shape[1:]).swapaxes(1, 2).reshape(w_oi.shape)


def load_into(model: nnx.Module, gguf_file: GGUFFile, cfg: LlamaConfig,
              target_prefix: tuple = ()) -> None:
  tensors = gguf_file.hf_tensors(cfg)
  ignore = {"rope_freqs.weight"}
  mapping.load(model, tensors, hf.llama_table(cfg, target_prefix), f"GGUF {gguf_file.path}",
               ignore)
