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


def _plant_base_drafts(monkeypatch, answer: list[int]) -> None:
  """Verify's drafts taken from the base's own answer, wrong at every third token: drafts the
  base keeps, and some it refuses."""
  original = step_lib.propose
  reference = jnp.asarray(answer + [DECODE_STOP] * 8)

  def planted(model, mode, state, **kw):
    group, count = original(model, mode, state, **kw)
    if mode != "verify":
      return group, count
    k = group.shape[1]
    idx = state.n_tokens[:, None] + jnp.arange(k)[None, :]
    drafts = jnp.take(reference, idx)
    drafts = jnp.where(idx % 3 == 2, (drafts + 1) % 90, drafts)
    count = jnp.where(state.done, 0, jnp.minimum(k, state.max_new - state.n_tokens))
    return group.at[:, 1:].set(drafts[:, 1:]), count

  monkeypatch.setattr(step_lib, "propose", planted)
