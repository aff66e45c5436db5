"""Self-distilled answers at accelerator scale: the base's own greedy answers to token-id prompts,
hundreds of rows in one jitted program, each chosen token's probability kept.

The probability the base gave a token when it chose it is the one a teacher-forced pass over the
answer would give it (same model, same context, up to rounding), so the answers' group boundaries
(segmentation `confident:p`) come with them: no boundary pass reads them again.

One program per (rows, prompt length, answer length): every row is prefilled at once into a dense
KV cache (prompts right-padded: a row's first answer token goes at its own length, and reads
only the slots before it, so the padding is overwritten before anything reads it), then a
`lax.while_loop` decodes until every row has ended its answer or the answer length is reached.
The serving engine (hamburger_jax.decode) answers requests that come and go; this answers a
corpus's prompts in fixed batches, which is what a training window wants.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax.decode.sampling import greedy
from hamburger_jax.model.kv_cache import KVCache
from hamburger_jax.model.llama import Llama, dtype_of
from hamburger_jax.model.rope import apply_rope, inverse_frequencies
from hamburger_jax.segmentation import confident_starts


# How a decode step reads and writes the cache: "in_place" (_in_place_step) or "engine"
# (Llama.forward with a KVCache, as the serving engine steps: the baseline that
# infer/experiments/answers_step.py times it against).
STEPS = ("in_place", "engine")


def _attend_cache(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array,
                  at_b1: jax.Array) -> jax.Array:
  """One new input a row attending to its cache's entries up to its own slot `at` (written
  already): [B, 1, H*Dh]. Scores and the weighted sum of values are multiplies and reductions in
  the cache's own layout, reading each entry once; a dot_general wants the batch dimensions
  (row, KV head) leading and would transpose the layer's whole cache first. attention.attend's
  math (float32 scores and softmax, probabilities rounded to the values' dtype), in another
  summation order."""
  b = q_bthd.shape[0]
  hkv, dh = k_bskd.shape[2:]
  f32 = jnp.float32
  if q_bthd.ndim == 5:  # a fused kernel's [B, 1, G, Hkv, Dh]
    q = jnp.swapaxes(q_bthd[:, 0], 1, 2)
  else:
    q = q_bthd[:, 0].reshape(b, hkv, -1, dh)
  q = q.astype(f32) / jnp.sqrt(f32(dh))  # [B, Hkv, G, Dh]
  scores = jnp.sum(q[:, None] * k_bskd.astype(f32)[..., None, :], axis=-1)  # [B, S, Hkv, G]
  seen = jnp.arange(k_bskd.shape[1])[None, :] <= at_b1
  scores = jnp.where(seen[..., None, None], scores, jnp.finfo(f32).min)
  probs = jax.nn.softmax(scores, axis=1).astype(v_bskd.dtype).astype(f32)
  out = jnp.sum(probs[..., None] * v_bskd.astype(f32)[..., None, :], axis=1)  # [B, Hkv, G, Dh]
  return out.astype(v_bskd.dtype).reshape(b, 1, -1)


def _in_place_step(model: Llama, tok_b: jax.Array, at_b1: jax.Array,
                   cache: KVCache) -> tuple[jax.Array, KVCache]:
  """The base's forward of one token a row at cache slot `at`, each layer writing its new entry
  into the cache before reading it: every read then follows the write before it, so XLA updates
  the loop's cache in place. (Llama.forward writes every layer after all have read: nothing
  orders the last layer's read before that write, and XLA copies the whole cache each step;
  infer/experiments/answers_step.py counts the copies in the compiled loop.)
  Returns the final-normed hidden state [B, D] and the cache."""
  rows = jnp.arange(tok_b.shape[0])[:, None]
  x = model.embed(tok_b[:, None])
  for i, layer in enumerate(model.decoder.layers):
    attn = layer.self_attn
    q, k, v = attn.project(layer.input_layernorm(x))
    inv_freq = inverse_frequencies(attn.rope_cfg)
    q, k = apply_rope(q, at_b1, inv_freq), apply_rope(k, at_b1, inv_freq)
    dt = cache.k.dtype
    cache = cache.replace(k=cache.k.at[i, rows, at_b1].set(k.astype(dt)),
                          v=cache.v.at[i, rows, at_b1].set(v.astype(dt)))
    x = x + attn.o_proj(_attend_cache(q, cache.k[i], cache.v[i], at_b1))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
  return model.norm(x)[:, 0], cache


def _engine_step(model: Llama, tok_b: jax.Array, at_b1: jax.Array,
                 cache: KVCache) -> tuple[jax.Array, KVCache]:
  step = model.forward(model.embed(tok_b[:, None]), at_b1, None, cache=cache, slots_bt=at_b1)
  return step.hidden[:, 0], step.cache


def _choose(logits_bv: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Greedy tokens [B] and the probability the distribution gives each [B] (float32)."""
  tok = greedy(logits_bv)
  best = jnp.take_along_axis(logits_bv, tok[:, None], axis=-1)[:, 0]
  return tok, jnp.exp(best - jax.nn.logsumexp(logits_bv, axis=-1))


