"""Verify mode (decode/step.py: verify_step): the base's exact output, drafted by the micro
decoder and checked by the base in one forward. Greedy, it emits the base's tokens whatever the
drafts: with the tiny random graft (drafts mostly refused) and with drafts that are the base's
own tokens but for planted errors (most kept), one request alone, in mixed batches, through
serving's refills and preemption; with a drafter of another depth than the micro decoder; with
grafts whose merged entries the engine does not build (HAMburger mode refused). Sampling, its
acceptance rule leaves each token with the base's distribution and refuses the first of several
drafts as often as it should (statistical tests); seeds reproduce; bad settings are refused."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from hamburger_jax.config import GraftConfig, HamburgerConfig
from hamburger_jax.decode import step as step_lib
from hamburger_jax.decode.engine import Engine, GenerationError
from hamburger_jax.decode.requests import Request, pooled_tokens_per_step
from hamburger_jax.decode.sampling import SamplingParams, sampling_logits
from hamburger_jax.model import lora
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.testing import DECODE_CFG, DECODE_STOP, tiny_decode_model

PROMPTS = [[1, 2, 3, 4, 5], [9, 8], list(range(10, 31)), [40, 41, 42], [7],
           [60, 61, 62, 63, 64, 65], [33, 34], [80, 70, 60]]
MAX_NEW = [12, 20, 7, 16, 9, 20, 3, 14]


@pytest.fixture(scope="module")
def engine() -> Engine:
  # The micro decoder's drafts alone (tests/test_lookup.py: lookup drafts)
  return Engine(tiny_decode_model(), None, stop_ids=[DECODE_STOP], block_size=4, draft_lookup=0)


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


def test_a_row_near_its_end_asks_only_for_the_entries_it_can_keep(engine):
  """A verify step writes K entries, but a row keeps no more than the tokens it has left
  (shapes.step_room): two rows of 5 + 6 tokens (one token a forward) fit 3 blocks of 4 each,
  where room for K = 4 past the 9th entry would take a 4th block and preempt the younger row.
  The host and the decode loop agree on that room: the loop never returns to the host for it
  (one round)."""
  prompts = [[1, 2, 3, 4, 5], [60, 61, 62, 63, 64]]
  reqs = lambda: [Request(p, max_new_tokens=6, id=i, draft_confidence=1.0)
                  for i, p in enumerate(prompts)]
  alone = [engine.generate([r], mode="verify")[0].token_ids for r in reqs()]
  assert [len(t) for t in alone] == [6, 6]  # no stop token: every row runs to its last token
  run = engine.serve(reqs(), slots=2, mode="verify", kv_blocks=7)
  got = {g.id: g for g in run}
  assert [got[i].token_ids for i in range(2)] == alone
  assert run.stats.preemptions == 0 and max(run.stats.blocks_used) == 6
  assert run.stats.rounds == 1


def _plant(monkeypatch, replace) -> None:
  """Verify's proposal, its group and count then passed through `replace(state, group, count)`
  (traced in the decode program: an engine made after this call runs it)."""
  original = step_lib.propose

  def planted(model, mode, state, **kw):
    group, count = original(model, mode, state, **kw)
    return replace(state, group, count) if mode == "verify" else (group, count)

  monkeypatch.setattr(step_lib, "propose", planted)


def _planted_drafts(monkeypatch, requests: list[Request], references: list[list[int]],
                    every: int = 5):
  """Each row's drafts taken from its request's reference tokens (the base's own) but wrong
  where the token's index is 3 mod `every`: drafts the base keeps, then refuses. A row's
  request is the one whose key it holds (Request.key: from its seed and id alone, so a
  refilled slot or a recomputed request finds its own)."""
  k, vocab = tiny_decode_model().max_group, DECODE_CFG.vocab_size
  keys = jnp.stack([jax.random.key_data(r.key()) for r in requests])
  width = max(map(len, references)) + k
  ref = jnp.asarray([t + [0] * (width - len(t)) for t in references], jnp.int32)

  def replace(state, group, count):
    del count  # every row drafts up to K - 1 tokens, ending at a stop token
    mine = jnp.all(jax.random.key_data(state.key)[:, None] == keys[None], axis=-1)
    row = jnp.argmax(mine, axis=1)  # an empty slot matches none: its count is 0
    idx = state.n_tokens[:, None] + jnp.arange(k)[None, :]
    drafts = ref[row[:, None], jnp.minimum(idx, width - 1)]
    drafts = jnp.where(idx % every == 3, (drafts + 1) % vocab, drafts)
    group = group.at[:, 1:].set(drafts[:, 1:])
    count = jnp.where(state.done, 0, jnp.minimum(k, state.max_new - state.n_tokens))
    stops = jnp.isin(group, jnp.asarray([DECODE_STOP]))
    first_stop = jnp.argmax(stops, axis=1)
    count = jnp.where(jnp.any(stops & (jnp.arange(k)[None] < count[:, None]), axis=1),
                      jnp.minimum(count, first_stop + 1), count)
    return group, count

  _plant(monkeypatch, replace)


def test_drafts_the_base_keeps_give_several_tokens_a_forward(engine, base_tokens, monkeypatch):
  """One request at a time (slot 0), drafts from its base answer with planted errors: every
  token is the base's; most forwards keep more than one (entries written past a kept prefix
  are overwritten, never read: a wrong read would change the next tokens)."""
  for i in (1, 3, 5):
    req = _requests()[i]
    with monkeypatch.context() as mp:
      _planted_drafts(mp, [req], [base_tokens[i]])
      eng = Engine(engine.model, None, stop_ids=[DECODE_STOP], block_size=4)
      g, = eng.generate([req], mode="verify")
    assert g.token_ids == base_tokens[i]
    assert max(g.groups) > 1 and len(g.groups) < len(base_tokens[i]), g.groups
    # A group ends before a planted error (index 3 mod 5), at the K-th token or at the end.
    starts = np.cumsum([0] + g.groups[:-1])
    for s, n in zip(starts, g.groups):
      assert n == 4 or (s + n) % 5 == 3 or s + n == len(base_tokens[i]), (s, n, g.groups)


def _kept_most_drafts(gens, base_tokens) -> None:
  """Every row has the base's tokens, and took fewer forwards than tokens: drafts were kept."""
  assert [g.token_ids for g in gens] == base_tokens
  assert pooled_tokens_per_step(gens) > 1.5
  for g in gens:
    assert g.error is None, g.error
    assert len(g.token_ids) < 2 or g.macro_steps < len(g.token_ids), (g.id, g.groups)


