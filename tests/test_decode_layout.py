"""The decoding layout (model/decode_layout.py): fused q|k|v and gate|up kernels and folded
merged-entry adapters compute what the training layout computes; the engine's step launches
what the targets ask on SmolLM2's shapes (lowered dots, counted without weights)."""

from __future__ import annotations

import dataclasses
import functools
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hamburger_jax import graft_checkpoint, precision, pretrained
from hamburger_jax.config import GraftConfig, HamburgerConfig
from hamburger_jax.convert import hf, release
from hamburger_jax.convert.mapping import WeightsError
from hamburger_jax.decode import launches
from hamburger_jax.model import lora
from hamburger_jax.model.decode_layout import decode_layout, fold_errors, is_decoding_layout
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import ALL_MERGED, causal_segment_mask
from hamburger_jax.run_config import load_run_config
from hamburger_jax.testing import DECODE_CFG

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def adapted() -> Hamburger:
  """A tiny HAMburger whose merged-entry adapters are non-zero (b = 0 at init would hide them)."""
  model = Hamburger(HamburgerConfig(DECODE_CFG, GraftConfig(merger_head_dim=16, base_lora_rank=4)),
                    rngs=nnx.Rngs(0))
  for i, lin in enumerate(lora.base_linears(model.base)):
    lin.lora.b.set_value(0.1 * jax.random.normal(jax.random.key(i), lin.lora.b.shape))
  return model


