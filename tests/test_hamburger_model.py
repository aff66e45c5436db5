"""The HAMburger model (docs/SPEC.md 1, 2.2, 5): merger, layout, loss vs a slow reference, full-size
parameter counts, initialisation, a training step, and the release checkpoint importer."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

from hamburger_jax import layout
from hamburger_jax.config import ConfigError, GraftConfig, HamburgerConfig, LlamaConfig
from hamburger_jax.convert import release
from hamburger_jax.convert.mapping import WeightsError
from hamburger_jax.objectives.losses import hamburger_loss
from hamburger_jax.model import lora
from hamburger_jax.model.compositional_embedder import CompositionalEmbedder
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import GraftParam, causal_segment_mask
from hamburger_jax.testing import (LLAMA_3_2_1B_GRAFT_PARAMS, llama_3_2_1b_config,
                                   synthetic_samples)

K = 4
VOCAB = 64
ENTRIES, GROUPS = 16, 10  # packed batch shape shared by the loss tests (one compile)


def tiny_config(hidden: int = 32, layers: int = 3, vocab: int = VOCAB, **graft) -> HamburgerConfig:
  base = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_layers=layers, num_heads=4, num_kv_heads=2, rope_theta=10000.0)
  graft = {"max_group": K, "num_features": 2, "micro_layers": 2, "merger_head_dim": 8, **graft}
  return HamburgerConfig(base, GraftConfig(**graft))  # features: layer 0 raw, layer 2 normed


@nnx.jit(static_argnames="ce_chunk")
def jit_loss(model: Hamburger, batch: dict[str, jax.Array], ce_chunk: int = 7):
  # One compiled program for every test below that shares a batch shape (eager dispatch would
  # compile each primitive per shape instead, which is slower on these small CPUs).
  return hamburger_loss(model, batch, ce_chunk)


@pytest.fixture(scope="module")
def model() -> Hamburger:
  m = Hamburger(tiny_config(), rngs=nnx.Rngs(0))
  # The base init (std 0.02) makes every embedding tiny; sharper weights make the merger's
  # softmax and the token distributions non-trivial, so the comparisons below mean something.
  for _, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
    if var.ndim >= 2:
      var.set_value(var[...] * 4.0)
  return m


@pytest.fixture(scope="module")
def fresh_model() -> Hamburger:
  """As initialised (docs/SPEC.md 2.3); tests must not modify it (clone it first)."""
  return Hamburger(tiny_config(), rngs=nnx.Rngs(1))


# ------------------------------------------------------------------------ merger (docs/SPEC.md 1.1)


def merger_weights(embedder: CompositionalEmbedder) -> dict[str, np.ndarray]:
  """Our embedder's params as float64 matrices acting as x @ W + b."""
  get = lambda v: np.asarray(v[...], np.float64)
  p = {"pos": get(embedder.pos)}
  for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
    lin = getattr(embedder, name)
    p[name + ".w"], p[name + ".b"] = get(lin.kernel), get(lin.bias)
  return p


def np_merge(e_sd: np.ndarray, p: dict[str, np.ndarray], num_heads: int) -> np.ndarray:
  """docs/SPEC.md 1.1 written out in NumPy, one group of S embeddings [S, D] -> [D]."""
  s, d = e_sd.shape
  if s == 1:
    return e_sd[0]  # single tokens are never merged
  mean = e_sd.mean(axis=0)
  q = mean @ p["q_proj.w"] + p["q_proj.b"]
  kv_in = np.concatenate([e_sd, p["pos"][:s]], axis=1)  # [S, D + D/2]
  k = kv_in @ p["k_proj.w"] + p["k_proj.b"]
  v = kv_in @ p["v_proj.w"] + p["v_proj.b"]
  dh = d // num_heads
  o = np.zeros(d)
  for h in range(num_heads):
    cols = slice(h * dh, (h + 1) * dh)
    scores = k[:, cols] @ q[cols] / math.sqrt(dh)
    w = np.exp(scores - scores.max())
    o[cols] = (w / w.sum()) @ v[:, cols]
  return mean + o @ p["out_proj.w"] + p["out_proj.b"]


