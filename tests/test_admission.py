"""Admission while running (decode/admission.py) on the tiny model: requests submitted while
others decode stream exactly what `generate` gives each alone, in both modes and through
preemption; a cancelled request frees its slot and blocks; requests over the limits, past a
full queue or after close are refused; and the text side (openai_api.text_stream) never sends
a stop string or half a character."""

from __future__ import annotations

import threading
import time

import pytest

from hamburger_jax.decode.admission import AdmissionLoop, Limits, LoopClosed, QueueFull
from hamburger_jax.decode.engine import Engine, GenerationError
from hamburger_jax.decode.requests import Request
from hamburger_jax.decode.sampling import SamplingParams
from hamburger_jax.openai_api.text_stream import TextStream
from hamburger_jax.testing import DECODE_STOP, tiny_decode_model

PROMPTS = [[1, 2, 3, 4, 5], [9, 8], list(range(10, 31)), [40, 41, 42], list(range(50, 90)),
           [7], [60, 61, 62, 63], list(range(3, 20))]
MAX_NEW = [12, 20, 7, 16, 9, 20, 3, 14]
LIMITS = Limits(slots=3, max_prompt_tokens=48, max_tokens=24)


@pytest.fixture(scope="module")
def engine() -> Engine:
  return Engine(tiny_decode_model(), None, stop_ids=[DECODE_STOP])


def _request(i: int, **kw) -> Request:
  return Request(PROMPTS[i], max_new_tokens=MAX_NEW[i], confidence=0.5, **kw)


@pytest.fixture(scope="module")
def alone(engine):
  return {m: [engine.generate([PROMPTS[i]], max_new_tokens=MAX_NEW[i], mode=m,
                              confidence=0.5)[0] for i in range(len(PROMPTS))]
          for m in ("base", "hamburger")}


def _served(loop, jobs, gap_s: float = 0.005):
  """Submits (index, mode, request) one by one while earlier ones decode; returns
  (Generation, streamed ids) per job."""
  out = []
  for i, mode, request in jobs:
    stream: list[int] = []
    out.append((loop.submit(request, mode, on_tokens=stream.extend), stream))
    time.sleep(gap_s)
  return [(t.wait(120), s) for t, s in out]


def test_arrivals_stream_what_generate_gives(engine, alone):
  loop = AdmissionLoop(engine, ("hamburger", "base"), LIMITS, round_steps=2)
  loop.start()
  try:
    jobs = [(i % 8, "base" if i % 3 == 0 else "hamburger", _request(i % 8)) for i in range(16)]
    for (i, mode, _), (gen, stream) in zip(jobs, _served(loop, jobs)):
      want = alone[mode][i]
      assert gen is not None and gen.error is None
      assert gen.token_ids == stream == want.token_ids, (i, mode)
      assert gen.groups == want.groups and gen.kv_entries == want.kv_entries
      # The entries a row holds: its prompt and one per macro step but the last.
      assert gen.kv_entries == gen.prompt_tokens + gen.macro_steps - 1
    assert loop.in_flight == 0 and loop.waiting == 0
    assert loop.stats["hamburger"].rounds and loop.stats["base"].rounds
  finally:
    loop.close()


def test_preempted_requests_stream_nothing_twice(engine, alone):
  # A pool of 9 usable blocks of 4 entries for 3 slots: requests are evicted and recomputed.
  small = Engine(engine.model, None, stop_ids=[DECODE_STOP], block_size=4)
  loop = AdmissionLoop(small, ("hamburger",), Limits(slots=3, max_prompt_tokens=48,
                                                     max_tokens=24, kv_blocks=10),
                       round_steps=3)
  loop.start()
  try:
    jobs = [(i, "hamburger", _request(i)) for i in (0, 1, 3, 5, 7, 2)]
    results = _served(loop, jobs, gap_s=0.0)
    assert loop.stats["hamburger"].preemptions > 0
    for (i, _, _), (gen, stream) in zip(jobs, results):
      assert gen.error is None and gen.token_ids == stream == alone["hamburger"][i].token_ids
  finally:
    loop.close()


