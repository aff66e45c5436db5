"""The reduced micro-step vocabulary: micro steps 1..K-1 choose among the N most frequent tokens
of the training answers instead of the whole vocabulary.

A micro step is 4 decoder layers and the LM head; on SmolLM2 the head (49,152 x 576) is about
half of it, so restricting the micro steps' head to a few thousand rows makes them much cheaper,
and HAMburger's speed-up k / (1 + (k - 1) r) grows as r falls. Token 0 of every group keeps the
base's full head (it is the base's own prediction), so any token can still be emitted: a token
outside the list only ends its group sooner. It changes what groups may continue with, so it was
measured for quality first (docs/results/decode_speed.md): at DEFAULT_SIZE every task and chat
score stayed within its paired interval of the full head's, and the entry points take the
first DEFAULT_SIZE ids by default where a checkpoint stores that many (hamburger_jax/cli.py).

The list is built from the answers a graft was trained on (`python -m train.micro_vocab`) and
stored with the checkpoint as `micro_vocab.json`: token ids by falling frequency, so any N up to
its length takes the first N. A run started from a checkpoint (train.init_from, a window's
--init-from) exports its graft with that checkpoint's list (`carried`), so the trained graft
decodes by default as its init did, and the two can be judged side by side.
"""

from __future__ import annotations

import json
from typing import Iterable, Sequence

import numpy as np

from hamburger_jax import files

FILE = "micro_vocab.json"
DEFAULT_SIZE = 2048  # the entry points' default (--micro-vocab; 0 there: the full vocabulary)
FORMAT = "hamburger-jax/micro-vocab-v1"


class MicroVocabError(ValueError):
  """A micro-step vocabulary that is missing or does not fit the model (says which and why)."""


def count_tokens(answers: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
  """How often each token id occurs in the answers, [vocab_size] int64."""
  counts = np.zeros((vocab_size,), np.int64)
  for ids in answers:
    ids = np.asarray(ids, np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
      raise MicroVocabError(f"an answer holds token id {int(bad[0])}, outside the vocabulary "
                            f"[0, {vocab_size}): the answers are not this model's tokens")
    np.add.at(counts, ids, 1)
  return counts


def by_frequency(counts: np.ndarray, size: int) -> np.ndarray:
  """The `size` most frequent token ids (ties: the smaller id first), int32."""
  order = np.lexsort((np.arange(counts.size), -counts))
  return order[:size].astype(np.int32)


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
  """Share of the counted answer tokens that are among `ids`."""
  total = counts.sum()
  return float(counts[ids].sum() / total) if total else 0.0


def save(checkpoint: str, counts: np.ndarray, size: int, sources: Sequence[str]) -> dict:
  """Writes the `size` most frequent ids (only ids that occur) into `checkpoint`/FILE,
  atomically; returns what was written."""
  if size < 1:
    raise MicroVocabError(f"size {size} must be >= 1")
  ids = by_frequency(counts, min(size, int((counts > 0).sum())))
  if not ids.size:
    raise MicroVocabError("the answers hold no tokens: nothing to build the list from")
  doc = {"format": FORMAT, "vocab_size": int(counts.size), "answer_tokens": int(counts.sum()),
         "sources": list(sources), "ids": ids.tolist(), "counts": counts[ids].tolist()}
  files.write_json_atomic(files.join(checkpoint, FILE), doc)
  return doc


def stored_size(checkpoint: str) -> int:
  """How many ids `checkpoint`'s list holds (0 without a list; a list that cannot be read is
  `load`'s error, at the load)."""
  path = files.join(checkpoint, FILE)
  if not files.isfile(path):
    return 0
  try:
    return len(json.loads(files.read_text(path))["ids"])
  except (OSError, ValueError, KeyError, TypeError):
    return DEFAULT_SIZE  # so that load says what is wrong with it


def carried(checkpoint: str | None, vocab_size: int) -> str | None:
  """The path of `checkpoint`'s list where a graft trained from that checkpoint carries it into
  its export: the list is token ids, not weights, so it stays the right one for the trained graft
  on a base of the same vocabulary. None without a list, or with one for a vocabulary other than
  `vocab_size` ids (another base's, which the export's graft would not decode with)."""
  if not checkpoint:
    return None
  path = files.join(checkpoint, FILE)
  if not files.isfile(path):
    return None
  try:
    stored = int(json.loads(files.read_text(path))["vocab_size"])
  except (OSError, ValueError, KeyError, TypeError):
    return None  # unreadable: `load` says what is wrong where the checkpoint itself is read
  return path if stored == vocab_size else None


def load(checkpoint: str, size: int, vocab_size: int) -> np.ndarray:
  """The first `size` ids of `checkpoint`'s list, checked against a model of `vocab_size`
  tokens: a missing list, a size it cannot give, or ids the model does not have are errors."""
  path = files.join(checkpoint, FILE)
  if size < 1:
    raise MicroVocabError(f"micro vocabulary size {size} must be >= 1 (leave it unset for the "
                          "full vocabulary)")
  if not files.isfile(path):
    raise MicroVocabError(f"{path} does not exist: build the checkpoint's list with `python -m "
                          f"train.micro_vocab --responses ANSWERS.jsonl --checkpoint {checkpoint}`"
                          " (or decode with the full vocabulary)")
  try:
    doc = json.loads(files.read_text(path))
    stored_vocab, ids = int(doc["vocab_size"]), np.asarray(doc["ids"], np.int64)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise MicroVocabError(f"{path} is not a micro vocabulary list ({e}): rebuild it with "
                          "`python -m train.micro_vocab`") from None
  if doc.get("format") != FORMAT:
    raise MicroVocabError(f"{path} has format {doc.get('format')!r}, not {FORMAT!r}: rebuild it")
  if stored_vocab != vocab_size:
    raise MicroVocabError(f"{path} was built for a vocabulary of {stored_vocab} tokens but the "
                          f"model has {vocab_size}: it belongs to another base model")
  if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= vocab_size:
    raise MicroVocabError(f"{path} holds ids outside [0, {vocab_size}): rebuild it")
  if np.unique(ids).size != ids.size:
    raise MicroVocabError(f"{path} repeats token ids: rebuild it")
  if size > ids.size:
    raise MicroVocabError(f"micro vocabulary size {size} exceeds the {ids.size} ids stored in "
                          f"{path}: use at most {ids.size}, or rebuild it with a larger --size")
  return ids[:size].astype(np.int32)
