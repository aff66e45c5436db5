"""Token log-probabilities recomputed after generation (decode/scoring.py) on the tiny decode
models, against an independent, unjitted forward of the model's pieces that rebuilds every
macro step's input from scratch (no layout, no packing, no decoding layout)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hamburger_jax.decode.engine import Engine
from hamburger_jax.decode.sampling import SamplingParams
from hamburger_jax.decode.scoring import Scorer
from hamburger_jax.model.hamburger import sharing_weights
from hamburger_jax.model.llama import causal_segment_mask
from hamburger_jax.openai_api import logprobs
from hamburger_jax.testing import DECODE_STOP, tiny_distill_model

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 31))]
MICRO_IDS = np.arange(0, 97, 3)  # a reduced micro vocabulary: every third token


@pytest.fixture(scope="module")
def model():
  return tiny_distill_model()  # merged-entry adapters set off zero: they act on merged entries


@pytest.fixture(scope="module")
def engine(model) -> Engine:
  return Engine(model, None, stop_ids=[DECODE_STOP])


PAD = 64  # the reference's forwards run at one padded length (rows past the end are unused)


@nnx.jit
def _features(model, x_btd, positions_bt, merged_bt, n):
  """The base's features [F, D] at entry n - 1 of the first n inputs, each attending to those
  before it (causal over a zero-padded row)."""
  mask = causal_segment_mask((jnp.arange(x_btd.shape[1]) < n).astype(jnp.int32)[None])
  return model.base_features(x_btd, positions_bt, mask, merged_bt=merged_bt)[0][0, n - 1]


@nnx.jit
def _micro_logits(model, seq_btd, n):
  """The head's logits at row n - 1 of the micro decoder over a causal, zero-padded row."""
  t = seq_btd.shape[1]
  h, _ = model.micro(seq_btd, jnp.arange(t)[None],
                     causal_segment_mask(jnp.ones((1, t), jnp.int32)))
  return model.base.logits(h[0, n - 1])


def reference_logprobs(model, prompt: list[int], tokens: list[int], groups: list[int],
                       micro_ids=None) -> list[float]:
  """Each token's log-softmax under the distribution that chose it, one macro step at a time
  from scratch: the base over the prompt and the merged entries so far gives token 0 (its
  normed last hidden state through the head), the micro decoder over
  [features, e(t0..t_{i-1})] token i (over `micro_ids` only, when given)."""
  k, f, d = model.max_group, model.num_features, model.cfg.base.hidden_size
  offset = model.cfg.graft.position_offset
  inputs = list(model.base.embed(jnp.asarray(prompt)))
  positions, merged = list(range(len(prompt))), [False] * len(prompt)
  out, done = [], 0
  for size in groups:
    group = tokens[done:done + size]
    n = len(inputs)
    x = jnp.zeros((1, PAD, d)).at[0, :n].set(jnp.stack(inputs))
    pos = jnp.zeros((1, PAD), jnp.int32).at[0, :n].set(jnp.asarray(positions))
    gate = jnp.zeros((1, PAD), bool).at[0, :n].set(jnp.asarray(merged))
    feats = _features(model, x, pos, gate, n)  # [F, D]
    for i, tok in enumerate(group):
      if i == 0:
        logits = model.base.logits(feats[-1])
      else:
        seq = jnp.concatenate([feats, model.base.embed(jnp.asarray(group[:i]))])
        padded = jnp.zeros((1, f + k - 1, d)).at[0, :len(seq)].set(seq)
        logits = _micro_logits(model, padded, len(seq))
        if micro_ids is not None:
          logits = jnp.full_like(logits, -jnp.inf).at[micro_ids].set(logits[micro_ids])
      out.append(float(jax.nn.log_softmax(logits)[tok]))
    ids = jnp.zeros((k,), jnp.int32).at[:size].set(jnp.asarray(group))
    inputs.append(model.smash(ids[None], jnp.asarray([size]))[0])
    done += size
    positions.append(len(prompt) - 1 + done + offset)
    merged.append(size >= 2)
  return out


def base_reference(model, ids: list[int]) -> np.ndarray:
  """log p(ids[t] | ids[:t]) for t >= 1 from the base's plain uncached forward."""
  logp = jax.nn.log_softmax(model.base(jnp.asarray(ids)[None])[0], axis=-1)
  return np.asarray([logp[t - 1, ids[t]] for t in range(1, len(ids))])


def _generate(engine, prompt, mode, confidence, **kw):
  return engine.generate([prompt], max_new_tokens=14, mode=mode, confidence=confidence, **kw)[0]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_base_mode_echo_is_the_plain_forward(model, engine, prompt):
  gen = _generate(engine, prompt, "base", 1.0)
  s = Scorer(engine).score("base", prompt, gen.token_ids, gen.groups, echo=True)
  assert s.token_ids == prompt + gen.token_ids and s.prompt_tokens == len(prompt)
  assert np.isnan(s.logprobs[0]) and not np.isnan(s.logprobs[1:]).any()
  np.testing.assert_allclose(s.logprobs[1:], base_reference(model, s.token_ids), atol=2e-5)
  # Greedy tokens are the argmax of the distribution reported for them.
  assert s.top_ids[len(prompt):, 0].tolist() == gen.token_ids
  np.testing.assert_array_equal(s.top_logprobs[len(prompt):, 0], s.logprobs[len(prompt):])
  assert (np.diff(s.top_logprobs[1:], axis=1) <= 0).all()  # by decreasing log-probability


