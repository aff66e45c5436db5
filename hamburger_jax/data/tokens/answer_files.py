"""The base's answers made in one window, kept as files for the next: token ids with their group
starts, in files of at most 16 MiB (what comes back from an accelerator machine per file).

Each file `answers-NNNNN.npz` holds whole samples in a token corpus's layout (data/tokens/
answers.Answers): `tokens` (uint16 when the vocabulary fits, else uint32), `samples` [S, 2],
`responses` [S, 3], `starts` (bit-packed group starts), and `prompts` [S]: the corpus samples
whose prompts were answered, so a later window answers other prompts, and `meta` (the format,
the vocabulary, the tokenizer's fingerprint and the corpus's, `corpus_fingerprint`): each file
stands alone, and no index file counts against the few files a call brings back. A window given
such a directory (--answers-in) trains on them beside the answers it makes: windows add data,
not only steps. The prompt ids are sample numbers of the corpus the answers were made from, so
answers are read only beside that corpus: with another one they would mark its samples answered.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Sequence

import numpy as np

from hamburger_jax import files
from hamburger_jax.data.tokens.answers import Answers

PATTERN = "answers-*.npz"
FORMAT = "hamburger-answers/1"
MAX_FILE_MB = 16.0
NPZ_OVERHEAD = 4096  # bytes of zip entries and array headers in a file (six arrays)


class AnswerFilesError(ValueError):
  """Answer files that cannot be read or do not fit; the message says what to do."""


def corpus_fingerprint(tokens: np.ndarray, samples: np.ndarray, responses: np.ndarray) -> str:
  """A short id of a token corpus (data/tokens/corpus.TokenCorpus's arrays): sha256 of its
  samples' tokens, bounds and response spans, which decide what its sample ids name. A rebuilt
  corpus of the same samples has the same one."""
  h = hashlib.sha256()
  for a in (tokens, samples, responses):
    a = np.ascontiguousarray(a)
    h.update(f"{a.dtype.str}{a.shape}".encode())
    for at in range(0, len(a), 1 << 22):  # in slices: a memory-mapped corpus stays on disk
      h.update(a[at:at + (1 << 22)].tobytes())
  return h.hexdigest()[:16]


def _id_dtype(vocab_size: int):
  return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _bytes_per_token(vocab_size: int) -> float:
  # the id, its bit-packed start, and a sample's rows spread over its tokens (a few bytes)
  return np.dtype(_id_dtype(vocab_size)).itemsize + 1 / 8


def save(answers: Answers, prompts: Sequence[int], directory: str, *, vocab_size: int,
         tokenizer: str | None, corpus: str, max_file_mb: float = MAX_FILE_MB) -> list[str]:
  """Writes `answers` (and the ids of their prompts' samples in the corpus of fingerprint
  `corpus`, one per answer) in files of at most `max_file_mb` MiB; returns the paths written."""
  n = len(answers.samples)
  if len(prompts) != n:
    raise ValueError(f"{len(prompts)} prompt ids for {n} answers: give one per answer")
  os.makedirs(directory, exist_ok=True)
  budget = int(max_file_mb * 2**20) - NPZ_OVERHEAD
  if budget <= 0:
    raise ValueError(f"max_file_mb={max_file_mb} leaves no room past a file's headers")
  lengths = answers.samples[:, 1]
  cost = lengths * _bytes_per_token(vocab_size) + 48  # + a sample's rows and prompt (6 int64)
  meta = json.dumps({"format": FORMAT, "vocab_size": vocab_size, "tokenizer": tokenizer,
                     "corpus_fingerprint": corpus})
  paths, first = [], 0
  while first < n:
    last = first + max(1, int(np.searchsorted(np.cumsum(cost[first:]), budget, side="right")))
    paths.append(_write_part(answers, prompts, first, min(last, n), directory, len(paths),
                             meta))
    first = last
  return paths


def _write_part(a: Answers, prompts: Sequence[int], first: int, last: int, directory: str,
                k: int, meta: str) -> str:
  t0, t1 = int(a.samples[first, 0]), int(a.samples[last - 1].sum())
  path = os.path.join(directory, f"answers-{k + 1:05d}.npz")
  files.write_atomic(path, lambda tmp: _savez(tmp,
           tokens=a.tokens[t0:t1].astype(_id_dtype(json.loads(meta)["vocab_size"])),
           samples=a.samples[first:last] - [t0, 0],
           responses=a.responses[first:last] - [first, t0, t0],
           starts=np.packbits(a.starts[t0:t1].astype(bool)), n_tokens=np.int64(t1 - t0),
           prompts=np.asarray(prompts[first:last], np.int64), meta=np.asarray(meta)))
  return path


def _savez(path: str, **arrays: np.ndarray) -> None:
  # Through an open file: np.savez appends ".npz" to a name without it.
  with open(path, "wb") as f:
    np.savez(f, **arrays)


def load(directories: Sequence[str], *, vocab_size: int, tokenizer: str | None, corpus: str
         ) -> tuple[Answers, np.ndarray]:
  """The answers of every directory, concatenated (samples numbered from 0), and the sample ids
  of their prompts in the corpus of fingerprint `corpus`: answers made from another corpus are
  an AnswerFilesError."""
  parts, prompts = [], []
  for d in directories:
    names = sorted(glob.glob(os.path.join(d, PATTERN)))
    if not names:
      raise AnswerFilesError(f"{d} holds no {PATTERN}: give the answers/ directory a window "
                             "wrote")
    for path in names:
      try:
        with np.load(path) as z:
          meta = json.loads(str(z["meta"]))
          if meta.get("format") != FORMAT:
            raise AnswerFilesError(f"{path} is not a file of answers ({FORMAT})")
          if meta["vocab_size"] != vocab_size or (tokenizer and meta["tokenizer"] not in
                                                  (None, tokenizer)):
            raise AnswerFilesError(
                f"the answers in {path} were made with another base or tokenizer (vocabulary "
                f"{meta['vocab_size']}, tokenizer {meta['tokenizer']}): leave them out")
          # Files from before the corpus was recorded carry none: their prompts are taken as
          # this corpus's (at worst a few prompts are answered twice, or not at all).
          made_from = meta.get("corpus_fingerprint")
          if made_from not in (None, corpus):
            raise AnswerFilesError(
                f"the answers in {path} answer prompts of another corpus (fingerprint "
                f"{made_from}, this one's {corpus}): their prompt ids would name other samples; "
                "leave them out (--answers-in), or train on the corpus they were made from")
          n = int(z["n_tokens"])
          parts.append(Answers(z["tokens"].astype(np.int32), z["samples"], z["responses"],
                               np.unpackbits(z["starts"])[:n].astype(np.uint8)))
          prompts.append(z["prompts"])
      except (OSError, ValueError, KeyError) as e:
        if isinstance(e, AnswerFilesError):
          raise
        raise AnswerFilesError(f"{path} cannot be read ({e}): bring it back again") from None
  return concatenate(parts), (np.concatenate(prompts) if prompts else np.zeros(0, np.int64))


def concatenate(parts: Sequence[Answers]) -> Answers:
  """Answers one after another, samples and tokens renumbered."""
  tokens, samples, responses, starts = [], [], [], []
  at = n = 0
  for a in parts:
    tokens.append(a.tokens)
    starts.append(a.starts)
    samples.append(a.samples + [at, 0])
    responses.append(a.responses + [n, at, at])
    at += len(a.tokens)
    n += len(a.samples)
  if not parts:
    return Answers(np.zeros(0, np.int32), np.zeros((0, 2), np.int64), np.zeros((0, 3), np.int64),
                   np.zeros(0, np.uint8))
  return Answers(np.concatenate(tokens), np.concatenate(samples), np.concatenate(responses),
                 np.concatenate(starts))
