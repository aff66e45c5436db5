"""Self-distilled answers in one jitted program: the serving engine's greedy tokens, and group
starts equal to the boundary pass's over the same samples (so no second pass is needed)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hamburger_jax import precision, segmentation
from hamburger_jax.data.tokens.answers import self_distilled_answers
from hamburger_jax.data.tokens.boundaries import boundary_pass
from hamburger_jax.decode.engine import Engine
from hamburger_jax.testing import DECODE_CFG, tiny_decode_model

MAX_NEW = 12


@pytest.fixture(scope="module")
def base():
  return tiny_decode_model().base


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, DECODE_CFG.vocab_size, int(rng.integers(1, 9))).tolist()
          for _ in range(n)]


def _stop_ids(base, prompts) -> list[int]:
  """Two ids the greedy answers emit midway (so some answers end early, others run to MAX_NEW)."""
  with precision.matmuls("highest"):
    gens = Engine(base, stop_ids=(), fused=False, dtype="float32").generate(
        prompts, max_new_tokens=MAX_NEW, mode="base")
  counts = np.bincount(np.concatenate([g.token_ids[2:6] for g in gens]),
                       minlength=DECODE_CFG.vocab_size)
  return np.argsort(-counts)[:2].tolist()


def test_answers_are_the_engine_s_greedy_answers_with_the_boundary_pass_s_groups(base):
  prompts = _prompts(11)
  stops = _stop_ids(base, prompts)
  with precision.matmuls("highest"):
    want = Engine(base, stop_ids=stops, fused=False, dtype="float32").generate(
        prompts, max_new_tokens=MAX_NEW, mode="base")
    # The threshold: the median of the answer tokens' teacher-forced probabilities, so that
    # an answering probability off by a little moves some group boundary.
    stats = segmentation.response_token_stats(base, [(p, g.token_ids) for p, g in
                                                     zip(prompts, want)])
    threshold = float(np.median(np.concatenate([st.prob for st in stats])))
    # 4 rows a batch: three batches, the last with spare rows.
    answers, stats = self_distilled_answers(base, prompts, rows=4, prompt_len=8,
                                            max_new=MAX_NEW, stop_ids=stops, max_group=4,
                                            threshold=threshold)
  assert stats.batches == 3 and stats.prompts == 11 and stats.skipped == 0
  ended = 0
  for i, (prompt, g) in enumerate(zip(prompts, want)):
    start, n = answers.samples[i]
    s, a, b = answers.responses[i]
    assert (s, a, b) == (i, start + len(prompt), start + n)
    assert answers.tokens[start:a].tolist() == prompt
    assert answers.tokens[a:b].tolist() == g.token_ids
    ended += g.token_ids[-1] in stops
  assert 0 < ended < 11 and stats.ended == ended  # both ways of ending occur
  assert stats.tokens == sum(len(g.token_ids) for g in want)
  # The groups: what a teacher-forced boundary pass over the same samples writes.
  with precision.matmuls("highest"):
    starts, _ = boundary_pass(base, answers.tokens, answers.samples, answers.responses,
                              range(11), row_len=32, rows_per_pass=2, max_group=4,
                              threshold=threshold)
  np.testing.assert_array_equal(answers.starts, starts)
  groups = np.diff(np.append(np.flatnonzero(starts), len(starts)))
  assert stats.groups == int(starts.sum()) and groups.max() > 1  # merges happened


def test_answers_stop_at_the_deadline_and_skip_prompts_too_long(base):
  prompts = _prompts(40, seed=1) + [list(range(20))]
  answers, stats = self_distilled_answers(base, iter(prompts[::-1]), rows=4, prompt_len=8,
                                          max_new=4, stop_ids=(), max_group=4, threshold=0.5,
                                          deadline=time.monotonic() - 1)
  assert stats.batches == 0 and stats.stopped_by == "time" and len(answers.samples) == 0
  answers, stats = self_distilled_answers(base, prompts[::-1], rows=16, prompt_len=8,
                                          max_new=4, stop_ids=(), max_group=4, threshold=0.5)
  assert stats.skipped == 1 and stats.prompts == 40 and stats.stopped_by == "prompts"
  assert stats.tokens == 40 * 4 and len(answers.tokens) == sum(map(len, prompts[:40])) + 160
  with pytest.raises(ValueError, match="rows=0"):
    self_distilled_answers(base, prompts, rows=0, prompt_len=8, max_new=4, stop_ids=(),
                           max_group=4, threshold=0.5)