def test_hamburger_at_confidence_1_is_the_base(engine):
  prompt = PROMPTS[0]
  scorer = Scorer(engine)
  ham = _generate(engine, prompt, "hamburger", 1.0)
  base = _generate(engine, prompt, "base", 1.0)
  assert ham.token_ids == base.token_ids and set(ham.groups) == {1}
  a = scorer.score("hamburger", prompt, ham.token_ids, ham.groups, echo=True)
  b = scorer.score("base", prompt, base.token_ids, base.groups, echo=True)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
  np.testing.assert_array_equal(a.top_ids, b.top_ids)


@pytest.mark.parametrize("micro", [False, True])
def test_hamburger_groups_match_the_reference(model, micro):
  m = sharing_weights(model, micro_vocab=MICRO_IDS if micro else None)
  engine = Engine(m, None, stop_ids=[DECODE_STOP])
  scorer = Scorer(engine)
  for prompt in PROMPTS[micro:]:
    gen = _generate(engine, prompt, "hamburger", 0.0)  # every group runs to K (or the end)
    assert max(gen.groups) >= 2
    s = scorer.score("hamburger", prompt, gen.token_ids, gen.groups)
    assert s.token_ids == gen.token_ids and s.prompt_tokens == 0
    want = reference_logprobs(m, prompt, gen.token_ids, gen.groups,
                              MICRO_IDS if micro else None)
    # The scorer's embedder and micro steps sum in another order than the reference's loop:
    # float32 differs by ~7e-5 relative on a logprob of -0.37 (seen on CI's CPU).
    np.testing.assert_allclose(s.logprobs, want, atol=5e-5)
    assert s.top_ids[:, 0].tolist() == gen.token_ids
    if micro:  # micro tokens choose among the reduced vocabulary only
      starts = np.cumsum([0] + gen.groups[:-1])
      micro_rows = np.setdiff1d(np.arange(len(gen.token_ids)), starts)
      finite = np.isfinite(s.top_logprobs[micro_rows])
      assert np.isin(s.top_ids[micro_rows][finite], MICRO_IDS).all()
      np.testing.assert_allclose(np.exp(s.top_logprobs[micro_rows]).sum(1), 1.0, atol=1e-5)
    # Echo adds the prompt, scored by the base: the same as in base mode.
    e = scorer.score("hamburger", prompt, gen.token_ids, gen.groups, echo=True)
    np.testing.assert_allclose(e.logprobs[len(prompt):], s.logprobs, atol=2e-5)
    np.testing.assert_allclose(e.logprobs[1:len(prompt)], base_reference(m, prompt), atol=2e-5)


def test_sampled_tokens_are_scored_before_temperature(model, engine):
  prompt = PROMPTS[1]
  gen = _generate(engine, prompt, "hamburger", 0.3, sampling=SamplingParams(1.5, 0, 0.9),
                  seed=3)
  s = Scorer(engine).score("hamburger", prompt, gen.token_ids, gen.groups)
  np.testing.assert_allclose(s.logprobs, reference_logprobs(model, prompt, gen.token_ids,
                                                            gen.groups), atol=2e-5)


def test_prompt_alone_and_bad_groups(model, engine):
  scorer = Scorer(engine)
  s = scorer.score("hamburger", PROMPTS[0], echo=True)
  np.testing.assert_allclose(s.logprobs[1:], base_reference(model, PROMPTS[0]), atol=2e-5)
  assert scorer.score("base", PROMPTS[0]).token_ids == []
  with pytest.raises(ValueError, match="group sizes sum to 3 but the response has 2 tokens"):
    scorer.score("hamburger", PROMPTS[0], [7, 8], [3])
  with pytest.raises(ValueError, match="the prompt is empty"):
    scorer.score("base", [], [7])


def test_a_stop_string_lists_tokens_up_to_the_one_that_completed_it():
  decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)
  assert logprobs.listed(decode, [0, 1, 2, 3, 4], [2, 3], ["cd"]) == ([0, 1, 2, 3], [2, 2])
  assert logprobs.listed(decode, [0, 1, 2, 3, 4], [2, 3], ["x"]) == ([0, 1, 2, 3, 4], [2, 3])
  assert logprobs.listed(decode, [0, 1, 2], [1, 1, 1], ["a"]) == ([0], [1])


def test_answer_pieces_join_to_the_whole_answer(engine):
  """The completions' shape on a model without a tokenizer: the echoed prompt, one piece per
  macro step; the pieces joined are the whole answer's logprobs."""
  prompt = PROMPTS[0]
  gen = _generate(engine, prompt, "hamburger", 0.5)
  scorer = Scorer(engine)
  pieces = logprobs.answer_pieces(scorer, None, mode="hamburger", chat=False, top=2, echo=True,
                                  prompt=prompt, ids=gen.token_ids, groups=gen.groups, stops=())
  assert [len(p.logprobs["tokens"]) for p in pieces] == [len(prompt), *gen.groups]
  _, lp = logprobs.joined(pieces, chat=False, scored=True)
  s = scorer.score("hamburger", prompt, gen.token_ids, gen.groups, echo=True)
  assert lp["tokens"] == [f"token_id:{i}" for i in prompt + gen.token_ids]
  assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
  np.testing.assert_allclose(lp["token_logprobs"][1:], s.logprobs[1:], rtol=1e-6)
  for t, alts in enumerate(lp["top_logprobs"][1:], 1):
    assert len(alts) in (2, 3) and alts[lp["tokens"][t]] == lp["token_logprobs"][t]
  chat = logprobs.answer_pieces(scorer, None, mode="hamburger", chat=True, top=0, echo=False,
                                prompt=prompt, ids=gen.token_ids, groups=gen.groups, stops=())
  content = logprobs.joined(chat, chat=True, scored=True)[1]["content"]
  assert [c["logprob"] for c in content] == lp["token_logprobs"][len(prompt):]
  assert all(c["top_logprobs"] == [] and c["bytes"] is None for c in content)