def test_merger_matches_numpy_reference_batched_with_padding(model):
  rng = np.random.default_rng(0)
  d = model.cfg.base.hidden_size
  sizes = np.array([[1, 2, 3], [4, 2, 1]])
  e = rng.normal(size=(*sizes.shape, K, d)).astype(np.float32)  # padded rows hold garbage
  got = np.asarray(model.embedder(jnp.asarray(e), jnp.asarray(sizes)))
  p = merger_weights(model.embedder)
  for idx in np.ndindex(sizes.shape):
    s = sizes[idx]
    want = np_merge(e[idx][:s].astype(np.float64), p, d // model.cfg.graft.merger_head_dim)
    np.testing.assert_allclose(got[idx], want, rtol=1e-5, atol=1e-5, err_msg=f"size {s}")
    if s == 1:  # the identity, bit for bit: the raw embedding
      np.testing.assert_array_equal(got[idx], e[idx][0])
  # smash == embedder(embed(ids)) with the padding ignored
  ids = np.array([[5, 9, 0, 0], [5, 9, 33, 7]])
  a = np.asarray(model.smash(jnp.asarray(ids), jnp.array([2, 2])))
  np.testing.assert_array_equal(a[0], a[1])


# ------------------------------------------------------------------------ layout (docs/SPEC.md 1.2)


def test_merged_positions_example():
  assert layout.merged_positions(5, [3, 1, 4]).tolist() == [0, 1, 2, 3, 4, 7, 8, 12]


def test_position_offset_shifts_merged_entries_by_one():
  assert layout.merged_positions(5, [3, 1, 4], 1).tolist() == [0, 1, 2, 3, 4, 8, 9, 13]
  cfg = GraftConfig(position_offset=1)  # the release's HF generate path
  s = layout.layout_sample([1, 2, 3], [4, 5, 6], [2, 1], K, cfg.position_offset)
  assert s.positions.tolist() == [0, 1, 2, 5, 6]
  assert layout.layout_sample([1, 2, 3], [4, 5, 6], [2, 1], K).positions.tolist() == [0, 1, 2, 4, 5]
  with pytest.raises(ConfigError, match="position_offset"):
    GraftConfig(position_offset=2)


def test_layout_and_packing_of_two_samples_in_one_row():
  a = layout.layout_sample([5, 6, 7], [8, 9, 10, 11, 12], [2, 3], K)
  b = layout.layout_sample([20, 21], [22], [1], K)
  assert a.positions.tolist() == [0, 1, 2, 4, 7] and a.pred_index.tolist() == [2, 3]
  assert a.input_size.tolist() == [1, 1, 1, 2, 3]
  assert a.input_ids[3].tolist() == [8, 9, 0, 0] and a.input_ids[4].tolist() == [10, 11, 12, 0]
  assert a.target_ids.tolist() == [[8, 9, 0, 0], [10, 11, 12, 0]]
  assert b.positions.tolist() == [0, 1, 2] and b.pred_index.tolist() == [1]
  batch = layout.pack_rows([[a, b], [b]], entries=10, groups=4, max_group=K)
  assert batch.positions[0].tolist() == [0, 1, 2, 4, 7, 0, 1, 2, 0, 0]  # restart per sample
  assert batch.segment_ids[0].tolist() == [1, 1, 1, 1, 1, 2, 2, 2, 0, 0]
  assert batch.input_size[0].tolist() == [1, 1, 1, 2, 3, 1, 1, 1, 0, 0]
  assert batch.pred_index[0].tolist() == [2, 3, 6, 0]  # b's index 1 offset by a's 5 entries
  assert batch.target_size[0].tolist() == [2, 3, 1, 0]
  assert batch.target_ids[0, 2].tolist() == [22, 0, 0, 0]
  assert batch.segment_ids[1].tolist() == [1, 1, 1] + [0] * 7
  assert batch.pred_index[1].tolist() == [1, 0, 0, 0]
  with pytest.raises(layout.LayoutError, match="overflows"):
    layout.pack_rows([[a, b]], entries=7, groups=4, max_group=K)


def test_stop_targets_and_trimming():
  target, valid = layout.stop_targets([1, 4, 2], K)
  assert valid.sum(axis=1).tolist() == [1, 4, 2]
  assert target[valid].tolist() == [1, 0, 0, 0, 1, 0, 1]
  assert target[~valid].sum() == 0


def test_stop_targets_through_the_loss_metrics(fresh_model):
  m = nnx.clone(fresh_model)
  out = m.micro.stop_head.out
  bias = 2.0  # a constant stop logit, so the BCE and the accuracy have closed forms
  out.kernel.set_value(jnp.zeros_like(out.kernel[...]))
  out.bias.set_value(jnp.full_like(out.bias[...], bias))
  sample = {"input_ids": np.arange(1, 11), "prompt_len": 3, "groups": [1, 4, 2]}
  _, metrics = jit_loss(m, packed([sample], [[0], []], ENTRIES, GROUPS))  # row 1: all padding
  assert int(metrics["tokens"]) == 7 and int(metrics["groups"]) == 3
  softplus = math.log1p(math.exp(bias))
  np.testing.assert_allclose(float(metrics["stop_bce"]), softplus - bias * 3 / 7, rtol=1e-6)
  np.testing.assert_allclose(float(metrics["stop_acc"]), 3 / 7, rtol=1e-6)  # right at stops only


# -------------------------------------------------------------------------- loss (docs/SPEC.md 2.2)


def _logsumexp(x: np.ndarray) -> np.ndarray:
  mx = x.max(axis=-1, keepdims=True)
  return (mx + np.log(np.exp(x - mx).sum(axis=-1, keepdims=True)))[..., 0]


def reference_loss(model: Hamburger, samples: list[dict]) -> tuple[float, float, float]:
  """Sample by sample, group by group, with the unbatched modules and NumPy CE / BCE."""
  emb = np.asarray(model.base.embed_tokens[...], np.float64)
  p = merger_weights(model.embedder)
  heads = model.cfg.base.hidden_size // model.cfg.graft.merger_head_dim
  f = model.num_features
  ces, bces = [], []
  for sample in samples:
    ids, plen, groups = sample["input_ids"], sample["prompt_len"], sample["groups"]
    prompt, response = ids[:plen], ids[plen:]
    starts = np.concatenate([[0], np.cumsum(groups)[:-1]]).astype(int)
    x = [emb[t] for t in prompt] + [np_merge(emb[response[a:a + g]], p, heads)
                                    for a, g in zip(starts, groups)]
    positions = list(range(plen)) + [plen - 1 + int(c) for c in np.cumsum(groups)]
    t = len(x)
    out = model.base.forward(jnp.asarray(np.stack(x)[None], jnp.float32),
                             jnp.asarray(positions)[None], jnp.tril(jnp.ones((1, t, t), bool)),
                             collect=model.feature_layers[:-1])
    feats = np.stack([np.asarray(c[0]) for c in out.collected] + [np.asarray(out.hidden[0])],
                     axis=1)  # [T, F, D]: raw residuals, then the normed last layer
    for gi, (a, g) in enumerate(zip(starts, groups)):
      fe = feats[plen - 1 + gi]  # last prompt entry predicts group 0, group gi-1's entry gi
      tokens = response[a:a + g]
      hs = [fe[-1]]  # h_0: the skip connection
      if g > 1:
        xm = np.concatenate([fe, emb[tokens[:g - 1]]]).astype(np.float32)  # exactly its size
        n = len(xm)
        h, _ = model.micro(jnp.asarray(xm[None]), jnp.arange(n)[None],
                           jnp.tril(jnp.ones((1, n, n), bool)))
        hs += list(np.asarray(h[0, f:]))
      hs = np.stack(hs)
      logits = hs.astype(np.float64) @ emb.T
      ces += list(_logsumexp(logits) - logits[np.arange(g), tokens])
      stop = np.asarray(model.stop_logits(jnp.asarray(hs, jnp.float32)), np.float64)
      z = (np.arange(g) == g - 1).astype(np.float64)
      bces += list(np.logaddexp(0, stop) - stop * z)
  lm, stop = float(np.mean(ces)), float(np.mean(bces))
  return lm + 0.5 * stop, lm, stop


def packed(samples: list[dict], rows: list[list[int]], entries: int, groups: int,
           position_offset: int = 0) -> dict[str, jax.Array]:
  lay = [layout.layout_sample(s["input_ids"][:s["prompt_len"]], s["input_ids"][s["prompt_len"]:],
                              s["groups"], K, position_offset) for s in samples]
  batch = layout.pack_rows([[lay[i] for i in row] for row in rows], entries, groups, K)
  return {k: jnp.asarray(v) for k, v in batch.as_dict().items()}


def test_loss_matches_slow_per_sample_reference(model):
  # Every sample has 5 base entries, so the reference's eager base forward sees one shape.
  rng = np.random.default_rng(1)
  samples = []
  for groups in ([4, 1], [2, 3, 1], [1, 4], [3, 2, 4], [2, 1]):
    plen, r = 5 - len(groups), sum(groups)
    samples.append({"input_ids": rng.integers(3, VOCAB, size=plen + r).astype(np.int32),
                    "prompt_len": plen, "groups": groups})
  loss, metrics = jit_loss(model, packed(samples, [[0, 1, 2], [3, 4]], ENTRIES, GROUPS))
  want, want_lm, want_stop = reference_loss(model, samples)
  assert int(metrics["tokens"]) == sum(sum(s["groups"]) for s in samples)
  assert int(metrics["groups"]) == sum(len(s["groups"]) for s in samples)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["lm_loss"]), want_lm, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["stop_bce"]), want_stop, rtol=1e-5)