@functools.partial(jax.jit, static_argnames=("max_new", "step"))
def answers_program(graphdef: nnx.GraphDef, state: nnx.State, prompt_ids: jax.Array,
                    lengths: jax.Array, stop_ids: jax.Array, *, max_new: int,
                    step: str = "in_place") -> tuple[jax.Array, jax.Array, jax.Array]:
  """Greedy answers of the base `(graphdef, state)` to prompts [R, P] (right-padded; `lengths`
  [R] >= 1): (tokens [R, max_new] int32, their probabilities [R, max_new] float32, answer
  lengths [R] int32). An answer ends with the first token in `stop_ids` (kept) or at max_new;
  entries after its end are 0. `step`: how a decode step goes (STEPS)."""
  model = nnx.merge(graphdef, state)
  cfg = model.cfg
  r, p = prompt_ids.shape
  decode = {"in_place": _in_place_step, "engine": _engine_step}[step]
  cache = KVCache.init(cfg.num_layers, r, p + max_new, cfg.num_kv_heads, cfg.head_dim,
                       dtype_of(cfg.dtype))
  slots = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (r, p))
  out = model.forward(model.embed(prompt_ids), slots, None, cache=cache, slots_bt=slots)
  # The head reads one position a row: [R, P, V] logits would be most of the memory.
  last = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
  tok, prob = _choose(model.logits(last))

  def body(carry):
    i, tok, prob, cache, tokens, probs, done = carry
    live = ~done
    tokens = tokens.at[:, i].set(jnp.where(live, tok, 0))
    probs = probs.at[:, i].set(jnp.where(live, prob, 0.0))
    done = done | jnp.isin(tok, stop_ids)
    hidden, cache = decode(model, tok, (lengths + i)[:, None], cache)
    tok, prob = _choose(model.logits(hidden))
    return i + 1, tok, prob, cache, tokens, probs, done

  def cond(carry):
    return (carry[0] < max_new) & ~jnp.all(carry[-1])

  init = (jnp.int32(0), tok, prob, out.cache, jnp.zeros((r, max_new), jnp.int32),
          jnp.zeros((r, max_new), jnp.float32), jnp.zeros((r,), bool))
  _, _, _, _, tokens, probs, _ = jax.lax.while_loop(cond, body, init)
  # An answer's length: up to and including its first stop token.
  ended = jnp.isin(tokens, stop_ids)
  first_stop = jnp.where(ended.any(axis=1), jnp.argmax(ended, axis=1) + 1, max_new)
  return tokens, probs, first_stop.astype(jnp.int32)


@dataclasses.dataclass
class AnswerStats:
  prompts: int = 0  # prompts answered
  skipped: int = 0  # prompts longer than the program's prompt length, or empty
  tokens: int = 0  # answer tokens
  ended: int = 0  # answers that ended with a stop token (the others reached max_new)
  groups: int = 0
  batches: int = 0
  seconds: float = 0.0  # the batches after the first (compilation excluded)
  timed_tokens: int = 0  # their answer tokens
  compile_seconds: float = 0.0  # the first batch, compilation included
  stopped_by: str = "prompts"  # or "time"

  @property
  def tokens_per_s(self) -> float:
    return self.timed_tokens / self.seconds if self.seconds > 0 else float("nan")

  @property
  def mean_group(self) -> float:
    return self.tokens / max(self.groups, 1)


