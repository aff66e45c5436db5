"""The static shapes of the engine's programs, planned on the host before anything compiles:
the prefill chunk sizes of a prompt, the decode layout (slots, max_new_tokens bucket, each slot's
view of the paged KV pool), the decode state of a layout's shapes (the one decode-state
builder: the standalone step program builds its state here too) and the views a decode program
reads.

A module of its own because every program the engine compiles is keyed by these shapes: they
decide how many programs there are and how much padding each runs, and they change apart from
what the programs compute (engine.py) and when requests run (serving.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hamburger_jax.config import LlamaConfig
from hamburger_jax.decode.lookup import LOOKUP_WINDOW, NO_TOKEN
from hamburger_jax.decode.paged_kv import PagedKVCache, blocks_for
from hamburger_jax.decode.requests import GenerationError
from hamburger_jax.decode.micro_rule import cost_size
from hamburger_jax.decode.step import DecodeState

# Prompts are prefilled in chunks, each padded to one of these sizes (one program per size).
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)
# What one prefill chunk costs beyond its tokens, in token-equivalents: a chunk reads every weight
# once (SmolLM2-135M on 2 CPU cores: ~30 tokens' worth of compute). prefill_chunks weighs it
# against padding: a 130-token prompt runs as 128 + 16 rather than padded to 256.
PREFILL_CHUNK_COST = 32
# Static sizes of the decode program: max_new_tokens in powers of two, and each slot's view of
# the KV pool (longest prompt + max_new_tokens) rounded up to a multiple of VIEW_STEP entries;
# decode programs read views of VIEW_STEP x 2^i entries of it (views).
LENGTH_BUCKETS = tuple(2 ** i for i in range(4, 18))
VIEW_STEP = 128
DEFAULT_BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True)
class Layout:
  """The static shapes of one set of programs (what compiling depends on)."""
  mode: str
  slots: int  # B
  max_new: int  # N
  blocks_per_row: int  # MB: a slot's view of the pool is MB x block_size entries
  num_blocks: int  # NB, the trash block included
  block_size: int
  # KV entries a macro step writes past a slot's length: 1, or K in verify mode (the token it
  # keeps for sure and K - 1 drafts) and in HAMburger mode merging at a layer L > 0 (the
  # group's lower-layer entries); the room a slot needs before a step runs is step_room's
  step_entries: int = 1


def step_room(step_entries: int, max_new, n_tokens):
  """The KV entries past a live row's length that its next macro step needs blocks for: the
  layout's `step_entries`, but no more than the tokens the row has left (`max_new - n_tokens`,
  each its own entry at most). A step keeps one entry per token it emits; those it writes past
  them are never read, and past the row's blocks they land in the trash block. The host
  (serving.Scheduler, numpy) and the decode loop (programs.py, traced) both ask this, so the
  loop returns to the host exactly when the host would add a block."""
  left = max_new - n_tokens
  if isinstance(left, jax.Array):
    return jnp.minimum(step_entries, left)
  return np.minimum(step_entries, left)


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


def chunk_sizes_used(longest: int) -> tuple[int, ...]:
  """Every chunk size prefill_chunks uses for some prompt of up to `longest` tokens, however a
  prompt is split (a cached prefix's chunks and the rest's are each such a prompt)."""
  if longest < 1:
    return ()
  buckets, cost = PREFILL_BUCKETS, PREFILL_CHUNK_COST
  # The same search as _chunk_sizes, once for every length up to `longest`.
  best = [(0, ())] + [None] * longest
  for r in range(1, longest + 1):
    best[r] = min((best[max(r - b, 0)][0] + b + cost, best[max(r - b, 0)][1] + (b,))
                  for b in buckets)
  return tuple(sorted({b for _, sizes in best[1:] for b in sizes}))


def generate_slots(n: int) -> int:
  """`generate`'s slots for n prompts: a power of two (the spare slots stay empty), so batches of
  similar size share their compiled programs."""
  return 1 << (n - 1).bit_length()


def plan_layout(mode: str, slots: int, max_new: int, longest_prompt: int, block_size: int,
                kv_blocks: int | None = None, step_entries: int = 1) -> Layout:
  """The static shapes for requests up to `longest_prompt` + `max_new` tokens, `step_entries`
  written a macro step (Layout). Without `kv_blocks` the pool holds every slot's view (nothing
  ever waits for blocks)."""
  n = bucket(max_new, LENGTH_BUCKETS)
  # Attention reads a slot's whole view every step: keep it tight (a multiple of VIEW_STEP).
  view = -(-(longest_prompt + n + step_entries) // VIEW_STEP) * VIEW_STEP
  mb = blocks_for(view, block_size)
  nb = kv_blocks if kv_blocks is not None else slots * mb + 1
  return Layout(mode, slots, n, mb, nb, block_size, step_entries)


def views(layout: Layout) -> list[int]:
  """The decode programs' views of a slot's table, in blocks: VIEW_STEP entries times a power
  of two, up to the layout's whole row."""
  step = blocks_for(VIEW_STEP, layout.block_size)
  out = [min(step, layout.blocks_per_row)]
  while out[-1] < layout.blocks_per_row:
    out.append(min(out[-1] * 2, layout.blocks_per_row))
  return out


def empty_state(layout: Layout, cfg: LlamaConfig, max_group: int,
                num_features: int) -> DecodeState:
  """A decode state of `layout`'s shapes with every slot empty (done) and every block-table
  entry the trash block, not yet placed (Engine.init_state puts it on the engine's devices).
  `cfg`: the base model's; `max_group` (K) and `num_features`: the mode's (1 and 1 in base)."""
  cache = PagedKVCache.init(cfg.num_layers, layout.num_blocks, layout.block_size, layout.slots,
                            layout.blocks_per_row, cfg.num_kv_heads, cfg.head_dim,
                            jnp.dtype(cfg.dtype))
  return decode_state(cache, cfg, slots=layout.slots, max_new=layout.max_new,
                      max_group=max_group, num_features=num_features)


def decode_state(cache, cfg: LlamaConfig, *, slots: int, max_new: int, max_group: int,
                 num_features: int) -> DecodeState:
  """The decode state over `cache` (paged, or a dense KVCache: one row per slot) with every one
  of `slots` slots empty (done): N = `max_new` tokens and K = `max_group` per slot, F =
  `num_features` features of the base's width and dtype (`cfg`). The one place a state is
  built: a caller that needs live slots (step_program.py) replaces the fields it fills. The
  micro steps' cost ratios are 0: every micro step a row goes on for runs (decode/micro_rule.py:
  pays; Engine.init_state sets the engine's)."""
  b, n, k = slots, max_new, max_group
  zeros = lambda *s, dt=jnp.int32: jnp.zeros(s, dt)
  return DecodeState(
      cache=cache, features=zeros(b, num_features, cfg.hidden_size, dt=jnp.dtype(cfg.dtype)),
      prompt_len=zeros(b), tokens=zeros(b, n + k), n_tokens=zeros(b), groups=zeros(b, n),
      n_steps=zeros(b), done=jnp.ones((b,), bool), max_new=zeros(b),
      continue_at=jnp.ones((b,), jnp.float32), max_group=jnp.full((b,), k, jnp.int32),
      temperature=zeros(b, dt=jnp.float32),
      top_k=zeros(b), top_p=jnp.ones((b,), jnp.float32),
      key=jax.random.split(jax.random.key(0), b), next_token=jnp.full((b,), -1, jnp.int32),
      context=jnp.full((b, LOOKUP_WINDOW), NO_TOKEN, jnp.int32),
      micro_cost=jnp.zeros((cost_size(b),), jnp.float32))
