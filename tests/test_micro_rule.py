"""The batch-aware micro loop (decode/micro_rule.py: pays): a batch's next
micro step runs only while enough rows go on to pay for it. Off, every row decodes as alone;
on, each group is cut where a plain lockstep reference cuts it and the row's next macro step
starts after the cut; one row alone is never cut."""

from __future__ import annotations

import numpy as np
import pytest

from hamburger_jax import testing
from hamburger_jax.decode import micro_rule
from hamburger_jax.decode.engine import Engine, GenerationError
from hamburger_jax.decode.requests import Request
from hamburger_jax.testing import DECODE_STOP, tiny_decode_model

PROMPTS = [[1, 2, 3, 4, 5], [9, 8], list(range(10, 31)), [40, 41, 42], [7],
           [60, 61, 62, 63, 64, 65, 66, 67], [33, 34], [80, 70, 60]]
MAX_NEW = [12, 14, 9, 16, 10, 13, 11, 15]
CONFIDENCES = [0.5, 0.0, 0.3, 0.7, 0.5, 0.0, 0.6, 0.4]


@pytest.fixture(scope="module")
def model():
  return tiny_decode_model()


@pytest.fixture(scope="module")
def engine(model) -> Engine:
  return Engine(model, None, stop_ids=[DECODE_STOP])


def requests() -> list[Request]:
  return [Request(p, max_new_tokens=n, confidence=c, id=i)
          for i, (p, n, c) in enumerate(zip(PROMPTS, MAX_NEW, CONFIDENCES))]


def test_pays_is_the_break_even_and_never_cuts_a_lone_row():
  assert all(bool(micro_rule.pays(np.int32(1), np.int32(1), np.float32(r)))
             for r in (0.0, 0.3, 1.0, 5.0))
  # 16 rows decoding, r = 0.2: a micro step costs 3.2 rows' base-step share.
  assert not bool(micro_rule.pays(np.int32(3), np.int32(16), np.float32(0.2)))
  assert bool(micro_rule.pays(np.int32(4), np.int32(16), np.float32(0.2)))
  assert bool(micro_rule.pays(np.int32(1), np.int32(16), np.float32(0.0)))  # off


def test_rule_off_decodes_each_row_as_the_per_row_reference(model, engine):
  got = engine.with_micro_rule("off").generate(requests())
  for g, p, n, c in zip(got, PROMPTS, MAX_NEW, CONFIDENCES):
    assert (g.token_ids, g.groups) == testing.reference_hamburger(model, p, n, c, DECODE_STOP)


def test_cut_groups_follow_the_lockstep_reference(model, engine):
  """r = 0.5: a micro step runs only while half the live rows go on. Each row's tokens and
  groups are the reference's, which cuts every group where the rule says and decodes the next
  macro step after the cut group; some groups are cut (the rows differ from the rule off)."""
  r = 0.5
  got = engine.with_micro_rule(r).generate(requests())
  want = testing.reference_hamburger_batch(model, PROMPTS, MAX_NEW, CONFIDENCES, DECODE_STOP, r)
  assert [(g.token_ids, g.groups) for g in got] == want
  off = engine.generate(requests())
  assert [g.groups for g in got] != [g.groups for g in off]
  assert sum(map(len, (g.groups for g in got))) > sum(map(len, (g.groups for g in off)))


def test_micro_step_1_pays_its_own_cost_and_the_merge(model, engine, monkeypatch):
  """auto with r = 0.1 at every micro batch for the later micro steps, r1 = 0.25 for micro
  step 1 and m = 0.25 (what a mixed base step costs over a plain one): micro step 1 runs only
  while half the live rows go on, or all of them at r1 alone."""
  sizes = len(micro_rule.micro_sizes(8))
  costs = lambda runner, slots: np.asarray([0.1] * sizes + [0.25] * sizes + [0.25])
  monkeypatch.setattr(micro_rule, "measure", costs)
  got = Engine(model, None, stop_ids=[DECODE_STOP], micro_rule="auto").generate(requests())
  want = testing.reference_hamburger_batch(model, PROMPTS, MAX_NEW, CONFIDENCES, DECODE_STOP,
                                           0.1, 0.25, r1=0.25)
  assert [(g.token_ids, g.groups) for g in got] == want
  assert want != testing.reference_hamburger_batch(model, PROMPTS, MAX_NEW, CONFIDENCES,
                                                   DECODE_STOP, 0.1, 0.25)
  assert want != testing.reference_hamburger_batch(model, PROMPTS, MAX_NEW, CONFIDENCES,
                                                   DECODE_STOP, 0.1, r1=0.25)


def test_a_lone_row_is_never_cut(engine):
  for i in (0, 1, 5):
    one = [Request(PROMPTS[i], max_new_tokens=MAX_NEW[i], confidence=CONFIDENCES[i], id=0)]
    off, on = engine.generate(one)[0], engine.with_micro_rule(5.0).generate(one)[0]
    assert (on.token_ids, on.groups) == (off.token_ids, off.groups)
    assert max(on.groups) >= 2


def test_served_requests_use_the_rule(engine):
  """serve() takes the rule from the engine: its rows are cut as generate's."""
  r = 0.5
  want = {g.id: g for g in engine.with_micro_rule(r).generate(requests())}
  served = {g.id: g for g in engine.with_micro_rule(r).serve(requests(), slots=8)}
  assert all(served[i].token_ids == want[i].token_ids for i in want)


def test_auto_measures_a_ratio_per_micro_batch(engine):
  auto = engine.with_micro_rule("auto")
  layout = auto.layout("hamburger", 8, 16, 32)
  costs = auto.micro_costs(layout)
  assert costs.shape == (2 * len(micro_rule.micro_sizes(8)) + 1,) == (7,)
  assert np.all(np.isfinite(costs)) and np.all(costs[:-1] > 0)
  assert costs[-1] == 0  # the tiny model has no merged-entry adapters: a mixed step is plain
  assert auto.micro_costs(layout) is costs  # measured once per slot count
  assert not np.any(auto.micro_costs(auto.layout("base", 8, 16, 32)))
  assert not np.any(engine.micro_costs(layout))  # off


@pytest.mark.parametrize("rule", ["fast", -0.1, float("nan"), True, None])
def test_bad_rules_are_refused(rule):
  with pytest.raises(GenerationError, match="give off, auto, or a cost ratio"):
    micro_rule.parse(rule)


def test_an_engine_with_another_rule_keeps_its_prefix_cache_when_the_other_changes_weights(model):
  from hamburger_jax.decode.prefix_cache import CachedPrefix  # pylint: disable=C0415
  engine = Engine(model, None, stop_ids=[DECODE_STOP])
  other = engine.with_micro_rule(5.0)
  assert other.prefix_cache is engine.prefix_cache  # the same weights: one cache
  entry = CachedPrefix(np.zeros((1, 2)), np.zeros((1, 2)), 2)
  engine.prefix_cache.put("base", [1, 2], entry)
  other.set_model(model)  # new weights for `other` only
  assert len(other.prefix_cache) == 0
  assert engine.prefix_cache.get("base", [1, 2]) is entry  # the original's entries survive
  assert other.programs is engine.programs  # the compiled programs stay shared
