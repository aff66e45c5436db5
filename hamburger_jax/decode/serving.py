"""Continuous batching over a paged KV pool: the host side of the engine.

A fixed number of slots and a queue of requests. A request is admitted into a free slot when
the pool has blocks for its prompt (plus one entry); it is prefilled alone (chunked when long)
while the other slots keep their state. The decode program then runs macro steps until a slot
finishes (its slot takes the next request), a live slot fills its last block (it gets one
more), or everything is done. (`round_steps=K` instead runs rounds of K macro steps, finished
slots idling until the round ends: fewer host round trips, idle slots; `infer.bench --mode serve
--round-steps` measures both.) When the pool has no block for a slot that needs one, the
youngest live request is preempted: its blocks are freed and it goes back to the front of the
queue, to be recomputed from its prompt later (its greedy output is unchanged: a request's
tokens depend only on its own prompt, settings and seed).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import threading
import time
from typing import Callable, Iterable, Iterator, Sequence

import jax
import numpy as np

from hamburger_jax.decode.paged_kv import TRASH_BLOCK, BlockAllocator, blocks_for, row_table
from hamburger_jax.decode.requests import Generation, GenerationError, Request
from hamburger_jax.decode.shapes import step_room


@dataclasses.dataclass
class ServeStats:
  """What one `serve` call did, for benches and tests (`ServeRun.stats`)."""
  slots: int = 0
  usable_blocks: int = 0
  rounds: int = 0  # decode program calls
  in_flight: list[int] = dataclasses.field(default_factory=list)  # live requests, per round
  blocks_used: list[int] = dataclasses.field(default_factory=list)  # blocks held, per round
  views: list[int] = dataclasses.field(default_factory=list)  # decode view (blocks), per round
  queued: list[int] = dataclasses.field(default_factory=list)  # requests waiting, per round
  round_s: list[float] = dataclasses.field(default_factory=list)  # decode seconds, per round
  preemptions: int = 0
  free_blocks_at_end: int = 0
  prefix_hits: int = 0  # prefills that copied a cached prefix (prefix_cache.py)
  prefix_tokens: int = 0  # prompt tokens copied from the prefix cache instead of prefilled
  compile_s: float = 0.0  # compiling this call's programs (0: compiled before), before the clock

  @property
  def mean_in_flight(self) -> float:
    return float(np.mean(self.in_flight)) if self.in_flight else 0.0

  @property
  def in_flight_while_queued(self) -> float:
    """Live requests, averaged over the decode time of the rounds that ran while requests
    waited: what the slots and the pool held when demand exceeded them (the stream's tail,
    when the queue is empty and rows finish one by one, left out)."""
    pairs = [(n, t) for n, q, t in zip(self.in_flight, self.queued, self.round_s) if q > 0]
    total = sum(t for _, t in pairs)
    return sum(n * t for n, t in pairs) / total if total > 0 else 0.0


def mean_blocks_held(gens: Iterable[Generation], block_size: int) -> float:
  """KV blocks a live request holds, averaged over every macro step of these requests: during
  its step s (1..S) a request holds its prompt, s - 1 entries and room for the next (`serve`
  adds a block when the last one is full). A pool that binds holds about its blocks / this many
  requests at once, so this figure's ratio between two modes bounds their ratio of requests in
  flight, for the same stream (prefill and preemption left out)."""
  held = steps = 0
  for g in gens:
    s = np.arange(1, g.macro_steps + 1)
    held += int(np.sum(blocks_for(g.prompt_tokens + s, block_size)))
    steps += g.macro_steps
  return held / steps if steps else 0.0


def check_tables(table: np.ndarray, live_slots) -> None:
  """No block is held by two live slots, nor twice by one (a shared block corrupts a row)."""
  held = [int(b) for s in live_slots for b in table[s] if b != TRASH_BLOCK]
  if len(held) != len(set(held)):
    dup = sorted({b for b in held if held.count(b) > 1})
    raise RuntimeError(f"KV blocks {dup} are held by more than one live slot")


class ServeRun:
  """One `serve` call: iterating it serves the requests and yields each one's Generation as it
  finishes; `stats` is this call's ServeStats, filled as it runs (complete when the iteration
  ends). `close()` stops serving early."""

  def __init__(self, results: Iterator[Generation], stats: ServeStats):
    self._results = results
    self.stats = stats

  def __iter__(self) -> ServeRun:
    return self

  def __next__(self) -> Generation:
    return next(self._results)

  def close(self) -> None:
    self._results.close()


# The stream callbacks of the serve calls in progress, by sink id. The decode programs are
# compiled once per engine and shared by every call, so the callback cannot be baked into them
# nor kept on the engine (two calls would clash): a call registers its callback here and hands
# the decode program the id, which the program passes back with each macro step.
_SINKS: dict[int, Callable] = {}
_SINK_IDS = itertools.count()
_SINK_LOCK = threading.Lock()


@contextlib.contextmanager
def stream_sink(callback: Callable[[np.ndarray, np.ndarray], bool | None] | None
                ) -> Iterator[int]:
  """A sink id for the decode programs' `sink` argument, live for the `with` block: their macro
  steps go to `callback(group, count)` (numpy arrays), which may return True to end the decode
  call after that step. None: id 0, which reports to no one."""
  if callback is None:
    yield 0
    return
  with _SINK_LOCK:
    sink = next(_SINK_IDS) % (2 ** 31 - 1) + 1  # an int32 the program carries; 0 is no one
    _SINKS[sink] = callback
  try:
    yield sink
  finally:
    with _SINK_LOCK:
      _SINKS.pop(sink, None)


def deliver_step(sink, group, count) -> np.bool_:
  """The decode programs' host callback: one macro step to the sink's callback, if it is live.
  A callback that returns True ends the decode call after this step (the tokens do not change:
  the host calls again)."""
  callback = _SINKS.get(int(sink))
  asked = callback(np.asarray(group), np.asarray(count)) if callback is not None else None
  return np.bool_(asked is True)


@dataclasses.dataclass
class _Live:
  request: Request
  blocks: list[int]
  admitted: float  # perf_counter when its prefill ended
  prefill_s: float
  preemptions: int


def serve(engine, requests: Iterable[Request], *, slots: int = 8,
          kv_blocks: int | None = None, mode: str | None = None,
          stream: Callable[[np.ndarray, np.ndarray], None] | None = None,
          max_new_bound: int | None = None, round_steps: int | None = None,
          progress: Callable[[Generation], None] | None = None) -> ServeRun:
  """Serves `requests` with `slots` concurrent rows and a pool of `kv_blocks` KV blocks (default:
  enough for every slot's longest request). Returns a ServeRun, which yields a Generation per
  request as it finishes; a request that cannot be served yields one with `error` set, and the
  others go on. A Request whose `ids` are set is not encoded again (serving works on copies).
  `stream(group, count)`: called once per macro step, in order. `round_steps`: None refills a
  slot as soon as it finishes; K returns to the host every K macro steps (the same tokens either
  way). Bad call arguments raise GenerationError here, before anything runs."""
  mode = engine.check_mode(mode)
  if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
    raise GenerationError(f"slots={slots!r} must be an integer >= 1")
  if round_steps is not None and (isinstance(round_steps, bool) or not isinstance(
      round_steps, int) or round_steps < 1):
    raise GenerationError(f"round_steps={round_steps!r} must be None (refill when a slot "
                          "finishes) or an integer >= 1")
  if stream is not None and not callable(stream):
    raise GenerationError("stream must be a callable (group, count), or None")
  stats = ServeStats(slots=slots)
  return ServeRun(_serve(engine, requests, stats, slots=slots, kv_blocks=kv_blocks, mode=mode,
                         stream=stream, max_new_bound=max_new_bound, round_steps=round_steps,
                         progress=progress), stats)


def _checked(engine, requests: Iterable, mode: str, arrival: float
             ) -> tuple[collections.deque, list[Generation]]:
  """(the requests that pass their checks, a failed Generation for each of the others)."""
  queue: collections.deque[Request] = collections.deque()
  failed: list[Generation] = []
  for i, r in enumerate(requests):
    # A copy: serving sets its id and token ids, never the caller's object (ids encoded
    # already travel with the copy, so no prompt is encoded twice).
    r = dataclasses.replace(r, id=i if r.id is None else r.id) if isinstance(r, Request) else (
        Request(r, id=i))
    try:
      r.check(engine)
      queue.append(r)
    except GenerationError as e:
      failed.append(_failed(r, mode, str(e), arrival))
  return queue, failed


def _fitting(queue, layout, usable: int, mode: str, arrival: float
             ) -> tuple[collections.deque, list[Generation]]:
  """(the requests the pool can hold alone in the worst case, one entry per token; a failed
  Generation for each of the others, which could otherwise be preempted forever)."""
  fits, too_big = collections.deque(), []
  for r in queue:
    error = pool_error(r, layout, usable)
    if error:
      too_big.append(_failed(r, mode, error, arrival))
    else:
      fits.append(r)
  return fits, too_big


def pool_error(r: Request, layout, usable: int) -> str | None:
  """Why a pool of `usable` blocks can never hold checked request `r` alone (one entry per
  token, the worst case: a step's room, step_room, never reaches past its last token's entry),
  or None when it can."""
  need = blocks_for(len(r.ids) + r.max_new_tokens, layout.block_size)
  if need <= usable:
    return None
  return (f"needs up to {need} KV blocks of {layout.block_size} entries (prompt {len(r.ids)} + "
          f"max_new_tokens {r.max_new_tokens}) but the pool has {usable}: raise kv_blocks or "
          "shorten the request")


class Scheduler:
  """Slots over one layout's KV pool: admission, room for the next entry (the youngest request
  gives way), decode rounds and the results of finished rows. A serve() call drives one over
  its list of requests; a server (decode/admission.py) keeps one per mode and feeds its queue
  between rounds.

  `limit`: the most macro steps a round runs (None: no cap). `refill`: a round also ends when a
  slot finishes while requests wait. `stochastic`: which decode program rounds run (None: the
  sampling one only in rounds where a live request samples)."""

  def __init__(self, engine, layout, stats: ServeStats, queue: collections.deque, *,
               mode: str, stream, limit: int | None, refill: bool, arrival: float,
               compile_s: float, stochastic: bool | None, compiled_only: bool = False):
    self.engine, self.layout, self.stats, self.queue = engine, layout, stats, queue
    # Run only programs compiled already (a server's loop, while the rest are prepared apart).
    self.compiled_only = compiled_only
    self.mode, self.stream, self.stochastic = mode, stream, stochastic
    self.arrival, self.compile_s = arrival, compile_s
    self.refill = refill
    self.limit = np.int32(limit if limit is not None else np.iinfo(np.int32).max)
    self.pool = BlockAllocator(layout.num_blocks)
    self.table = np.full((layout.slots, layout.blocks_per_row), TRASH_BLOCK, np.int32)
    self.live: dict[int, _Live] = {}
    self.free_slots = list(range(layout.slots))
    self.lengths = np.zeros((layout.slots,), np.int64)
    self.generated = np.zeros((layout.slots,), np.int64)  # tokens each live slot emitted
    self.preempted: dict[int, int] = collections.Counter()
    self.state = engine.init_state(layout)

  def _put_table(self) -> None:
    self.state = self.state.replace(cache=self.state.cache.replace(
        table=self.engine.put(self.table)))

  def release(self, slot: int) -> None:
    self.pool.give_back(self.live.pop(slot).blocks)
    self.table[slot] = TRASH_BLOCK
    self.free_slots.append(slot)
    self.free_slots.sort()

  def drop(self, request: Request) -> bool:
    """Removes `request` (this object) whether it waits or decodes: a live one's slot stops
    and its blocks are free for the next round. False when it is neither."""
    for i, r in enumerate(self.queue):
      if r is request:
        del self.queue[i]
        return True
    for slot, lv in self.live.items():
      if lv.request is request:
        self.release(slot)
        self.state = self.state.replace(done=self.state.done.at[slot].set(True))
        return True
    return False

  def admit(self) -> None:
    """Admits while a slot and the prompt's blocks are free (first come, first served)."""
    engine, stats = self.engine, self.stats
    while self.queue and self.free_slots:
      r = self.queue[0]
      need = blocks_for(len(r.ids) + int(step_room(self.layout.step_entries,
                                                   r.max_new_tokens, 0)),
                        self.layout.block_size)
      if need > self.pool.free:
        if not self.live:
          raise RuntimeError("KV pool accounting error: nothing is live and blocks are missing")
        return
      self.queue.popleft()
      slot = self.free_slots.pop(0)
      blocks = self.pool.take(need)
      self.table[slot] = row_table(blocks, self.layout.blocks_per_row)
      self._put_table()
      t = time.perf_counter()
      hits, reused = engine.prefix_cache.hits, engine.prefix_cache.tokens_reused
      self.state = engine.prefill(self.layout, self.state, r, slot, self.compiled_only)
      jax.block_until_ready(self.state.done)
      stats.prefix_hits += engine.prefix_cache.hits - hits
      stats.prefix_tokens += engine.prefix_cache.tokens_reused - reused
      now = time.perf_counter()
      self.live[slot] = _Live(r, blocks, now, now - t, self.preempted[id(r)])
      self.lengths[slot] = len(r.ids)
      self.generated[slot] = 0

  def make_room(self) -> None:
    """Every live slot gets room for the entries its next macro step may keep (step_room);
    the youngest gives way when blocks run out (back to the queue's head, recomputed
    later)."""
    live, size = self.live, self.layout.block_size
    for slot in sorted(live, key=lambda s: live[s].admitted):
      if slot not in live:
        continue
      room = int(step_room(self.layout.step_entries, live[slot].request.max_new_tokens,
                           self.generated[slot]))
      while self.lengths[slot] + room > len(live[slot].blocks) * size:
        if self.pool.free == 0:
          victim = max(live, key=lambda s: live[s].admitted)
          self.preempted[id(live[victim].request)] += 1
          self.stats.preemptions += 1
          self.queue.appendleft(live[victim].request)
          self.release(victim)
          self.state = self.state.replace(done=self.state.done.at[victim].set(True))
          if victim == slot:
            break
          continue
        live[slot].blocks += self.pool.take(1)
        self.table[slot] = row_table(live[slot].blocks, self.layout.blocks_per_row)
    check_tables(self.table, live)
    self._put_table()

  def decode_round(self, sink) -> list[tuple[Request, Generation]]:
    """One decode call over the live slots; (request, Generation) of the rows it finished."""
    engine, stats, live = self.engine, self.stats, self.live
    stats.rounds += 1
    stats.in_flight.append(len(live))
    stats.queued.append(len(self.queue))
    stats.blocks_used.append(self.pool.usable - self.pool.free)
    stochastic = self.stochastic
    if stochastic is None:
      stochastic = any(not lv.request.sampling.greedy for lv in live.values())
    decode, view = engine.decode_for(self.layout, stochastic, self.stream is not None,
                                     max(len(lv.blocks) for lv in live.values()),
                                     self.compiled_only)
    stats.views.append(view)
    refill = np.bool_(bool(self.queue) and self.refill)
    t_round = time.perf_counter()
    self.state = decode(engine.params, self.state, engine.put(refill), engine.put(self.limit),
                        sink)
    done, n_tokens, length = jax.device_get((self.state.done, self.state.n_tokens,
                                             self.state.cache.length))
    stats.round_s.append(time.perf_counter() - t_round)
    slots = list(live)
    if np.array_equal(n_tokens[slots], self.generated[slots]):
      # Every live row emits a token a step: the loop stopped before its first, and would again
      # on every call (an endless serve) rather than fail.
      raise RuntimeError("a decode round ran no macro step: the decode loop and make_room "
                         "disagree on the room a row needs (keep both on shapes.step_room)")
    self.lengths[:] = length
    self.generated[:] = n_tokens
    finished = [s for s in sorted(live) if done[s]]
    if not finished:
      return []
    results = self._results(finished, n_tokens, length)
    stats.free_blocks_at_end = self.pool.free
    return results

  def _results(self, finished: list[int], n_tokens, length) -> list[tuple[Request, Generation]]:
    tokens, groups, n_steps = jax.device_get((self.state.tokens, self.state.groups,
                                              self.state.n_steps))
    now = time.perf_counter()
    tok = self.engine.tokenizer
    results = []
    for s in finished:
      lv = self.live[s]
      row = tokens[s, :n_tokens[s]].tolist()
      text = tok.decode(row, skip_special_tokens=True) if tok is not None else ""
      entries = int(length[s])
      if self.mode == "hamburger" and self.engine.merge_layer:
        # A merge at layer L: `length` counts the lower layers' entries (one a token); a
        # group's is the upper layers' (one a forwarded macro step, as at L = 0).
        entries = len(lv.request.ids) + max(int(n_steps[s]) - 1, 0)
      results.append((lv.request, Generation(
          row, text, groups[s, :n_steps[s]].tolist(), int(n_steps[s]), entries,
          len(lv.request.ids), lv.prefill_s, now - lv.admitted, self.compile_s,
          id=lv.request.id, queue_s=lv.admitted - lv.prefill_s - self.arrival,
          latency_s=now - self.arrival, preemptions=lv.preemptions,
          **_settings(lv.request, self.mode))))
      self.release(s)
    return results


