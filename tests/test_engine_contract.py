"""The engine's public contract: the package's exports, each prompt templated once however a
caller compiles and generates, serve's per-call stats and stream callback (nothing kept on the
engine), and the settings a Generation carries."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import hamburger_jax
from hamburger_jax.decode import serving
from hamburger_jax.decode.engine import Engine, GenerationError
from hamburger_jax.decode.requests import Generation, Request
from hamburger_jax.decode.sampling import SamplingParams
from hamburger_jax.testing import DECODE_STOP, tiny_decode_model

TEXTS = ["hello there", "why is the sky blue", "two plus two", "a"]


class CountingTokenizer:
  """A stand-in chat tokenizer that counts how often a prompt is templated."""
  stop_ids = (DECODE_STOP,)

  def __init__(self):
    self.calls = 0

  def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
    self.calls += 1
    text = "".join(m["content"] for m in messages)
    return [1] + [3 + ord(c) % 90 for c in text] + [2]

  def decode(self, ids, skip_special_tokens=True):
    return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def engine() -> Engine:
  return Engine(tiny_decode_model(), CountingTokenizer(), stop_ids=[DECODE_STOP])


def test_package_exports_the_user_facing_names():
  # pylint: disable=import-outside-toplevel
  from hamburger_jax import (Engine as E, Generation as G, GenerationError as GE, Request as R,
                             SamplingParams as S, load, load_hamburger, load_llama)
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  assert (E, G, GE, R, S) == (Engine, Generation, GenerationError, Request, SamplingParams)
  assert (load, load_hamburger, load_llama) == (pretrained.load, pretrained.load_hamburger,
                                               pretrained.load_llama)
  assert sorted(hamburger_jax.__all__) == sorted(
      ["Engine", "Request", "Generation", "GenerationError", "SamplingParams", "load",
       "load_hamburger", "load_llama"])
  with pytest.raises(AttributeError):
    hamburger_jax.no_such_name  # pylint: disable=pointless-statement


def test_light_submodules_import_without_jax():
  """The exports load on first use: a CLI reading hamburger_jax.config before parsing its
  arguments does not pay for JAX (nor meet an import cycle)."""
  code = ("import sys, hamburger_jax.config, hamburger_jax; assert 'jax' not in sys.modules; "
          "from hamburger_jax import *; assert Engine.__name__ == 'Engine'; print('ok')")
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_compile_then_generate_templates_each_prompt_once(engine):
  tok = engine.tokenizer
  tok.calls = 0
  reqs = engine.requests(TEXTS, max_new_tokens=6, confidence=0.5, max_group=3)
  assert tok.calls == len(TEXTS) and all(r.ids is not None for r in reqs)
  engine.compile(reqs, mode="hamburger")
  gens = engine.generate(reqs, mode="hamburger")
  assert tok.calls == len(TEXTS)
  assert all(g.compile_s == 0 for g in gens)  # compile built what generate ran (max_new 6)
  assert [g.id for g in gens] == [0, 1, 2, 3]
  # Raw prompts: generate alone templates each once.
  tok.calls = 0
  again = engine.generate(TEXTS, max_new_tokens=6, mode="hamburger", confidence=0.5,
                          max_group=3)
  assert tok.calls == len(TEXTS)
  assert [g.token_ids for g in again] == [g.token_ids for g in gens]


def test_serve_templates_each_prompt_once_even_when_preempted(engine):
  tok = engine.tokenizer
  small = Engine(engine.model, tok, stop_ids=[DECODE_STOP], block_size=4)
  tok.calls = 0
  reqs = [Request(t, max_new_tokens=12, confidence=0.0, id=i) for i, t in enumerate(TEXTS * 2)]
  run = small.serve(reqs, slots=4, kv_blocks=12, mode="hamburger")
  out = list(run)
  assert all(g.error is None for g in out) and run.stats.preemptions > 0
  assert tok.calls == len(reqs)
  assert all(r.ids is None for r in reqs)  # the caller's requests are left as they were
  checked = small.requests(TEXTS, max_new_tokens=4)
  tok.calls = 0
  assert all(g.error is None for g in small.serve(checked, slots=2, mode="base"))
  assert tok.calls == 0


def test_a_request_keeps_the_ids_it_was_given():
  eng = Engine(tiny_decode_model(), None, stop_ids=[DECODE_STOP])
  r = Request([5, 6, 7], max_new_tokens=4)
  r.check(eng)
  r.prompt = [8, 9]  # ids are the encoded prompt, set once
  r.check(eng)
  assert r.ids == [5, 6, 7]
  r.ids = [5, 500]  # still checked against the vocabulary
  with pytest.raises(GenerationError, match="token ids must be in"):
    r.check(eng)


def test_serve_returns_its_own_stats_and_the_engine_keeps_none(engine):
  prompts = [[1, 2, 3], [4, 5], list(range(10, 30)), [7]]
  a = engine.serve([Request(p, max_new_tokens=8, id=i) for i, p in enumerate(prompts)],
                   slots=2, mode="base")
  b = engine.serve([Request(prompts[0], max_new_tokens=8)], slots=1, mode="base")
  assert a.stats is not b.stats and a.stats.rounds == 0  # nothing ran yet
  first = next(a)
  got_b = list(b)  # interleaved with a: each call keeps its own figures
  rest = list(a)
  assert a.stats.slots == 2 and b.stats.slots == 1
  assert max(a.stats.in_flight) == 2 and max(b.stats.in_flight) == 1
  assert a.stats.free_blocks_at_end == a.stats.usable_blocks
  assert sorted(g.id for g in [first, *rest]) == [0, 1, 2, 3]
  assert got_b[0].token_ids == next(g for g in [first, *rest] if g.id == 0).token_ids
  for name in ("last_serve", "stream_callback"):
    assert not hasattr(engine, name)
  with pytest.raises(GenerationError, match="slots=0"):
    engine.serve([], slots=0)  # argument errors raise at the call


def test_interleaved_streams_reach_their_own_callbacks(engine):
  """Two serve calls decoding in turns, each with its own callback: each callback sees its own
  call's macro steps, once each and in order; the tokens equal generate's (streamed or not)."""
  prompts = [[1, 2, 3, 4, 5], [9, 8], list(range(10, 31))]
  seen, live_sinks = {"a": [], "b": []}, []

  def record(name):
    def callback(group, count):
      seen[name].append((group.copy(), count.copy()))
      live_sinks.append(len(serving._SINKS))  # pylint: disable=protected-access
    return callback

  runs = {name: engine.serve([Request(p, max_new_tokens=10, confidence=0.5, id=i)
                              for i, p in enumerate(prompts[j:j + 2])],
                             slots=2, mode="hamburger", round_steps=2, stream=record(name))
          for j, name in enumerate(("a", "b"))}
  out = {"a": {}, "b": {}}
  live = dict(runs)
  while live:
    for name in list(live):
      g = next(live[name], None)
      if g is None:
        del live[name]
      else:
        out[name][g.id] = g
  assert max(live_sinks) == 2  # one call decoded while the other's callback was live
  for j, name in enumerate(("a", "b")):
    for i, p in enumerate(prompts[j:j + 2]):
      want = engine.generate([p], max_new_tokens=10, mode="hamburger", confidence=0.5)[0]
      g = out[name][i]
      assert (g.token_ids, g.groups) == (want.token_ids, want.groups)
      # The same request's steps in its slot of this call's stream (slots are given in order).
      steps = [(grp[i], c[i]) for grp, c in seen[name] if c[i] > 0]
      assert [int(c) for _, c in steps] == g.groups
      assert [int(t) for grp, c in steps for t in grp[:c]] == g.token_ids
      assert all(grp.dtype.kind == "i" and c.shape == (2,) for grp, c in seen[name])
  assert serving._SINKS == {}  # pylint: disable=protected-access


def test_a_stream_sink_ends_with_its_call(engine):
  """A callback is registered while its call decodes and dropped when the caller stops early,
  so an abandoned call leaves nothing behind."""
  sinks = serving._SINKS  # pylint: disable=protected-access
  calls = []
  run = engine.serve([Request([1, 2, 3], max_new_tokens=6, id=i) for i in range(3)], slots=1,
                     mode="base", stream=lambda g, c: calls.append(int(c[0])))
  next(run)
  assert len(sinks) == 1 and sum(calls) == 6  # live between two results
  run.close()
  assert sinks == {}
  with serving.stream_sink(None) as sink:
    assert sink == 0 and sinks == {}


def test_generations_carry_their_requests_settings(engine):
  hot = SamplingParams(temperature=0.8, top_k=5)
  reqs = [Request([1, 2, 3], max_new_tokens=5, confidence=0.7, max_group=2, seed=3,
                  sampling=hot, id="a"),
          Request([4, 5], max_new_tokens=5, confidence=1, id="b"),
          Request([4, 500], confidence=0.4, max_group=3, seed=9, id="bad")]
  got = {g.id: g for g in engine.serve(reqs, slots=2, mode="hamburger")}
  a, b, bad = got["a"], got["b"], got["bad"]
  assert (a.mode, a.confidence, a.max_group, a.seed, a.sampling) == ("hamburger", 0.7, 2, 3, hot)
  assert (bad.mode, bad.confidence, bad.max_group, bad.seed) == ("hamburger", 0.4, 3, 9)
  assert bad.error and bad.settings() == {"confidence": 0.4, "max_group": 3}
  # As the request gave them: a JSON 1 prints as 1, not 1.0.
  assert a.settings() == {"confidence": 0.7, "max_group": 2}
  assert b.settings() == {"confidence": 1, "max_group": None} and type(b.confidence) is int
  base = engine.generate([[1, 2, 3]], max_new_tokens=3, mode="base", confidence=0.2)[0]
  assert (base.mode, base.confidence, base.settings()) == ("base", 0.2, {})
  # record() is what the CLIs printed before the settings were carried: the same keys, in order.
  assert list(a.record()) == ["text", "token_ids", "new_tokens", "decode_tokens_per_s", "groups",
                              "macro_steps", "kv_entries", "prompt_tokens", "prefill_s",
                              "decode_s"]
  assert bad.record() == {"id": "bad", "error": bad.error}


def test_generate_takes_requests_with_their_own_settings_and_ids(engine):
  reqs = [Request([9, 8], max_new_tokens=5, confidence=0.0, id="x"),
          Request([1, 2, 3], max_new_tokens=7, confidence=1.0, id="y")]
  gens = engine.generate(reqs, mode="hamburger", max_new_tokens=100, confidence=0.5)
  assert [g.id for g in gens] == ["x", "y"]  # input order, the requests' ids
  assert [g.new_tokens <= r.max_new_tokens for g, r in zip(gens, reqs)] == [True, True]
  assert gens[1].groups == [1] * gens[1].new_tokens and gens[0].confidence == 0.0
  mixed = engine.generate([reqs[0], [4, 5, 6]], mode="hamburger", max_new_tokens=4)
  assert [g.id for g in mixed] == ["x", 1] and mixed[1].new_tokens <= 4
  with pytest.raises(GenerationError, match="distinct"):
    engine.generate([reqs[0], reqs[0]], mode="hamburger")
  assert np.all([r.ids is None for r in reqs])


def test_a_stream_callback_that_answers_true_returns_after_each_step(engine):
  """A callback returning True ends each decode call after one macro step (how a server admits
  arrivals at once); the tokens are the same, one round per macro step."""
  prompts = [[1, 2, 3, 4, 5], [9, 8], list(range(10, 31))]
  reqs = lambda: [Request(p, max_new_tokens=10, confidence=0.5, id=i)
                  for i, p in enumerate(prompts)]
  quiet = engine.serve(reqs(), slots=3, mode="hamburger", stream=lambda g, c: None)
  want = {g.id: g for g in quiet}
  eager = engine.serve(reqs(), slots=3, mode="hamburger", stream=lambda g, c: True)
  got = {g.id: g for g in eager}
  for i in want:
    assert (got[i].token_ids, got[i].groups) == (want[i].token_ids, want[i].groups)
  assert eager.stats.rounds == max(g.macro_steps for g in got.values())
  assert quiet.stats.rounds < eager.stats.rounds