def _inputs(model, b=2, t=9):
  ids = jax.random.randint(jax.random.key(1), (b, t), 0, DECODE_CFG.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  return model.base.embed(ids), pos, causal_segment_mask(jnp.ones((b, t), jnp.int32))


@pytest.mark.parametrize("fused,mixed", [(True, "factors"), (True, "kernels"),
                                         (False, "factors")])
def test_decoding_layout_computes_the_training_layouts_forward(adapted, fused, mixed):
  """Plain entries: the same features (to float32 rounding: one matmul of q|k|v is three
  matmuls' columns). Merged entries, per row (in either mixed form) or all: the folded
  kernels and the factors give what the adapters give unfolded."""
  runner = decode_layout(adapted, fused=fused, mixed=mixed)
  assert runner.cfg.base.fused_projections == fused
  x, pos, mask = _inputs(adapted)
  feats = lambda m, merged: np.asarray(m.base_features(x, pos, mask, merged_bt=merged)[0])
  np.testing.assert_allclose(feats(runner, None), feats(adapted, None), rtol=1e-5, atol=1e-5)
  rows = jax.random.bernoulli(jax.random.key(2), 0.5, x.shape[:2])
  np.testing.assert_allclose(feats(runner, rows), feats(adapted, rows), rtol=1e-4, atol=1e-4)
  every = jnp.ones(x.shape[:2], bool)
  np.testing.assert_allclose(feats(runner, ALL_MERGED), feats(adapted, every), rtol=1e-4,
                             atol=1e-4)
  assert not np.allclose(feats(adapted, every), feats(adapted, None), atol=1e-3)  # they act
  h = jax.random.normal(jax.random.key(3), (3, 6, DECODE_CFG.hidden_size))
  pos6, mask6 = jnp.broadcast_to(jnp.arange(6), (3, 6)), causal_segment_mask(jnp.ones((3, 6),
                                                                                     jnp.int32))
  np.testing.assert_allclose(runner.micro(h, pos6, mask6)[0], adapted.micro(h, pos6, mask6)[0],
                             rtol=1e-5, atol=1e-5)


def test_fused_kernels_hold_the_separate_ones(adapted):
  """q|k|v [D, G + 2, Hkv, Dh] and gate|up [D, 2, F] are the checkpoint's kernels, moved: each
  separate kernel is read back exactly, so converters and exports keep one layout."""
  runner = decode_layout(adapted)
  src, dst = adapted.base.decoder.layers[1], runner.base.decoder.layers[1]
  d, h, hkv, dh = (DECODE_CFG.hidden_size, DECODE_CFG.num_heads, DECODE_CFG.num_kv_heads,
                   DECODE_CFG.head_dim)
  g = h // hkv
  qkv = np.asarray(dst.self_attn.qkv_proj.kernel[...])
  assert qkv.shape == (d, g + 2, hkv, dh)
  q = qkv[:, :g].transpose(0, 2, 1, 3).reshape(d, h * dh)  # back to head h = kv * G + g
  np.testing.assert_array_equal(q, src.self_attn.q_proj.kernel[...])
  np.testing.assert_array_equal(qkv[:, g].reshape(d, -1), src.self_attn.k_proj.kernel[...])
  np.testing.assert_array_equal(qkv[:, g + 1].reshape(d, -1), src.self_attn.v_proj.kernel[...])
  gate_up = np.asarray(dst.mlp.gate_up_proj.kernel[...])
  np.testing.assert_array_equal(gate_up[:, 0], src.mlp.gate_proj.kernel[...])
  np.testing.assert_array_equal(gate_up[:, 1], src.mlp.up_proj.kernel[...])
  np.testing.assert_array_equal(dst.self_attn.o_proj.kernel[...], src.self_attn.o_proj.kernel[...])
  # The folded kernel of a merged entry: W + scale * a @ b.
  want = src.mlp.down_proj.kernel[...] + src.mlp.down_proj.lora.delta()
  np.testing.assert_allclose(dst.mlp.down_proj.lora.kernel[...], want, rtol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_no_export_takes_a_decoding_layout(adapted, tmp_path, fused):
  """Fused or not, what decode_layout makes is marked, and every export refuses it (its
  adapters are folded: a separate-projection layout would export without them)."""
  runner = decode_layout(adapted, fused=fused)
  assert is_decoding_layout(runner) and is_decoding_layout(runner.base)
  assert not is_decoding_layout(adapted)
  with pytest.raises(ValueError, match="decoding layout already"):
    decode_layout(runner, fused=fused)
  with pytest.raises(WeightsError, match="decoding layout"):
    graft_checkpoint.save_graft(runner, str(tmp_path / "x"), "random")
  assert not (tmp_path / "x").exists()
  with pytest.raises(WeightsError, match="decoding layout"):
    hf.save(runner.base, runner.cfg.base, str(tmp_path / "hf"))
  assert not (tmp_path / "hf").exists()
  with pytest.raises(WeightsError, match="decoding layout"):
    release.export_release_state_dict(runner, fold_adapters=True)
  with pytest.raises(WeightsError, match="decoding layout"):
    release.write_lightning_checkpoint(runner, tmp_path / "release.ckpt", "base",
                                       fold_adapters=True)
  assert not (tmp_path / "release.ckpt").exists()
  graft_checkpoint.save_graft(adapted, str(tmp_path / "y"), "random")  # the model it came from
  assert (tmp_path / "y").is_dir()


def test_a_base_in_another_dtype_is_a_decoding_layout_too(tmp_path):
  """Separate projections and no adapters, but bfloat16: marked and refused; a model with
  nothing to change is its own layout, unmarked, and exports."""
  plain = Hamburger(HamburgerConfig(DECODE_CFG, GraftConfig(merger_head_dim=16)), rngs=nnx.Rngs(0))
  assert decode_layout(plain, fused=False) is plain and not is_decoding_layout(plain)
  cast = decode_layout(plain.base, fused=False, dtype="bfloat16")
  assert is_decoding_layout(cast) and not cast.cfg.fused_projections
  with pytest.raises(WeightsError, match="decoding layout"):
    hf.save(cast, cast.cfg, str(tmp_path / "hf"))
  with pytest.raises(ValueError, match="dtype='float16'"):
    decode_layout(plain, dtype="float16")


def test_bfloat16_layout_keeps_norms_softmax_and_logits_in_float32(adapted):
  runner = decode_layout(adapted, dtype="bfloat16")
  kernels = [v for p, v in nnx.to_flat_state(nnx.state(runner)) if p[-1] == "kernel"]
  assert kernels and all(v.dtype == jnp.bfloat16 for v in kernels)
  x, pos, mask = _inputs(runner)
  feats = runner.base_features(x, pos, mask)[0]
  assert feats.dtype == jnp.bfloat16
  assert runner.logits(feats[:, -1, -1]).dtype == jnp.float32


def test_micro_vocabulary_carries_over(adapted):
  from hamburger_jax.model.hamburger import sharing_weights  # pylint: disable=C0415
  reduced = sharing_weights(adapted, micro_vocab=np.arange(5, 12))
  runner = decode_layout(reduced)
  np.testing.assert_array_equal(runner.micro_ids[...], np.arange(5, 12))


def test_smollm2_step_launches_meet_their_targets():
  """SmolLM2-135M's shapes with the shipped graft (abstract: no weights): the base step lowers
  to at most 190 matmuls (30 layers of q|k|v, o, gate|up, down and attention's two, and the
  head), a merged entry to as many, and the forced-K HAMburger macro step to at most 1.6x the
  base macro step's."""
  cfg = load_run_config(str(REPO / "configs" / "smollm2_135m.yaml"), shared_only=True)
  hcfg = HamburgerConfig(pretrained.architecture(cfg.model), cfg.graft)
  assert hcfg.graft.base_lora_rank == 16 and hcfg.base.num_layers == 30
  model = nnx.eval_shape(lambda: Hamburger(hcfg, rngs=nnx.Rngs(0)))
  runner = nnx.eval_shape(decode_layout, model)
  figs = launches.figures(runner, 1, 512, model, tpu=False)
  dots = {name: f["dots"] for name, f in figs.items()}
  assert dots["base step"] == dots["merged step"] == 30 * 6 + 1 <= 190
  # A mixed step: each of the 4 projections of a layer adds the factors' 2 matmuls, or in the
  # GPU's form one more full kernel.
  assert dots["mixed step"] == dots["base step"] + 30 * 4 * 2
  kernels = nnx.eval_shape(functools.partial(decode_layout, mixed="kernels"), model)
  mixed = launches.programs(kernels, 1, 512)["mixed step"]
  assert launches.lowered_dots(*mixed) == dots["base step"] + 30 * 4
  assert dots["macro step, HAMburger forced K"] <= 1.6 * dots["macro step, base mode"]
  assert dots["micro step"] == 4 * 6 + 1 + 3  # 4 micro layers, the head, the stop head


def test_engine_decodes_in_the_backends_layout(adapted):
  """This run pins float32 (tests/conftest.py): every backend's engine decodes fused float32,
  and the separate projections give the same tokens."""
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  engine = Engine(adapted, None, stop_ids=())
  assert (engine.fused, engine.dtype) == (True, "float32")
  assert engine.model is adapted and engine.runner.cfg.base.fused_projections
  separate = Engine(adapted, None, stop_ids=(), fused=False)
  prompts = [[1, 2, 3, 4], [5, 6]]
  for mode in ("base", "hamburger"):
    a = engine.generate(prompts, max_new_tokens=8, mode=mode, confidence=0.5)
    b = separate.generate(prompts, max_new_tokens=8, mode=mode, confidence=0.5)
    assert [(g.token_ids, g.groups) for g in a] == [(g.token_ids, g.groups) for g in b]


@pytest.mark.parametrize("platform,dtype,mixed,branch,widths", [
    ("cpu", "float32", "factors", True, "each"), ("gpu", "bfloat16", "kernels", False, "two"),
    ("tpu", "bfloat16", "factors", False, "two"), ("metal", "float32", "factors", False, "two")])
def test_each_backend_decodes_in_its_own_dtype(platform, dtype, mixed, branch, widths):
  """The policy as stated (precision.py), not read back from the function under test."""
  with precision.backend_policy():
    assert precision.decode_defaults(platform) == {"dtype": dtype, "fused": True,
                                                   "mixed": mixed, "plain_branch": branch,
                                                   "verify_widths": widths}


def test_a_pin_overrides_every_backend_and_can_be_undone():
  before = (precision.decode_defaults("gpu"), jax.config.jax_default_matmul_precision)
  with precision.backend_policy():
    assert jax.config.jax_default_matmul_precision is None
    precision.pin(decode_dtype="float32", matmuls="highest")
    assert [precision.decode_defaults(p)["dtype"] for p in ("cpu", "gpu", "tpu")] == [
        "float32"] * 3
    assert jax.config.jax_default_matmul_precision == "highest"
    precision.pin(decode_dtype="bfloat16", matmuls="default")
    assert precision.decode_defaults("cpu")["dtype"] == "bfloat16"
    assert jax.config.jax_default_matmul_precision is None
    with pytest.raises(ValueError, match="decode_dtype='float16'"):
      precision.pin(decode_dtype="float16")
    precision.unpin()
    assert [precision.decode_defaults(p)["dtype"] for p in ("cpu", "gpu", "tpu")] == [
        "float32", "bfloat16", "bfloat16"]
  assert (precision.decode_defaults("gpu"), jax.config.jax_default_matmul_precision) == before


@pytest.mark.parametrize("platform,dtype,mixed", [("cpu", "float32", "factors"),
                                                  ("gpu", "bfloat16", "kernels"),
                                                  ("tpu", "bfloat16", "factors")])
def test_an_engine_takes_its_devices_dtype(adapted, monkeypatch, platform, dtype, mixed):
  """An engine whose device is on `platform` (a stand-in device: the engine reads only its
  platform here) decodes that platform's dtype and mixed form, its weights laid out in it."""
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  device = types.SimpleNamespace(platform=platform)
  with precision.backend_policy(), monkeypatch.context() as patch:
    patch.setattr(jax, "devices", lambda *args, **kwargs: [device])
    engine = Engine(adapted, None, stop_ids=())
  assert (engine.fused, engine.dtype, engine.plain_branch) == (True, dtype, platform == "cpu")
  assert {a.mixed for _, a in nnx.iter_graph(engine.runner)
          if isinstance(a, lora.FoldedAdapter)} == {mixed}
  kernels = [v for p, v in nnx.to_flat_state(nnx.state(engine.runner)) if p[-1] == "kernel"]
  assert kernels and {v.dtype for v in kernels} == {jnp.dtype(dtype)}


def _known_adapters(relative: float) -> Hamburger:
  """A tiny HAMburger whose every adapter changes its kernel by `relative` of the kernel's
  norm (the shipped graft's: 0.3-2%)."""
  model = Hamburger(HamburgerConfig(DECODE_CFG, GraftConfig(merger_head_dim=16, base_lora_rank=4)),
                    rngs=nnx.Rngs(0))
  for i, lin in enumerate(lora.base_linears(model.base)):
    lin.lora.b.set_value(jax.random.normal(jax.random.key(i), lin.lora.b.shape))
    scale = relative * jnp.linalg.norm(lin.kernel[...]) / jnp.linalg.norm(lin.lora.delta())
    lin.lora.b.set_value(lin.lora.b[...] * scale)
  return model


def test_bfloat16_merged_entries_keep_their_adapters():
  """Adapters changing each kernel by 1% (what rounding to bfloat16 leaves 0.25 of on the
  shipped graft): the bfloat16 layout's merged-entry logits lie near float32's adapted ones,
  as near as the bfloat16 base to the float32 base, and far from the unadapted ones; logits
  that lost the adapters (the plain bfloat16 kernels) would not."""
  model = _known_adapters(0.01)
  errors = np.array(list(fold_errors(model, "bfloat16").values()))
  assert len(errors) == 7 * DECODE_CFG.num_layers and 0 < errors.max() < 0.3
  assert max(fold_errors(model, "float32").values()) < 1e-4
  runner = decode_layout(model, dtype="bfloat16")
  ids = jax.random.randint(jax.random.key(1), (4, 16), 0, DECODE_CFG.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(16), ids.shape)
  mask = causal_segment_mask(jnp.ones(ids.shape, jnp.int32))

  def logits(m, merged):
    feats = m.base_features(m.base.embed(ids), pos, mask, merged_bt=merged)[0]
    return np.asarray(m.logits(feats[..., -1, :]), np.float64)

  adapted, plain = logits(model, jnp.ones(ids.shape, bool)), logits(model, None)
  merged, lost = logits(runner, ALL_MERGED), logits(runner, None)
  dist = lambda a, b: float(np.linalg.norm(a - b))
  assert dist(merged, adapted) < 0.5 * dist(merged, plain)
  assert dist(merged, adapted) < 1.2 * dist(lost, plain)  # the base's own rounding
  assert dist(lost, adapted) > dist(lost, plain)  # the check above fails where adapters are lost


def test_a_bfloat16_model_folds_in_float32():
  """A model held in bfloat16 folds W + BA in float32, rounded once (not BA rounded to
  bfloat16, then the sum again)."""
  cfg = dataclasses.replace(DECODE_CFG, dtype="bfloat16", param_dtype="bfloat16")
  model = Hamburger(HamburgerConfig(cfg, GraftConfig(merger_head_dim=16, base_lora_rank=4)),
                    rngs=nnx.Rngs(0))
  for i, lin in enumerate(lora.base_linears(model.base)):
    lin.lora.b.set_value(0.02 * jax.random.normal(jax.random.key(i), lin.lora.b.shape))
  src = model.base.decoder.layers[1].mlp.down_proj
  runner = decode_layout(model)
  got = runner.base.decoder.layers[1].mlp.down_proj.lora.kernel[...]
  a, b = (np.asarray(v[...], np.float64) for v in (src.lora.a, src.lora.b))
  want = np.asarray(src.kernel[...], np.float64) + src.lora.scale * a @ b
  assert got.dtype == jnp.bfloat16
  # Rounded once: within half a bfloat16 step (8 significant bits) of the exact sum, give or
  # take the float32 sum's own rounding (where W and BA nearly cancel).
  half_step = 2.0 ** (np.floor(np.log2(np.abs(want) + 1e-30)) - 8)
  slack = 2.0 ** -23 * (np.abs(np.asarray(src.kernel[...], np.float64)) + np.abs(want))
  assert np.all(np.abs(np.asarray(got, np.float64) - want) <= half_step * (1 + 1e-6) + slack)


def test_a_mixed_step_reads_each_kernel_once(adapted):
  """A base step whose batch holds merged and plain entries runs the plain kernels, and the
  adapters' low-rank factors on the merged rows: not a second full kernel a projection (which
  cost a mixed step on SmolLM2 at 16 rows 1.39x a plain step, against 1.01x). Here rank 4 in
  a width of 64 (factors 1.17x the plain step's flops; two full kernels 1.82x)."""
  runner = decode_layout(adapted, mixed="factors")
  graphdef, params = nnx.split(runner)
  flops = {}
  for name in ("base", "mixed"):
    fn = launches.TIMED_STEPS[name]
    step = jax.jit(lambda p, x, c, fn=fn: fn(nnx.merge(graphdef, p), x, c))
    cost = step.lower(params, *launches.unit_args(runner, name, 4, 32)).compile().cost_analysis()
    flops[name] = (cost[0] if isinstance(cost, list) else cost)["flops"]
  assert flops["base"] < flops["mixed"] < 1.3 * flops["base"]
  with pytest.raises(ValueError, match="mixed='both': use one of factors, kernels"):
    decode_layout(adapted, mixed="both")