def test_kept_drafts_in_a_batch_give_the_base_tokens(engine, base_tokens, monkeypatch):
  """Eight rows of different prompts and lengths, each drafting from its own base answer with
  planted errors: each keeps its own drafts (rows advance by different counts a forward)."""
  _planted_drafts(monkeypatch, _requests(), base_tokens)
  eng = Engine(engine.model, None, stop_ids=[DECODE_STOP], block_size=4)
  _kept_most_drafts(eng.generate(_requests(), mode="verify"), base_tokens)


def test_kept_drafts_through_refills_and_preemption_give_the_base_tokens(engine, base_tokens,
                                                                         monkeypatch):
  """The same through serving: 3 slots refilled as rows finish, and a pool small enough that
  some rows are preempted and recomputed (their drafts start again from their first token)."""
  _planted_drafts(monkeypatch, _requests(), base_tokens)
  eng = Engine(engine.model, None, stop_ids=[DECODE_STOP], block_size=4)
  # 11 blocks of 4 entries hold any one row, not three at their longest (here 14 would).
  run = eng.serve(_requests(), slots=3, mode="verify", kv_blocks=11)
  got = {g.id: g for g in run}
  assert run.stats.preemptions > 0
  _kept_most_drafts([got[i] for i in range(len(PROMPTS))], base_tokens)


# ----------------------------------------------------------------------------- other grafts


def _graft(**options) -> Hamburger:
  """A graft with `options` on tiny_decode_model's base (`base_tokens` is its greedy output),
  its merged-entry adapters, if any, set off zero: wherever they acted, tokens would change."""
  model = Hamburger(HamburgerConfig(DECODE_CFG, GraftConfig(merger_head_dim=16, **options)),
                    rngs=nnx.Rngs(1), base=tiny_decode_model().base)
  for i, lin in enumerate(lora.base_linears(model.base) if model.cfg.graft.base_lora_rank else []):
    lin.lora.b.set_value(0.05 * jax.random.normal(jax.random.key(i), lin.lora.b.shape))
  return model


