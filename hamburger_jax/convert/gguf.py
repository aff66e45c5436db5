"""GGUF import (llama.cpp files): metadata -> config, dequantised tensors -> our params.

Parsing a GGUF file and dequantising it takes seconds (SmolLM2-135M: ~4 s to parse its 49k-token
vocabulary, ~1.5 s to dequantise), so `read_converted` keeps the result, float32 arrays and the
metadata, in the per-user converted-weights cache (hamburger_jax.cache) and reads it back
memory-mapped while the file is unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import struct
from typing import Any, Mapping

import numpy as np
from flax import nnx
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

from hamburger_jax import cache, files
from hamburger_jax.config import ConfigError, LlamaConfig
from hamburger_jax.convert import hf, mapping
from hamburger_jax.convert.mapping import WeightsError

# Part of every cache entry's fingerprint: bump it when `hf_tensors` or the metadata reading
# would give other values for the same file, so that no entry written by older code is used.
CONVERSION_VERSION = 1
_CACHE_FORMAT = "hamburger-jax/gguf-float32-v1"

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
    return config_from_metadata(self.metadata, self.path, **overrides)

  def hf_tensors(self, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Dequantised float32 tensors under transformers' names, q/k in rotate-half order."""
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


def read_config(path: str) -> LlamaConfig:
  """The architecture in a GGUF file's metadata, parsed once per process for each version of the
  file (its path, size and modification time): GGUFReader parses every field, the tokenizer's
  ~50k strings too, seconds a call, and a run's builds, stages and checks each ask."""
  st = os.stat(path)
  return _read_config(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_config(path: str, size: int, mtime_ns: int) -> LlamaConfig:
  del size, mtime_ns  # the cache's key: a rewritten file is read again
  return GGUFFile(path).config()


def config_from_metadata(metadata: Mapping[str, Any], path: str, **overrides) -> LlamaConfig:
  try:
    return LlamaConfig.from_gguf_metadata(metadata, **overrides)
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}") from None


@dataclasses.dataclass(frozen=True)
class ConvertedGGUF:
  """A GGUF file converted: its metadata (as GGUFFile.metadata) and float32 tensors (as
  GGUFFile.hf_tensors). Tokenizer.from_gguf reads it like a GGUFFile."""
  path: str
  metadata: dict[str, Any]
  tensors: Mapping[str, np.ndarray]
  from_cache: bool  # read back from the converted-weights cache (else converted just now)

  def config(self, **overrides) -> LlamaConfig:
    return config_from_metadata(self.metadata, self.path, **overrides)


def read_converted(path: str) -> ConvertedGGUF:
  """The GGUF file at `path` converted, from the converted-weights cache when it holds this very
  file (same fingerprint: size, mtime, first and last MiB, CONVERSION_VERSION), else converted
  here and written to the cache (unless HAMBURGER_JAX_NO_WEIGHT_CACHE is set)."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"GGUF file {path} does not exist")
  use_cache = cache.weight_cache_enabled()
  if use_cache:
    fingerprint = cache.file_fingerprint(path, CONVERSION_VERSION)
    entry = cache.weights_path(path, ".safetensors")
    hit = _read_entry(entry, fingerprint)
    if hit is not None:
      return ConvertedGGUF(path, *hit, from_cache=True)
  f = GGUFFile(path)
  tensors = f.hf_tensors(f.config())
  if use_cache:
    _write_entry(entry, fingerprint, path, f.metadata, tensors)
  return ConvertedGGUF(path, f.metadata, tensors, from_cache=False)


def _read_entry(entry: str, fingerprint: str
                ) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
  """(metadata, tensors) of a cache entry written for `fingerprint`, else None. The tensors are
  read-only views of the memory-mapped file (safetensors' own reader copies them): loading
  copies each once, into the model. Entries are replaced by rename, never rewritten in place, so
  a mapping stays valid while another process refreshes the entry."""
  try:
    with open(entry, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(n))
  except FileNotFoundError:
    return None
  except (OSError, ValueError, struct.error) as e:
    cache.warn(f"unreadable converted-weights cache entry {entry} ({e}); converting again")
    return None
  info = header.pop("__metadata__", {})
  if info.get("format") != _CACHE_FORMAT or info.get("fingerprint") != fingerprint:
    return None  # written for another version of the file or of this code: rebuilt by the caller
  try:
    data = np.memmap(entry, dtype=np.uint8, mode="r", offset=8 + n)
    tensors = {}
    for name, t in header.items():
      if t["dtype"] != "F32":
        raise ValueError(f"tensor {name} is {t['dtype']}, not F32")
      start, end = t["data_offsets"]
      tensors[name] = data[start:end].view(np.float32).reshape(t["shape"])
    return json.loads(info["gguf_metadata"]), tensors
  except (OSError, ValueError, KeyError, TypeError) as e:
    cache.warn(f"corrupt converted-weights cache entry {entry} ({e}); converting again")
    return None


def _write_entry(entry: str, fingerprint: str, source: str, metadata: Mapping[str, Any],
                 tensors: Mapping[str, np.ndarray]) -> None:
  """Writes a cache entry atomically (temp file + rename): readers see the old entry or the
  whole new one, never a partial file."""
  try:
    os.makedirs(os.path.dirname(entry), exist_ok=True)
    files.write_atomic(entry, lambda tmp: save_file(
        {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, tmp,
        metadata={"format": _CACHE_FORMAT, "fingerprint": fingerprint, "source": source,
                  "gguf_metadata": json.dumps(dict(metadata))}))
  except OSError as e:
    cache.warn(f"could not write the converted-weights cache entry {entry} ({e}); the next load "
               f"converts {source} again (set {cache.NO_WEIGHT_CACHE_ENV}=1 to stop trying)")


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


def load_into(model: nnx.Module, converted: ConvertedGGUF, cfg: LlamaConfig,
              target_prefix: tuple = ()) -> None:
  ignore = {"rope_freqs.weight"}
  mapping.load(model, converted.tensors, hf.llama_table(cfg, target_prefix),
               f"GGUF {converted.path}", ignore)
