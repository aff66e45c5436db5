"""The generation engine: one jitted prefill + one jitted `lax.while_loop` decode, for the base model
and for HAMburger. HAMburger is the base loop with a different step: each macro step emits a group
of 1..K tokens (micro steps) and writes ONE KV entry for it.

Rows of a batch advance independently: per-row KV slot counters, RoPE positions, emission counts
and done flags. All buffers are static-shaped, so the same program runs on CPU, GPU and TPU.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax.config import DEFAULT_CONFIDENCE
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.kv_cache import KVCache
from hamburger_jax.model.llama import Llama
from infer.sampling import SamplingParams, sample

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class GenerationError(ValueError):
  """A request cannot be served as given; the message says what to change."""


@flax.struct.dataclass
class DecodeState:
  cache: KVCache
  features: jax.Array  # [B, F, D] base features at each row's predicting position (base mode F=1)
  prompt_len: jax.Array  # [B]
  tokens: jax.Array  # [B, N + K] emitted tokens
  n_tokens: jax.Array  # [B]
  groups: jax.Array  # [B, N] tokens emitted by each macro step
  n_steps: jax.Array  # [B]
  done: jax.Array  # [B] bool
  confidence: jax.Array  # [B] continue a group while P(continue) >= confidence
  rng: jax.Array
  temperature: jax.Array  # scalar (traced, so changing it does not recompile)
  top_p: jax.Array  # scalar


@dataclasses.dataclass
class Generation:
  """One row's result."""
  token_ids: list[int]
  text: str
  groups: list[int]  # tokens per macro step (sums to len(token_ids))
  macro_steps: int
  kv_entries: int  # KV cache entries the row holds at the end (prompt included)
  prompt_tokens: int
  prefill_s: float
  decode_s: float
  compile_s: float = 0.0  # spent compiling this bucket's programs (0 when reused)

  @property
  def new_tokens(self) -> int:
    return len(self.token_ids)

  @property
  def decode_tokens_per_s(self) -> float:
    return self.new_tokens / self.decode_s if self.decode_s > 0 else float("nan")

  @property
  def tokens_per_step(self) -> float:
    return self.new_tokens / max(self.macro_steps, 1)


def bucket(n: int, buckets: Sequence[int]) -> int:
  for b in buckets:
    if n <= b:
      return b
  raise GenerationError(f"{n} exceeds the largest bucket {buckets[-1]}")


def _continues(stop_logit: jax.Array, confidence: jax.Array) -> jax.Array:
  """P(continue) = 1 - sigmoid(stop) >= c; c = 1 always stops after one token (exactly)."""
  return (confidence < 1.0) & (jax.nn.sigmoid(-stop_logit) >= confidence)


def base_of(model: Llama | Hamburger) -> Llama:
  return model.base if isinstance(model, Hamburger) else model