@dataclasses.dataclass
class Answers:
  """Samples of prompt + answer in a token corpus's layout (hamburger_jax.data.tokens.corpus):
  tokens [N], samples [S, 2] (start, length), responses [S, 3] (sample, start, end), and the
  group starts [N] uint8 of the answers (segmentation confident:p on the answering
  probabilities)."""
  tokens: np.ndarray
  samples: np.ndarray
  responses: np.ndarray
  starts: np.ndarray


def self_distilled_answers(model: nnx.Module, prompts: Iterable[Sequence[int]], *, rows: int,
                           prompt_len: int, max_new: int, stop_ids: Sequence[int],
                           max_group: int, threshold: float, deadline: float | None = None,
                           progress: Callable[[AnswerStats], None] | None = None
                           ) -> tuple[Answers, AnswerStats]:
  """The base `model`'s (a Llama, run in its dtype) greedy answers to `prompts` (token ids),
  `rows` at a time, until the prompts or the clock (`deadline`, time.monotonic(); a batch is
  started only before it) run out. Prompts longer than `prompt_len` are skipped (counted)."""
  if rows < 1 or prompt_len < 1 or max_new < 1:
    raise ValueError(f"rows={rows}, prompt_len={prompt_len} and max_new={max_new} must be >= 1")
  graphdef, state = nnx.split(model)
  stops = jnp.asarray(np.asarray(stop_ids, np.int32).reshape(-1))
  stats = AnswerStats()
  pieces: list[np.ndarray] = []
  samples, responses, starts = [], [], []
  at = 0
  it = iter(prompts)
  while deadline is None or time.monotonic() < deadline:
    batch = []
    for ids in it:
      if 0 < len(ids) <= prompt_len:
        batch.append(np.asarray(ids, np.int32))
        if len(batch) == rows:
          break
      else:
        stats.skipped += 1
    if not batch:
      break
    ids = np.zeros((rows, prompt_len), np.int32)
    lengths = np.ones(rows, np.int32)  # spare rows answer a 1-token prompt, unread
    for i, b in enumerate(batch):
      ids[i, :len(b)] = b
      lengths[i] = len(b)
    t = time.perf_counter()
    tokens, probs, count = jax.device_get(answers_program(
        graphdef, state, jnp.asarray(ids), jnp.asarray(lengths), stops, max_new=max_new))
    dt = time.perf_counter() - t
    n_tokens = int(count[:len(batch)].sum())
    if stats.batches == 0:
      stats.compile_seconds = dt
    else:
      stats.seconds += dt
      stats.timed_tokens += n_tokens
    stats.batches += 1
    for i, prompt in enumerate(batch):
      n = int(count[i])
      answer = tokens[i, :n]
      p = len(prompt)
      resp = np.arange(p + n) >= p
      span_start = np.arange(p + n) == p
      probs_i = np.concatenate([np.ones(p, np.float32), probs[i, :n]])
      s = confident_starts(probs_i, resp, span_start, max_group, threshold)
      pieces.append(np.concatenate([prompt, answer]))
      starts.append(s.astype(np.uint8))
      samples.append((at, p + n))
      responses.append((len(samples) - 1, at + p, at + p + n))
      at += p + n
      stats.prompts += 1
      stats.tokens += n
      stats.ended += int(n > 0 and np.isin(answer[-1], stop_ids))
      stats.groups += int(s.sum())
    if progress is not None:
      progress(stats)
  else:
    stats.stopped_by = "time"
  answers = Answers(
      tokens=np.concatenate(pieces) if pieces else np.zeros(0, np.int32),
      samples=np.asarray(samples, np.int64).reshape(-1, 2),
      responses=np.asarray(responses, np.int64).reshape(-1, 3),
      starts=np.concatenate(starts) if starts else np.zeros(0, np.uint8))
  return answers, stats