def test_token_zero_is_the_base_prediction(model):
  ids = jnp.array([[3, 17, 42, 8, 21]])
  p = ids.shape[1]
  base_logits = model.base(ids)[0, p - 1]
  feats, _ = model.base_features(model.base.embed(ids), jnp.arange(p)[None],
                                 causal_segment_mask(jnp.ones((1, p), jnp.int32)))
  h = model.micro_hidden(feats[:, p - 1], jnp.array([[9, 10, 11, 12]]))
  np.testing.assert_allclose(np.asarray(model.logits(h[:, 0])[0]), np.asarray(base_logits),
                             rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------- sizes (docs/SPEC.md 1.5)


def test_abstract_builds_have_the_shapes_of_eval_shape():
  """model.abstract (rng counters on the host) builds what nnx.eval_shape does, a module that
  keeps its Rngs included, and allocates no array."""
  from hamburger_jax.model.abstract import abstract  # pylint: disable=import-outside-toplevel

  class KeepsRngs(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.dense = nnx.Linear(4, 3, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)

  cfg = tiny_config(micro_layers=2, base_lora_rank=4)
  for build in (lambda rngs: Hamburger(cfg, rngs=rngs), KeepsRngs):
    ours, theirs = abstract(build, seed=3), nnx.eval_shape(lambda b=build: b(nnx.Rngs(3)))
    shapes = lambda m: jax.tree.map(lambda x: (np.shape(x), str(x.dtype)), nnx.state(m))
    assert shapes(ours) == shapes(theirs)
    assert not [x for x in jax.tree.leaves(nnx.state(ours)) if isinstance(x, jax.Array)]


def test_parameter_counts_at_llama_3_2_1b():
  cfg = HamburgerConfig(llama_3_2_1b_config(), GraftConfig(merger_head_dim=32))
  abstract = nnx.eval_shape(lambda: Hamburger(cfg, rngs=nnx.Rngs(0)))
  counts: dict[str, int] = {}
  by_type = {GraftParam: 0, nnx.Param: 0}
  for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    n = math.prod(var.shape)
    if path[0] == "base":
      key = "base"
    elif path[0] == "embedder":
      key = "out_proj" if path[1] == "out_proj" else "merger"
    elif path[1] == "decoder":
      key = f"micro{path[3]}"
    else:
      key = path[1]
    counts[key] = counts.get(key, 0) + n
    by_type[GraftParam if isinstance(var, GraftParam) else nnx.Param] += n
  assert counts == {"base": 1_235_814_400, "merger": 16_787_456, "out_proj": 4_196_352,
                    "micro0": 60_821_504, "micro1": 60_821_504, "micro2": 60_821_504,
                    "micro3": 60_821_504, "stop_head": 8_394_753}
  assert by_type == {GraftParam: LLAMA_3_2_1B_GRAFT_PARAMS, nnx.Param: 1_235_814_400}
  assert abstract.feature_layers == (3, 7, 11, 15)
  assert abstract.embedder.num_heads == 64
  # The release importer covers every param exactly once.
  targets = [r.target for r in release.release_table(cfg).values()]
  assert len(targets) == len(set(targets))
  assert set(targets) == {tuple(p) for p, _ in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}


def test_feature_layers():
  assert GraftConfig().resolved_feature_layers(16) == (3, 7, 11, 15)
  assert GraftConfig(num_features=2).resolved_feature_layers(4) == (1, 3)
  assert GraftConfig(num_features=3, feature_layers=(0, 5, 9)).resolved_feature_layers(10) == (
      0, 5, 9)
  with pytest.raises(ConfigError, match="last layer"):
    GraftConfig(num_features=2, feature_layers=(0, 2)).resolved_feature_layers(4)


# -------------------------------------------------------------------------- init (docs/SPEC.md 2.3)


def _check_torch_uniform(name: str, w: np.ndarray, fan_in: int) -> None:
  bound = 1 / math.sqrt(fan_in)
  assert np.abs(w).max() <= bound, name
  if w.size >= 1000:  # roughly uniform: U(-b, b) has std b / sqrt(3) and reaches near +-b
    assert abs(w.std() - bound / math.sqrt(3)) < 0.05 * bound, name
    assert np.abs(w).max() > 0.95 * bound and abs(w.mean()) < 0.1 * bound, name


def test_graft_initialisation(fresh_model):
  m = fresh_model
  params = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(m, GraftParam))}
  seen = 0
  for path, var in params.items():
    name, w = ".".join(map(str, path)), np.asarray(var[...])
    if path[-1] == "weight":  # RMSNorm of the micro decoder
      np.testing.assert_array_equal(w, 1.0, err_msg=name)
    elif path[-1] in ("kernel", "bias"):
      fan_in = params[(*path[:-1], "kernel")].shape[0]  # kernels are [in, out]
      _check_torch_uniform(name, w, fan_in)
      seen += 1
  assert seen == 2 * 4 + 2 * 3 + 2 * 7  # merger+out_proj w/b, stop head w/b, 2 micro layers
  # pos: xavier normal on [K, D/2], std sqrt(2 / (D/2 + K)); a wider merger for the statistics
  emb = CompositionalEmbedder(256, K, 32, rngs=nnx.Rngs(2))
  pos = np.asarray(emb.pos[...])
  want = math.sqrt(2 / (128 + K))
  assert abs(pos.std() - want) < 0.1 * want and abs(pos.mean()) < 0.1 * want
  assert np.abs(pos).max() > 2 * want  # normal, not uniform


