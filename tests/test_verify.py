"""Verify mode (decode/step.py: verify_step): the base's exact output, drafted by the micro
decoder and checked by the base in one forward. Greedy, it emits the base's tokens whatever the
drafts: with the tiny random graft (drafts mostly refused) and with drafts that are the base's
own tokens but for planted errors (most kept), one request alone, in mixed batches, through
serving's refills and preemption. Sampling, its acceptance rule leaves each token with the
base's distribution (a statistical test); seeds reproduce; bad settings are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from hamburger_jax.decode import step as step_lib
from hamburger_jax.decode.engine import Engine, GenerationError
from hamburger_jax.decode.requests import Request
from hamburger_jax.decode.sampling import SamplingParams, sampling_logits
from hamburger_jax.testing import DECODE_CFG, DECODE_STOP, tiny_decode_model

PROMPTS = [[1, 2, 3, 4, 5], [9, 8], list(range(10, 31)), [40, 41, 42], [7],
           [60, 61, 62, 63, 64, 65], [33, 34], [80, 70, 60]]
MAX_NEW = [12, 20, 7, 16, 9, 20, 3, 14]


@pytest.fixture(scope="module")
def engine() -> Engine:
  return Engine(tiny_decode_model(), None, stop_ids=[DECODE_STOP], block_size=4)


@pytest.fixture(scope="module")
def base_tokens(engine):
  return [g.token_ids for g in engine.generate(
      [Request(p, max_new_tokens=n, id=i) for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))],
      mode="base")]


def _requests(**kw):
  return [Request(p, max_new_tokens=n, id=i, **kw)
          for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]


@pytest.mark.parametrize("draft_confidence", [0.0, 0.5, 1.0])
def test_greedy_verify_is_the_base_in_a_mixed_batch(engine, base_tokens, draft_confidence):
  got = engine.generate(_requests(draft_confidence=draft_confidence), mode="verify")
  for g, want in zip(got, base_tokens):
    assert g.token_ids == want
    assert g.kv_entries == g.prompt_tokens + len(want)  # one entry per kept token
    assert sum(g.groups) == len(want) and g.macro_steps == len(g.groups)
    assert g.mode == "verify" and g.settings()["draft_confidence"] == draft_confidence
  if draft_confidence == 1.0:  # no drafts: one token a forward, as the base
    assert all(set(g.groups) == {1} for g in got)


def test_serving_with_refills_and_preemption_keeps_the_base_tokens(engine, base_tokens):
  run = engine.serve(_requests(), slots=3, mode="verify", kv_blocks=14)
  got = {g.id: g for g in run}
  assert run.stats.preemptions > 0  # a small pool: some requests were recomputed
  for i, want in enumerate(base_tokens):
    assert got[i].token_ids == want and got[i].error is None


def _planted_drafts(monkeypatch, reference: jax.Array, vocab: int, every: int = 5):
  """Verify's proposal with drafts taken from `reference` [1, L] (the base's own tokens) but
  wrong where the token's index is 3 mod `every`: drafts the base keeps, then refuses."""
  original = step_lib.propose
  k = tiny_decode_model().max_group

  def planted(model, mode, state, **kw):
    group, count = original(model, mode, state, **kw)
    if mode != "verify":
      return group, count
    idx = state.n_tokens[:, None] + jnp.arange(k)[None, :]
    drafts = jnp.take(reference[0], jnp.minimum(idx, reference.shape[1] - 1))
    drafts = jnp.where(idx % every == 3, (drafts + 1) % vocab, drafts)
    group = group.at[:, 1:].set(drafts[:, 1:])
    count = jnp.where(state.done, 0, jnp.minimum(k, state.max_new - state.n_tokens))
    stops = jnp.isin(group, jnp.asarray([DECODE_STOP]))
    first_stop = jnp.argmax(stops, axis=1)
    count = jnp.where(jnp.any(stops & (jnp.arange(k)[None] < count[:, None]), axis=1),
                      jnp.minimum(count, first_stop + 1), count)
    return group, count

  monkeypatch.setattr(step_lib, "propose", planted)