def test_cancel_frees_the_slot_and_blocks(engine, alone):
  loop = AdmissionLoop(engine, ("hamburger",), Limits(slots=2, max_prompt_tokens=48,
                                                      max_tokens=24), round_steps=1)
  loop.start()
  try:
    first = threading.Event()
    long = [Request(PROMPTS[i], max_new_tokens=24, confidence=1.0) for i in (2, 4)]
    tickets = [loop.submit(r, on_tokens=lambda ids: first.set()) for r in long]
    queued = loop.submit(_request(3))  # waits: both slots are taken
    assert first.wait(60)
    for t in (*tickets, queued):
      loop.cancel(t)
    for t in (*tickets, queued):
      gen = t.wait(60)
      assert gen.error == "cancelled" and len(gen.token_ids) == 0
    sched_stats = loop.stats["hamburger"]
    # Served after the cancellations: the slots and every block came back.
    gen = loop.submit(_request(0)).wait(60)
    assert gen.token_ids == alone["hamburger"][0].token_ids
    assert loop.in_flight == 0 and loop.waiting == 0
    assert sched_stats.free_blocks_at_end == sched_stats.usable_blocks
  finally:
    loop.close()


def test_a_reader_that_fails_cancels_its_request(engine, alone):
  """A stream callback that raises (its client's event loop is gone, say) cancels its own
  request; the others are served."""
  loop = AdmissionLoop(engine, ("hamburger",), LIMITS, round_steps=1)
  loop.start()
  try:
    def gone(ids):
      raise RuntimeError("event loop is closed")
    broken = loop.submit(Request(PROMPTS[4], max_new_tokens=24, confidence=1.0), on_tokens=gone)
    fine = loop.submit(_request(0))
    assert broken.wait(60).error == "cancelled" and loop.cancelled == 1
    assert fine.wait(60).token_ids == alone["hamburger"][0].token_ids
  finally:
    loop.close()


def test_refusals(engine):
  loop = AdmissionLoop(engine, ("hamburger",), Limits(slots=2, max_prompt_tokens=16,
                                                      max_tokens=8, max_queue=2))
  # Not started: nothing leaves the queue.
  with pytest.raises(GenerationError, match="the prompt has 21 tokens, over this server's "
                     "limit of 16"):
    loop.submit(Request(PROMPTS[2], max_new_tokens=4))
  with pytest.raises(GenerationError, match="max_tokens=9 is over this server's limit of 8"):
    loop.submit(Request(PROMPTS[0], max_new_tokens=9))
  with pytest.raises(GenerationError, match="mode 'base' is not served here"):
    loop.submit(Request(PROMPTS[0], max_new_tokens=4), "base")
  with pytest.raises(GenerationError, match="confidence must be in"):
    loop.submit(Request(PROMPTS[0], max_new_tokens=4, confidence=2.0))
  once = Request(PROMPTS[0], max_new_tokens=4)
  loop.submit(once)
  with pytest.raises(GenerationError, match="being served already: submit a copy"):
    loop.submit(once)
  loop.submit(Request(PROMPTS[1], max_new_tokens=4))
  with pytest.raises(QueueFull, match="2 requests are waiting"):
    loop.submit(Request(PROMPTS[3], max_new_tokens=4))
  loop.close(drain=False)
  with pytest.raises(LoopClosed):
    loop.submit(Request(PROMPTS[0], max_new_tokens=4))
  with pytest.raises(GenerationError, match="slots=0 must be an integer >= 1"):
    AdmissionLoop(engine, ("hamburger",), Limits(slots=0))


def test_close_without_draining_fails_what_remains(engine):
  loop = AdmissionLoop(engine, ("base",), Limits(slots=1, max_prompt_tokens=48, max_tokens=24),
                       round_steps=1)
  loop.start()
  tickets = [loop.submit(Request(PROMPTS[i], max_new_tokens=24,
                                 sampling=SamplingParams(0.8, 0, 0.9), seed=i)) for i in range(4)]
  loop.close(drain=False, timeout=60)
  gens = [t.wait(10) for t in tickets]
  assert all(g is not None for g in gens), "a request hung after close"
  assert any(g.error and "shut down" in g.error for g in gens)


def _decode(vocab):
  return lambda ids: "".join(vocab[i] for i in ids)


def test_text_stream_holds_back_stop_strings_and_partial_characters():
  vocab = ["Hel", "lo", " wor", "ld", "\n\n", "User", ":", " more", "\ufffd", "é"]
  stream = TextStream(_decode(vocab), stops=["\n\nUser:"])
  sent = [stream.feed([0, 1]), stream.feed([2, 3]), stream.feed([4]), stream.feed([5])]
  assert sent == ["Hello", " world", "", ""]  # "\n\n", "\n\nUser" could begin the stop
  assert stream.feed([6, 7]) == "" and stream.stopped
  assert stream.sent == "Hello world"
  plain = TextStream(_decode(vocab))
  assert plain.feed([0, 8]) == "Hel"  # an incomplete character waits for its other bytes
  assert plain.feed([1]) == "\ufffdlo" and plain.finish() == ""
  tail = TextStream(_decode(vocab), stops=["xyz"])
  assert tail.feed([4]) == "\n\n" and tail.feed([5]) == "User"
  no_stop = TextStream(_decode(vocab), stops=["Userx"])
  assert no_stop.feed([5]) == "" and no_stop.finish() == "User"