# ----------------------------------------------------------------------------- training step


def test_graft_only_training_step_lowers_the_loss_and_freezes_the_base(fresh_model):
  m = fresh_model  # not modified: the step below updates a split-off copy of its state
  samples = synthetic_samples(6, VOCAB, K, seed=2, prompt_len=(2, 6), response_len=(4, 10))
  batch = packed(samples, [[0, 1, 2], [3, 4, 5]], entries=32, groups=24)
  graphdef, graft, base = nnx.split(m, GraftParam, nnx.Param)
  graft_paths = {p[0] for p, _ in nnx.to_flat_state(graft)}
  assert graft_paths == {"embedder", "micro"}
  assert {p[0] for p, _ in nnx.to_flat_state(base)} == {"base"}
  base_before = jax.tree.map(np.array, base)
  tx = optax.adam(1e-2)
  opt_state = tx.init(graft)

  @jax.jit
  def step(graft, base, opt_state, batch):
    def loss_fn(graft):
      return hamburger_loss(nnx.merge(graphdef, graft, base), batch, ce_chunk=64)
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(graft)
    updates, opt_state = tx.update(grads, opt_state, graft)
    return optax.apply_updates(graft, updates), opt_state, loss

  losses = []
  for _ in range(6):
    graft, opt_state, loss = step(graft, base, opt_state, batch)
    losses.append(float(loss))
  assert losses[-1] < losses[0] - 0.2, losses
  trained = nnx.merge(graphdef, graft, base)
  _, _, base_after = nnx.split(trained, GraftParam, nnx.Param)
  assert len(jax.tree.leaves(base_after)) == len(jax.tree.leaves(base_before)) == 3 * 9 + 2
  jax.tree.map(np.testing.assert_array_equal, base_after, base_before)
  graft_before = nnx.split(m, GraftParam, nnx.Param)[1]  # `m` itself was never updated
  moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), graft, graft_before)
  assert all(jax.tree.leaves(moved))  # every grafted param was trained


