"""Packed batches of token-id samples for the teacher in the step (hamburger_jax.objectives.online_teacher).

A sample is a token sequence with its assistant responses marked (spans) and each response
token's group start (the boundaries of hamburger_jax.data.tokens.boundaries): a multi-turn
conversation is one sample, every response of it smashed into groups, every other token (the
template, the user's turns) one unmerged entry. Laid out as docs/SPEC.md 1.2 and 2.2 generalised
to several responses: an entry's RoPE position is its last token's, and a group is predicted by
the entry just before it (the last prompt token, or the previous group of the same response).

A row packs samples (segments) under three limits, all static shapes: `tokens` unmerged tokens
(the teacher's row), `entries` HAMburger entries and `groups` predicted groups. Everything is
vectorised NumPy over a row: batches are made on the host while the accelerator runs the
previous step.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from hamburger_jax.layout import LayoutError


@dataclasses.dataclass(frozen=True)
class TokenSample:
  tokens: np.ndarray  # [n] int32
  spans: tuple[tuple[int, int], ...]  # responses [start, end) in the sample, start >= 1
  group_start: np.ndarray  # [n] bool: the token opens a group (read on response tokens only)

  @property
  def response_tokens(self) -> int:
    return sum(e - s for s, e in self.spans)

  def size(self) -> tuple[int, int, int]:
    """(tokens, entries, groups) the sample takes in a row."""
    resp = np.zeros(len(self.tokens), bool)
    for s, e in self.spans:
      resp[s:e] = True
    starts = self._starts(resp)
    groups = int(np.count_nonzero(starts & resp))
    return len(self.tokens), int(len(self.tokens) - resp.sum()) + groups, groups

  def _starts(self, resp: np.ndarray) -> np.ndarray:
    starts = np.asarray(self.group_start, bool) & resp
    for s, _ in self.spans:
      starts[s] = True  # a response opens its first group whatever the boundaries say
    return starts


def layout_row(samples: Sequence[TokenSample], max_group: int) -> dict[str, np.ndarray]:
  """One row's fields, unpadded: the entries' (input_ids, input_size, positions, segment_ids),
  the groups' (pred_index, target_ids, target_size, window_ids, window_size, teacher_index) and
  the unmerged row's (tokens, token_segment)."""
  k = max_group
  tok = np.concatenate([s.tokens for s in samples]).astype(np.int32)
  t = len(tok)
  lengths = np.array([len(s.tokens) for s in samples])
  offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  seg = np.repeat(np.arange(1, len(samples) + 1, dtype=np.int32), lengths)
  pos = (np.arange(t) - np.repeat(offsets, lengths)).astype(np.int32)
  resp = np.zeros(t, bool)
  span_end = np.zeros(t, np.int64)
  starts = np.zeros(t, bool)
  for o, s in zip(offsets, samples):
    for a, b in s.spans:
      if not 1 <= a < b <= len(s.tokens):
        raise LayoutError(f"response span [{a}, {b}) is outside its sample of {len(s.tokens)} "
                          "tokens or has no token before it to predict it")
      resp[o + a:o + b] = True
      span_end[o + a:o + b] = o + b
      starts[o + a] = True
  starts |= np.concatenate([np.asarray(s.group_start, bool) for s in samples]) & resp
  entry_tok = np.flatnonzero(~resp | starts)  # each entry's first token, in order
  size = np.diff(np.append(entry_tok, t))
  if size.max(initial=1) > k:
    raise LayoutError(f"a group of {int(size.max())} tokens exceeds max_group={k}: the "
                      "boundaries were made for a larger K")
  step = np.arange(k)
  idx = np.minimum(entry_tok[:, None] + step, t - 1)
  input_ids = np.where(step < size[:, None], tok[idx], 0).astype(np.int32)
  ge = np.flatnonzero(resp[entry_tok])  # the entries that are response groups
  t0 = entry_tok[ge]
  window_size = np.minimum(k, span_end[t0] - t0)
  w = t0[:, None] + step
  inside = step < window_size[:, None]
  return {
      "input_ids": input_ids, "input_size": size.astype(np.int32),
      "positions": pos[entry_tok + size - 1], "segment_ids": seg[entry_tok],
      "pred_index": (ge - 1).astype(np.int32), "target_ids": input_ids[ge],
      "target_size": size[ge].astype(np.int32),
      "window_ids": np.where(inside, tok[np.minimum(w, t - 1)], 0).astype(np.int32),
      "window_size": window_size.astype(np.int32),
      "teacher_index": np.where(inside, w - 1, (t0 - 1)[:, None]).astype(np.int32),
      "tokens": tok, "token_segment": seg}


