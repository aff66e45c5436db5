"""The fidelity figures (hamburger_jax/evaluation/fidelity.py) against an independent reference:
one uncached forward per record and per one-merge context, built by hand from the records,
pooled in plain Python; with the graft options that change what is merged or adapted. The
committed fidelity set: its size, its groups, and that no training source holds its prompts."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hamburger_jax.config import GraftConfig, HamburgerConfig
from hamburger_jax.data.tfds_builder import from_bfloat16_bits
from hamburger_jax.evaluation import fidelity, fidelity_set
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import causal_segment_mask
from hamburger_jax.testing import DECODE_CFG, DISTILL_GRAFT, tiny_distill_model

K = 4


def _records(n: int = 5, seed: int = 0) -> list[fidelity_set.FidelityRecord]:
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    prompt = tuple(int(t) for t in rng.integers(1, 96, rng.integers(3, 9)))
    groups = tuple(int(g) for g in rng.choice([1, 2, 3, 4], rng.integers(4, 12),
                                                p=[0.35, 0.3, 0.15, 0.2]))
    response = tuple(int(t) for t in rng.integers(1, 96, sum(groups)))
    out.append(fidelity_set.FidelityRecord("synthetic", f"r{i}", prompt, response, groups))
  return out


def _model(**graft) -> Hamburger:
  model = tiny_distill_model()
  if not graft:
    return model
  cfg = HamburgerConfig(DECODE_CFG, dataclasses.replace(DISTILL_GRAFT, **graft))
  other = Hamburger(cfg, rngs=nnx.Rngs(1))
  # The tiny model's weights, plus what the option adds (a contextual projection set off zero,
  # so that it acts).
  nnx.update(other, nnx.state(model))
  if other.embedder.contextual:
    w = other.embedder.context_proj.kernel
    w.set_value(0.3 * jax.random.normal(jax.random.key(7), w.shape))
  return other


def _topk_kl(logp_t: np.ndarray, logq: np.ndarray, k: int = 16) -> float:
  ids = np.argsort(-logp_t)[:k]
  p = np.exp(logp_t[ids] - np.logaddexp.reduce(logp_t[ids]))
  return float(np.sum(p * (np.log(p) - logq[ids])))


def _forward(model, x, positions, merged):
  t = x.shape[0]
  feats, _ = model.base_features(x[None], jnp.asarray(positions)[None],
                                 causal_segment_mask(jnp.ones((1, t), jnp.int32)),
                                 merged_bt=jnp.asarray(merged)[None])
  return feats[0]  # [T, F, D]


def _log_softmax(x):
  return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1), np.float64)


def _reference(model, rec, teacher_feats):
  """Per-item values of one record: {figure: [(value, size)]}, every forward uncached."""
  g = model.cfg.graft
  ids = np.asarray(rec.prompt + rec.response)
  p, groups = len(rec.prompt), np.asarray(rec.groups)
  ends = np.cumsum(groups)
  starts = ends - groups
  logp_t = _log_softmax(model.base(jnp.asarray(ids)[None])[0])  # the exact base, plain

  def entry(gi, context=True):
    grp = np.zeros(K, np.int32)
    grp[:groups[gi]] = ids[p + starts[gi]:p + ends[gi]]
    ctx = None
    if g.contextual_entry and context:
      window = np.zeros(K, np.int32)
      w = ids[p + starts[gi]:p + starts[gi] + K]
      window[:len(w)] = w
      ctx = model.group_context(jnp.asarray(teacher_feats[gi])[None], jnp.asarray(window)[None])
    return model.smash(jnp.asarray(grp)[None], jnp.asarray([groups[gi]]), ctx)[0]

  out = {}
  add = lambda name, value, size: out.setdefault(name, []).append((value, int(size)))
  # The merged context: the prompt plain, then one entry per group.
  x = jnp.concatenate([model.base.embed(jnp.asarray(ids[:p])),
                       jnp.stack([entry(i) for i in range(len(groups))])])
  positions = list(range(p)) + [p - 1 + int(e) for e in ends]
  is_merged = [False] * p + [bool(s >= 2) for s in groups]
  adapted = (np.maximum.accumulate(is_merged) if g.adapter_scope == "after_merge"
             else np.asarray(is_merged))
  feats = _forward(model, x, positions, adapted)
  for gi in range(len(groups)):
    pred = p - 1 + gi  # the prompt's last token predicts group 0, group gi - 1's entry group gi
    read = 1 if gi == 0 else groups[gi - 1]
    window = ids[p + starts[gi]:p + starts[gi] + K]
    padded = np.zeros(K, np.int32)
    padded[:len(window)] = window
    h = model.micro_hidden(feats[pred][None], jnp.asarray(padded)[None])[0]
    logq = _log_softmax(model.logits(h))
    for i in range(len(window)):
      at = p - 1 + starts[gi] + i  # the plain position predicting the window's token i
      agree = float(np.argmax(logq[i]) == np.argmax(logp_t[at]))
      kl = _topk_kl(logp_t[at], logq[i])
      if i == 0:
        kind = "merged" if read >= 2 else "single"
        add(f"agree_{kind}", agree, read if read >= 2 else groups[gi])
        add(f"kl_{kind}", kl, read if read >= 2 else groups[gi])
      else:
        add(f"agree_s{i + 1}", agree, groups[gi])
        add(f"kl_s{i + 1}", kl, groups[gi])
  # One merge: the plain tokens before a merged group, then its entry alone.
  for gi in range(len(groups) - 1):
    if groups[gi] < 2:
      continue
    before = p + starts[gi]
    x = jnp.concatenate([model.base.embed(jnp.asarray(ids[:before])), entry(gi)[None]])
    feats = _forward(model, x, list(range(before)) + [p - 1 + int(ends[gi])],
                     [False] * before + [True])
    logq = _log_softmax(model.logits(feats[-1, -1]))
    at = p - 1 + ends[gi]
    add("agree_one_merge", float(np.argmax(logq) == np.argmax(logp_t[at])), groups[gi])
    add("kl_one_merge", _topk_kl(logp_t[at], logq), groups[gi])
  return out


@pytest.mark.parametrize("graft", [{}, {"adapter_scope": "after_merge"},
                                   {"contextual_entry": True}],
                         ids=["shipped-graft", "after_merge", "contextual"])
def test_figures_equal_an_uncached_reference(graft):
  """Every figure, pooled and by group size, of 3 records (groups of 1 to 4, merged and single
  entries, one-merge contexts; batches of 2 and a partial one) equals the reference's."""
  model = _model(**graft)
  records = _records(3)
  taught = fidelity.teacher_records(model, records)
  got = fidelity.fidelity_figures(model, taught, batch=2, progress=False)
  items: dict[str, list] = {}
  for rec, t in zip(records, taught):
    feats = from_bfloat16_bits(t["teacher_features"])
    for name, vals in _reference(model, rec, feats).items():
      items.setdefault(name, []).extend(vals)
  assert set(items) <= set(got["items"])
  for name, vals in items.items():
    values = np.array([v for v, _ in vals])
    assert got["items"][name] == len(vals), name
    assert got[name] == pytest.approx(values.mean(), abs=2e-4), name
    for size in sorted({s for _, s in vals}):
      sel = np.array([s == size for _, s in vals])
      assert got["by_size"][name][str(size)] == pytest.approx(values[sel].mean(), abs=2e-4)
  # The figures measure something: a random graft is far from the base after merged entries.
  assert 0 < got["agree_single"] <= 1 and got["agree_merged"] < 1


