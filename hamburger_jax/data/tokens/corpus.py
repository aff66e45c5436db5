"""Training conversations as token ids on disk: whole multi-turn chats, rendered once, in samples
of at most max_len tokens, with every assistant response's span marked.

`train.token_corpus` is the command line (`hamburger_jax.data.tokens.build` builds it). A corpus
is a directory of flat numpy arrays that a trainer memory-maps (`TokenCorpus.load`) and cuts into
rows without tokenising anything:

  tokens.npy     uint16 [N] (uint32 for vocabularies over 65,536): the samples' ids, concatenated
  samples.npy    int64 [S, 2]: (start, length) of each sample in tokens, contiguous, in order
  responses.npy  int64 [T, 3]: (sample, start, end) of each assistant response, absolute and
                 half-open: the turn's content ids and its end-of-turn id (none if the response
                 was truncated to fit max_len); ordered by sample then start
  split.npy      uint8 [S]: 0 train, 1 validation (all samples of a conversation share it)
  source.npy     uint8 [S]: index into meta["sources"]
  meta.json      written last: its presence marks the corpus complete (FORMAT, counts, settings)

A sample is the chat template's system line followed by consecutive (user, assistant) pairs of
one conversation, so it equals `tokenizer.apply_chat_template` of those messages (a sample whose
one response was truncated to fit: the start of it), and the ids before each response equal the
prompt the engine builds for them (add_generation_prompt=True).
A conversation longer than max_len is cut into several samples at pair boundaries; each repeats
the system line (the earlier pairs are then out of sight, as in any fixed-context training).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

from hamburger_jax import files

FORMAT = "hamburger-token-corpus/1"
META_FILE = "meta.json"
ARRAYS = ("tokens", "samples", "responses", "split", "source")
SPLITS = ("train", "validation")


class CorpusError(ValueError):
  """A token corpus cannot be built or read; the message names what was wrong and what to do."""


@dataclasses.dataclass(frozen=True, eq=False)
class TokenCorpus:
  """A built corpus: the arrays of the module docstring (memory-mapped by default) and its meta."""

  tokens: np.ndarray
  samples: np.ndarray
  responses: np.ndarray
  split: np.ndarray
  source: np.ndarray
  meta: dict

  @classmethod
  def load(cls, path: str, mmap: bool = True) -> "TokenCorpus":
    """Opens the corpus at `path`; CorpusError if it is missing, unfinished or of another format."""
    rebuild = f"build it with: python -m train.token_corpus --out {path}"
    if not os.path.isdir(path):
      raise CorpusError(f"{path} is not a token corpus (no such directory); {rebuild}")
    meta_path = os.path.join(path, META_FILE)
    if not os.path.exists(meta_path):
      raise CorpusError(f"{path} is not a finished token corpus (no {META_FILE}: the build was "
                        f"stopped, or this is another kind of directory); {rebuild} --overwrite")
    try:
      with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    except json.JSONDecodeError as e:
      raise CorpusError(f"{meta_path} is not valid JSON ({e}); {rebuild} --overwrite") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
      found = meta.get("format") if isinstance(meta, dict) else None
      raise CorpusError(f"{path} holds format {found!r}, this code reads {FORMAT!r}; {rebuild} "
                        "--overwrite")
    arrays = {}
    for name in ARRAYS:
      file = os.path.join(path, f"{name}.npy")
      if not os.path.exists(file):
        raise CorpusError(f"{path} lacks {name}.npy (a partial copy?); copy the whole directory "
                          f"again or {rebuild} --overwrite")
      arrays[name] = np.load(file, mmap_mode="r" if mmap else None)
    corpus = cls(meta=meta, **arrays)
    corpus._check(path, rebuild)
    return corpus

  def _check(self, path: str, rebuild: str) -> None:
    s, n = self.meta.get("samples"), self.meta.get("tokens")
    problems = []
    if self.samples.ndim != 2 or self.samples.shape[1:] != (2,) or len(self.samples) != s:
      problems.append(f"samples.npy has shape {self.samples.shape}, meta says {s} samples")
    if self.responses.ndim != 2 or self.responses.shape[1:] != (3,):
      problems.append(f"responses.npy has shape {self.responses.shape}, expected [T, 3]")
    if self.tokens.ndim != 1 or len(self.tokens) != n:
      problems.append(f"tokens.npy has shape {self.tokens.shape}, meta says {n} tokens")
    for name in ("split", "source"):
      if getattr(self, name).shape != (s,):
        problems.append(f"{name}.npy has shape {getattr(self, name).shape}, expected ({s},)")
    if problems:
      raise CorpusError(f"{path} is inconsistent: {'; '.join(problems)}; {rebuild} --overwrite")

  def sample_ids(self, split: str) -> np.ndarray:
    """Indices of the samples of `split` ("train" or "validation"), ascending."""
    if split not in SPLITS:
      raise CorpusError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    return np.flatnonzero(np.asarray(self.split) == SPLITS.index(split))

  def sample(self, i: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(token ids of sample i as int32, [(start, end), ...] of its responses relative to the
    sample's first token)."""
    if not 0 <= i < len(self.samples):
      raise IndexError(f"sample {i} is outside [0, {len(self.samples)})")
    start, length = (int(x) for x in self.samples[i])
    ids = np.asarray(self.tokens[start:start + length], np.int32)
    which = np.asarray(self.responses[:, 0])
    lo, hi = np.searchsorted(which, i, "left"), np.searchsorted(which, i, "right")
    spans = [(int(a) - start, int(b) - start) for a, b in np.asarray(self.responses[lo:hi, 1:])]
    return ids, spans

  @property
  def response_tokens(self) -> int:
    return int(self.meta["response_tokens"])


