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
import copy
import dataclasses
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from hamburger_jax import precision, sharding
from hamburger_jax.config import DEFAULT_CONFIDENCE, DEFAULT_PREFIX_CACHE_TOKENS
from hamburger_jax.decode import micro_rule as micro_rules, serving, shapes
from hamburger_jax.decode.prefix_cache import CachedPrefix, PrefixCache, cacheable_prefix
from hamburger_jax.decode.requests import Generation, GenerationError, Request
from hamburger_jax.decode.runner import decode_runner
from hamburger_jax.decode import step as decode_step
from hamburger_jax.decode.sampling import SamplingParams
from hamburger_jax.decode.shapes import (DEFAULT_BLOCK_SIZE, LENGTH_BUCKETS, Layout, bucket,
                                         generate_slots, prefill_chunks)
from hamburger_jax.decode.step import DecodeState, StepVariant, base_of
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import Llama

StreamCallback = Callable[[np.ndarray, np.ndarray], None]  # (group [B, K], count [B])


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
    compile_for(layout, longest_prompt, stochastic, stream=False) -> the same, for any prompt
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
               turn_end_ids: Sequence[int] | None = None, fused: bool | None = None,
               dtype: str | None = None, variant: StepVariant = StepVariant(),
               matmul_precision: str = precision.DEFAULT_PRECISION,
               micro_rule: str | float = micro_rules.DEFAULT_MICRO_RULE):
    """`fused`, `dtype`: the decoding layout (model/decode_layout.py; None: the backend's
    default, precision.decode_defaults). `variant`: what each macro step computes
    (decode/step.py; the default is HAMburger as specified). `matmul_precision`: of float32
    matmuls (hamburger_jax/precision.py: "highest" for the same greedy tokens on any
    backend). `micro_rule`: when a batch's next micro step runs (decode/micro_rule.py: "off",
    "auto" or a cost ratio; with "off", a row's tokens do not depend on its batch mates)."""
    self.tokenizer = tokenizer
    platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    defaults = precision.decode_defaults(platform)
    self.fused = defaults["fused"] if fused is None else fused
    self.dtype = defaults["dtype"] if dtype is None else dtype
    self.variant = variant
    self.precision = precision.check(matmul_precision)
    self.micro_rule = micro_rules.parse(micro_rule)
    # DecodeState.micro_cost by (rule, slots): "auto" measures once per slot count.
    self._micro_costs: dict[tuple, np.ndarray] = {}
    self.max_seq_len = max_seq_len or base_of(model).cfg.max_position_embeddings
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

  def _empty_state(self, layout: Layout) -> DecodeState:
    k = self.runner.max_group if layout.mode == "hamburger" else 1
    f = self.runner.num_features if layout.mode == "hamburger" else 1
    return shapes.empty_state(layout, self.base_cfg, k, f)

  def init_state(self, layout: Layout) -> DecodeState:
    """A decode state of `layout`'s shapes with every slot empty (done) and every block-table
    entry the trash block, placed by `put`: what `prefill` and the decode programs take. Its
    micro steps' cost ratios are the engine's micro_rule's (`micro_costs`)."""
    state = self._empty_state(layout)
    return self.put(state.replace(micro_cost=self.micro_costs(layout)))

  def micro_costs(self, layout: Layout) -> np.ndarray:
    """DecodeState.micro_cost under the engine's micro_rule at `layout`'s slots: r at each
    micro batch size (decode/step.py: pays); 0 in base mode, which has no micro steps. "auto"
    times the steps the first time a slot count asks (decode/micro_rule.py: measure)."""
    if layout.mode != "hamburger":
      return micro_rules.costs("off", layout.slots)
    key = (self.micro_rule, layout.slots)
    if key not in self._micro_costs:
      self._micro_costs[key] = micro_rules.costs(
          self.micro_rule, layout.slots, lambda: micro_rules.measure(self.runner, layout.slots))
    return self._micro_costs[key]

  def with_micro_rule(self, rule: str | float) -> "Engine":
    """This engine deciding micro steps by `rule` (decode/micro_rule.py): its weights,
    compiled programs, measured costs and prefix cache shared (the rule is a runtime operand
    of the same programs)."""
    other = copy.copy(self)
    other.micro_rule = micro_rules.parse(rule)
    return other

  def put(self, tree):
    """Host values onto the engine's devices: replicated over the mesh, if there is one (the
    decode state is small next to the weights, which the mesh splits)."""
    if self.mesh is None:
      return jax.tree.map(jnp.asarray, tree)
    return jax.device_put(tree, NamedSharding(self.mesh, P()))

  def _abstract_state(self, layout: Layout):
    state = jax.eval_shape(lambda: self._empty_state(layout))
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
    feats, row = decode_step.forward_features(model, mode, decode_step.base_of(model).embed(
        ids_c[None]), slots, row, slots)
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

  def _decode_impl(self, params, state: DecodeState, refill, limit, sink, *, mode: str,
                   stochastic: bool, stream: bool, view: int) -> DecodeState:
    """Macro steps until every slot is done, or (with `refill`) a slot finishes so the host can
    give it the next request, or a live slot's blocks are full so the host can add one, or
    `limit` macro steps have run, or (with `stream`) the sink asks for the host.

    Attention reads the first `view` blocks of each slot's table (the host picks a view that
    holds every live slot's blocks): its cost follows the live lengths, not the layout's.
    `sink`: with `stream`, each macro step goes to serving.deliver_step with it, whose answer
    can end the call after that step (a server with requests waiting to be admitted)."""
    full_table = state.cache.table
    state = state.replace(cache=state.cache.replace(table=full_table[:, :view]))
    model = nnx.merge(self.graphdef, params)
    offset = model.cfg.graft.position_offset if mode == "hamburger" else 0
    n_max = state.groups.shape[1]
    stop_ids = jnp.asarray(self.stop_ids, jnp.int32)
    done_at_start = state.done

    def body(carry):
      step, state, _ = carry
      asked = []  # the sink's answer to this step: return to the host after it
      report = None
      if stream:
        report = lambda group, count: asked.append(jax.experimental.io_callback(
            serving.deliver_step, jax.ShapeDtypeStruct((), jnp.bool_), sink, group, count,
            ordered=True))
      # Unconditional: a branch around the step would copy the whole KV pool (XLA cannot
      # update a buffer in place through a conditional). When every slot is done this one
      # step is wasted (done slots write only their own unused entries or the trash block),
      # and the loop ends.
      state = decode_step.macro_step(
          model, mode, state, stop_ids=stop_ids, stochastic=stochastic, offset=offset,
          variant=self.variant, report=report)
      return step + 1, state, asked[0] if asked else jnp.bool_(False)

    def cond(carry):
      step, state, host = carry
      finished = jnp.any(state.done & ~done_at_start)
      full = jnp.any(~state.done & (state.cache.length >= state.cache.capacity()))
      return (step < jnp.minimum(n_max, limit)) & ~jnp.all(state.done) & ~(
          refill & finished) & ~full & ~host

    _, state, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), state, jnp.bool_(False)))
    return state.replace(cache=state.cache.replace(table=full_table))

  # ------------------------------------------------------------------ programs

  def layout(self, mode: str, slots: int, max_new: int, longest_prompt: int,
             kv_blocks: int | None = None) -> Layout:
    """The static shapes for requests up to `longest_prompt` + `max_new` tokens, in this
    engine's blocks (shapes.plan_layout)."""
    return shapes.plan_layout(mode, slots, max_new, longest_prompt, self.block_size, kv_blocks)

  def _spec(self, shape: tuple, dtype) -> jax.ShapeDtypeStruct:
    """An abstract argument, replicated over the mesh if there is one (as `put` places it)."""
    if self.mesh is None:
      return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, P()))

  def lower_prefill(self, layout: Layout, chunk: int) -> jax.stages.Lowered:
    """The prefill program of one `chunk`-token prompt chunk, lowered (`prefill` runs it)."""
    state = self._abstract_state(layout)
    i32 = self._spec((), jnp.int32)
    request = {k: self._spec((), getattr(state, k).dtype)
               for k in ("max_new", "confidence", "max_group", "temperature", "top_k", "top_p")}
    key = jax.eval_shape(lambda: jax.random.key(0))
    request["key"] = self._spec(key.shape, key.dtype)
    fn = self._jit(self._prefill_impl, static_argnames=("mode",))
    with precision.matmuls(self.precision):
      return fn.lower(self.params, state, self._spec((chunk,), jnp.int32), i32, i32, i32,
                      self._spec((), bool), request, mode=layout.mode)

  def _prefill_program(self, layout: Layout, chunk: int):
    key = ("prefill", layout, chunk)
    if key not in self.programs:
      self.programs[key] = self.lower_prefill(layout, chunk).compile()
    return self.programs[key]

  def lower_prefix(self, layout: Layout, size: int) -> tuple[jax.stages.Lowered, ...]:
    """(read, write) of a `size`-entry prefix of one slot (prefix caching), lowered."""
    state = self._abstract_state(layout)
    i32 = self._spec((), jnp.int32)
    cache = state.cache
    kv = self._spec((cache.k.shape[0], size, *cache.k.shape[3:]), cache.k.dtype)
    # Not self._jit: reading must not donate the state, which goes on decoding.
    read = jax.jit(lambda state, slot: state.cache.read_row(slot, size), **(
        {} if self.mesh is None else {"out_shardings": NamedSharding(self.mesh, P())}))
    write = self._jit(lambda state, slot, k, v, n: state.replace(
        cache=state.cache.write_row(slot, k, v, n)))
    return read.lower(state, i32), write.lower(state, i32, kv, kv, i32)

  def _prefix_programs(self, layout: Layout, size: int):
    """(read, write) of a `size`-entry prefix of one slot (prefix caching)."""
    key = ("prefix", layout, size)
    if key not in self.programs:
      self.programs[key] = tuple(p.compile() for p in self.lower_prefix(layout, size))
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
      self.programs[key] = self.lower_decode(layout, stochastic, stream, view).compile()
    return self.programs[key]

  def lower_decode(self, layout: Layout, stochastic: bool, stream: bool,
                   view: int) -> jax.stages.Lowered:
    """The decode loop of `decode_program`, lowered."""
    state = self._abstract_state(layout)
    fn = self._jit(self._decode_impl, static_argnames=("mode", "stochastic", "stream", "view"))
    i32 = self._spec((), jnp.int32)
    with precision.matmuls(self.precision):
      return fn.lower(self.params, state, self._spec((), bool), i32, i32, mode=layout.mode,
                      stochastic=stochastic, stream=stream, view=view)

  def views(self, layout: Layout) -> list[int]:
    """The decode programs' views of a slot's table, in blocks (shapes.views)."""
    return shapes.views(layout)

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

  def compile_for(self, layout: Layout, longest_prompt: int, stochastic: bool,
                  stream: bool = False) -> float:
    """Compiles what any prompt of up to `longest_prompt` tokens runs in `layout` (every
    prefill chunk size and prefix size it can use), for a server that cannot know its prompts
    before they arrive; returns the seconds spent, as compile_programs."""
    t = time.perf_counter()
    before = len(self.programs)
    for chunk in shapes.PREFILL_BUCKETS:
      if chunk == shapes.PREFILL_BUCKETS[0] or chunk // 2 < longest_prompt:
        self._prefill_program(layout, chunk)
    if self.prefix_cache.enabled:
      for size in shapes.LENGTH_BUCKETS:
        if size == shapes.LENGTH_BUCKETS[0] or size // 2 < longest_prompt:
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

    The engine decodes `model` in the decoding layout (model/decode_layout.py: fused
    projections, folded adapters, its dtype); base adapters act only on macro steps whose input
    is a merged entry, so mode "base" (which never marks an input merged) is the base model,
    exactly. An abstract model (nnx.eval_shape) gives an engine whose programs can be lowered
    and compiled (for a mesh of devices that are not attached) but not run."""
    runner, abstract = decode_runner(model, fused=self.fused, dtype=self.dtype)
    graphdef, params = nnx.split(runner)
    if getattr(self, "graphdef", graphdef) != graphdef:
      raise GenerationError("set_model needs a model of the same architecture as the engine's")
    if self.mesh is not None:
      shardings = sharding.state_shardings(params, self.mesh, sharding.INFER_RULES)
      params = (jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             params, shardings) if abstract else jax.device_put(params, shardings))
    self.model, self.runner = model, runner
    self.base_cfg = base_of(runner).cfg
    self.graphdef, self.params = graphdef, params
    self.prefix_cache.clear()  # its entries were computed with the old weights
