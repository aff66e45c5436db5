"""Merge at layer L (hamburger_jax/model/layer_merge.py) against an independent formulation: ONE
uncached forward over the record's tokens unmerged, where at layers >= L the keys of every token
but a merged group's last are masked away and the adapters act at the merged groups' last
tokens; built by hand, layer by layer, with dense masks. The gather (lower layers per token, one
entry per group above) must give the same figures, teacher-forced in the merged context and in
the one-merge contexts, and a checkpoint records the layer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hamburger_jax.config import ConfigError, GraftConfig, HamburgerConfig
from hamburger_jax.evaluation import fidelity
from hamburger_jax.model import layer_merge
from hamburger_jax.model.hamburger import Hamburger, with_merge_layer, with_merged_entry
from hamburger_jax.testing import DECODE_CFG, DISTILL_GRAFT, tiny_distill_model

from test_fidelity import _log_softmax, _records, _topk_kl

K = 4
N = DECODE_CFG.num_layers


def _model(merge_layer: int, **graft) -> Hamburger:
  """The tiny distill model (adapters off zero) merged at `merge_layer`; an attention pooling
  gets its output projection set off zero, so that it acts."""
  base = tiny_distill_model()
  cfg = HamburgerConfig(DECODE_CFG, dataclasses.replace(DISTILL_GRAFT, merge_layer=merge_layer,
                                                         **graft))
  model = Hamburger(cfg, rngs=nnx.Rngs(1))
  nnx.update(model, nnx.state(base))
  _norm_off_one(model)
  if model.pooling is not None:
    w = model.pooling.out_proj.kernel
    w.set_value(0.2 * jax.random.normal(jax.random.key(3), w.shape))
  return model


def _norm_off_one(model) -> None:
  """The final norm's weight off 1, as a trained base's: a norm applied twice then shows."""
  w = model.base.norm.weight
  w.set_value(1.0 + 0.5 * jax.random.uniform(jax.random.key(5), w.shape))


def _masked_features(model, ids, upper_hidden, adapted, positions=None):
  """Features [T, F, D] of the plain row `ids`: layers < L exact and causal; at layers >= L a
  query reads no key of `upper_hidden` tokens but its own, and the adapters act at `adapted`."""
  l, t = model.merge_layer, len(ids)
  base = model.base
  x = base.embed(jnp.asarray(ids))[None]
  pos = jnp.arange(t)[None] if positions is None else jnp.asarray(positions)[None]
  causal = np.tril(np.ones((t, t), bool))
  hidden = np.asarray(upper_hidden, bool)
  upper_mask = causal & (~hidden[None, :] | np.eye(t, dtype=bool))
  feats = {}
  for i, layer in enumerate(base.decoder.layers):
    mask = jnp.asarray(causal if i < l else upper_mask)[None]
    merged = None if i < l else jnp.asarray(adapted, bool)[None]
    x, _ = layer(x, pos, mask, merged_bt=merged)
    feats[i] = x[0]
  out = [feats[i] for i in model.feature_layers[:-1]] + [base.norm(x)[0]]
  return jnp.stack(out, axis=1)


def _pooled_reference(model, ids, starts, ends, merged_groups):
  """The masked formulation with a learned pooling: the pooled entry replaces the group's last
  token's layer-L state. Runs the lower layers plainly, pools, then the upper layers masked."""
  l, t = model.merge_layer, len(ids)
  base = model.base
  causal = np.tril(np.ones((t, t), bool))
  x = base.embed(jnp.asarray(ids))[None]
  pos = jnp.arange(t)[None]
  feats = {}
  for i in range(l):
    x, _ = base.decoder.layers[i](x, pos, jnp.asarray(causal)[None])
    feats[i] = x[0]
  hidden = np.zeros(t, bool)
  adapted = np.zeros(t, bool)
  for s, e in merged_groups:
    states = jnp.zeros((K, x.shape[-1])).at[:e - s].set(x[0, s:e])
    x = x.at[0, e - 1].set(model.pool_group(states[None], jnp.asarray([e - s]))[0])
    hidden[s:e - 1] = True
    adapted[e - 1] = True
  upper = causal & (~hidden[None, :] | np.eye(t, dtype=bool))
  for i in range(l, len(base.decoder.layers)):
    x, _ = base.decoder.layers[i](x, pos, jnp.asarray(upper)[None],
                                  merged_bt=jnp.asarray(adapted)[None])
    feats[i] = x[0]
  out = [feats[i] for i in model.feature_layers[:-1]] + [base.norm(x)[0]]
  return jnp.stack(out, axis=1)


