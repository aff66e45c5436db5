"""The generation engine: jitted per-request prefill into a paged KV pool, and one jitted
`lax.while_loop` decode over a fixed number of slots, for the base model and for HAMburger.
HAMburger is the base loop with a different step: each macro step emits a group of 1..K tokens
(micro steps) and writes ONE KV entry for it.

Slots advance independently: per-slot KV block tables and lengths, RoPE positions, emission
counts, done flags, max_new_tokens, confidence and sampling settings. All buffers are
static-shaped, so the same program runs on CPU, GPU and TPU. The host side (which request goes
to which slot, when, with which blocks) is `hamburger_jax/decode/serving.py`; `generate` is
serving with one slot per prompt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Callable, Iterable, Sequence

import flax.struct
import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from hamburger_jax import sharding
from hamburger_jax.config import DEFAULT_CONFIDENCE, DEFAULT_PREFIX_CACHE_TOKENS
from hamburger_jax.decode import serving
from hamburger_jax.decode.paged_kv import PagedKVCache, blocks_for
from hamburger_jax.decode.prefix_cache import CachedPrefix, PrefixCache, cacheable_prefix
from hamburger_jax.decode.requests import Generation, GenerationError, Request
from hamburger_jax.decode.sampling import SamplingParams, sample_rows
from hamburger_jax.model.hamburger import Hamburger, continues
from hamburger_jax.model.llama import Llama

StreamCallback = Callable[[np.ndarray, np.ndarray], None]  # (group [B, K], count [B])

# Prompts are prefilled in chunks, each padded to one of these sizes (one program per size).
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)
# What one prefill chunk costs beyond its tokens, in token-equivalents: a chunk reads every weight
# once (SmolLM2-135M on 2 CPU cores: ~30 tokens' worth of compute). prefill_chunks weighs it
# against padding: a 130-token prompt runs as 128 + 16 rather than padded to 256.
PREFILL_CHUNK_COST = 32
# Static sizes of the decode program: max_new_tokens in powers of two, and each slot's view of
# the KV pool (longest prompt + max_new_tokens) rounded up to a multiple of VIEW_STEP entries;
# decode programs read views of VIEW_STEP x 2^i entries of it (Engine.views).
LENGTH_BUCKETS = tuple(2 ** i for i in range(4, 18))
VIEW_STEP = 128
DEFAULT_BLOCK_SIZE = 16
# A macro step whose continuing rows fit in slots / MICRO_BATCH_DIVISOR runs its micro steps on
# those rows only (micro_batch_sizes).
MICRO_BATCH_DIVISOR = 4


@flax.struct.dataclass
class DecodeState:
  cache: PagedKVCache
  features: jax.Array  # [B, F, D] base features at each slot's predicting position (base: F=1)
  prompt_len: jax.Array  # [B]
  tokens: jax.Array  # [B, N + K] emitted tokens
  n_tokens: jax.Array  # [B]
  groups: jax.Array  # [B, N] tokens emitted by each macro step
  n_steps: jax.Array  # [B]
  done: jax.Array  # [B] bool; empty slots are done
  max_new: jax.Array  # [B] the slot's own max_new_tokens (<= N)
  confidence: jax.Array  # [B] continue a group while P(continue) >= confidence
  max_group: jax.Array  # [B] the most tokens one macro step of the slot may emit (<= K)
  temperature: jax.Array  # [B] 0 = greedy
  top_k: jax.Array  # [B] 0 = off
  top_p: jax.Array  # [B] 1 = off
  key: jax.Array  # [B] the slot's request key; token keys fold in the step and micro index


@dataclasses.dataclass(frozen=True)
class Layout:
  """The static shapes of one set of programs (what compiling depends on)."""
  mode: str
  slots: int  # B
  max_new: int  # N
  blocks_per_row: int  # MB: a slot's view of the pool is MB x block_size entries
  num_blocks: int  # NB, the trash block included
  block_size: int


def bucket(n: int, buckets: Sequence[int]) -> int:
  for b in buckets:
    if n <= b:
      return b
  raise GenerationError(f"{n} exceeds the largest bucket {buckets[-1]}")


def prefill_chunks(n: int, start: int = 0) -> list[tuple[int, int, int]]:
  """(start, valid tokens, bucket) of each prefill chunk of n prompt tokens from `start`: the
  chunk sizes with the least padded tokens + PREFILL_CHUNK_COST per chunk, largest first."""
  sizes = _chunk_sizes(n, PREFILL_BUCKETS, PREFILL_CHUNK_COST)
  out, end = [], start + n
  for size in sizes:
    valid = min(size, end - start)
    out.append((start, valid, size))
    start += valid
  return out


@functools.lru_cache(maxsize=4096)
def _chunk_sizes(n: int, buckets: tuple[int, ...], chunk_cost: int) -> tuple[int, ...]:
  best = [(0, ())] + [None] * n  # best[r]: (cost, sizes) for the first r tokens
  for r in range(1, n + 1):
    best[r] = min((best[max(r - b, 0)][0] + b + chunk_cost, best[max(r - b, 0)][1] + (b,))
                  for b in buckets)
  return tuple(sorted(best[n][1], reverse=True))


def generate_slots(n: int) -> int:
  """`generate`'s slots for n prompts: a power of two (the spare slots stay empty), so batches of
  similar size share their compiled programs."""
  return 1 << (n - 1).bit_length()


def micro_batch_sizes(slots: int) -> tuple[int, ...]:
  """The micro batches (below `slots`) a macro step may gather its continuing rows into: one
  row, and a quarter of the slots. Each is one more traced copy of the micro steps; the LM head
  they run costs less for fewer rows (SmolLM2 on 2 CPU cores: 1 row ~3 ms, 4 rows ~8 ms, 16 rows
  ~17 ms), which is what a macro step pays when only a few rows continue."""
  return tuple(sorted({n for n in (1, slots // MICRO_BATCH_DIVISOR) if 1 <= n < slots}))


def micro_branch(n_continuing: jax.Array, slots: int) -> jax.Array:
  """Which micro batch a macro step runs: 0 none (no row continues), i the i-th of
  micro_batch_sizes(slots) (the smallest that holds the continuing rows), last every slot."""
  sizes = jnp.asarray((*micro_batch_sizes(slots), slots), jnp.int32)
  return jnp.where(n_continuing == 0, 0, 1 + jnp.searchsorted(sizes, n_continuing))


def base_of(model: Llama | Hamburger) -> Llama:
  return model.base if isinstance(model, Hamburger) else model


class Engine:
  """Generation and serving for a `Llama` (mode "base") or a `Hamburger` (mode "hamburger" or
  "base").

  Mode "base" on a Hamburger model decodes with its base weights only (base adapters never act),
  so the two modes of one engine compare the same base in the same code. `mesh`: decode under
  a device mesh, weights placed by the inference rules (tensor axis; `sharding.INFER_RULES`).

  Users call `requests`, `compile`, `generate` and `serve`.

  Contract: a host-side scheduler (serving.py, or another) drives the device through these
  public members alone, so that they can change inside without breaking it:
    layout(mode, slots, max_new, longest_prompt, kv_blocks=None) -> Layout (static shapes)
    init_state(layout) -> DecodeState, every slot empty (done), on the engine's devices
    compile_programs(layout, prompt_ids, stochastic, stream=False) -> seconds compiling
    prefill(layout, state, request, slot) -> DecodeState, a checked request live in `slot`
    decode_program(layout, stochastic, stream, view)
        -> fn(params, state, refill, limit, sink) -> DecodeState (macro steps, then back)
    views(layout) -> [blocks], view_for(layout, blocks) -> the smallest view that holds them
    put(tree) -> the tree on the engine's devices
    encode_prompt(prompt) -> token ids; check_mode(mode) -> "base" | "hamburger"
    params (what the programs take), prefix_cache (its hits and tokens_reused count up),
    tokenizer, max_group, max_seq_len, base_cfg, block_size
  Nothing one call does stays on the engine but compiled programs and the prefix cache: a
  serve call's stats and stream callback belong to that call (serving.ServeRun,
  serving.stream_sink), so calls never see each other's.
  """

  def __init__(self, model: Llama | Hamburger, tokenizer: Any = None, *,
               max_seq_len: int | None = None, stop_ids: Sequence[int] | None = None,
               block_size: int = DEFAULT_BLOCK_SIZE, mesh: jax.sharding.Mesh | None = None,
               prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
               turn_end_ids: Sequence[int] | None = None):
    self.tokenizer = tokenizer
    base = base_of(model)
    self.base_cfg = base.cfg
    self.max_seq_len = max_seq_len or base.cfg.max_position_embeddings
    if stop_ids is None:
      stop_ids = tokenizer.stop_ids if tokenizer is not None else ()
    self.stop_ids = tuple(int(i) for i in stop_ids)
    # What ends a turn in a prompt (prefix caching), also where generation ignores it (benches
    # that decode every request to its max_new_tokens pass stop_ids=()).
    if turn_end_ids is None:
      turn_end_ids = tokenizer.stop_ids if tokenizer is not None else self.stop_ids
    self.turn_end_ids = tuple(int(i) for i in turn_end_ids)
    if block_size < 1:
      raise GenerationError(f"block_size={block_size} must be >= 1")
    self.block_size = block_size
    self.mesh = mesh
    try:
      self.prefix_cache = PrefixCache(prefix_cache_tokens)
    except ValueError as e:
      raise GenerationError(str(e)) from None
    self.set_model(model)
    # Compiled programs by (kind, layout, ...): compiled ahead of time so timings never include
    # compilation and reuse is observable.
    self.programs: dict[tuple, Any] = {}

  # ------------------------------------------------------------------ traced pieces

  def _features(self, model, mode: str, x_btd, positions_bt, cache, slots_bt, merged_bt=None):
    mask = cache.mask(slots_bt)
    if mode == "hamburger":
      return model.base_features(x_btd, positions_bt, mask, cache, slots_bt, merged_bt)
    out = base_of(model).forward(x_btd, positions_bt, mask, cache, slots_bt)
    return out.hidden[:, :, None, :], out.cache

  def init_state(self, layout: Layout) -> DecodeState:
    """A decode state of `layout`'s shapes with every slot empty (done) and every block-table
    entry the trash block, placed by `put`: what `prefill` and the decode programs take."""
    cfg = self.base_cfg
    b, n = layout.slots, layout.max_new
    k = self.model.max_group if layout.mode == "hamburger" else 1
    f = self.model.num_features if layout.mode == "hamburger" else 1
    cache = PagedKVCache.init(cfg.num_layers, layout.num_blocks, layout.block_size, b,
                              layout.blocks_per_row, cfg.num_kv_heads, cfg.head_dim,
                              jnp.dtype(cfg.dtype))
    zeros = lambda *s, dt=jnp.int32: jnp.zeros(s, dt)
    return self.put(DecodeState(
        cache=cache, features=zeros(b, f, cfg.hidden_size, dt=jnp.dtype(cfg.dtype)),
        prompt_len=zeros(b), tokens=zeros(b, n + k), n_tokens=zeros(b), groups=zeros(b, n),
        n_steps=zeros(b), done=jnp.ones((b,), bool), max_new=zeros(b),
        confidence=jnp.ones((b,), jnp.float32), max_group=jnp.full((b,), k, jnp.int32),
        temperature=zeros(b, dt=jnp.float32),
        top_k=zeros(b), top_p=jnp.ones((b,), jnp.float32),
        key=jax.random.split(jax.random.key(0), b)))

  def put(self, tree):
    """Host values onto the engine's devices: replicated over the mesh, if there is one (the
    decode state is small next to the weights, which the mesh splits)."""
    if self.mesh is None:
      return jax.tree.map(jnp.asarray, tree)
    return jax.device_put(tree, NamedSharding(self.mesh, P()))

  def _abstract_state(self, layout: Layout):
    state = jax.eval_shape(lambda: self.init_state(layout))
    if self.mesh is None:
      return state
    rep = NamedSharding(self.mesh, P())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state)

  def _jit(self, fn, **kw):
    if self.mesh is not None:  # the state stays replicated from one program to the next
      kw["out_shardings"] = NamedSharding(self.mesh, P())
    return jax.jit(fn, donate_argnames=("state",), **kw)

  def _prefill_impl(self, params, state: DecodeState, ids_c, start, n_valid, slot, last,
                    request: dict[str, jax.Array], *, mode: str) -> DecodeState:
    """Writes one prompt chunk's KV entries into `slot`'s blocks; the last chunk also takes the
    slot's predicting features and the request's settings (the slot goes live)."""
    model = nnx.merge(self.graphdef, params)
    cache = state.cache
    row = cache.replace(table=cache.table[slot][None], length=cache.length[slot][None])
    slots = (start + jnp.arange(ids_c.shape[0]))[None]
    feats, row = self._features(model, mode, base_of(model).embed(ids_c[None]), slots, row, slots)
    state = state.replace(cache=cache.replace(k=row.k, v=row.v))

    def insert(state: DecodeState) -> DecodeState:
      at = lambda x, v: x.at[slot].set(v)
      zero = lambda x: x.at[slot].set(jnp.zeros_like(x[slot]))
      prompt_len = start + n_valid
      return state.replace(
          cache=state.cache.replace(length=at(state.cache.length, prompt_len)),
          features=at(state.features, feats[0, n_valid - 1]),
          prompt_len=at(state.prompt_len, prompt_len), tokens=zero(state.tokens),
          n_tokens=zero(state.n_tokens), groups=zero(state.groups), n_steps=zero(state.n_steps),
          done=at(state.done, False), **{k: at(getattr(state, k), v) for k, v in request.items()})

    # The pool stays out of the cond, which would copy it (see _decode_impl).
    k, v = state.cache.k, state.cache.v
    small = state.replace(cache=state.cache.replace(k=None, v=None))
    small = jax.lax.cond(last, insert, lambda s: s, small)
    return small.replace(cache=small.cache.replace(k=k, v=v))

  def _sample(self, logits_bv, state: DecodeState, micro: int, stochastic: bool) -> jax.Array:
    # A token's key depends only on its request, macro step and micro index: never on the slot,
    # the batch mates or when the request arrived.
    keys = jax.vmap(lambda k, s: jax.random.fold_in(jax.random.fold_in(k, s), micro))(
        state.key, state.n_steps)
    return sample_rows(logits_bv, keys, state.temperature, state.top_k, state.top_p,
                       stochastic=stochastic)

  def _propose(self, model, mode: str, state: DecodeState, stochastic: bool):
    """One macro step's group: tokens [B, K'] and how many of them each row emits [B]."""
    base = base_of(model)
    remaining = state.max_new - state.n_tokens
    stop_ids = jnp.asarray(self.stop_ids, jnp.int32)
    h0 = state.features[:, -1]  # skip connection: token 0 is the base's own prediction
    t0 = self._sample(base.logits(h0), state, 0, stochastic)
    count = jnp.where(state.done, 0, 1).astype(jnp.int32)
    if mode != "hamburger" or model.max_group == 1:
      return t0[:, None], count
    k = model.max_group
    b = t0.shape[0]
    tokens = jnp.zeros((b, k), jnp.int32).at[:, 0].set(t0)
    cont = (~state.done & continues(model.stop_logits(h0), state.confidence)
            & ~jnp.isin(t0, stop_ids) & (remaining > 1) & (state.max_group > 1))

    rows_state = state.replace(cache=None)  # the per-row fields (never the KV pool)

    def micro_loop(rs: DecodeState, tokens, count, cont):
      """Micro steps 1..K-1 for the rows of `rs` (a slice of the state's rows)."""
      left = rs.max_new - rs.n_tokens

      def micro_step(i, x_btd, cache, tokens, count, cont):
        """Runs inputs ending with e(t_{i-1}) and emits t_i where `cont`."""
        h, cache = model.micro_step(i, x_btd, cache)
        ti = model.micro_token(self._sample(model.micro_logits(h), rs, i, stochastic))
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, jnp.where(cont, ti, 0)[:, None], i,
                                                     1)
        count = count + cont
        cont = cont & continues(model.stop_logits(h), rs.confidence) & ~jnp.isin(
            ti, stop_ids) & (left > i + 1) & (rs.max_group > i + 1)
        return cache, tokens, count, cont

      # Micro step 1 reads the F features and e(t0) in one pass (one read of the weights).
      x = jnp.concatenate([rs.features, base.embed(tokens[:, :1])], axis=1)
      carry = (jnp.int32(2), *micro_step(1, x, model.micro_cache(tokens.shape[0]), tokens, count,
                                         cont))

      def body(carry):
        i, cache, tokens, count, cont = carry
        x = base.embed(jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1))
        return (i + 1, *micro_step(i, x, cache, tokens, count, cont))

      _, _, tokens, count, _ = jax.lax.while_loop(
          lambda c: (c[0] < k) & jnp.any(c[4]), body, carry)
      return tokens, count

    def full(operands):
      return micro_loop(rows_state, *operands)

    def compact(size: int):
      def run(operands):
        """Only the rows that continue, gathered into a micro batch of `size` rows: a micro
        step's LM head then reads `size` rows, not every slot (padding rows emit nothing)."""
        tokens, count, cont = operands
        idx = jnp.nonzero(cont, size=size, fill_value=b)[0]  # b: a padding row
        take = lambda x: x[jnp.minimum(idx, b - 1)]
        sub_tokens, sub_count = micro_loop(jax.tree.map(take, rows_state), take(tokens),
                                           take(count), idx < b)
        return (tokens.at[idx].set(sub_tokens, mode="drop"),
                count.at[idx].set(sub_count, mode="drop"))
      return run

    # Rows whose stop head fired after token 0 need no micro decoder work at all; when few rows
    # go on, the smallest micro batch that holds them runs the micro steps.
    return jax.lax.switch(micro_branch(jnp.sum(cont), b),
                          [lambda o: o[:2], *(compact(n) for n in micro_batch_sizes(b)), full],
                          (tokens, count, cont))

  def _decode_impl(self, params, state: DecodeState, refill, limit, sink, *, mode: str,
                   stochastic: bool, stream: bool, view: int) -> DecodeState:
    """Macro steps until every slot is done, or (with `refill`) a slot finishes so the host can
    give it the next request, or a live slot's blocks are full so the host can add one, or
    `limit` macro steps have run.

    Attention reads the first `view` blocks of each slot's table (the host picks a view that
    holds every live slot's blocks): its cost follows the live lengths, not the layout's.
    `sink`: with `stream`, each macro step goes to serving.deliver_step with it."""
    full_table = state.cache.table
    state = state.replace(cache=state.cache.replace(table=full_table[:, :view]))
    model = nnx.merge(self.graphdef, params)
    base = base_of(model)
    offset = model.cfg.graft.position_offset if mode == "hamburger" else 0
    n_max = state.groups.shape[1]
    rows = jnp.arange(state.done.shape[0])[:, None]
    stop_ids = jnp.asarray(self.stop_ids, jnp.int32)
    done_at_start = state.done

    def body(carry):
      step, state = carry
      group, count = self._propose(model, mode, state, stochastic)
      k = group.shape[1]
      emitted = jnp.arange(k)[None, :] < count[:, None]
      idx = jnp.where(emitted, state.n_tokens[:, None] + jnp.arange(k)[None, :], n_max + k)
      tokens = state.tokens.at[rows, idx].set(group, mode="drop")
      gidx = jnp.where(count > 0, state.n_steps, n_max)[:, None]
      groups = state.groups.at[rows, gidx].set(count[:, None], mode="drop")
      n_tokens = state.n_tokens + count
      done = state.done | jnp.any(emitted & jnp.isin(group, stop_ids), axis=1) | (
          n_tokens >= state.max_new)
      if stream:
        jax.experimental.io_callback(serving.deliver_step, None, sink, group, count,
                                     ordered=True)
      state = state.replace(tokens=tokens, groups=groups, n_tokens=n_tokens,
                            n_steps=state.n_steps + (count > 0), done=done)

      def advance(state: DecodeState) -> DecodeState:
        # The emitted group becomes ONE base input at the position of its last token.
        if mode == "hamburger":
          x = model.smash(group, jnp.maximum(count, 1))
        else:
          x = base.embed(group[:, 0])
        pos = state.prompt_len - 1 + state.n_tokens + offset
        slot = state.cache.length
        # Base adapters act only on a merged entry (a group of >= 2 tokens): after a single
        # token the base runs its exact weights, so confidence 1.0 is the base, token for token.
        merged = (count >= 2)[:, None] if mode == "hamburger" else None
        feats, cache = self._features(model, mode, x[:, None], pos[:, None], state.cache,
                                      slot[:, None], merged)
        cache = cache.replace(length=cache.length + (~state.done).astype(jnp.int32))
        return state.replace(cache=cache, features=feats[:, 0])

      # Unconditional: a cond here would copy the whole KV pool every step (XLA cannot update a
      # buffer in place through a conditional). When every slot is done this one forward is
      # wasted (done slots write only their own unused entries or the trash block), and the
      # loop ends.
      return step + 1, advance(state)

    def cond(carry):
      step, state = carry
      finished = jnp.any(state.done & ~done_at_start)
      full = jnp.any(~state.done & (state.cache.length >= state.cache.capacity()))
      return (step < jnp.minimum(n_max, limit)) & ~jnp.all(state.done) & ~(
          refill & finished) & ~full

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state.replace(cache=state.cache.replace(table=full_table))

  # ------------------------------------------------------------------ programs

  def layout(self, mode: str, slots: int, max_new: int, longest_prompt: int,
             kv_blocks: int | None = None) -> Layout:
    """The static shapes for requests up to `longest_prompt` + `max_new` tokens. Without
    `kv_blocks` the pool holds every slot's view (nothing ever waits for blocks)."""
    n = bucket(max_new, LENGTH_BUCKETS)
    # Attention reads a slot's whole view every step: keep it tight (a multiple of VIEW_STEP).
    view = -(-(longest_prompt + n + 1) // VIEW_STEP) * VIEW_STEP
    mb = blocks_for(view, self.block_size)
    nb = kv_blocks if kv_blocks is not None else slots * mb + 1
    return Layout(mode, slots, n, mb, nb, self.block_size)

  def _prefill_program(self, layout: Layout, chunk: int):
    key = ("prefill", layout, chunk)
    if key not in self.programs:
      state = self._abstract_state(layout)
      i32 = jax.ShapeDtypeStruct((), jnp.int32)
      request = {k: jax.ShapeDtypeStruct((), getattr(state, k).dtype)
                 for k in ("max_new", "confidence", "max_group", "temperature", "top_k",
                           "top_p")}
      request["key"] = jax.eval_shape(lambda: jax.random.key(0))
      fn = self._jit(self._prefill_impl, static_argnames=("mode",))
      self.programs[key] = fn.lower(
          self.params, state, jax.ShapeDtypeStruct((chunk,), jnp.int32), i32, i32, i32,
          jax.ShapeDtypeStruct((), bool), request, mode=layout.mode).compile()
    return self.programs[key]

  def _prefix_programs(self, layout: Layout, size: int):
    """(read, write) of a `size`-entry prefix of one slot (prefix caching)."""
    key = ("prefix", layout, size)
    if key not in self.programs:
      state = self._abstract_state(layout)
      i32 = jax.ShapeDtypeStruct((), jnp.int32)
      cache = state.cache
      kv = jax.ShapeDtypeStruct((cache.k.shape[0], size, *cache.k.shape[3:]), cache.k.dtype)
      # Not self._jit: reading must not donate the state, which goes on decoding.
      read = jax.jit(lambda state, slot: state.cache.read_row(slot, size), **(
          {} if self.mesh is None else {"out_shardings": NamedSharding(self.mesh, P())}))
      write = self._jit(lambda state, slot, k, v, n: state.replace(
          cache=state.cache.write_row(slot, k, v, n)))
      self.programs[key] = (read.lower(state, i32).compile(),
                            write.lower(state, i32, kv, kv, i32).compile())
    return self.programs[key]

  def prompt_plan(self, ids: Sequence[int]) -> tuple[int, list[tuple[int, int, int]]]:
    """(cacheable prefix length, prefill chunks) of a prompt: with prefix caching on, the
    prefix's chunks come first and end at its last token, whether it is cached or not."""
    p0 = cacheable_prefix(ids, self.turn_end_ids) if self.prefix_cache.enabled else 0
    return p0, (prefill_chunks(p0) if p0 else []) + prefill_chunks(len(ids) - p0, p0)

  def decode_program(self, layout: Layout, stochastic: bool, stream: bool, view: int):
    """The compiled decode loop (compiled on first use): `fn(params, state, refill, limit, sink)
    -> state`, taking `params`, a DecodeState of `layout` (donated), and scalars put on the
    engine's devices: `refill` (bool: return when a slot finishes), `limit` (int32: the most
    macro steps) and `sink` (int32: the stream sink of serving.stream_sink; 0 for none).
    `stochastic`: sample the slots with temperature > 0 (False: every slot greedy). `stream`:
    report each macro step's (group [B, K], count [B]) to the sink's callback. `view`: the
    blocks of each slot's table that attention reads (one of `views(layout)`)."""
    key = ("decode", layout, stochastic, stream, view)
    if key not in self.programs:
      state = self._abstract_state(layout)
      fn = self._jit(self._decode_impl, static_argnames=("mode", "stochastic", "stream", "view"))
      i32 = jax.ShapeDtypeStruct((), jnp.int32)
      self.programs[key] = fn.lower(self.params, state, jax.ShapeDtypeStruct((), bool), i32, i32,
                                    mode=layout.mode, stochastic=stochastic, stream=stream,
                                    view=view).compile()
    return self.programs[key]

  def views(self, layout: Layout) -> list[int]:
    """The decode programs' views of a slot's table, in blocks: VIEW_STEP entries times a power
    of two, up to the layout's whole row."""
    step = blocks_for(VIEW_STEP, layout.block_size)
    out = [min(step, layout.blocks_per_row)]
    while out[-1] < layout.blocks_per_row:
      out.append(min(out[-1] * 2, layout.blocks_per_row))
    return out

  def view_for(self, layout: Layout, blocks: int) -> int:
    """The smallest view that holds `blocks` blocks of every live slot."""
    return next(v for v in self.views(layout) if v >= blocks)

  def prefill(self, layout: Layout, state: DecodeState, r: Request, slot: int) -> DecodeState:
    """Prefills request `r` (checked: its `ids` set) into `slot` (its blocks already in the
    state's table), chunk by chunk; the slot then decodes with the request's settings."""
    request = self.put({
        "max_new": np.int32(r.max_new_tokens), "confidence": np.float32(r.confidence),
        "max_group": np.int32(r.max_group or self.max_group or 1),
        "temperature": np.float32(r.sampling.temperature), "top_k": np.int32(r.sampling.top_k),
        "top_p": np.float32(r.sampling.top_p), "key": r.key()})
    p0, chunks = self.prompt_plan(r.ids)
    prefix = self.prefix_cache.get(layout.mode, r.ids[:p0]) if p0 else None
    read, write = self._prefix_programs(layout, bucket(p0, LENGTH_BUCKETS)) if p0 else (None,) * 2
    if prefix is not None:
      state = write(state, self.put(np.int32(slot)), prefix.k, prefix.v, self.put(np.int32(p0)))
    for j, (start, valid, size) in enumerate(chunks):
      if start < p0 and prefix is not None:
        continue
      ids = np.zeros((size,), np.int32)
      ids[:valid] = r.ids[start:start + valid]
      args = self.put((ids, np.int32(start), np.int32(valid), np.int32(slot),
                       np.bool_(j == len(chunks) - 1)))
      state = self._prefill_program(layout, size)(self.params, state, *args, request)
      if start + valid == p0:  # a miss: the prefix's entries are all written now
        k, v = read(state, self.put(np.int32(slot)))
        self.prefix_cache.put(layout.mode, r.ids[:p0], CachedPrefix(k, v, p0))
    return state

  def compile_programs(self, layout: Layout, prompts: Iterable[Sequence[int]], stochastic: bool,
                       stream: bool = False) -> float:
    """Compiles what serving these prompts (token ids) in `layout` runs; returns the seconds
    spent (0 when all were compiled already; a load from JAX's persistent compilation cache
    counts as compiling)."""
    t = time.perf_counter()
    before = len(self.programs)
    plans = [self.prompt_plan(ids) for ids in prompts]
    for chunk in sorted({c for _, chunks in plans for _, _, c in chunks}):
      self._prefill_program(layout, chunk)
    for size in sorted({bucket(p0, LENGTH_BUCKETS) for p0, _ in plans if p0}):
      self._prefix_programs(layout, size)
    for view in self.views(layout):
      self.decode_program(layout, stochastic, stream, view)
    return time.perf_counter() - t if len(self.programs) > before else 0.0

  @property
  def max_group(self) -> int | None:
    """The most tokens a macro step can emit: the HAMburger model's K (None for a base model,
    whose steps emit one token whatever a request's cap)."""
    return self.model.max_group if isinstance(self.model, Hamburger) else None

  @property
  def compilations(self) -> int:
    return len(self.programs)

  # ------------------------------------------------------------------ host side

  def encode_prompt(self, prompt) -> list[int]:
    """str -> chat-templated user turn; list of messages -> chat template; list of ints -> as is."""
    if isinstance(prompt, str):
      if not prompt.strip():
        raise GenerationError("empty prompt: give at least one non-blank character")
      prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, dict) or not hasattr(prompt, "__len__"):
      raise GenerationError(f"a prompt is a string, a list of chat messages or a list of token "
                            f"ids; got {type(prompt).__name__}")
    if len(prompt) and isinstance(prompt[0], dict):
      if self.tokenizer is None:
        raise GenerationError("text prompts need a tokenizer; pass token ids or a tokenizer")
      return list(self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                     tokenize=True))
    if not len(prompt):
      raise GenerationError("empty prompt: give at least one token")
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in prompt):
      raise GenerationError("a token-id prompt must hold integers only")
    ids = [int(i) for i in prompt]
    vocab = self.base_cfg.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
      raise GenerationError(f"prompt token ids must be in [0, {vocab}); got {min(ids)}..{max(ids)}")
    return ids

  def check_mode(self, mode: str | None) -> str:
    mode = mode or ("hamburger" if isinstance(self.model, Hamburger) else "base")
    if mode not in ("base", "hamburger"):
      raise GenerationError(f"mode={mode!r}: use 'base' or 'hamburger'")
    if mode == "hamburger" and not isinstance(self.model, Hamburger):
      raise GenerationError("mode 'hamburger' needs a HAMburger model (load a checkpoint)")
    return mode

  def serve(self, requests: Iterable, *, slots: int = 8, kv_blocks: int | None = None,
            mode: str | None = None, max_new_bound: int | None = None,
            round_steps: int | None = None,
            progress: Callable[[Generation], None] | None = None,
            stream: StreamCallback | None = None) -> serving.ServeRun:
    """Continuous batching (see serving.serve): returns a ServeRun that yields each request's
    result as it finishes; its `stats` are this call's. `stream(group, count)`: called once per
    macro step, in order, with numpy arrays [slots, K] and [slots] (count 0: an empty or
    finished slot)."""
    return serving.serve(self, requests, slots=slots, kv_blocks=kv_blocks, mode=mode,
                         max_new_bound=max_new_bound, round_steps=round_steps,
                         progress=progress, stream=stream)

  def requests(self, prompts: Sequence, *, max_new_tokens: int = 128,
               sampling: SamplingParams = SamplingParams(),
               confidence: float | Sequence[float] = DEFAULT_CONFIDENCE, seed: int = 0,
               max_group: int | None = None) -> list[Request]:
    """Checked requests for `prompts` (texts, message lists or token-id lists), with ids 0..n-1
    and one confidence for all or one per prompt. Each prompt is encoded here, once: `compile`,
    `generate` and `serve` take these requests and use their ids as they are. Raises
    GenerationError on the first bad prompt or setting."""
    reqs = self._batch(prompts, max_new_tokens, sampling, confidence, seed, max_group)
    for r in reqs:
      r.check(self)
    return reqs

  def _batch(self, prompts: Sequence, max_new_tokens: int, sampling: SamplingParams,
             confidence: float | Sequence[float], seed: int,
             max_group: int | None) -> list[Request]:
    """A Request per item, unchecked: items that are Requests already are kept as they are
    (their own settings); the others take these settings and their index as id."""
    if isinstance(prompts, (str, dict)) or not len(prompts):
      raise GenerationError("prompts must be a non-empty list (wrap a single prompt in a list)")
    conf = np.asarray(confidence, np.float64)
    if conf.ndim and conf.shape != (len(prompts),):
      raise GenerationError(f"confidence has {conf.size} values for {len(prompts)} prompts: give "
                            "one value, or one per prompt")
    conf = np.broadcast_to(conf, (len(prompts),))
    return [p if isinstance(p, Request) else Request(
        p, max_new_tokens=max_new_tokens, confidence=float(c), sampling=sampling, seed=seed, id=i,
        max_group=max_group) for i, (p, c) in enumerate(zip(prompts, conf))]

  def compile(self, prompts: Sequence, *, max_new_tokens: int = 128, mode: str | None = None,
              sampling: SamplingParams = SamplingParams(), stream: bool = False) -> float:
    """Compiles the programs that `generate` with these arguments runs (confidence and seed do
    not change them), so that a caller can time compilation apart from generation. Returns the
    seconds spent: 0 when they were compiled already. `prompts` as for `generate`: Requests from
    `requests` are not encoded again (raw prompts are, here and again in `generate`)."""
    mode = self.check_mode(mode)
    reqs = []
    for r in self._batch(prompts, max_new_tokens, sampling, DEFAULT_CONFIDENCE, 0, None):
      r = dataclasses.replace(r)  # the caller's requests stay as they are
      r.check(self)
      reqs.append(r)
    layout = self.layout(mode, generate_slots(len(reqs)), max(r.max_new_tokens for r in reqs),
                         max(len(r.ids) for r in reqs))
    return self.compile_programs(layout, [r.ids for r in reqs],
                                 any(not r.sampling.greedy for r in reqs), stream)

  def generate(self, prompts: Sequence, *, max_new_tokens: int = 128, mode: str | None = None,
               sampling: SamplingParams = SamplingParams(),
               confidence: float | Sequence[float] = DEFAULT_CONFIDENCE, seed: int = 0,
               stream: StreamCallback | None = None,
               max_group: int | None = None) -> list[Generation]:
    """Generates for a batch of prompts (texts, message lists or token-id lists) or Requests
    (from `requests`: encoded once there; each carries its own settings, which the arguments
    here do not change): one slot per prompt, results in prompt order. Raises GenerationError on
    any bad prompt or setting. `max_group`: the most tokens a macro step may emit (None: the
    model's K). `stream`: as for `serve`."""
    mode = self.check_mode(mode)
    # serve checks each request; it reports the bad ones before any work, so the first error
    # stops the batch before anything compiles.
    reqs = self._batch(prompts, max_new_tokens, sampling, confidence, seed, max_group)
    # Results come back by id; serve gives an id-less request its index.
    ids = [i if r.id is None else r.id for i, r in enumerate(reqs)]
    try:
      order = {rid: i for i, rid in enumerate(ids)}
    except TypeError:
      order = {}
    if len(order) != len(reqs):
      raise GenerationError("generate needs a distinct, hashable id on each Request")
    out: list[Generation | None] = [None] * len(reqs)
    run = serving.serve(self, reqs, slots=generate_slots(len(reqs)), mode=mode, stream=stream)
    with contextlib.closing(run):  # an error ends the run at once (its stream sink too)
      for g in run:
        if g.error:
          raise GenerationError(g.error)
        out[order[g.id]] = g
    return out

  def set_model(self, model: Llama | Hamburger) -> None:
    """Takes new weights; compiled programs are kept when the architecture is the same.

    Base adapters stay unfolded: they act per row, only on macro steps whose input is a merged
    entry, so mode "base" (which never marks an input merged) is the base model, exactly.
    """
    graphdef, params = nnx.split(model)
    if getattr(self, "graphdef", graphdef) != graphdef:
      raise GenerationError("set_model needs a model of the same architecture as the engine's")
    if self.mesh is not None:
      params = jax.device_put(params, sharding.state_shardings(params, self.mesh,
                                                               sharding.INFER_RULES))
    self.model = model
    self.graphdef, self.params = graphdef, params
    self.prefix_cache.clear()  # its entries were computed with the old weights