def test_a_contextual_entry_with_zero_projection_is_the_plain_one():
  plain = tiny_distill_model()
  ctx = Hamburger(HamburgerConfig(DECODE_CFG, dataclasses.replace(DISTILL_GRAFT,
                                                                 contextual_entry=True)),
                  rngs=nnx.Rngs(1))
  nnx.update(ctx, nnx.state(plain))  # the projection stays at its zero init
  taught = fidelity.teacher_records(plain, _records(3))
  a = fidelity.fidelity_figures(plain, taught, batch=2, progress=False)
  b = fidelity.fidelity_figures(ctx, taught, batch=2, progress=False)
  for name in ("agree_merged", "kl_merged", "agree_one_merge", "kl_s2"):
    assert a[name] == pytest.approx(b[name], abs=1e-5)


def test_after_merge_adapts_every_entry_after_a_samples_first_merge():
  model = _model(adapter_scope="after_merge")
  size = jnp.array([[1, 1, 2, 1, 1, 1, 3, 1, 0, 0]])
  seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2, 0, 0]])
  got = np.asarray(model.adapted_entries(size, seg))[0].tolist()
  assert got == [False, False, True, True, False, False, True, True, False, False]
  assert np.asarray(tiny_distill_model().adapted_entries(size, seg))[0].tolist() == [
      False, False, True, False, False, False, True, False, False, False]