# ------------------------------------------------------------------------- release (docs/SPEC.md 5)


def release_config(tied: bool = True, **graft) -> HamburgerConfig:
  base = LlamaConfig(vocab_size=80, hidden_size=64, intermediate_size=96, num_layers=4,
                     num_heads=4, num_kv_heads=2, tie_word_embeddings=tied)
  # 64 merger heads of one at D = 64: the release's fixed head count.
  graft = {"max_group": K, "merger_head_dim": 1, "micro_layers": 4, **graft}
  return HamburgerConfig(base, GraftConfig(**graft))


def release_state_dict(cfg: HamburgerConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """Key names and torch-layout shapes of docs/SPEC.md 5, written out by hand, random values."""
  b = cfg.base
  v, d, f, dh = b.vocab_size, b.hidden_size, b.intermediate_size, b.head_dim
  h, hkv = b.num_heads * dh, b.num_kv_heads * dh

  def layer(prefix: str) -> dict[str, tuple]:
    names = {"self_attn.q_proj.weight": (h, d), "self_attn.k_proj.weight": (hkv, d),
             "self_attn.v_proj.weight": (hkv, d), "self_attn.o_proj.weight": (d, h),
             "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
             "mlp.down_proj.weight": (d, f), "input_layernorm.weight": (d,),
             "post_attention_layernorm.weight": (d,)}
    return {prefix + name: shape for name, shape in names.items()}

  shapes = {"model.model.embed_tokens.weight": (v, d), "model.model.norm.weight": (d,),
            "comp_embedder.merger.pos": (K, d // 2),
            "comp_embedder.merger.q_proj.weight": (d, d), "comp_embedder.merger.q_proj.bias": (d,),
            "comp_embedder.merger.k_proj.weight": (d, d + d // 2),
            "comp_embedder.merger.k_proj.bias": (d,),
            "comp_embedder.merger.v_proj.weight": (d, d + d // 2),
            "comp_embedder.merger.v_proj.bias": (d,),
            "comp_embedder.out_proj.weight": (d, d), "comp_embedder.out_proj.bias": (d,),
            "micro_step_decoder.stop_head.0.weight": (d, d),
            "micro_step_decoder.stop_head.0.bias": (d,),
            "micro_step_decoder.stop_head.2.weight": (d, d),
            "micro_step_decoder.stop_head.2.bias": (d,),
            "micro_step_decoder.stop_head.4.weight": (1, d),
            "micro_step_decoder.stop_head.4.bias": (1,)}
  for i in range(b.num_layers):
    shapes.update(layer(f"model.model.layers.{i}."))
  for i in range(4):
    shapes.update(layer(f"micro_step_decoder.decoders.{i}."))
  if not b.tie_word_embeddings:
    shapes["model.lm_head.weight"] = (v, d)
  rng = np.random.default_rng(seed)
  sd = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
  sd["comp_embedder.embedding.weight"] = sd["model.model.embed_tokens.weight"].copy()
  if b.tie_word_embeddings:
    sd["model.lm_head.weight"] = sd["model.model.embed_tokens.weight"].copy()
  return sd


def abstract_model(cfg: HamburgerConfig) -> Hamburger:
  return nnx.eval_shape(lambda: Hamburger(cfg, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("tied", [True, False])
def test_release_import_export_round_trip(tied):
  cfg = release_config(tied)
  sd = release_state_dict(cfg)
  m = abstract_model(cfg)
  release.load_release_state_dict(m, sd)  # every param filled: the model was abstract
  out = release.export_release_state_dict(m)
  assert sorted(out) == sorted(sd)
  for k in sd:
    assert out[k].dtype == np.float32 and np.array_equal(out[k], sd[k]), k
  # The layout is right, not only invertible: the merger and the stop head compute what the
  # release's formulas give on the torch-layout tensors (y = x W^T + b).
  p = {"pos": sd["comp_embedder.merger.pos"]}
  for name in ("q_proj", "k_proj", "v_proj"):
    p[name + ".w"] = sd[f"comp_embedder.merger.{name}.weight"].T.astype(np.float64)
    p[name + ".b"] = sd[f"comp_embedder.merger.{name}.bias"]
  p["out_proj.w"] = sd["comp_embedder.out_proj.weight"].T.astype(np.float64)
  p["out_proj.b"] = sd["comp_embedder.out_proj.bias"]
  emb = sd["model.model.embed_tokens.weight"].astype(np.float64)
  ids = np.array([7, 3, 50])
  got = np.asarray(m.smash(jnp.asarray(np.pad(ids, (0, 1)))[None], jnp.array([3])))[0]
  np.testing.assert_allclose(got, np_merge(emb[ids], p, 64), rtol=1e-4, atol=1e-4)
  x = emb[:2]
  silu = lambda z: z / (1 + np.exp(-z))
  lin = lambda z, i: z @ sd[f"micro_step_decoder.stop_head.{i}.weight"].T + sd[
      f"micro_step_decoder.stop_head.{i}.bias"]
  want = lin(silu(lin(silu(lin(x, 0)), 2)), 4)[:, 0]
  np.testing.assert_allclose(np.asarray(m.stop_logits(jnp.asarray(x, jnp.float32))), want,
                             rtol=1e-4, atol=1e-4)
  if not tied:
    np.testing.assert_array_equal(np.asarray(m.base.lm_head[...]), sd["model.lm_head.weight"].T)


def test_release_import_casts_each_tensor_to_the_param_dtype():
  cfg = release_config()
  sd = release_state_dict(cfg)
  for k in list(sd):
    if k.startswith("model.") or k == "comp_embedder.embedding.weight":
      sd[k] = sd[k].astype(ml_dtypes.bfloat16)  # the release stores the base in bf16
  m = abstract_model(cfg)
  release.load_release_state_dict(m, sd)
  assert m.base.embed_tokens[...].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(m.base.embed_tokens[...]),
                                sd["model.model.embed_tokens.weight"].astype(np.float32))


@pytest.mark.parametrize("edit,key", [
    ("drop", "micro_step_decoder.stop_head.2.bias"),
    ("drop", "model.model.layers.3.mlp.down_proj.weight"),
    ("drop", "model.lm_head.weight"),
    ("drop", "comp_embedder.embedding.weight"),
    ("extra", "comp_embedder.merger.extra_proj.weight"),
    ("shape", "comp_embedder.merger.pos"),
    ("shape", "micro_step_decoder.decoders.1.self_attn.k_proj.weight"),
    ("untie", "comp_embedder.embedding.weight"),
    ("untie", "model.lm_head.weight"),
])
def test_release_import_errors_name_the_tensor(edit, key):
  cfg = release_config()
  sd = release_state_dict(cfg)
  if edit == "drop":
    del sd[key]
  elif edit == "extra":
    sd[key] = np.zeros((3, 3), np.float32)
  elif edit == "shape":
    sd[key] = np.zeros((sd[key].shape[0] + 1, *sd[key].shape[1:]), np.float32)
  else:
    sd[key] = sd[key] + np.float32(1e-3)
  with pytest.raises(WeightsError, match=key.replace(".", r"\.")):
    release.load_release_state_dict(abstract_model(cfg), sd)


def test_release_merger_head_count_is_checked():
  cfg = release_config(merger_head_dim=2)  # 32 heads: shapes fit, the merge would differ
  sd = release_state_dict(cfg)
  with pytest.raises(ConfigError, match="64 heads"):
    release.load_release_state_dict(abstract_model(cfg), sd)
  release.load_release_state_dict(abstract_model(cfg), sd, check_heads=False)


def test_graft_config_from_hparams():
  g = release.graft_config_from_hparams(
      {"base_model_name": "meta-llama/Llama-3.2-1B-Instruct", "max_steps": 4},
      llama_3_2_1b_config())
  assert (g.max_group, g.merger_head_dim, g.micro_layers) == (4, 32, 4)
  assert g.resolved_feature_layers(16) == (3, 7, 11, 15)
  assert g.position_offset == 0
  with pytest.raises(WeightsError, match="max_steps"):
    release.graft_config_from_hparams({"base_model_name": "x"}, llama_3_2_1b_config())


def test_lightning_checkpoint_round_trip(tmp_path):
  torch = pytest.importorskip("torch")
  cfg = release_config()
  sd = release_state_dict(cfg, seed=3)
  m = abstract_model(cfg)
  release.load_release_state_dict(m, sd)
  path = tmp_path / "hamburger.ckpt"
  release.write_lightning_checkpoint(m, path, "meta-llama/Llama-3.2-1B-Instruct")
  got, hparams = release.read_lightning_checkpoint(path)
  assert hparams == {"base_model_name": "meta-llama/Llama-3.2-1B-Instruct", "max_steps": K}
  assert sorted(got) == sorted(sd)
  for k in sd:
    assert got[k].dtype == np.float32 and np.array_equal(got[k], sd[k]), k
  raw = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
  ptrs = {raw[k].data_ptr() for k in ("model.model.embed_tokens.weight", "model.lm_head.weight",
                                       "comp_embedder.embedding.weight")}
  assert len(ptrs) == 1  # the tied copies share one storage, as in a torch state dict
  loaded = release.load_lightning_checkpoint(path, cfg.base, num_features=4)
  assert loaded.cfg.graft.max_group == K and loaded.cfg.graft.merger_head_dim == 1
  np.testing.assert_array_equal(np.asarray(loaded.micro.stop_head.out.kernel[...]),
                                sd["micro_step_decoder.stop_head.4.weight"].T)
  # bf16, as the release stores its base: bit-exact through torch's bfloat16
  release.write_lightning_checkpoint(m, path, "base", dtype="bfloat16")
  got, _ = release.read_lightning_checkpoint(path)
  for k in ("model.model.norm.weight", "comp_embedder.merger.pos"):
    assert got[k].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got[k].view(np.uint16),
                                  sd[k].astype(ml_dtypes.bfloat16).view(np.uint16))
  with pytest.raises(FileNotFoundError):
    release.read_lightning_checkpoint(tmp_path / "missing.ckpt")


def test_release_export_folds_base_adapters_only_when_asked():
  """The release format has one set of base weights: a model with merged-entry adapters exports
  only with fold_adapters=True, and then equals our model with the adapters acting everywhere."""
  cfg = release_config(True, base_lora_rank=4, base_lora_alpha=8.0)
  m = Hamburger(cfg, rngs=nnx.Rngs(0))
  for lin in lora.base_linears(m.base):  # b = 0 at init: make the adapters do something
    lin.lora.b.set_value(jnp.full(lin.lora.b.shape, 0.05, lin.lora.b.dtype))
  with pytest.raises(ValueError, match="fold_adapters=True"):
    release.export_release_state_dict(m)
  sd = release.export_release_state_dict(m, fold_adapters=True)
  plain = abstract_model(release_config(True))
  release.load_release_state_dict(plain, sd)
  ids = jnp.array([[5, 9, 0, 0], [3, 0, 0, 0], [7, 1, 2, 0]])[None]
  size = jnp.array([[2, 1, 3]])
  pos = jnp.arange(3)[None]
  mask = causal_segment_mask(jnp.ones((1, 3), jnp.int32))
  everywhere = jnp.ones((1, 3), bool)
  want = m.base_features(m.smash(ids, size), pos, mask, merged_bt=everywhere)[0]
  got = plain.base_features(plain.smash(ids, size), pos, mask)[0]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
  gated = m.base_features(m.smash(ids, size), pos, mask, merged_bt=size >= 2)[0]
  assert not np.allclose(np.asarray(gated), np.asarray(want), atol=1e-3)  # folding changes it