def _reference(model, rec):
  """Per-item values of one record from the masked formulation: {figure: [(value, size)]}."""
  ids = np.asarray(rec.prompt + rec.response)
  p, groups = len(rec.prompt), np.asarray(rec.groups)
  ends = p + np.cumsum(groups)
  starts = ends - groups
  logp_t = _log_softmax(model.base(jnp.asarray(ids)[None])[0])
  out = {}
  add = lambda name, value, size: out.setdefault(name, []).append((value, int(size)))
  merged = [(int(s), int(e)) for s, e, g in zip(starts, ends, groups) if g >= 2]

  def features(upto, groups_merged):
    row = ids[:upto]
    if model.pooling is not None:
      return _pooled_reference(model, row, None, None, groups_merged)
    hidden = np.zeros(upto, bool)
    adapted = np.zeros(upto, bool)
    for s, e in groups_merged:
      hidden[s:e - 1] = True
      adapted[e - 1] = True
    return _masked_features(model, row, hidden, adapted)

  feats = features(len(ids), merged)
  for gi in range(len(groups)):
    pred = p - 1 if gi == 0 else ends[gi - 1] - 1  # the predicting entry's last token
    read = 1 if gi == 0 else groups[gi - 1]
    window = ids[starts[gi]:starts[gi] + K]
    padded = np.zeros(K, np.int32)
    padded[:len(window)] = window
    h = model.micro_hidden(feats[pred][None], jnp.asarray(padded)[None])[0]
    logq = _log_softmax(model.logits(h))
    for i in range(len(window)):
      at = starts[gi] - 1 + i
      agree = float(np.argmax(logq[i]) == np.argmax(logp_t[at]))
      if i == 0:
        kind = "merged" if read >= 2 else "single"
        add(f"agree_{kind}", agree, read if read >= 2 else groups[gi])
        add(f"kl_{kind}", _topk_kl(logp_t[at], logq[i]), read if read >= 2 else groups[gi])
      else:
        add(f"agree_s{i + 1}", agree, groups[gi])
  for gi in range(len(groups) - 1):
    if groups[gi] < 2:
      continue
    f = features(int(ends[gi]), [(int(starts[gi]), int(ends[gi]))])
    logq = _log_softmax(model.logits(f[-1, -1]))
    at = ends[gi] - 1
    add("agree_one_merge", float(np.argmax(logq) == np.argmax(logp_t[at])), groups[gi])
    add("kl_one_merge", _topk_kl(logp_t[at], logq), groups[gi])
  return out


@pytest.mark.parametrize("merge_layer,graft", [(1, {}), (3, {"merge_pooling": "attention"}),
                                               (N, {})],
                         ids=["L1", "L3-pooled", "L-all"])
def test_the_gather_equals_the_masked_forward(merge_layer, graft):
  """Every figure of 3 records (groups of 1 to 4; batches of 2 and a partial one), pooled and by
  group size, at L = 1, N (the top: one merged entry reads nothing above) and with a learned
  pooling at L = 3, equals the masked formulation's."""
  model = _model(merge_layer, **graft)
  records = _records(3)
  taught = fidelity.teacher_records(model, records)
  got = fidelity.fidelity_figures(model, taught, batch=2, progress=False)
  items: dict[str, list] = {}
  for rec in records:
    for name, vals in _reference(model, rec).items():
      items.setdefault(name, []).extend(vals)
  for name, vals in items.items():
    values = np.array([v for v, _ in vals])
    assert got["items"][name] == len(vals), name
    assert got[name] == pytest.approx(values.mean(), abs=2e-4), name
    for size in sorted({s for _, s in vals}):
      sel = np.array([s == size for _, s in vals])
      assert got["by_size"][name][str(size)] == pytest.approx(values[sel].mean(), abs=2e-4)


