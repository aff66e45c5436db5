"""Prefix caching: the KV entries of a prompt's earlier turns, computed once and copied into the
slot of every later request that starts with the same turns.

Chat requests share their first turns: every SmolLM2 chat prompt starts with the same ~20-token
system turn, and the next turn of a conversation repeats the whole history. The cacheable prefix
of a prompt is everything up to and including the end-of-turn token that closes the turn before
its last one (`cacheable_prefix`): a rule on the prompt alone, so a request is always prefilled
in the same chunks (that prefix, then the rest) whether its prefix is cached or not. The cached
entries are then bitwise the ones a miss computes, and a request's tokens never depend on which
requests came before it (chunking a prompt differently would change its float rounding).

The entries are copied into the slot's own blocks, not shared between slots: a slot writes only
blocks it owns (docs of paged_kv.py), and the pool accounting stays per request.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import jax

# Prefixes shorter than this are not worth a cache entry (a copy program call and a chunk of
# their own cost about as much as prefilling them with the rest).
MIN_PREFIX_TOKENS = 16


def cacheable_prefix(ids: Sequence[int], stop_ids: Sequence[int]) -> int:
  """Tokens of the prompt's earlier turns: up to and including the second-to-last end-of-turn
  token (the last one closes the final user turn). 0 when there is none or it is too short."""
  stops = [i for i, t in enumerate(ids) if t in stop_ids]
  if len(stops) < 2 or stops[-2] + 1 < MIN_PREFIX_TOKENS:
    return 0
  return stops[-2] + 1


@dataclasses.dataclass
class CachedPrefix:
  k: jax.Array  # [L, padded length, Hkv, Dh]: entries past `length` are not the prefix's
  v: jax.Array
  length: int


class PrefixCache:
  """A least-recently-used store of prefix KV entries, keyed by (mode, prefix token ids), holding
  at most `capacity_tokens` entries in all (padding included)."""

  def __init__(self, capacity_tokens: int):
    if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int) or (
        capacity_tokens < 0):
      raise ValueError(f"prefix cache capacity {capacity_tokens!r} must be an integer >= 0 "
                       "(tokens; 0 turns prefix caching off)")
    self.capacity_tokens = capacity_tokens
    self._entries: collections.OrderedDict[tuple, CachedPrefix] = collections.OrderedDict()
    self.hits = 0
    self.misses = 0
    self.tokens_reused = 0

  @property
  def enabled(self) -> bool:
    return self.capacity_tokens > 0

  @property
  def tokens(self) -> int:
    return sum(e.k.shape[1] for e in self._entries.values())

  def __len__(self) -> int:
    return len(self._entries)

  def get(self, mode: str, prefix: Sequence[int]) -> CachedPrefix | None:
    key = (mode, tuple(prefix))
    entry = self._entries.get(key)
    if entry is None:
      self.misses += 1
      return None
    self._entries.move_to_end(key)
    self.hits += 1
    self.tokens_reused += entry.length
    return entry

  def put(self, mode: str, prefix: Sequence[int], entry: CachedPrefix) -> None:
    size = entry.k.shape[1]
    if size > self.capacity_tokens:
      return
    self._entries[(mode, tuple(prefix))] = entry
    self._entries.move_to_end((mode, tuple(prefix)))
    while self.tokens > self.capacity_tokens:
      self._entries.popitem(last=False)

  def clear(self) -> None:
    self._entries.clear()
