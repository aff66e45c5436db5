"""The decode benches' instruments on a tiny model: the w-row forward loop of `infer.bench --mode
widths` (what it runs and what it counts) and `infer.experiments.ablate_step`'s variants (each
part taken out only inside its block, and with every part out HAMburger mode is the base's
step)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from hamburger_jax.costs import analytic
from hamburger_jax.decode.engine import Engine
from hamburger_jax.model.decode_layout import decode_layout
from hamburger_jax.model.hamburger import sharing_weights
from hamburger_jax.model.kv_cache import KVCache
from hamburger_jax.testing import DECODE_CFG, DECODE_STOP, tiny_decode_model
from hamburger_jax.benchmarks import widths
from hamburger_jax.decode import step_costs
from infer.experiments import ablate_step


@pytest.fixture(scope="module")
def model():
  return tiny_decode_model()


@pytest.mark.parametrize("shape,width", [("slots", 3), ("tokens", 3), ("slots", 1)])
def test_forward_loop_runs_the_base_forward_and_its_head(model, monkeypatch, shape, width):
  monkeypatch.setattr(step_costs, "STEPS", 1)
  base = model.base
  fn, (params, cache, x) = widths.forward_loop(base, shape, width, kv_len=5)
  batch, rows = (width, 1) if shape == "slots" else (1, width)
  assert x.shape == (batch, rows, DECODE_CFG.hidden_size) and cache.slots == 5 + rows
  fresh = KVCache.init(DECODE_CFG.num_layers, batch, 5 + rows, DECODE_CFG.num_kv_heads,
                       DECODE_CFG.head_dim).replace(length=jnp.full((batch,), 5, jnp.int32))
  pos = 5 + jnp.broadcast_to(jnp.arange(rows), (batch, rows))
  out = base.forward(x, pos, None, fresh, pos)
  expected = jnp.argmax(base.logits(out.hidden[:, -1]), axis=-1)
  token, _ = fn(params, cache, x)
  np.testing.assert_array_equal(token, expected)


def test_measure_counts_the_weights_once_and_each_sequences_cache(model):
  base = model.base
  costs = widths.measure(base, [1, 2], kv_len=8, repeats=1)
  assert [(c.shape, c.width) for c in costs] == [("slots", 1), ("slots", 2), ("tokens", 1),
                                                  ("tokens", 2)]
  w = widths.weight_bytes(base)
  kv = analytic.kv_bytes(DECODE_CFG, DECODE_CFG.num_layers, 1, 8)
  assert [c.bytes_read for c in costs] == [w + kv, w + 2 * kv, w + kv, w + kv]
  assert all(c.step_s > 0 for c in costs)
  lines = widths.report(costs, copy_gb_s=10.0)
  assert lines[2].startswith("| slots | 1 | ") and "| 1.00x |" in lines[2]
  assert len(lines) == 2 + len(costs)


def test_projection_variants_cover_each_layout(model):
  best = widths.measure_variants(DECODE_CFG, [1, 2], repeats=1)
  assert set(best) == {(v, w) for v in widths.VARIANTS for w in (1, 2)}
  lines = widths.report_variants(DECODE_CFG, best, copy_gb_s=10.0)
  assert [l.split(" | ")[0] for l in lines[2:]] == [f"| {v}" for v in widths.VARIANTS]


def test_projection_variants_compute_the_same_layer(model):
  """Fused and separate projections are one computation laid out two ways: with the fused
  weights built from the separate ones, the two stacks agree."""
  cfg = DECODE_CFG
  fn_s, (x, ws) = widths.projection_stack(cfg, "separate f32", 2)
  fn_f, (_, wf) = widths.projection_stack(cfg, "fused f32", 2)
  q = cfg.num_heads * cfg.head_dim
  fused = [{"qkv": jnp.concatenate([w["q"], w["k"], w["v"]], axis=1), "o": w["o"],
            "gu": jnp.concatenate([w["gate"], w["up"]], axis=1), "down": w["down"]} for w in ws]
  assert fused[0]["qkv"].shape == wf[0]["qkv"].shape and fused[0]["qkv"].shape[1] > q
  np.testing.assert_allclose(fn_s(x, ws), fn_f(x, fused), rtol=1e-5, atol=1e-6)


def test_ablate_step_variants_take_their_parts_out(model):
  """With the adapters, the proposal and the embedder out, a HAMburger step is a base step;
  the engine of the real step still merges."""
  everything_out = Engine(model, None, stop_ids=[DECODE_STOP],
                          variant=ablate_step.step_variant("all_out"))
  out = everything_out.generate([[1, 2, 3], [9, 8]], max_new_tokens=8, mode="hamburger",
                                confidence=0.0)
  base = Engine(model, None, stop_ids=[DECODE_STOP]).generate(
      [[1, 2, 3], [9, 8]], max_new_tokens=8, mode="base")
  assert [g.token_ids for g in out] == [g.token_ids for g in base]
  assert all(set(g.groups) == {1} for g in out)
  real = Engine(model, None, stop_ids=[DECODE_STOP]).generate(
      [[1, 2, 3]], max_new_tokens=8, mode="hamburger", confidence=0.0)
  assert max(real[0].groups) > 1


@pytest.mark.parametrize("argv,match", [(["--batch", "0"], "--batch 0 must be >= 1"),
                                        (["--confidence", "1.5"], r"must be in \[0, 1\]")])
def test_ablate_step_rejects_bad_flags(capsys, argv, match):
  with pytest.raises(SystemExit):
    ablate_step.main(argv)
  assert re.search(match, capsys.readouterr().err)


def test_step_costs_times_each_step_in_a_loop(model):
  from hamburger_jax.benchmarks.timing import step_costs  # pylint: disable=C0415
  for m in (model, sharing_weights(model, micro_vocab=np.arange(7))):
    cost = step_costs(decode_layout(m), repeats=1, batch=2)
    assert set(cost) == {"base", "merged", "mixed", "micro", "first micro"}
    assert all(v > 0 for v in cost.values())


def test_ablate_step_without_micro_steps_decodes_the_base(model):
  out = Engine(model, None, stop_ids=[DECODE_STOP],
               variant=ablate_step.step_variant("no_micro_steps")).generate(
                   [[1, 2, 3], [9, 8]], max_new_tokens=8, mode="hamburger", confidence=0.0)
  base = Engine(model, None, stop_ids=[DECODE_STOP]).generate(
      [[1, 2, 3], [9, 8]], max_new_tokens=8, mode="base")
  assert [g.token_ids for g in out] == [g.token_ids for g in base]
  assert all(set(g.groups) == {1} for g in out)