def test_merging_above_the_top_layer_is_the_base():
  """At L = N nothing is merged where the base reads: on the base's own greedy answers every
  token 0 agrees (after merged and single entries, and after one merge); one layer lower the
  merge shows."""
  base = tiny_distill_model()
  _norm_off_one(base)
  records = []
  forward = jax.jit(lambda ids: base.base(ids[None])[0])  # one shape: causal, so the padding
  for r in _records(3):                                    # after a position never reaches it
    n = len(r.prompt)
    ids = np.zeros(n + len(r.response), np.int32)
    ids[:n] = r.prompt
    for i in range(n, len(ids)):
      ids[i] = int(jnp.argmax(forward(jnp.asarray(ids))[i - 1]))
    records.append(dataclasses.replace(r, response=tuple(int(t) for t in ids[n:])))
  top = with_merged_entry(with_merge_layer(base, N), "last_token")
  taught = fidelity.teacher_records(top, records)
  got = fidelity.fidelity_figures(top, taught, batch=2, progress=False)
  for name in ("agree_merged", "agree_single", "agree_one_merge"):
    assert got[name] == 1.0, name
  lower = fidelity.fidelity_figures(with_merged_entry(with_merge_layer(base, 1), "last_token"),
                                    taught, batch=2, progress=False)
  assert lower["agree_merged"] < 1.0


def test_merge_layer_zero_is_todays_graft():
  """with_merge_layer(model, 0) is the model: the same figures to the bit."""
  moved = _model(2)
  model = Hamburger(HamburgerConfig(DECODE_CFG, DISTILL_GRAFT), rngs=nnx.Rngs(1))
  nnx.update(model, nnx.state(moved))
  taught = fidelity.teacher_records(model, _records(2))
  a = fidelity.fidelity_figures(model, taught, batch=2, progress=False)
  b = fidelity.fidelity_figures(with_merge_layer(moved, 0), taught, batch=2, progress=False)
  for name in ("agree_merged", "kl_merged", "kl_single", "kl_one_merge", "kl_s2"):
    assert a[name] == b[name], name


def test_an_attention_pooling_starts_as_the_last_token():
  states = jax.random.normal(jax.random.key(0), (5, K, DECODE_CFG.hidden_size))
  sizes = jnp.asarray([1, 2, 3, 4, 2])
  pooled = _model(2, merge_pooling="attention")
  pooled.pooling.out_proj.kernel.set_value(jnp.zeros_like(pooled.pooling.out_proj.kernel[...]))
  np.testing.assert_array_equal(np.asarray(pooled.pool_group(states, sizes)),
                                np.asarray(layer_merge.last_of_group(states, sizes)))


def test_kv_compression():
  assert layer_merge.kv_compression(209, 100, 0, 30) == pytest.approx(2.09)
  assert layer_merge.kv_compression(209, 100, 15, 30) == pytest.approx(1.353, abs=1e-3)
  assert layer_merge.kv_compression(209, 100, 30, 30) == 1.0


def test_bad_merge_layers_are_refused():
  with pytest.raises(ConfigError, match="exceeds the base's 4 layers"):
    _model(5)
  with pytest.raises(ConfigError, match="must be >= 0"):
    GraftConfig(merge_layer=-1)
  with pytest.raises(ConfigError, match="needs merge_layer > 0"):
    GraftConfig(merge_pooling="attention")
  with pytest.raises(ConfigError, match="contextual_entry"):
    GraftConfig(merge_layer=2, contextual_entry=True)


# ----------------------------------------------------------------------------- training


def _metrics(run_dir):
  import json  # pylint: disable=import-outside-toplevel
  return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _loaded(cfg, export):
  """The run's model with a graft checkpoint loaded over it."""
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  model, _ = pretrained.build_run_model(dataclasses.replace(
      cfg, train=dataclasses.replace(cfg.train, init_from="")))
  pretrained.load_graft(model, export)
  return model