def test_a_failing_observer_is_said_once_and_serving_goes_on(engine, capsys):
  class Broken:
    def __init__(self):
      self.calls = 0

    def refused(self, mode):
      self.calls += 1
      raise RuntimeError("metrics backend down")

    def ended(self, ticket, gen):
      self.calls += 1
      raise KeyError("no such label")

  loop = AdmissionLoop(engine, ("hamburger",), Limits(slots=2, max_prompt_tokens=48,
                                                      max_tokens=24))
  broken = Broken()
  loop.observers.append(broken)
  for _ in range(2):
    with pytest.raises(GenerationError):
      loop.submit(Request(PROMPTS[0], max_new_tokens=99))
  loop.start()
  try:
    got = [t.wait(120) for t in [loop.submit(_request(i)) for i in (0, 1, 3)]]
  finally:
    loop.close()
  assert all(g.error is None and g.token_ids for g in got)
  assert broken.calls == 2 + 3  # every request still reaches the observer
  err = capsys.readouterr().err
  assert err.count("metrics backend down") == 1 and err.count("no such label") == 1
  assert "Broken.refused" in err and "Broken.ended" in err


def test_requests_are_answered_while_the_rest_of_the_programs_are_prepared(engine, alone):
  """start() compiles the fewest programs that answer every request (each prefill chunk size,
  the sampling loop of the widest view); requests served before the rest are prepared get the
  tokens they get after, and `pending` names what is left until prepare_rest() is done."""
  fresh = Engine(engine.model, None, stop_ids=[DECODE_STOP])  # nothing compiled yet
  loop = AdmissionLoop(fresh, ("hamburger", "base"), LIMITS)
  loop.start(background=False)
  try:
    pending = loop.pending()
    assert any("greedy" in p for p in pending["base"]) and pending["hamburger"]
    compiled = set(fresh.programs)
    jobs = [(i, m, _request(i)) for i in (0, 2, 3) for m in ("hamburger", "base")]
    before = _served(loop, jobs)
    assert set(fresh.programs) == compiled  # the loop compiled nothing of its own
    loop.prepare_rest()
    assert loop.pending() == {"hamburger": [], "base": []}
    assert loop.prepared.seconds > 0 and loop.prepared.error is None
    after = _served(loop, [(i, m, _request(i)) for i, m, _ in jobs])
  finally:
    loop.close()
  for (i, m, _), (g, stream), (h, _) in zip(jobs, before, after):
    assert g.token_ids == stream == alone[m][i].token_ids == h.token_ids, (i, m)


def test_the_rest_is_prepared_between_requests(engine):
  """prepare_rest waits for the requests in flight to end before its next program (they keep
  the cores), and goes on after prepare_yield_s when they do not."""
  fresh = Engine(engine.model, None, stop_ids=[DECODE_STOP])
  loop = AdmissionLoop(fresh, ("base",), LIMITS)
  loop.start(background=False)
  held, first = threading.Event(), threading.Event()
  stream: list[int] = []

  def reader(ids):  # keeps its request in flight until released
    stream.extend(ids)
    first.set()
    held.wait(60)

  try:
    todo = len(loop.pending()["base"])
    assert todo >= 2
    ticket = loop.submit(_request(1), "base", on_tokens=reader)
    assert first.wait(60)
    loop.prepare_yield_s = 60.0
    preparer = threading.Thread(target=loop.prepare_rest)
    preparer.start()
    deadline = time.monotonic() + 60
    while loop.prepared.waits == 0:  # until it has found the request in flight
      assert time.monotonic() < deadline and preparer.is_alive()
      time.sleep(0.01)
    # It waits for the request (60 s at most) before its first program: none prepared yet.
    assert len(loop.pending()["base"]) == todo
    held.set()
    assert ticket.wait(60).token_ids == stream
    preparer.join(120)
    assert not preparer.is_alive() and loop.pending() == {"base": []}
    assert loop.prepared.waits == 1  # the rest followed one another, nothing in flight
  finally:
    held.set()
    loop.close()
  busy = AdmissionLoop(Engine(engine.model, None, stop_ids=[DECODE_STOP]), ("base",), LIMITS)
  busy.start(background=False)
  busy._idle.clear()  # pylint: disable=protected-access  # a request that never ends
  busy.prepare_yield_s = 0.05
  try:
    todo = len(busy.pending()["base"])
    busy.prepare_rest()  # each program after its wait
    assert busy.pending() == {"base": []} and busy.prepared.waits == todo
  finally:
    busy.close()
