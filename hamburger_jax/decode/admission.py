"""Admission while running: the engine's serving loop for requests that arrive over time.

`serve()` (serving.py) takes a list it knows in advance and sizes its layout from it. A server
cannot: `AdmissionLoop` fixes its layouts when it starts (slots, KV pool, longest prompt, largest
max_tokens, from its limits), compiles every program a request within them can run, and then
runs the same `Scheduler` on a thread of its own. Requests come in through `submit()` from any
thread: checked there (a request over the limits is refused, never truncated), queued, and
admitted between decode rounds. Each macro step's group reaches its request's `on_tokens` as it
is produced; `cancel()` frees a request's slot and blocks at the next round.

A round ends after the macro step during which a request was cancelled, or arrived while a slot
is free for it (the decode program's stream callback answers, serving.deliver_step), when a slot
finishes while requests wait, or after `round_steps` steps: an arrival waits for at most one
macro step before its prefill when a slot is free, and a full batch makes few host round trips. A model with a
graft serves both modes at once, one scheduler (and KV pool) per mode, rounds taking turns.
A preempted request is recomputed from its prompt and gives the same tokens (serving.py), so
its stream resumes where it was and nothing is sent twice.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import sys
import threading
import time
from typing import Callable

import numpy as np

from hamburger_jax import cache
from hamburger_jax.decode.paged_kv import BlockAllocator
from hamburger_jax.decode.requests import Generation, GenerationError, Request
from hamburger_jax.decode.serving import Scheduler, ServeStats, pool_error, stream_sink

log = logging.getLogger(__name__)

# The most macro steps a round runs: with a graft's two modes, one mode's round waits for the
# other's. Arrivals and cancellations end a round at the next step anyway (_deliver).
DEFAULT_ROUND_STEPS = 32
# Rounds the per-round statistics keep: a server runs for days, its figures describe the
# recent past.
STATS_WINDOW = 4096
# How long the background compile waits for the requests in flight to end before it prepares
# its next program anyway: on a few cores a program loaded beside a request slows its answer
# (a second start's first 8-token answer took 6.8 s beside the rest's 46 loads, 3.4 s without),
# while a server that is never idle still gets the faster programs, one per wait.
PREPARE_YIELD_S = 5.0


class QueueFull(RuntimeError):
  """The loop already holds `max_queue` requests waiting for a slot: try again later."""


class LoopClosed(RuntimeError):
  """The loop is shutting down (or failed) and takes no more requests."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """What a server's layouts are sized for; a request beyond them is refused."""
  slots: int = 8
  max_prompt_tokens: int = 1024
  max_tokens: int = 512
  kv_blocks: int | None = None  # None: every slot can hold its longest request
  max_queue: int = 256

  def check(self) -> None:
    for name in ("slots", "max_prompt_tokens", "max_tokens", "max_queue"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise GenerationError(f"{name}={v!r} must be an integer >= 1")
    if self.kv_blocks is not None and (not isinstance(self.kv_blocks, int)
                                       or self.kv_blocks < 2):
      raise GenerationError(f"kv_blocks={self.kv_blocks!r} must be an integer >= 2 (one block "
                            "is reserved), or None")


class Ticket:
  """One submitted request: its tokens stream to `on_tokens(ids)` (on the loop's thread, in
  order, once per macro step: the step's new token ids) and its end to
  `on_done(generation)` (error set when it failed or was cancelled). `wait()` blocks for the
  Generation."""

  def __init__(self, request: Request, mode: str, on_tokens: Callable | None,
               on_done: Callable | None):
    self.request, self.mode = request, mode
    self.on_tokens, self.on_done = on_tokens, on_done
    self.sent = 0  # tokens handed to on_tokens
    self.steps = 0  # macro steps that handed it tokens
    self.submitted = time.perf_counter()
    self.first: float | None = None  # perf_counter when its first tokens went out
    self.ended: float | None = None
    self.produced = 0  # tokens of the current attempt (a preempted request starts again)
    self.attempt = 0
    self.cancelled = False
    self.reader_gone: Callable[[], None] = lambda: None  # the loop's cancel, set by submit
    self.result: Generation | None = None
    self._done = threading.Event()

  def wait(self, timeout: float | None = None) -> Generation | None:
    self._done.wait(timeout)
    return self.result

  @property
  def done(self) -> bool:
    return self._done.is_set()

  def finish(self, gen: Generation) -> Exception | None:
    """Ends the ticket; what `on_done` raised, if it did."""
    if self._done.is_set():
      return None
    self.result, self.ended = gen, time.perf_counter()
    self._done.set()
    return _guarded(self.on_done, gen) if self.on_done is not None else None

  def deliver(self, ids: list[int], attempt: int) -> None:
    """This attempt's next tokens: only those past what was sent go out."""
    if attempt != self.attempt:
      self.attempt, self.produced = attempt, 0
    new = ids[max(self.sent - self.produced, 0):]
    self.produced += len(ids)
    if new and not self.cancelled and self.on_tokens is not None:
      self.sent, self.steps = self.sent + len(new), self.steps + 1
      self.first = self.first or time.perf_counter()
      if _guarded(self.on_tokens, new) is not None:
        self.reader_gone()  # whoever read the stream is gone: free its slot


def _guarded(callback: Callable, *args) -> Exception | None:
  """Calls a caller's callback on the loop's thread: its failure must not end serving for
  every other request (a client's event loop may be gone). What it raised, or None."""
  try:
    callback(*args)
    return None
  except Exception as e:  # pylint: disable=broad-except
    return e


@dataclasses.dataclass
class Prepared:
  """What an AdmissionLoop's background compile has done: its seconds, the programs the
  compilation cache gave and those it compiled, the times it found requests in flight and
  waited for them before a program, and the error that stopped it (if one did)."""
  seconds: float = 0.0
  cache_hits: int = 0
  cache_misses: int = 0
  waits: int = 0
  error: str | None = None


class AdmissionLoop:
  """Serves requests submitted from any thread, on one loop thread over `engine`.

  `modes`: the modes served (each its own layout and KV pool). `start()` compiles and starts
  the thread; `close()` stops taking requests, lets the ones in flight finish (or fails them
  when `drain` is False) and joins. `observers` (a server's metrics) hear of every request
  that ends, `ended(ticket, generation)` on the loop's thread, of every one refused,
  `refused(mode)` on the submitter's, and (those that have the method) of every `on_done`
  that raised, `on_done_failed(ticket, error)` on the loop's thread; their failures are
  ignored."""

  def __init__(self, engine, modes: tuple[str, ...], limits: Limits = Limits(), *,
               round_steps: int = DEFAULT_ROUND_STEPS):
    limits.check()
    if not modes:
      raise GenerationError("serve at least one mode")
    self.engine, self.limits = engine, limits
    self.modes = tuple(engine.check_mode(m) for m in modes)
    self.round_steps = round_steps
    self.layouts = {m: engine.layout(m, limits.slots, limits.max_tokens,
                                     limits.max_prompt_tokens, limits.kv_blocks)
                    for m in self.modes}
    self.usable = {m: BlockAllocator(lay.num_blocks).usable for m, lay in self.layouts.items()}
    self.stats = {m: _window_stats(limits.slots, self.usable[m]) for m in self.modes}
    self.compile_s = 0.0
    self.compile_cache = cache.CompileCounts()  # start()'s programs: read from the cache, or not
    self._pending: list[tuple] = []  # program keys start() left to prepare_rest
    self.prepared = Prepared()  # what prepare_rest did so far
    self._prepared_counts = cache.CompileCounts()
    self._preparer: threading.Thread | None = None
    self.prepare_yield_s = PREPARE_YIELD_S
    self._idle = threading.Event()  # no request in flight (prepare_rest's turn)
    self._idle.set()
    self._cond = threading.Condition()
    self._inbox: collections.deque[Ticket] = collections.deque()
    self._cancels: collections.deque[Ticket] = collections.deque()
    self._waiting = 0  # submitted, not yet in a slot
    self.cancelled = 0  # requests stopped by cancel() before they finished
    self._tickets: dict[int, Ticket] = {}  # by id(request), every ticket not finished
    self._closing = False
    self._drain = True
    self.error: str | None = None
    self._thread: threading.Thread | None = None
    self._current: Scheduler | None = None  # the scheduler whose round is decoding
    self._scheds: tuple[Scheduler, ...] = ()
    self.observers: list = []
    self._observer_errors: set[tuple[str, str]] = set()

  # ------------------------------------------------------------------ any thread

  def start(self, background: bool = True) -> float:
    """Compiles the programs that answer every request within the limits, each mode's fewest
    (Engine.ready_keys: every prefill chunk size, the sampling decode loop of the widest view),
    and starts the loop; returns the seconds spent compiling them. The rest (greedy loops,
    narrower views, prefix caching: faster, the same tokens) compile on a thread of their own
    after, one at a time when no request is in flight (or after PREPARE_YIELD_S of
    waiting) so that serving keeps its turns (`background`; else `prepare_rest()` does it),
    and the loop takes each as it is ready (`pending` names those still to come)."""
    t = time.perf_counter()
    longest = self.limits.max_prompt_tokens
    with cache.counting(self.compile_cache):
      self.engine.compile_keys([k for lay in self.layouts.values()
                                for k in self.engine.ready_keys(lay, longest)])
    self.compile_s = time.perf_counter() - t
    with self._cond:
      self._pending = [k for lay in self.layouts.values()
                       for k in self.engine.serving_keys(lay, longest)
                       if k not in self.engine.programs]
    self._thread = threading.Thread(target=self._run, name="admission-loop", daemon=True)
    self._thread.start()
    if background and self._pending:
      self._preparer = threading.Thread(target=self.prepare_rest, name="compile-rest",
                                        daemon=True)
      self._preparer.start()
    return self.compile_s

  def prepare_rest(self) -> None:
    """Compiles the programs `start` left for later, one at a time, each once no request is in
    flight or `prepare_yield_s` has passed (stops when the loop closes); `prepared` counts its
    seconds and what the compilation cache gave."""
    while True:
      with self._cond:
        if self._closing or not self._pending:
          return
        self.prepared.waits += not self._idle.is_set()
      self._idle.wait(self.prepare_yield_s)
      with self._cond:
        if self._closing or not self._pending:  # closed while it waited
          return
        key = self._pending[0]
      t = time.perf_counter()
      try:
        with cache.counting(self._prepared_counts):
          self.engine.compile_keys([key])
      except Exception as e:  # pylint: disable=broad-except
        with self._cond:  # serving goes on with the programs it has
          self.prepared.error = f"{type(e).__name__}: {e}"
          self._pending.clear()
        return
      with self._cond:
        self._pending.remove(key)
        self.prepared.seconds += time.perf_counter() - t
        self.prepared.cache_hits = self._prepared_counts.hits
        self.prepared.cache_misses = self._prepared_counts.misses

  def pending(self) -> dict[str, list[str]]:
    """The programs still being prepared, by mode, named for a reader (/health)."""
    with self._cond:
      keys = list(self._pending)
    out: dict[str, list[str]] = {m: [] for m in self.modes}
    for kind, layout, *rest in keys:
      if kind == "decode":
        stochastic, _, view = rest
        what = f"decode {'sampling' if stochastic else 'greedy'}, view {view} blocks"
      else:
        what = f"{kind} {rest[0]}"
      out[layout.mode].append(what)
    return out

  def submit(self, request: Request, mode: str | None = None, *,
             on_tokens: Callable | None = None, on_done: Callable | None = None) -> Ticket:
    """Checks `request` against the engine and the limits (GenerationError says what to
    change), then queues it. Raises QueueFull or LoopClosed instead of queueing."""
    mode = self.modes[0] if mode is None else mode
    try:
      return self._queue(request, mode, on_tokens, on_done)
    except (GenerationError, QueueFull, LoopClosed):
      for observer in self.observers:
        self._observe(observer.refused, mode)
      raise

  def _queue(self, request: Request, mode: str, on_tokens: Callable | None,
             on_done: Callable | None) -> Ticket:
    if mode not in self.modes:
      raise GenerationError(f"mode {mode!r} is not served here; use one of {list(self.modes)}")
    request.check(self.engine)
    lim = self.limits
    if len(request.ids) > lim.max_prompt_tokens:
      raise GenerationError(f"the prompt has {len(request.ids)} tokens, over this server's "
                            f"limit of {lim.max_prompt_tokens}: shorten it")
    if request.max_new_tokens > lim.max_tokens:
      raise GenerationError(f"max_tokens={request.max_new_tokens} is over this server's limit "
                            f"of {lim.max_tokens}: ask for at most {lim.max_tokens}")
    error = pool_error(request, self.layouts[mode], self.usable[mode])
    if error:
      raise GenerationError(error)
    ticket = Ticket(request, mode, on_tokens, on_done)
    ticket.reader_gone = lambda: self.cancel(ticket)
    with self._cond:
      if id(request) in self._tickets:
        raise GenerationError("this Request object is being served already: submit a copy "
                              "(dataclasses.replace(request))")
      if self._closing or self.error:
        raise LoopClosed(self.error or "the server is shutting down")
      if self._waiting >= lim.max_queue:
        raise QueueFull(f"{self._waiting} requests are waiting (the limit is {lim.max_queue}); "
                        "try again later")
      self._waiting += 1
      self._tickets[id(request)] = ticket
      self._idle.clear()
      self._inbox.append(ticket)
      self._cond.notify()
    return ticket

  def cancel(self, ticket: Ticket) -> None:
    """Stops `ticket` (nothing more goes to its callbacks); its slot and blocks are freed at the
    next round, and it finishes with error 'cancelled'."""
    with self._cond:
      if ticket.done or ticket.cancelled:
        return
      ticket.cancelled = True
      self._cancels.append(ticket)
      self._cond.notify()

  def close(self, drain: bool = True, timeout: float | None = None) -> None:
    with self._cond:
      self._closing, self._drain = True, drain
      self._cond.notify()
    self._idle.set()  # a waiting preparer sees the close at once
    if self._thread is not None:
      self._thread.join(timeout)
    if self._preparer is not None:  # it stops after the program it is compiling
      self._preparer.join(timeout)

  @property
  def waiting(self) -> int:
    return self._waiting

  @property
  def in_flight(self) -> int:
    return len(self._tickets)

  def kv_blocks(self) -> dict[str, tuple[int, int]]:
    """(blocks used, blocks free) of each mode's KV pool, now."""
    pools = {s.mode: s.pool for s in self._scheds}
    return {m: (self.usable[m] - pools[m].free, pools[m].free) if m in pools
            else (0, self.usable[m]) for m in self.modes}

  # ------------------------------------------------------------------ the loop's thread

  def _run(self) -> None:
    scheds = {m: Scheduler(self.engine, lay, self.stats[m], collections.deque(), mode=m,
                           stream=self._deliver, limit=self.round_steps, refill=True,
                           arrival=time.perf_counter(), compile_s=0.0, stochastic=None,
                           compiled_only=True)
              for m, lay in self.layouts.items()}
    self._scheds = tuple(scheds.values())
    try:
      with stream_sink(self._deliver) as sink_id:
        sink = self.engine.put(np.int32(sink_id))
        while self._take(scheds):
          for sched in scheds.values():
            self._round(sched, sink)
    except Exception as e:  # pylint: disable=broad-except
      # A device or program error ends serving: every request hears it, none hangs.
      with self._cond:
        self.error = f"the serving loop failed: {type(e).__name__}: {e}"
      raise
    finally:
      self._fail_all(self.error or "the server shut down before this request finished")

  def _take(self, scheds: dict[str, Scheduler]) -> bool:
    """Moves arrivals into the schedulers' queues and applies cancellations; blocks while
    there is nothing to do. False when the loop should end."""
    with self._cond:
      while True:
        busy = any(s.queue or s.live for s in scheds.values())
        if self._closing and (not self._drain or (not busy and not self._inbox)):
          return False
        if busy or self._inbox or self._cancels:
          break
        self._cond.wait()
      arrivals, cancels = list(self._inbox), list(self._cancels)
      self._inbox.clear()
      self._cancels.clear()
    for ticket in arrivals:
      scheds[ticket.mode].queue.append(ticket.request)
    for ticket in cancels:
      sched = scheds[ticket.mode]
      queued = any(r is ticket.request for r in sched.queue)
      if sched.drop(ticket.request):
        with self._cond:
          self._waiting -= queued
          self.cancelled += 1
        self._finish(ticket, _ended(ticket, "cancelled"))
    return True

  def _round(self, sched: Scheduler, sink) -> None:
    before = len(sched.queue)
    sched.admit()
    sched.make_room()
    with self._cond:
      self._waiting -= before - len(sched.queue)
    if not sched.live:
      return
    self._current = sched
    for request, gen in sched.decode_round(sink):
      self._finish(self._tickets[id(request)], gen)

  def _finish(self, ticket: Ticket, gen: Generation) -> None:
    with self._cond:
      self._tickets.pop(id(ticket.request), None)
      if not self._tickets:
        self._idle.set()
    self._end(ticket, gen)

  def _end(self, ticket: Ticket, gen: Generation) -> None:
    if ticket.done:
      return
    error = ticket.finish(gen)
    if error is not None:
      # Its client may never hear that the request ended: said for each request, unlike an
      # observer's failure, since each is a client left waiting.
      log.warning("request %r: its on_done callback failed (%s: %s); serving goes on",
                  ticket.request.id, type(error).__name__, error, exc_info=error)
    for observer in self.observers:
      self._observe(observer.ended, ticket, gen)
      if error is not None and hasattr(observer, "on_done_failed"):
        self._observe(observer.on_done_failed, ticket, error)

  def _observe(self, callback: Callable, *args) -> None:
    """An observer's callback, guarded: its failure never ends serving, and is said once per
    callback and kind of error (on stderr), not once per request."""
    try:
      callback(*args)
    except Exception as e:  # pylint: disable=broad-except
      key = (getattr(callback, "__qualname__", repr(callback)), type(e).__name__)
      if key not in self._observer_errors:
        self._observer_errors.add(key)
        print(f"warning: an observer of served requests failed ({key[0]}: {key[1]}: {e}); "
              "serving goes on, and its further failures of this kind are not reported",
              file=sys.stderr)

  def _deliver(self, group: np.ndarray, count: np.ndarray) -> bool:
    """One macro step of the scheduler now decoding (the loop's thread waits on it). True (end
    the round now) when a request was cancelled, or arrived while a slot is free for it: one
    free at the round's start, or one whose request finished during it (it emits nothing)."""
    freed = False
    for slot, lv in self._current.live.items():
      n = int(count[slot])
      freed |= n == 0
      ticket = self._tickets.get(id(lv.request))
      if n and ticket is not None:
        ticket.deliver(group[slot, :n].tolist(), lv.preemptions)
    return bool(self._cancels) or (bool(self._inbox) and (
        freed or any(s.free_slots for s in self._scheds)))

  def _fail_all(self, error: str) -> None:
    with self._cond:
      self._closing = True
      tickets = list(self._tickets.values())
      self._tickets.clear()
      self._inbox.clear()
      self._idle.set()
    for ticket in tickets:
      self._end(ticket, _ended(ticket, error))


def _window_stats(slots: int, usable: int) -> ServeStats:
  window = lambda: collections.deque(maxlen=STATS_WINDOW)
  return ServeStats(slots=slots, usable_blocks=usable, in_flight=window(),
                    blocks_used=window(), views=window(), queued=window(), round_s=window())


def recent(stats: ServeStats) -> dict:
  """A mode's figures over the last STATS_WINDOW rounds (GET /health)."""
  mean = lambda xs: round(float(np.mean(xs)), 4) if xs else 0.0
  return {"rounds": stats.rounds, "round_s_mean": mean(stats.round_s),
          "in_flight_mean": mean(stats.in_flight), "preemptions": stats.preemptions,
          "prefix_tokens": stats.prefix_tokens}


def _ended(ticket: Ticket, error: str) -> Generation:
  r = ticket.request
  return Generation([], "", [], 0, 0, len(r.ids or ()), 0.0, 0.0, id=r.id, error=error,
                    mode=ticket.mode, confidence=r.confidence, max_group=r.max_group,
                    seed=r.seed, sampling=r.sampling)
