"""Graft checkpoints: save/load round trip, atomic export, and mismatches caught with clear errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from flax import nnx

from hamburger_jax import assets, pretrained
from hamburger_jax.config import GraftConfig, HamburgerConfig, LlamaConfig, to_dict
from hamburger_jax.convert.mapping import WeightsError
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import GraftParam

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
                  num_kv_heads=2)


def _model(seed: int, graft: GraftConfig = GraftConfig(merger_head_dim=16)) -> Hamburger:
  return Hamburger(HamburgerConfig(CFG, graft), rngs=nnx.Rngs(seed))


def _params(model, kind) -> dict:
  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, kind))}


@pytest.mark.parametrize("include_base", [False, True])
def test_graft_checkpoint_round_trip(tmp_path, include_base):
  src, dst = _model(0), _model(1)
  path = str(tmp_path / "ckpt")
  pretrained.save_graft(src, path, "random", dtype="float32", include_base=include_base)
  assert sorted(os.listdir(path)) == sorted(
      ["graft.safetensors", "hamburger.json"] + (["base.safetensors"] if include_base else []))
  assert not os.path.exists(path + ".tmp")
  before = _params(dst, nnx.Param)
  pretrained.load_graft(dst, path)
  for p, v in _params(src, GraftParam).items():
    np.testing.assert_array_equal(_params(dst, GraftParam)[p], v)
  after = _params(dst, nnx.Param)
  src_all = _params(src, nnx.Param)
  for p in before:
    if p not in _params(src, GraftParam):  # base params: loaded only when saved
      want = src_all[p] if include_base else before[p]
      np.testing.assert_array_equal(after[p], want)


def test_bfloat16_export_is_close(tmp_path):
  src, dst = _model(0), _model(1)
  pretrained.save_graft(src, str(tmp_path / "c"), "random")  # default bfloat16
  pretrained.load_graft(dst, str(tmp_path / "c"))
  for p, v in _params(src, GraftParam).items():
    np.testing.assert_allclose(_params(dst, GraftParam)[p], v, rtol=1e-2, atol=1e-3)


def test_mismatches_are_named(tmp_path):
  path = str(tmp_path / "c")
  pretrained.save_graft(_model(0), path, "random", dtype="float32")
  other = _model(0, GraftConfig(merger_head_dim=16, micro_layers=2))
  with pytest.raises(WeightsError, match="graft config"):
    pretrained.load_graft(other, path)
  with pytest.raises(WeightsError, match="not a HAMburger checkpoint"):
    pretrained.load_graft(_model(0), str(tmp_path))
  meta_path = os.path.join(path, "hamburger.json")
  meta = json.load(open(meta_path))
  with open(meta_path, "w") as f:  # claims the default base: its architecture differs
    json.dump({**meta, "base_source": "smollm2"}, f)
  try:
    assets.smollm2_gguf()
  except assets.AssetError:
    pytest.skip("needs the SmolLM2 weights package")
  with pytest.raises(WeightsError, match="trained on a different base"):
    pretrained.load_hamburger(path)


def test_load_hamburger_means_the_shipped_checkpoint_unless_told_untrained(monkeypatch,
                                                                          tmp_path):
  assert pretrained.resolve_checkpoint(None) == pretrained.DEFAULT_CHECKPOINT
  assert pretrained.resolve_checkpoint(str(tmp_path)) == str(tmp_path)
  with pytest.raises(ValueError, match="configures an untrained graft only"):
    pretrained.load_hamburger(graft=GraftConfig())  # would be ignored: the checkpoint has one
  monkeypatch.setattr(pretrained, "DEFAULT_CHECKPOINT", str(tmp_path / "not-shipped"))
  assert pretrained.resolve_checkpoint(None) is None
  with pytest.raises(WeightsError, match="load_hamburger\\('untrained'\\)"):
    pretrained.load_hamburger()


def test_untrained_graft_and_checkpoint_round_trip_on_a_gguf_base(monkeypatch, tmp_path):
  """load_hamburger builds a checkpointed model abstractly and fills it (base from the GGUF file,
  graft and adapters from the checkpoint): the same params as the model that was saved."""
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  from hamburger_jax.testing import write_tiny_llama_gguf  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv(cache.NO_WEIGHT_CACHE_ENV, "1")
  base_path = str(tmp_path / "tiny.gguf")
  write_tiny_llama_gguf(base_path)
  graft = GraftConfig(num_features=2, merger_head_dim=16, micro_layers=1, base_lora_rank=4)
  src, _ = pretrained.load_hamburger(pretrained.UNTRAINED, base_path, graft=graft, seed=3)
  assert src.cfg.graft == graft
  base, _ = pretrained.load_llama(base_path)
  want = Hamburger(HamburgerConfig(base.cfg, graft), rngs=nnx.Rngs(3), base=base)
  for p, v in _params(want, nnx.Param).items():
    np.testing.assert_array_equal(_params(src, nnx.Param)[p], v)
  for path, var in nnx.to_flat_state(nnx.state(src, GraftParam)):  # make every graft param count
    var.set_value(var[...] + 0.01 * (1 + len(path)))
  ckpt = str(tmp_path / "ckpt")
  pretrained.save_graft(src, ckpt, base_path, dtype="float32")
  loaded, tok = pretrained.load_hamburger(ckpt)
  got, saved = _params(loaded, nnx.Param), _params(src, nnx.Param)
  assert got.keys() == saved.keys()
  for p, v in saved.items():
    np.testing.assert_array_equal(got[p], v, err_msg=str(p))
  assert tok.encode("AB") == [63]


@pytest.mark.slow
def test_shipped_checkpoint_loads_is_trained_and_is_the_base_at_confidence_1():
  """The shipped graft fits the repo budget, loads onto the real base, and has learned: on the
  base's own greedy answer to a prompt (grouped in pairs), its teacher-forced loss is far below
  that of an untrained graft of the same architecture. With nothing merged (confidence 1.0) it
  decodes exactly the base's greedy tokens on real prompts (its adapters act on merged entries
  only)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from hamburger_jax import layout  # pylint: disable=import-outside-toplevel
  from hamburger_jax.losses import hamburger_loss  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel

  ckpt = pretrained.DEFAULT_CHECKPOINT
  size = sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt))
  assert size <= 64 * 2**20, f"{ckpt} is {size / 2**20:.1f} MiB, over the 64 MiB repo budget"
  trained, tok = pretrained.load_hamburger()  # no argument: the shipped checkpoint
  assert to_dict(trained.cfg.graft) == pretrained.read_meta(ckpt)["graft"]
  untrained, _ = pretrained.load_hamburger(pretrained.UNTRAINED, graft=trained.cfg.graft)
  prompt = tok.apply_chat_template(
      [{"role": "user", "content": "Describe how a bicycle works in three sentences."}],
      tokenize=True)
  answer = Engine(trained, tok, stop_ids=()).generate([prompt], max_new_tokens=32,
                                                      mode="base")[0].token_ids
  k = trained.max_group
  lay = layout.layout_sample(prompt, answer, [2] * 16, k)
  batch = {n: jnp.asarray(v) for n, v in layout.pack_rows(
      [[lay]], lay.num_entries, lay.num_groups, k).as_dict().items()}
  loss = {name: float(hamburger_loss(m, batch)[1]["lm_loss"])
          for name, m in (("trained", trained), ("untrained", untrained))}
  # Measured: trained 5.5, untrained 12.7 nats (a mis-loaded graft scores like the untrained one).
  assert loss["untrained"] > 2 * loss["trained"], loss
  engine = Engine(trained, tok)
  prompts = ["Describe how a bicycle works in three sentences.", "What is 17 + 25?",
             "Write a haiku about the sea.", "List three uses of copper."]
  base = engine.generate(prompts, max_new_tokens=24, mode="base")
  one = engine.generate(prompts, max_new_tokens=24, mode="hamburger", confidence=1.0)
  for b, h in zip(base, one):
    assert h.token_ids == b.token_ids and h.groups == [1] * h.new_tokens