def run_layout(engine, requests: Sequence[Request], *, slots: int, mode: str,
               kv_blocks: int | None = None, max_new_bound: int | None = None):
  """The layout a serving run of these checked requests decodes in (one set of programs)."""
  longest = max(len(r.ids) for r in requests)
  bound = max(max_new_bound or 0, max(r.max_new_tokens for r in requests))
  return engine.layout(mode, slots, bound, longest, kv_blocks)


def precompile(engine, runs: Iterable[tuple[Sequence[Request], int, str]]) -> float:
  """Compiles the programs of several serving runs, (requests, slots, mode) each, together
  (decode/programs.py compiles them on a pool of threads): a judge's base and HAMburger runs
  before the first decodes. Unstreamed runs, as `serve` makes without a stream; stochastic
  where a run's requests sample, as `serve` decides. Returns the seconds spent."""
  jobs = []
  for requests, slots, mode in runs:
    queue, failed = _checked(engine, requests, mode, time.perf_counter())
    if failed:
      raise GenerationError(f"cannot compile for request {failed[0].id}: {failed[0].error}")
    stochastic = any(not r.sampling.greedy for r in queue)
    jobs.append((run_layout(engine, queue, slots=slots, mode=mode), [r.ids for r in queue],
                 stochastic, False))
  return engine.compile_layouts(jobs)