class Engine:
  """Batched generation for a `Llama` (mode "base") or a `Hamburger` (mode "hamburger" or "base").

  Mode "base" on a Hamburger model decodes with its base weights only (base adapters never act),
  so the two modes of one engine compare the same base in the same code.
  """

  def __init__(self, model: Llama | Hamburger, tokenizer: Any = None, *,
               max_seq_len: int | None = None, stop_ids: Sequence[int] | None = None):
    self.tokenizer = tokenizer
    base = base_of(model)
    self.base_cfg = base.cfg
    self.max_seq_len = max_seq_len or base.cfg.max_position_embeddings
    if stop_ids is None:
      stop_ids = tokenizer.stop_ids if tokenizer is not None else ()
    self.stop_ids = tuple(int(i) for i in stop_ids)
    self.set_model(model)
    # Compiled programs by (mode, batch bucket, prompt bucket, max_new, sampler, stream): compiled
    # ahead of time so timings never include compilation and reuse is observable.
    self.programs: dict[tuple, tuple[Any, Any]] = {}
    self.stream_callback: Callable[[np.ndarray, np.ndarray], None] | None = None

  # ------------------------------------------------------------------ traced pieces

  def _features(self, model, mode: str, x_btd, positions_bt, cache: KVCache, slots_bt,
                merged_bt=None):
    mask = cache.mask(slots_bt)
    if mode == "hamburger":
      return model.base_features(x_btd, positions_bt, mask, cache, slots_bt, merged_bt)
    base = base_of(model)
    out = base.forward(x_btd, positions_bt, mask, cache, slots_bt)
    return out.hidden[:, :, None, :], out.cache

  def _prefill_impl(self, params, ids_bp, prompt_len_b, done_b, confidence_b, rng, temperature,
                    top_p, *, mode: str, max_new: int) -> DecodeState:
    model = nnx.merge(self.graphdef, params)
    base = base_of(model)
    cfg = base.cfg
    b, p = ids_bp.shape
    k = model.max_group if mode == "hamburger" else 1
    cache = KVCache.init(cfg.num_layers, b, p + max_new, cfg.num_kv_heads, cfg.head_dim,
                         jnp.dtype(cfg.dtype))
    slots = jnp.broadcast_to(jnp.arange(p), (b, p))
    feats, cache = self._features(model, mode, base.embed(ids_bp), slots, cache, slots)
    last = jnp.maximum(prompt_len_b - 1, 0)
    return DecodeState(
        cache=cache.replace(length=prompt_len_b), features=feats[jnp.arange(b), last],
        prompt_len=prompt_len_b, tokens=jnp.zeros((b, max_new + k), jnp.int32),
        n_tokens=jnp.zeros((b,), jnp.int32), groups=jnp.zeros((b, max_new), jnp.int32),
        n_steps=jnp.zeros((b,), jnp.int32), done=done_b, confidence=confidence_b, rng=rng,
        temperature=temperature, top_p=top_p)

  def _propose(self, model, mode: str, state: DecodeState, sampling: SamplingParams, rng):
    """One macro step's group: tokens [B, K'] and how many of them each row emits [B]."""
    base = base_of(model)
    dyn = {"temperature": state.temperature, "top_p": state.top_p}
    remaining = state.groups.shape[1] - state.n_tokens
    stop_ids = jnp.asarray(self.stop_ids, jnp.int32)
    h0 = state.features[:, -1]  # skip connection: token 0 is the base's own prediction
    t0 = sample(base.logits(h0), jax.random.fold_in(rng, 0), sampling, dyn)
    count = jnp.where(state.done, 0, 1).astype(jnp.int32)
    if mode != "hamburger" or model.max_group == 1:
      return t0[:, None], count
    k, f = model.max_group, state.features.shape[1]
    b = t0.shape[0]
    tokens = jnp.zeros((b, k), jnp.int32).at[:, 0].set(t0)
    cont = (~state.done & _continues(model.stop_logits(h0), state.confidence)
            & ~jnp.isin(t0, stop_ids) & (remaining > 1))

    def micro_step(i, x_btd, cache, tokens, count, cont):
      """Runs inputs ending with e(t_{i-1}) at slot/position F-1+i and emits t_i where `cont`."""
      t = x_btd.shape[1]
      slots = jnp.broadcast_to(f + i - t + jnp.arange(t), (b, t))  # slot == RoPE position here
      h, cache = model.micro(x_btd, slots, cache.mask(slots), cache, slots)
      h = h[:, -1]
      ti = sample(base.logits(h), jax.random.fold_in(rng, i), sampling, dyn)
      tokens = jax.lax.dynamic_update_slice_in_dim(tokens, jnp.where(cont, ti, 0)[:, None], i, 1)
      count = count + cont
      cont = cont & _continues(model.stop_logits(h), state.confidence) & ~jnp.isin(
          ti, stop_ids) & (remaining > i + 1)
      return cache, tokens, count, cont

    def run_micro(operands):
      tokens, count, cont = operands
      cfg = base.cfg
      cache = KVCache.init(len(model.micro.decoder.layers), b, f + k - 1, cfg.num_kv_heads,
                           cfg.head_dim, jnp.dtype(cfg.dtype))
      # Micro step 1 reads the F features and e(t0) in one pass (one read of the weights).
      x = jnp.concatenate([state.features, base.embed(tokens[:, :1])], axis=1)
      carry = (jnp.int32(2), *micro_step(1, x, cache, tokens, count, cont))

      def body(carry):
        i, cache, tokens, count, cont = carry
        x = base.embed(jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1))
        return (i + 1, *micro_step(i, x, cache, tokens, count, cont))

      _, _, tokens, count, _ = jax.lax.while_loop(
          lambda c: (c[0] < k) & jnp.any(c[4]), body, carry)
      return tokens, count

    # Rows whose stop head fired after token 0 need no micro decoder work at all.
    return jax.lax.cond(jnp.any(cont), run_micro, lambda o: o[:2], (tokens, count, cont))

  def _decode_impl(self, params, state: DecodeState, *, mode: str, sampling: SamplingParams,
                   stream: bool) -> DecodeState:
    model = nnx.merge(self.graphdef, params)
    base = base_of(model)
    offset = model.cfg.graft.position_offset if mode == "hamburger" else 0
    max_new = state.groups.shape[1]
    b = state.done.shape[0]
    rows = jnp.arange(b)[:, None]
    stop_ids = jnp.asarray(self.stop_ids, jnp.int32)

    def body(carry):
      step, state = carry
      rng, key = jax.random.split(state.rng)
      group, count = self._propose(model, mode, state, sampling, key)
      k = group.shape[1]
      emitted = jnp.arange(k)[None, :] < count[:, None]
      idx = jnp.where(emitted, state.n_tokens[:, None] + jnp.arange(k)[None, :], max_new + k)
      tokens = state.tokens.at[rows, idx].set(group, mode="drop")
      gidx = jnp.where(count > 0, state.n_steps, max_new)[:, None]
      groups = state.groups.at[rows, gidx].set(count[:, None], mode="drop")
      n_tokens = state.n_tokens + count
      done = state.done | jnp.any(emitted & jnp.isin(group, stop_ids), axis=1) | (
          n_tokens >= max_new)
      if stream:
        jax.experimental.io_callback(self._on_step, None, group, count, ordered=True)
      state = state.replace(tokens=tokens, groups=groups, n_tokens=n_tokens,
                            n_steps=state.n_steps + (count > 0), done=done, rng=rng)

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

      state = jax.lax.cond(jnp.all(state.done), lambda s: s, advance, state)
      return step + 1, state

    _, state = jax.lax.while_loop(
        lambda c: (c[0] < max_new) & ~jnp.all(c[1].done), body, (jnp.int32(0), state))
    return state

  def _on_step(self, group, count):
    if self.stream_callback is not None:
      self.stream_callback(np.asarray(group), np.asarray(count))

  # ------------------------------------------------------------------ host side

  def encode_prompt(self, prompt) -> list[int]:
    """str -> chat-templated user turn; list of messages -> chat template; list of ints -> as is."""
    if isinstance(prompt, str):
      if not prompt.strip():
        raise GenerationError("empty prompt: give at least one non-blank character")
      prompt = [{"role": "user", "content": prompt}]
    if len(prompt) and isinstance(prompt[0], dict):
      if self.tokenizer is None:
        raise GenerationError("text prompts need a tokenizer; pass token ids or a tokenizer")
      return list(self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                     tokenize=True))
    ids = [int(i) for i in prompt]
    if not ids:
      raise GenerationError("empty prompt: give at least one token")
    vocab = self.base_cfg.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
      raise GenerationError(f"prompt token ids must be in [0, {vocab}); got {min(ids)}..{max(ids)}")
    return ids

  def _request(self, prompts: Sequence, max_new_tokens: int, mode: str | None,
               sampling: SamplingParams, confidence: float | Sequence[float], seed: int
               ) -> tuple[str, list[list[int]], tuple]:
    """Checks a request and lays it out in its shape buckets: (mode, prompt ids, prefill args)."""
    mode = mode or ("hamburger" if isinstance(self.model, Hamburger) else "base")
    if mode not in ("base", "hamburger"):
      raise GenerationError(f"mode={mode!r}: use 'base' or 'hamburger'")
    if mode == "hamburger" and not isinstance(self.model, Hamburger):
      raise GenerationError("mode 'hamburger' needs a HAMburger model (load a checkpoint)")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
      raise GenerationError(f"max_new_tokens={max_new_tokens} must be an integer >= 1")
    if isinstance(prompts, (str, dict)) or not len(prompts):
      raise GenerationError("prompts must be a non-empty list (wrap a single prompt in a list)")
    conf = np.broadcast_to(np.asarray(confidence, np.float32), (len(prompts),))
    if not np.all((conf >= 0) & (conf <= 1)):
      raise GenerationError(f"confidence must be in [0, 1], got {conf.tolist()}")
    ids = [self.encode_prompt(p) for p in prompts]
    longest = max(map(len, ids))
    if longest + max_new_tokens > self.max_seq_len:
      raise GenerationError(
          f"prompt has {longest} tokens + max_new_tokens {max_new_tokens} > max_seq_len "
          f"{self.max_seq_len}: shorten the prompt or lower max_new_tokens")
    n = len(ids)
    b = 1 << (n - 1).bit_length()  # batch bucket: a power of two
    p = bucket(longest, PROMPT_BUCKETS)
    ids_bp = np.zeros((b, p), np.int32)
    lens = np.ones((b,), np.int32)
    for i, row in enumerate(ids):
      ids_bp[i, :len(row)] = row
      lens[i] = len(row)
    done = np.arange(b) >= n  # padding rows start finished
    conf_b = np.ones((b,), np.float32)
    conf_b[:n] = conf
    dyn = sampling.dynamic()
    args = (self.params, jnp.asarray(ids_bp), jnp.asarray(lens), jnp.asarray(done),
            jnp.asarray(conf_b), jax.random.key(seed), dyn["temperature"], dyn["top_p"])
    return mode, ids, args

  def compile(self, prompts: Sequence, *, max_new_tokens: int = 128, mode: str | None = None,
              sampling: SamplingParams = SamplingParams(), stream: bool = False) -> float:
    """Compiles the programs that `generate` with these arguments runs (confidence and seed do
    not change them), so that a caller can time compilation apart from generation. Returns the
    seconds spent: 0 when they were compiled already; loading them from JAX's persistent
    compilation cache counts as compiling."""
    mode, _, args = self._request(prompts, max_new_tokens, mode, sampling, DEFAULT_CONFIDENCE, 0)
    return self._program(args, mode, int(max_new_tokens), sampling, stream)[2]

  def generate(self, prompts: Sequence, *, max_new_tokens: int = 128, mode: str | None = None,
               sampling: SamplingParams = SamplingParams(),
               confidence: float | Sequence[float] = DEFAULT_CONFIDENCE, seed: int = 0,
               stream: Callable[[np.ndarray, np.ndarray], None] | None = None
               ) -> list[Generation]:
    """Generates for a batch of prompts (texts, message lists or token-id lists)."""
    mode, ids, args = self._request(prompts, max_new_tokens, mode, sampling, confidence, seed)
    self.stream_callback = stream
    params, n = args[0], len(ids)
    prefill, decode, compile_s = self._program(args, mode, int(max_new_tokens), sampling,
                                               stream is not None)
    t0 = time.perf_counter()
    state = jax.block_until_ready(prefill(*args))
    t1 = time.perf_counter()
    state = decode(params, state)
    tokens, n_tokens, groups, n_steps, kv = jax.device_get(
        (state.tokens, state.n_tokens, state.groups, state.n_steps, state.cache.length))
    t2 = time.perf_counter()
    out = []
    for i in range(n):
      row = tokens[i, :n_tokens[i]].tolist()
      text = self.tokenizer.decode(row, skip_special_tokens=True) if self.tokenizer else ""
      out.append(Generation(row, text, groups[i, :n_steps[i]].tolist(), int(n_steps[i]),
                            int(kv[i]), len(ids[i]), t1 - t0, t2 - t1, compile_s))
    return out

  def set_model(self, model: Llama | Hamburger) -> None:
    """Takes new weights; compiled programs are kept when the architecture is the same.

    Base adapters stay unfolded: they act per row, only on macro steps whose input is a merged
    entry, so mode "base" (which never marks an input merged) is the base model, exactly.
    """
    graphdef, params = nnx.split(model)
    if getattr(self, "graphdef", graphdef) != graphdef:
      raise GenerationError("set_model needs a model of the same architecture as the engine's")
    self.model = model
    self.graphdef, self.params = graphdef, params

  @property
  def compilations(self) -> int:
    return len(self.programs)

  def _program(self, prefill_args, mode, max_new, sampling, stream):
    """The compiled (prefill, decode) pair for this shape bucket, compiling it on first use."""
    key = (mode, prefill_args[1].shape, max_new, sampling.static_key(), stream)
    if key in self.programs:
      return (*self.programs[key], 0.0)
    t = time.perf_counter()
    prefill = jax.jit(self._prefill_impl, static_argnames=("mode", "max_new"))
    state = jax.eval_shape(prefill, *prefill_args, mode=mode, max_new=max_new)
    prefill = prefill.lower(*prefill_args, mode=mode, max_new=max_new).compile()
    decode = jax.jit(self._decode_impl, static_argnames=("mode", "sampling", "stream"),
                     donate_argnames=("state",))
    decode = decode.lower(prefill_args[0], state, mode=mode, sampling=sampling,
                          stream=stream).compile()
    self.programs[key] = (prefill, decode)
    return prefill, decode, time.perf_counter() - t