# Text whose ids depend on the merges and the pre-tokenizer (digits, whitespace runs, code,
# non-ASCII), which the vocabulary alone does not show.
_FINGERPRINT_PROBE = ("Hello, world! 12345 + 6.78 = ?\n\n  def f(x):\n\treturn x**2  # done\n"
                      "Ünïcödé 東京 🙂 naïve café -- 'quoted' \"text\" 1,000,000")


def tokenizer_fingerprint(tokenizer) -> str:
  """A short id of the tokenizer: sha256 of its vocabulary, of the ids of a probe text (merges
  and pre-tokenizer) and of its chat template, which all decide the ids. Compare it before
  training a model on a corpus: ids from another tokenizer would be read silently."""
  h = hashlib.sha256()
  for i in range(tokenizer.vocab_size):
    h.update(tokenizer.id_to_token(i).encode() + b"\n")
  h.update(np.asarray(tokenizer.encode(_FINGERPRINT_PROBE), np.int64).tobytes())
  h.update(b"\0" + (tokenizer.chat_template or "").encode())
  return h.hexdigest()[:16]


def write_arrays(out_dir: str, arrays: dict[str, np.ndarray], meta: dict) -> dict:
  """Writes a corpus from its arrays (ARRAYS: tokens, samples, responses, split, source) and
  `meta` (the counts are filled in here), atomically; returns the meta. For corpora made
  without a tokenizer (synthetic ids)."""
  missing = [n for n in ARRAYS if n not in arrays]
  if missing:
    raise CorpusError(f"write_arrays needs {', '.join(missing)}")
  resp = arrays["responses"]
  meta = {**meta, "format": FORMAT, "samples": len(arrays["samples"]),
          "tokens": len(arrays["tokens"]),
          "response_tokens": int((resp[:, 2] - resp[:, 1]).sum()) if len(resp) else 0,
          "validation_samples": int(np.sum(arrays["split"]))}

  def write(tmp: str) -> None:
    for name in ARRAYS:
      np.save(os.path.join(tmp, f"{name}.npy"), arrays[name])
    files.write_json_atomic(os.path.join(tmp, META_FILE), meta, indent=1)

  files.write_dir_atomic(out_dir, write)
  return meta
