"""infer.bench's cost model (the timings themselves are never asserted)."""

from types import SimpleNamespace

import pytest

from infer.bench import lockstep_cost


def _gen(groups):
  return SimpleNamespace(groups=groups, macro_steps=len(groups))


def test_lockstep_cost_at_batch_one_is_the_spec_ceiling():
  groups = [4, 1, 2, 4, 1]  # 12 tokens, k = 2.4
  k, r = 12 / 5, 0.25
  assert 12 / lockstep_cost([_gen(groups)], r) == pytest.approx(k / (1 + (k - 1) * r))


def test_lockstep_cost_follows_the_largest_group_and_the_slowest_row():
  # step 1: max group 3 -> 1 + 2r; step 2: 1 -> 1; step 3 (row b only): 2 -> 1 + r
  gens = [_gen([3, 1]), _gen([1, 1, 2])]
  assert lockstep_cost(gens, 0.5) == pytest.approx((1 + 2 * 0.5) + 1 + (1 + 0.5))