# Per field: which of the row's limits pads it (tokens, entries or groups), and its trailing
# shape in units of max_group.
_PAD = {"input_ids": "entries", "input_size": "entries", "positions": "entries",
        "segment_ids": "entries", "pred_index": "groups", "target_ids": "groups",
        "target_size": "groups", "window_ids": "groups", "window_size": "groups",
        "teacher_index": "groups", "tokens": "tokens", "token_segment": "tokens"}


def pack_batch(rows: Sequence[Sequence[TokenSample]], *, tokens: int, entries: int, groups: int,
               max_group: int) -> dict[str, np.ndarray]:
  """Rows of samples -> a static-shape batch [len(rows), ...] (zeros pad; a padding group has
  window_size 0, a padding entry input_size 0 and segment 0)."""
  limits = {"tokens": tokens, "entries": entries, "groups": groups}
  out: dict[str, np.ndarray] = {}
  for r, row in enumerate(rows):
    fields = layout_row(row, max_group) if row else None
    for name, limit in _PAD.items():
      n = limits[limit]
      if name not in out:
        tail = (max_group,) if name in ("input_ids", "target_ids", "window_ids",
                                        "teacher_index") else ()
        out[name] = np.zeros((len(rows), n, *tail), np.int32)
      if fields is None:
        continue
      v = fields[name]
      if len(v) > n:
        raise LayoutError(f"row {r} holds {len(v)} {limit} but the batch has room for {n}: "
                          f"pack it with the same limits")
      out[name][r, :len(v)] = v
  return out


def pack_rows(samples: Iterable[TokenSample], *, rows: int, tokens: int, entries: int,
              groups: int, misses: int = 16,
              oversize: Callable[[TokenSample], None] | None = None
              ) -> Iterator[list[list[TokenSample]]]:
  """Batches of `rows` rows from a stream of samples, first fit: a sample goes to the first row
  with room for its tokens, entries and groups; after `misses` samples in a row fit nowhere the
  batch is closed and they open the next ones. A sample larger than a row is an error, or, given
  `oversize`, handed to it and left out (a long answer of single-token groups can need more
  groups than a row has, where rows are sized for the usual ones)."""
  limit = np.array([tokens, entries, groups])
  batch: list[list[TokenSample]] = [[] for _ in range(rows)]
  used = np.zeros((rows, 3), np.int64)
  waiting: list[tuple[TokenSample, np.ndarray]] = []
  source = iter(samples)
  done = False
  while not done or waiting:
    pending, waiting = waiting, []
    missed = 0
    while True:
      if pending:
        s, size = pending.pop(0)
      else:
        s = next(source, None)
        if s is None:
          done = True
          break
        size = np.array(s.size())
        if np.any(size > limit) and oversize is not None:
          oversize(s)
          continue
        if np.any(size > limit):
          raise LayoutError(f"a sample takes (tokens, entries, groups) {tuple(size)}, more "
                            f"than a row's {tuple(limit)}: make rows larger or samples shorter")
      fits = np.flatnonzero(np.all(used + size <= limit, axis=1))
      if len(fits):
        batch[fits[0]].append(s)
        used[fits[0]] += size
        continue
      waiting.append((s, size))
      missed += 1
      if missed >= misses:
        waiting.extend(pending)
        break
    if any(batch):
      yield batch
    batch = [[] for _ in range(rows)]
    used[:] = 0
    if done and not waiting:
      break
