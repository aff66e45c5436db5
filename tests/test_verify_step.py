"""What one verify step costs: the base's LM head runs once a step (its check's K rows also
give the next step's token 0), counted as the decode loop executes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from hamburger_jax.decode import step as step_lib
from hamburger_jax.decode.engine import Engine
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import Llama
from hamburger_jax.testing import DECODE_STOP, tiny_decode_model

pytestmark = pytest.mark.portable


def test_the_lm_head_runs_once_a_verify_step(monkeypatch):
  """Every executed pass of the base's LM head outside the drafts is counted (a host callback
  inside it fires only where the program runs it): one a macro step, and one more for the
  first step after the prefill, which has no token 0 drawn yet. Drafting keeps its own head."""
  passes = []
  head = Llama.logits

  def counted(self, h):
    jax.debug.callback(lambda: passes.append(1))
    return head(self, h)

  engine = Engine(tiny_decode_model(), None, stop_ids=[DECODE_STOP])
  base, = engine.generate([[5, 6, 7, 8]], max_new_tokens=24, mode="base")
  _plant_base_drafts(monkeypatch, base.token_ids)
  monkeypatch.setattr(Llama, "logits", counted)
  monkeypatch.setattr(Hamburger, "micro_logits", lambda self, h: head(self.base, h))
  g, = engine.generate([[5, 6, 7, 8]], max_new_tokens=24, mode="verify")
  assert g.token_ids == base.token_ids
  passes.clear()
  g, = engine.generate([[5, 6, 7, 8]], max_new_tokens=24, mode="verify")
  jax.effects_barrier()
  assert max(g.groups) > 1  # drafts were kept: steps of several tokens were checked
  assert len(passes) == g.macro_steps + 1, (len(passes), g.macro_steps)


def _plant_base_drafts(monkeypatch, answers, vary: bool = False) -> None:
  """Verify's drafts taken from the base's own answer (one, or one a row: `answers` a list of
  lists), wrong at every third token: drafts the base keeps, and some it refuses. `vary`: a
  row drafts 0..K-1 drafts, by its step and row."""
  original = step_lib.propose
  rows = answers if answers and isinstance(answers[0], list) else [answers]
  width = max(len(a) for a in rows) + 8
  reference = jnp.asarray([a + [DECODE_STOP] * (width - len(a)) for a in rows])

  def planted(model, mode, state, **kw):
    group, count = original(model, mode, state, **kw)
    if mode != "verify":
      return group, count
    b, k = group.shape
    idx = state.n_tokens[:, None] + jnp.arange(k)[None, :]
    ref = reference[jnp.arange(b) % reference.shape[0]]
    drafts = jnp.take_along_axis(ref, jnp.minimum(idx, width - 1), axis=1)
    drafts = jnp.where(idx % 3 == 2, (drafts + 1) % 90, drafts)
    most = (1 + (state.n_steps + jnp.arange(b)) % k) if vary else k
    count = jnp.where(state.done, 0, jnp.minimum(most, state.max_new - state.n_tokens))
    return group.at[:, 1:].set(drafts[:, 1:]), count

  monkeypatch.setattr(step_lib, "propose", planted)


@pytest.mark.parametrize("widths", ["two", "each"])
def test_a_verify_forward_of_each_width_keeps_the_base_tokens(monkeypatch, widths):
  """Rows drafting 0..K-1 drafts a step (planted, from the base's own answers, every third one
  wrong): with the forward compiled at widths 1 and K, or at each width 1..K (the narrowest
  that holds the step's drafts), every row's tokens are the base's; "each" compiles the
  forward's K widths (more matmuls in the program)."""
  prompts = [[5, 6, 7, 8], [11, 3], [40, 41, 42, 43, 44, 45]]
  engine = Engine(tiny_decode_model(), None, stop_ids=[DECODE_STOP], verify_widths=widths)
  base = engine.generate(prompts, max_new_tokens=20, mode="base")
  _plant_base_drafts(monkeypatch, [g.token_ids for g in base], vary=True)
  got = engine.generate(prompts, max_new_tokens=20, mode="verify")
  for g, b in zip(got, base):
    assert g.token_ids == b.token_ids
  assert any(max(g.groups) > 1 for g in got)
  layout = engine.layout("verify", 4, 20, 6)
  dots = engine.lower_decode(layout, False, False, engine.views(layout)[0]).as_text().count(
      "stablehlo.dot_general")
  other = Engine(engine.model, None, stop_ids=[DECODE_STOP],
                 verify_widths="two" if widths == "each" else "each")
  other_dots = other.lower_decode(layout, False, False, other.views(layout)[0]).as_text().count(
      "stablehlo.dot_general")
  assert (dots > other_dots) == (widths == "each")