def test_a_set_from_another_base_is_refused():
  model = tiny_distill_model()
  fset = fidelity_set.FidelitySet(tuple(_records(2)), {"base_fingerprint": "0123456789abcdef"})
  with pytest.raises(fidelity_set.FidelitySetError, match="another base"):
    fidelity_set.check_fits(fset, model.base, model.max_group)


# ----------------------------------------------------------------------------- the committed set


def test_the_committed_set_is_held_out_and_well_formed():
  from hamburger_jax import pretrained
  from hamburger_jax.data import heldout
  from hamburger_jax.data.teacher_pass import base_fingerprint
  fset = fidelity_set.load()
  assert len(fset.records) >= 64
  assert all(sum(r.groups) == len(r.response) and max(r.groups) <= K for r in fset.records)
  assert sum(g >= 2 for r in fset.records for g in r.groups) >= 500  # merged entries to read
  base, tok = pretrained.load_llama()
  assert fset.meta["base_fingerprint"] == base_fingerprint(base)
  # Held out of every training source: ShareGPT records among the held-out examples that the
  # token corpus leaves out (and past every pair self-distillation and prepare_data read),
  # MT-Bench first turns (left out of the corpus by their text), reasoning items from the
  # evaluation seeds (training draws below them).
  held = heldout.heldout_sets(tok, heldout.sourcelib.sharegpt_path())
  for r in fset.records:
    if r.source == "sharegpt_heldout":
      assert r.id.split("/", 1)[1].rsplit(":", 1)[0] in held.records, r.id
    elif r.source == "mt_bench":
      text = tok.decode(list(r.prompt))
      assert any(q in heldout.sourcelib.normalize_question(text) for q in held.prompts), r.id
    else:
      name, seed, _ = r.id.split("/")
      assert name == r.source and int(seed) >= heldout.EVAL_SEED, r.id
  chat = [r for r in fset.records if r.source == "sharegpt_heldout"]
  assert min(e.reference["index"] for e in heldout.SHAREGPT_HELDOUT.examples(
      len(chat), count_tokens=lambda s: len(tok.encode(s)))) >= heldout.SHAREGPT_HELDOUT_START


def test_the_oracle_entry_fits_the_slots_better_than_the_embedder():
  """Free entries optimised against the frozen reading side: step 0 is the embedder's own
  one-merge figure on the same slots; the KL falls and agreement does not drop."""
  from hamburger_jax.evaluation import oracle_entry
  model = tiny_distill_model()
  taught = fidelity.teacher_records(model, _records(4))
  # 13 slots: the one-merge rows of the first two records (7 and 6), in order.
  curve = oracle_entry.optimise(model, taught, slots=13, steps=40, lr=1.0, report_every=20)
  assert curve.steps == [0, 20, 40] and curve.slots == 13
  own = fidelity.one_merge(model, taught[:2])
  assert own["items"]["agree_one_merge"] == 13
  assert curve.agree[0] == pytest.approx(own["agree_one_merge"], abs=1e-6)
  assert curve.kl[0] == pytest.approx(own["kl_one_merge"], rel=1e-4)
  assert curve.kl[-1] < 0.5 * curve.kl[0], curve.kl
  assert curve.agree[-1] >= curve.agree[0]
  n = int(sum(taught[0]["groups"]))  # every token its own group, each with its features
  single = [dict(taught[0], groups=np.ones(n, np.int32), teacher_features=np.repeat(
      taught[0]["teacher_features"][:1], n, axis=0))]
  with pytest.raises(ValueError, match="no merged group"):
    oracle_entry.optimise(model, single, slots=4, steps=2)