@pytest.mark.parametrize("depth", [2, 6])
def test_a_drafter_of_another_depth_than_the_micro_decoder_gives_the_base_tokens(base_tokens,
                                                                                 depth):
  """A drafter shallower or deeper than the 4-layer micro decoder: the micro steps' cache has
  the depth of the decoder that runs them, and verify mode drafting from it at every step
  emits the base's tokens."""
  model = _graft(drafter_layers=depth)
  assert [model.micro_cache(2, drafting).k.shape[0] for drafting in (False, True)] == [4, depth]
  eng = Engine(model, None, stop_ids=[DECODE_STOP], block_size=4, draft_lookup=0)
  got = eng.generate(_requests(draft_confidence=0.0), mode="verify")
  assert [g.token_ids for g in got] == base_tokens
  assert any(max(g.groups) > 1 for g in got)  # some of its drafts were kept


@pytest.mark.parametrize("option", [{"adapter_scope": "after_merge"},
                                    {"contextual_entry": True}], ids=lambda o: next(iter(o)))
def test_a_graft_hamburger_mode_cannot_decode_serves_verify_and_base(base_tokens, option):
  """Options that act only once an entry is merged (which the engine's HAMburger step does not
  build): the graft loads, verify and base modes (no entry merged) emit the base's tokens, and
  HAMburger mode, asked for or the default, is refused with a line that says so."""
  eng = Engine(_graft(base_lora_rank=4, base_lora_alpha=8.0, **option), None,
               stop_ids=[DECODE_STOP], block_size=4)
  for mode in ("verify", "base"):
    got = eng.generate(_requests(draft_confidence=0.5), mode=mode)
    assert [g.token_ids for g in got] == base_tokens, mode
  name = next(iter(option))
  for mode in ("hamburger", None):
    with pytest.raises(GenerationError, match=f"{name}=.* does not decode in HAMburger mode: "
                                              "verify and base modes"):
      eng.generate([[1, 2]], max_new_tokens=4, mode=mode)


# ----------------------------------------------------------------------------- sampling


def _sampling_rows(n: int, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   seed: int = 1) -> step_lib.DecodeState:
  """n rows at macro step 0 with the fields sampling reads (`sample`, `accepted_drafts`),
  each row its own key from `seed`; the others unset."""
  unset = {f.name: None for f in dataclasses.fields(step_lib.DecodeState)}
  return step_lib.DecodeState(**{
      **unset, "n_steps": jnp.zeros((n,), jnp.int32), "done": jnp.zeros((n,), bool),
      "temperature": jnp.full((n,), temperature), "top_k": jnp.full((n,), top_k, jnp.int32),
      "top_p": jnp.full((n,), top_p), "key": jax.random.split(jax.random.key(seed), n)})


def test_the_acceptance_rule_leaves_the_base_distribution():
  """A draft kept with probability p(d), else a draw from p without d: the token that results is
  distributed as p (temperature, top-k and top-p applied), whatever the draft; chi-square over
  4,000 draws per case."""
  v = 12
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, v)) * 2.0, jnp.float32)
  n = 4000
  for temperature, top_k, top_p, draft in ((1.0, 0, 1.0, 3), (0.7, 5, 1.0, 0), (1.3, 0, 0.8, 7)):
    state = _sampling_rows(n, temperature, top_k, top_p)
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


@pytest.mark.parametrize("temperature, top_k, n_drafts, made", [
    (1.0, 0, 3, (0.6, 0.4, 0.7)), (1.0, 0, 2, (0.6, 0.4, 0.99)), (0.7, 5, 3, None)],
                         ids=["three", "two-of-three", "top-k"])
