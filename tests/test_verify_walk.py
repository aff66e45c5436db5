"""The drafts' teacher-forced figures (hamburger_jax/evaluation/verify_walk.py): the walk's steps
equal the engine's verify steps on the same prompts, record by record; the chained figure
against a count by hand."""

from __future__ import annotations

import numpy as np
import pytest

from hamburger_jax.decode.engine import Engine
from hamburger_jax.decode.requests import Request
from hamburger_jax.evaluation import fidelity_set, verify_walk
from hamburger_jax.testing import DECODE_STOP, tiny_decode_model

PROMPTS = [[5, 6, 7, 8], [11, 3], [40, 41, 42, 43, 44, 45], [90, 2, 77]]


def _repeating_model():
  """A tiny HAMburger whose base mostly repeats its last token (its layers' outputs scaled
  down) and whose micro decoder drafts exactly a repeat (its layers' outputs zero): drafts the
  base keeps, until its answer changes token."""
  model = tiny_decode_model()
  for stack, scale in ((model.base.decoder, 0.35), (model.micro.decoder, 0.0)):
    for layer in stack.layers:
      for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
        lin.kernel.set_value(lin.kernel[...] * scale)
  return model


@pytest.fixture(scope="module")
def setup():
  model = _repeating_model()
  engine = Engine(model, None, stop_ids=[DECODE_STOP], draft_lookup=0)  # the drafter's steps
  answers = engine.generate(PROMPTS, max_new_tokens=24, mode="base")
  records = [fidelity_set.FidelityRecord("synthetic", f"r{i}", tuple(p), tuple(a.token_ids),
                                         (1,) * len(a.token_ids))
             for i, (p, a) in enumerate(zip(PROMPTS, answers))]
  return model, engine, verify_walk.single_token_records(model, records)


@pytest.mark.parametrize("draft_confidence", [0.0, 0.6])
def test_the_walk_takes_the_engines_steps(setup, draft_confidence):
  model, engine, records = setup
  figures = verify_walk.draft_figures(model, records, draft_confidence, [DECODE_STOP])
  gens = engine.generate([Request(list(r["input_ids"][:r["prompt_len"]]),
                                  max_new_tokens=len(r["input_ids"]) - int(r["prompt_len"]),
                                  draft_confidence=draft_confidence, id=i)
                          for i, r in enumerate(records)], mode="verify")
  assert [g.macro_steps for g in gens] == figures["walk_steps"]
  tokens = sum(g.new_tokens for g in gens)
  assert figures["walk_tokens_per_forward"] == pytest.approx(
      tokens / sum(g.macro_steps for g in gens))
  if draft_confidence == 0.0:  # the test has drafts kept and drafts refused
    assert 1.3 < figures["walk_tokens_per_forward"] < 3.9, figures


def test_chained_counts_the_drafts_all_right_so_far():
  agree = np.array([[1, 1, 0, 1], [1, 1, 1, 1], [1, 0, 1, 1], [1, 1, 1, 0]], bool)
  w = verify_walk.DraftWindows(agree, np.ones_like(agree), np.array([4, 4, 2, 1]),
                               np.arange(4))
  out = verify_walk.chained([w])
  # Window sizes cut the drafts: row 2 has draft 1 only, row 3 none.
  assert out["chained"] == pytest.approx(1 + (1 + 3 + 0 + 0) / 4)
  assert out["marginal"]["d1"] == pytest.approx(2 / 3)  # rows 0-2 have a draft 1
  assert out["marginal"]["d3"] == pytest.approx(1.0)  # rows 0, 1


def test_the_drafts_task_compares_the_walk_with_the_drafters_own_steps(setup, tmp_path):
  """`infer.eval --tasks drafts` with an engine that drafts by lookups too (the default): the
  walk is the drafter's alone, so the engine it is compared with drafts without lookups, and
  every record takes the walk's steps (with lookups the steps differ: here the drafter's repeats
  are kept more often than the lookups' drafts)."""
  from hamburger_jax.data.teacher_pass import base_fingerprint  # pylint: disable=C0415
  model, _, records = setup
  recs = tuple(fidelity_set.FidelityRecord(
      "synthetic", f"r{i}", tuple(int(t) for t in r["input_ids"][:r["prompt_len"]]),
      tuple(int(t) for t in r["input_ids"][r["prompt_len"]:]),
      (1,) * (len(r["input_ids"]) - int(r["prompt_len"]))) for i, r in enumerate(records))
  path = fidelity_set.save(fidelity_set.FidelitySet(
      recs, {"base_fingerprint": base_fingerprint(model.base)}), str(tmp_path / "set.json"))
  with_lookups = Engine(model, None, stop_ids=[DECODE_STOP], draft_lookup=1)
  out = verify_walk.drafts_task(model, with_lookups, path=path)
  assert out["walk_equals_engine"] == out["n"] == len(PROMPTS)
  looked_up = with_lookups.generate([Request(list(r.prompt), max_new_tokens=len(r.response), id=i)
                                     for i, r in enumerate(recs)], mode="verify")
  assert [g.token_ids for g in looked_up] == [list(r.response) for r in recs]
  assert [g.macro_steps for g in looked_up] != out["walk_steps"]