def test_drafts_the_base_keeps_give_several_tokens_a_forward(engine, base_tokens, monkeypatch):
  """One request at a time (slot 0), drafts from its base answer with planted errors: every
  token is the base's; most forwards keep more than one (entries written past a kept prefix
  are overwritten, never read: a wrong read would change the next tokens)."""
  for i in (1, 3, 5):
    ref = jnp.asarray([base_tokens[i] + [0] * 8], jnp.int32)
    with monkeypatch.context() as mp:
      _planted_drafts(mp, ref, DECODE_CFG.vocab_size)
      eng = Engine(engine.model, None, stop_ids=[DECODE_STOP], block_size=4)
      g, = eng.generate([Request(PROMPTS[i], max_new_tokens=MAX_NEW[i])], mode="verify")
    assert g.token_ids == base_tokens[i]
    assert max(g.groups) > 1 and len(g.groups) < len(base_tokens[i]), g.groups
    # A group ends before a planted error (index 3 mod 5), at the K-th token or at the end.
    starts = np.cumsum([0] + g.groups[:-1])
    for s, n in zip(starts, g.groups):
      assert n == 4 or (s + n) % 5 == 3 or s + n == len(base_tokens[i]), (s, n, g.groups)


# ----------------------------------------------------------------------------- sampling


def test_the_acceptance_rule_leaves_the_base_distribution():
  """A draft kept with probability p(d), else a draw from p without d: the token that results is
  distributed as p (temperature, top-k and top-p applied), whatever the draft; chi-square over
  4,000 draws per case."""
  v = 12
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, v)) * 2.0, jnp.float32)
  n = 4000
  for temperature, top_k, top_p, draft in ((1.0, 0, 1.0, 3), (0.7, 5, 1.0, 0), (1.3, 0, 0.8, 7)):
    state = step_lib.DecodeState(
        cache=None, features=None, prompt_len=None, tokens=None, n_tokens=None, groups=None,
        n_steps=jnp.zeros((n,), jnp.int32), done=jnp.zeros((n,), bool), max_new=None,
        confidence=None, max_group=None, temperature=jnp.full((n,), temperature),
        top_k=jnp.full((n,), top_k, jnp.int32), top_p=jnp.full((n,), top_p),
        key=jax.random.split(jax.random.key(1), n), veto=jnp.full((n,), -1, jnp.int32),
        micro_cost=None)
    lg = jnp.broadcast_to(logits[:, None], (n, 1, v))
    drafts = jnp.full((n, 1), draft, jnp.int32)
    kept, refused = step_lib.accepted_drafts(lg, drafts, jnp.ones((n,), jnp.int32), state, True)
    redraw = step_lib.sample(jnp.broadcast_to(logits, (n, v)), state.replace(
        n_steps=state.n_steps + 1), 0, True, refused)
    token = np.where(np.asarray(kept) == 1, draft, np.asarray(redraw))
    p = np.asarray(jax.nn.softmax(sampling_logits(logits, jnp.full((1,), temperature),
                                                  jnp.full((1,), top_k),
                                                  jnp.full((1,), top_p))))[0]
    assert set(np.unique(token)) <= set(np.flatnonzero(p > 0))  # filtered tokens never come
    support = p > 0
    observed = np.bincount(token, minlength=v)[support]
    expected = p[support].astype(np.float64)
    expected = expected / expected.sum() * observed.sum()
    assert stats.chisquare(observed, expected).pvalue > 1e-3, (temperature, observed)
    assert 0 < (np.asarray(kept) == 1).mean() < 1  # both paths taken