def test_a_graft_moved_to_layer_l_trains_and_records_it(tmp_path):
  """A run at merge_layer 2 from an L = 0 graft: its adapters start at zero (so step 0 is the
  untrained merge) while the micro decoder is the graft's; the loss falls; the export records
  the layer, and reloads merged there. A checkpoint that predates the option reads as L = 0."""
  from hamburger_jax import graft_checkpoint, pretrained, testing, training
  from hamburger_jax.model import lora
  from hamburger_jax.run_config import load_run_config
  tiny = str(testing.REPO_ROOT / "configs" / "tiny.yaml")
  base_sets = ["graft.base_lora_rank=4", "train.recipe=distill", "train.eval_every=0",
               "train.eps=1.0e-6", "train.log_every=1"]
  data = testing.build_synthetic_teacher_dataset(str(tmp_path / "data"),
                                                 load_run_config(tiny, base_sets))
  common = base_sets + [f"data.dir={data}", "checkpoint.every=100"]
  l0 = load_run_config(tiny, common + ["train.steps=2", f"checkpoint.dir={tmp_path / 'l0'}"])
  training.run(l0, progress=False, log=lambda *_: None)
  export0 = str(tmp_path / "l0" / "export")
  moved_cfg = load_run_config(tiny, common + [
      "train.steps=12", "graft.merge_layer=2", "data.tokens=384", f"train.init_from={export0}",
      f"checkpoint.dir={tmp_path / 'l2'}"])
  moved, _ = pretrained.build_run_model(moved_cfg)
  plain = _loaded(l0, export0)
  for lin_moved, lin_plain in zip(lora.base_linears(moved.base), lora.base_linears(plain.base)):
    assert not np.any(np.asarray(lin_moved.lora.b[...]))  # the adapters start again at zero
    assert np.any(np.asarray(lin_plain.lora.b[...]))
    np.testing.assert_array_equal(np.asarray(lin_moved.lora.a[...]),
                                  np.asarray(lin_plain.lora.a[...]))
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(moved.micro)),
                               nnx.to_flat_state(nnx.state(plain.micro))):
    np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
  training.run(moved_cfg, progress=False, log=lambda *_: None)
  losses = [m["loss"] for m in _metrics(tmp_path / "l2")]
  assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3]), losses
  export2 = str(tmp_path / "l2" / "export")
  assert graft_checkpoint.read_meta(export2)["graft"]["merge_layer"] == 2
  assert _loaded(moved_cfg, export2).merge_layer == 2
  old = dict(graft_checkpoint.read_meta(export0)["graft"])
  old.pop("merge_layer")
  old.pop("merge_pooling")
  assert pretrained._graft_config({"graft": old}, export0).merge_layer == 0  # pylint: disable=W0212


# ----------------------------------------------------------------------------- decoding


PROMPTS = [[1, 2, 3, 4, 5], [9, 8], list(range(10, 31)), [40, 41, 42]]


@pytest.fixture(scope="module")
def decode_model():
  """The tiny distill model (adapters, sharpened stop head) merged at layer 2 of 4."""
  from hamburger_jax.testing import sharpen  # pylint: disable=import-outside-toplevel
  model = _model(2)
  sharpen(model.micro.stop_head, 3.0)
  return model


@pytest.fixture(scope="module")
def decode_engine(decode_model):
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  from hamburger_jax.testing import DECODE_STOP  # pylint: disable=import-outside-toplevel
  return Engine(decode_model, None, stop_ids=[DECODE_STOP])


@pytest.mark.parametrize("confidence", [0.5, 0.0])
def test_the_engine_at_layer_l_equals_the_uncached_reference(decode_model, decode_engine,
                                                            confidence):
  """Batched, paged, jitted decoding at L = 2 gives each row the tokens and groups of a plain
  loop that recomputes the masked forward from scratch every step (testing.reference_hamburger),
  merging groups of every size; the upper layers hold one entry a forwarded step."""
  from hamburger_jax.testing import DECODE_STOP, reference_hamburger
  gens = decode_engine.generate(PROMPTS, max_new_tokens=14, mode="hamburger",
                                confidence=confidence)
  sizes = set()
  for prompt, g in zip(PROMPTS, gens):
    tokens, groups = reference_hamburger(decode_model, prompt, 14, confidence, DECODE_STOP)
    assert (g.token_ids, g.groups) == (tokens, groups)
    assert g.kv_entries == len(prompt) + g.macro_steps - 1
    sizes |= set(groups)
  assert max(sizes) >= 3


def test_confidence_one_at_layer_l_is_the_base(decode_model, decode_engine):
  from hamburger_jax.testing import DECODE_STOP
  ham = decode_engine.generate(PROMPTS, max_new_tokens=12, mode="hamburger", confidence=1.0)
  base = decode_engine.generate(PROMPTS, max_new_tokens=12, mode="base")
  for h, b in zip(ham, base):
    assert h.token_ids == b.token_ids and set(h.groups) == {1}
  assert any(DECODE_STOP not in h.token_ids for h in ham)