def _serve(engine, requests: Iterable, stats: ServeStats, *, slots: int, kv_blocks: int | None,
           mode: str, stream, max_new_bound: int | None, round_steps: int | None,
           progress) -> Iterator[Generation]:
  arrival = time.perf_counter()
  queue, failed = _checked(engine, requests, mode, arrival)
  yield from _report(failed, progress)
  if not queue:
    return
  layout = run_layout(engine, queue, slots=slots, mode=mode, kv_blocks=kv_blocks,
                      max_new_bound=max_new_bound)
  usable = BlockAllocator(layout.num_blocks).usable
  stats.usable_blocks = usable
  queue, too_big = _fitting(queue, layout, usable, mode, arrival)
  yield from _report(too_big, progress)
  if not queue:
    return
  stochastic = any(not r.sampling.greedy for r in queue)
  compile_s = engine.compile_programs(layout, [r.ids for r in queue], stochastic,
                                     stream is not None)
  # Queueing and latency count from the end of compilation (reported apart: stats.compile_s),
  # as they would once a server's programs are compiled.
  stats.compile_s = compile_s
  run = Scheduler(engine, layout, stats, queue, mode=mode, stream=stream, limit=round_steps,
                  refill=round_steps is None, arrival=arrival + compile_s, compile_s=compile_s,
                  stochastic=stochastic)
  # The callback is live (its sink id valid) for as long as this call decodes, and no longer,
  # however the caller stops iterating.
  with stream_sink(stream) as sink_id:
    sink = engine.put(np.int32(sink_id))
    while run.queue or run.live:
      run.admit()
      run.make_room()
      if run.live:
        yield from _report([g for _, g in run.decode_round(sink)], progress)


def _settings(r: Request, mode: str) -> dict:
  """The request's settings a Generation carries (as given: the CLIs print them back)."""
  return dict(mode=mode, confidence=r.confidence, max_group=r.max_group, seed=r.seed,
              sampling=r.sampling, draft_confidence=r.draft_confidence)


def _failed(r: Request, mode: str, error: str, arrival: float) -> Generation:
  return Generation([], "", [], 0, 0, 0, 0.0, 0.0, id=r.id, error=error,
                    latency_s=time.perf_counter() - arrival, **_settings(r, mode))


def _report(results: list[Generation], progress) -> Iterator[Generation]:
  for g in results:
    if progress is not None:
      progress(g)
    yield g