def test_the_first_refused_of_three_drafts_falls_where_the_acceptance_probabilities_say(
    temperature, top_k, n_drafts, made):
  """Draft i kept with probability p_i(d_i), by a uniform of its own, once every draft before it
  was: j drafts kept with probability p_1 .. p_j (1 - p_{j+1}), all n_drafts with p_1 .. p_n,
  more never; the refused draft is the first one not kept. Chi-square over 20,000 rows, each
  its own key. Drafts whose probabilities are `made` to order (the third beyond the row's
  n_drafts in one case: never checked, however likely), or under temperature and top-k (the
  third outside the top 5: always refused)."""
  v, k, n = 12, 3, 20000
  if made is None:
    logits = np.random.default_rng(0).normal(size=(k, v)) * 2.0
    ranks = np.argsort(-logits, axis=1)
    drafts = np.array([ranks[0, 1], ranks[1, 0], ranks[2, 6]])
  else:
    logits = np.zeros((k, v))  # draft i is token i; the other tokens share 1 - p_i evenly
    logits[np.arange(k), np.arange(k)] = np.log(np.asarray(made) * (v - 1) / (1 - np.asarray(made)))
    drafts = np.arange(k)
  logits = jnp.asarray(logits, jnp.float32)
  kept, refused = step_lib.accepted_drafts(
      jnp.broadcast_to(logits, (n, k, v)), jnp.broadcast_to(jnp.asarray(drafts, jnp.int32), (n, k)),
      jnp.full((n,), n_drafts, jnp.int32), _sampling_rows(n, temperature, top_k, seed=2), True)
  probs = jax.nn.softmax(sampling_logits(logits, jnp.full((k,), temperature),
                                         jnp.full((k,), top_k), jnp.ones((k,))), axis=-1)
  p = np.asarray(probs, np.float64)[np.arange(k), drafts][:n_drafts]
  if made is not None:
    np.testing.assert_allclose(p, made[:n_drafts], rtol=1e-5)
  reach = np.cumprod(np.concatenate([[1.0], p]))  # P(the first j drafts kept), j = 0..n_drafts
  expected = np.zeros(k + 1)
  expected[:n_drafts + 1] = np.append(reach[:-1] * (1 - p), reach[-1])
  observed = np.bincount(np.asarray(kept), minlength=k + 1)
  support = expected > 0
  assert observed[~support].sum() == 0, observed
  assert stats.chisquare(observed[support], expected[support] * n).pvalue > 1e-3, (
      observed, expected * n)
  np.testing.assert_array_equal(
      refused, np.where(np.asarray(kept) < n_drafts, drafts[np.minimum(kept, k - 1)], -1))


def test_sampled_verify_has_the_base_distribution_and_seeds_reproduce(engine, monkeypatch):
  """The first two tokens after a prompt, sampled at temperature 1 by 1,024 requests in verify
  mode and by 1,024 others in base mode, on disjoint seeds (independent draws): the same
  distribution of pairs, and of how often the second token is the draft, by chi-square tests
  of homogeneity; the same seeds give the same tokens. The draft after t0 is planted: the
  base's most likely token there, kept about one time in seven, so that a rule that keeps it
  too often or draws it again after refusing it moves its frequency (the micro decoder's own
  drafts are kept some 5 times in 1,024: such a rule would pass unseen)."""
  prompt, n = [5, 6, 7], 1024
  after_t0 = engine.model.base(jnp.asarray([prompt + [t] for t in range(DECODE_CFG.vocab_size)]))
  likeliest = jnp.argmax(after_t0[:, -1], axis=-1).astype(jnp.int32)
  _plant(monkeypatch, lambda state, group, count: (group.at[:, 1].set(likeliest[group[:, 0]]),
                                                   count))
  planted = Engine(engine.model, None, stop_ids=[DECODE_STOP], block_size=4)
  sampling = SamplingParams(temperature=1.0)
  reqs = lambda seeds: [Request(prompt, max_new_tokens=2, sampling=sampling, seed=s, id=i,
                                draft_confidence=0.0) for i, s in enumerate(seeds)]
  ver = planted.generate(reqs(range(n)), mode="verify")
  base = engine.generate(reqs(range(n, 2 * n)), mode="base")
  assert [g.token_ids for g in planted.generate(reqs(range(64)), mode="verify")] == [
      g.token_ids for g in ver[:64]]
  pairs = lambda gens: [tuple(g.token_ids) for g in gens if len(g.token_ids) == 2]
  a, b = pairs(ver), pairs(base)
  cats = sorted(set(a) | set(b))
  table = np.array([[a.count(c) for c in cats], [b.count(c) for c in cats]])
  table = table[:, table.sum(0) >= 10]  # chi-square wants no tiny cells
  assert table.shape[1] >= 3
  assert stats.chi2_contingency(table).pvalue > 1e-3, table
  drafted = lambda ps: sum(t1 == int(likeliest[t0]) for t0, t1 in ps)
  table = np.array([[drafted(a), len(a) - drafted(a)], [drafted(b), len(b) - drafted(b)]])
  assert stats.chi2_contingency(table).pvalue > 1e-3, table
  kept = sum(g.groups == [2] for g in ver)
  assert 0.05 * n < kept < 0.5 * n, kept


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