def test_served_preempted_and_refilled_rows_equal_a_batch_of_one(decode_model):
  """A pool too small for the requests: rows wait, are preempted and recomputed, slots refill;
  every request gets what it gets alone."""
  from hamburger_jax.decode.engine import Engine
  from hamburger_jax.decode.requests import Request
  from hamburger_jax.testing import DECODE_STOP
  engine = Engine(decode_model, None, stop_ids=[DECODE_STOP], block_size=4)
  prompts = PROMPTS + [[7], list(range(50, 70)), [33, 34]]
  new, conf = [12, 16, 7, 14, 10, 9, 15], [0.5, 0.0, 0.3, 0.5, 0.0, 0.6, 0.2]
  alone = [engine.generate([p], max_new_tokens=n, mode="hamburger", confidence=c)[0]
           for p, n, c in zip(prompts, new, conf)]
  run = engine.serve([Request(p, max_new_tokens=n, confidence=c, id=i)
                      for i, (p, n, c) in enumerate(zip(prompts, new, conf))],
                     slots=4, kv_blocks=12, mode="hamburger")
  got = {g.id: g for g in run}
  for i, want in enumerate(alone):
    assert got[i].error is None, got[i].error
    assert (got[i].token_ids, got[i].groups) == (want.token_ids, want.groups), f"request {i}"
  assert run.stats.preemptions > 0 and run.stats.free_blocks_at_end == 11


def test_kv_compression_of_generations_counts_layer_entries():
  """The judge's and the eval's KV compression: tokens over macro steps at L = 0; at L > 0 the
  layer entries kept unmerged over those kept (a base run, one token a step, is 1 at any L)."""
  import types  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.requests import kv_compression  # pylint: disable=C0415
  gens = [types.SimpleNamespace(new_tokens=30, macro_steps=12),
          types.SimpleNamespace(new_tokens=12, macro_steps=8)]
  assert kv_compression(gens) == pytest.approx(42 / 20)
  assert kv_compression(gens, 15, 30) == pytest.approx(30 * 42 / (15 * 42 + 15 * 20))
  base = [types.SimpleNamespace(new_tokens=9, macro_steps=9)]
  assert kv_compression(base, 8, 30) == pytest.approx(1.0)


def test_shared_turns_at_layer_l_come_from_the_prefix_cache_unchanged(decode_model):
  """Prompts sharing a system turn: its entries (every layer's: a prompt token is an entry
  above L too) are copied from the prefix cache and every request emits what it emits alone."""
  from hamburger_jax.decode.engine import Engine
  from hamburger_jax.decode.requests import Request
  from hamburger_jax.testing import DECODE_STOP
  system = list(range(20, 35)) + [DECODE_STOP]
  chats = [system + [5, 6, 7, DECODE_STOP, 1], system + [8, 9, DECODE_STOP, 1],
           system + list(range(40, 52)) + [DECODE_STOP, 1]]
  engine = Engine(decode_model, None, stop_ids=[DECODE_STOP])
  reqs = lambda: [Request(c, max_new_tokens=12, confidence=0.3, id=i)
                  for i, c in enumerate(chats)]
  alone = []
  for r in reqs():
    engine.prefix_cache.clear()
    alone.append(next(iter(engine.serve([r], slots=1, mode="hamburger"))))
  engine.prefix_cache.clear()
  run = engine.serve(reqs(), slots=2, mode="hamburger")
  got = {g.id: g for g in run}
  for i, want in enumerate(alone):
    assert (got[i].token_ids, got[i].groups) == (want.token_ids, want.groups), f"request {i}"
  assert run.stats.prefix_hits == 2 and max(max(g.groups) for g in got.values()) >= 2


def test_a_graft_merging_at_layer_l_launches_no_embedder():
  """The forced macro step at L = 2 runs the same decoder layers as at L = 0 (L of them K wide,
  the rest one wide) and no compositional embedder: fewer, wider kernels."""
  from hamburger_jax.decode import launches
  from hamburger_jax.decode.runner import decode_runner
  step = "macro step, HAMburger forced K"
  dots = {}
  for layer in (0, 2):
    model = _model(layer)
    runner, _ = decode_runner(model)
    dots[layer] = launches.figures(runner, 1, 64, model, tpu=False)[step]["dots"]
  # The embedder's q, k, v and output projections and its attention's two contractions.
  assert dots[2] == dots[0] - 6