def test_sampled_verify_has_the_base_distribution_and_seeds_reproduce(engine):
  """The second token after a prompt, sampled at temperature 1 by 1,024 requests, in verify mode
  against base mode (the micro decoder's drafts kept or refused): the same distribution by a
  chi-square test of homogeneity; the same seeds give the same tokens."""
  sampling = SamplingParams(temperature=1.0)
  n = 1024
  reqs = lambda: [Request([5, 6, 7], max_new_tokens=2, sampling=sampling, seed=3, id=i,
                          draft_confidence=0.0) for i in range(n)]
  ver = engine.generate(reqs(), mode="verify")
  base = engine.generate(reqs(), mode="base")
  assert [g.token_ids for g in engine.generate(reqs()[:64], mode="verify")] == [
      g.token_ids for g in ver[:64]]
  pairs = lambda gens: [tuple(g.token_ids) for g in gens if len(g.token_ids) == 2]
  a, b = pairs(ver), pairs(base)
  cats = sorted(set(a) | set(b))
  table = np.array([[a.count(c) for c in cats], [b.count(c) for c in cats]])
  table = table[:, table.sum(0) >= 10]  # chi-square wants no tiny cells
  assert table.shape[1] >= 3
  assert stats.chi2_contingency(table).pvalue > 1e-3, table
  assert any(len(g.groups) == 1 and g.groups[0] == 2 for g in ver)  # some drafts were kept


def test_bad_settings_are_refused(engine):
  with pytest.raises(GenerationError, match="draft_confidence must be in"):
    engine.generate([[1, 2]], max_new_tokens=4, mode="verify", draft_confidence=1.5)
  with pytest.raises(GenerationError, match="mode 'verify' needs a HAMburger model"):
    Engine(engine.model.base, None).generate([[1, 2]], max_new_tokens=4, mode="verify")
  with pytest.raises(GenerationError, match="use one of base, hamburger, verify"):
    engine.generate([[1, 2]], max_new_tokens=4, mode="speculate")


# ----------------------------------------------------------------------------- the HTTP server


def test_the_server_serves_verify_beside_the_other_modes(engine, base_tokens):
  """One server with verify, HAMburger and base pools: a verify completion is the base's, with
  the base's log-probabilities; `draft_confidence` is a request field, checked like the rest."""
  import asyncio  # pylint: disable=import-outside-toplevel
  import httpx2 as httpx  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.admission import AdmissionLoop, Limits  # pylint: disable=C0415
  from hamburger_jax.openai_api.app import Server  # pylint: disable=C0415
  from hamburger_jax.openai_api.protocol import Defaults  # pylint: disable=C0415
  loop = AdmissionLoop(engine, ("verify", "hamburger", "base"),
                       Limits(slots=2, max_prompt_tokens=32, max_tokens=24))
  server = Server(loop, Defaults(model="tiny", mode="verify", max_tokens=24, confidence=0.5))
  loop.start()

  async def ask(client, body):
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[1],
                                                   "max_tokens": MAX_NEW[1], **body})
    return r.status_code, r.json()

  async def run():
    transport = httpx.ASGITransport(app=server.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tiny") as client:
      return await asyncio.gather(
          ask(client, {"logprobs": 2}), ask(client, {"mode": "base", "logprobs": 2}),
          ask(client, {"draft_confidence": 0.5}), ask(client, {"draft_confidence": 2}))
  try:
    verify, base, gated, bad = asyncio.run(run())
  finally:
    loop.close()
  assert verify[0] == base[0] == gated[0] == 200
  ids = lambda body: body["choices"][0]["logprobs"]["tokens"]
  assert verify[1]["choices"][0]["text"] == base[1]["choices"][0]["text"]
  assert ids(verify[1]) == ids(base[1])
  lp = lambda body: body["choices"][0]["logprobs"]["token_logprobs"]
  assert lp(verify[1]) == pytest.approx(lp(base[1]), abs=1e-5)
  assert bad[0] == 400 and bad[1]["error"]["param"] == "draft_confidence"
