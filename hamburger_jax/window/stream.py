"""A window's training batches: token-id samples of a corpus (hamburger_jax.data.tokens.corpus)
with their group starts (hamburger_jax.data.tokens.boundaries), packed
(hamburger_jax.data.tokens.online_batch) on a host thread while the accelerator runs the
previous steps."""

from __future__ import annotations

import queue
import threading
from typing import Iterator, Sequence

import numpy as np

from hamburger_jax.data.tokens.online_batch import TokenSample, pack_batch, pack_rows
from hamburger_jax.run_config import RunConfig

RESPONSE_TOKENS = "response_tokens"  # a batch's count of trained tokens (host side only)
PREFETCH = 8  # batches made ahead


class Samples:
  """TokenSamples of a corpus's arrays and a group-start array over its tokens."""

  def __init__(self, tokens: np.ndarray, samples: np.ndarray, responses: np.ndarray,
               starts: np.ndarray):
    self.tokens, self.samples, self.responses, self.starts = tokens, samples, responses, starts
    bounds = np.searchsorted(responses[:, 0], np.arange(len(samples) + 1))
    self._first, self._end = bounds[:-1], bounds[1:]

  def __call__(self, i: int) -> TokenSample:
    start, n = (int(x) for x in self.samples[i])
    spans = tuple((int(a) - start, int(b) - start)
                  for _, a, b in self.responses[self._first[i]:self._end[i]])
    return TokenSample(np.asarray(self.tokens[start:start + n], np.int32), spans,
                       self.starts[start:start + n].astype(bool))

  def lengths(self, ids: Sequence[int]) -> np.ndarray:
    return self.samples[np.asarray(ids, np.int64), 1]

  def response_lengths(self, ids: Sequence[int]) -> np.ndarray:
    """Response tokens of each sample `ids`."""
    per = np.zeros(len(self.samples), np.int64)
    np.add.at(per, self.responses[:, 0], self.responses[:, 2] - self.responses[:, 1])
    return per[np.asarray(ids, np.int64)]

  def prompt(self, i: int) -> np.ndarray:
    """Sample i's tokens before its first response (the history its first answer follows)."""
    start = int(self.samples[i, 0])
    if self._first[i] == self._end[i]:
      return np.zeros(0, np.int32)
    return np.asarray(self.tokens[start:int(self.responses[self._first[i], 1])], np.int32)

  def extended(self, tokens: np.ndarray, samples: np.ndarray, responses: np.ndarray,
               starts: np.ndarray) -> "Samples":
    """These samples followed by more (arrays of the same layout, indices from 0): the new
    ones are numbered from len(self.samples) on."""
    n, at = len(self.samples), len(self.tokens)
    return Samples(np.concatenate([self.tokens, tokens.astype(self.tokens.dtype)]),
                   np.concatenate([self.samples, samples + [at, 0]]),
                   np.concatenate([self.responses, responses + [n, at, at]]),
                   np.concatenate([self.starts, starts.astype(self.starts.dtype)]))


def mix(answer_ids: np.ndarray, corpus_ids: np.ndarray, samples: Samples, share: float,
        rng: np.random.Generator) -> np.ndarray:
  """The training order: the answers shuffled with the first corpus samples that hold
  (1 - share) / share of the answers' response tokens, then the other corpus samples in
  their order."""
  answered = int(samples.response_lengths(answer_ids).sum())
  want = answered * (1 - share) / max(share, 1e-9)
  k = int(np.searchsorted(np.cumsum(samples.response_lengths(corpus_ids)), want))
  return np.concatenate([rng.permutation(np.concatenate([answer_ids, corpus_ids[:k]])),
                         corpus_ids[k:]])


def batches(samples: Samples, ids: Sequence[int], cfg: RunConfig,
            left_out: list[TokenSample] | None = None) -> Iterator[dict]:
  """Static-shape batches of the samples `ids` in order (the last, partial one too), each with
  its response-token count under RESPONSE_TOKENS. Samples larger than a row go to `left_out`
  (else they are an error)."""
  d, k = cfg.data, cfg.graft.max_group
  limits = dict(tokens=d.row_tokens, entries=d.entries, groups=d.groups)
  for rows in pack_rows((samples(i) for i in ids), rows=d.rows,
                        oversize=None if left_out is None else left_out.append, **limits):
    batch = pack_batch(rows, max_group=k, **limits)
    batch[RESPONSE_TOKENS] = sum(s.response_tokens for row in rows for s in row)
    yield batch


class Prefetch:
  """Iterates `it` on a thread, PREFETCH items ahead; an error there is raised here."""

  def __init__(self, it: Iterator):
    self._q: queue.Queue = queue.Queue(PREFETCH)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, args=(it,), daemon=True)
    self._thread.start()

  def _run(self, it: Iterator) -> None:
    try:
      for item in it:
        while not self._stop.is_set():
          try:
            self._q.put(("item", item), timeout=0.1)
            break
          except queue.Full:
            continue
        if self._stop.is_set():
          return
      self._q.put(("end", None))
    except BaseException as e:  # pylint: disable=broad-except
      self._q.put(("error", e))

  def __iter__(self):
    return self

  def __next__(self):
    kind, item = self._q.get()
    if kind == "end":
      raise StopIteration
    if kind == "error":
      raise item
    return item

  def close(self) -> None:
    self._stop.set()
