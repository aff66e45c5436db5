"""Verify mode's lookup drafts (decode/lookup.py): the search equals a plain loop over the
window; through the engine the tokens are the base's (greedy, alone, in a batch, through
serving's refills and preemption; sampled, a request's tokens do not depend on its batch mates),
and each step keeps exactly the drafts a walk over the base's own answer predicts, so the window
holds the prompt and every emitted token in order."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hamburger_jax.decode import lookup
from hamburger_jax.decode.engine import Engine, GenerationError
from hamburger_jax.decode.requests import Request
from hamburger_jax.decode.sampling import SamplingParams
from hamburger_jax.testing import DECODE_STOP, tiny_decode_model

pytestmark = pytest.mark.portable

# The tiny model's greedy answers fall into loops, where lookups find their drafts.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [11, 3, 11, 3, 9], [40, 41, 42, 43, 44, 45], [7],
           list(range(10, 31))]
MAX_NEW = [30, 24, 40, 17, 19]


def _drafts_by_loop(ctx: list[int], n_drafts: int, min_n: int) -> list[int]:
  """The rule of lookup_drafts, over one row's tokens (no window padding)."""
  for n in range(min(lookup.LOOKUP_MAX_N, len(ctx) - 1), min_n - 1, -1):
    tail, found = ctx[-n:], None
    for s in range(len(ctx) - n - 1, -1, -1):
      if ctx[s:s + n] == tail:
        if s + n + n_drafts <= len(ctx):
          found = s
          break
        found = s if found is None else found
    if found is not None:
      return ctx[found + n:found + n + n_drafts]
  return []


@pytest.mark.parametrize("min_n", [1, 2, 3])
@pytest.mark.parametrize("n_drafts", [1, 3])
def test_the_search_equals_a_loop(min_n, n_drafts):
  rng = np.random.default_rng(min_n * 10 + n_drafts)
  rows = []
  for length in [0, 1, 2, 5, 9, 30, lookup.LOOKUP_WINDOW, 400]:
    for vocab in (2, 3, 6):
      rows.append(list(rng.integers(0, vocab, length)))
  window = np.stack([lookup.context_of(r) for r in rows])
  drafts, count = lookup.lookup_drafts(jnp.asarray(window), n_drafts, min_n)
  for r, d, c in zip(rows, np.asarray(drafts), np.asarray(count)):
    want = _drafts_by_loop(r[-lookup.LOOKUP_WINDOW:], n_drafts, min_n)
    assert list(d[:c]) == want, (r, min_n, n_drafts)


def test_shift_in_appends_each_rows_count():
  window = jnp.asarray(np.stack([lookup.context_of([1, 2, 3]), lookup.context_of([])]))
  out = np.asarray(lookup.shift_in(window, jnp.asarray([[7, 8, 9], [4, 5, 6]]),
                                   jnp.asarray([2, 3])))
  np.testing.assert_array_equal(out[0], lookup.context_of([1, 2, 3, 7, 8]))
  np.testing.assert_array_equal(out[1], lookup.context_of([4, 5, 6]))


@pytest.fixture(scope="module")
def engines():
  model = tiny_decode_model()
  return (Engine(model, None, stop_ids=[DECODE_STOP], block_size=4),
          Engine(model, None, stop_ids=[DECODE_STOP], block_size=4, draft_lookup=1))


@pytest.fixture(scope="module")
def base_tokens(engines):
  return [g.token_ids for g in engines[0].generate(_requests(), mode="base")]


def _requests(**kw):
  return [Request(p, max_new_tokens=n, id=i, **kw)
          for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]


def _walk(prompt: list[int], answer: list[int], k: int, min_n: int) -> list[int]:
  """Tokens a forward of greedy verify with lookup drafts alone (the micro decoder off): each
  step emits the base's token t0 and keeps the drafts after it that are the base's next
  tokens; drafts end at a stop id (kept) and at the answer's last token."""
  groups, i = [], 0
  while i < len(answer):
    kept = 0
    if answer[i] != DECODE_STOP and i + 1 < len(answer):
      drafts = _drafts_by_loop((prompt + answer[:i + 1])[-lookup.LOOKUP_WINDOW:], k - 1, min_n)
      if DECODE_STOP in drafts:
        drafts = drafts[:drafts.index(DECODE_STOP) + 1]
      for d, t in zip(drafts[:len(answer) - i - 1], answer[i + 1:]):
        if d != t:
          break
        kept += 1
    groups.append(1 + kept)
    i += 1 + kept
  return groups


def test_greedy_lookup_verify_keeps_the_drafts_a_walk_predicts(engines, base_tokens):
  """Drafter off (draft confidence 1): every kept draft is a lookup's, and the steps are those
  of a walk over the base's answer; drafter on: the base's tokens still."""
  eng = engines[1]
  got = eng.generate(_requests(draft_confidence=1.0), mode="verify")
  for g, p, want in zip(got, PROMPTS, base_tokens):
    assert g.token_ids == want
    assert g.groups == _walk(p, want, eng.max_group, 1), (p, want)
  assert sum(len(g.groups) for g in got) < sum(len(w) for w in base_tokens)  # drafts kept
  for g, want in zip(eng.generate(_requests(), mode="verify"), base_tokens):
    assert g.token_ids == want


def test_serving_with_refills_and_preemption_keeps_the_base_tokens(engines, base_tokens):
  """3 slots refilled as rows finish, a pool too small for three rows at their longest: the
  preempted rows start again from their prompt, window included."""
  run = engines[1].serve(_requests(draft_confidence=1.0), slots=3, mode="verify", kv_blocks=13)
  got = {g.id: g for g in run}
  assert run.stats.preemptions > 0
  for i, (p, want) in enumerate(zip(PROMPTS, base_tokens)):
    assert got[i].token_ids == want and got[i].error is None
    assert got[i].groups == _walk(p, want, engines[1].max_group, 1)


def test_a_sampled_request_does_not_depend_on_its_batch_mates(engines):
  sampling = SamplingParams(temperature=1.0)
  reqs = lambda: [Request(p, max_new_tokens=n, id=i, seed=3, sampling=sampling)
                  for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]
  batch = engines[1].generate(reqs(), mode="verify")
  alone = engines[1].generate(reqs()[2:3], mode="verify")
  assert alone[0].token_ids == batch[2].token_ids


@pytest.mark.parametrize("bad", [-1, lookup.LOOKUP_MAX_N + 1, True, 1.5])
def test_a_bad_match_length_is_refused(engines, bad):
  with pytest.raises(GenerationError, match="draft_lookup="):
    Engine(engines[0].model, None, draft_lookup=bad)
