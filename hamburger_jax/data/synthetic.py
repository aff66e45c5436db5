"""Synthetic samples: responses that count upward from a prompt-dependent start, split into
random groups. Learnable token patterns for a model without a tokenizer: the tiny config's
training data and prompts, the benches' samples, the tests."""

from __future__ import annotations

import numpy as np

from hamburger_jax.data.tfds_builder import build_dataset


def synthetic_samples(n: int, vocab: int, max_group: int, seed: int = 0,
                      prompt_len: tuple[int, int] = (4, 12),
                      response_len: tuple[int, int] = (8, 40)) -> list[dict]:
  """Responses that count upward mod (vocab - 3) from a prompt-dependent start (so the next
  tokens are predictable and the graft has something to learn), split into random groups."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    p = int(rng.integers(*prompt_len))
    r = int(rng.integers(*response_len))
    prompt = rng.integers(3, vocab, size=p)
    start = int(prompt[-1])
    response = 3 + (start + np.arange(r)) % (vocab - 3)
    groups, left = [], r
    while left:
      g = int(min(left, rng.integers(1, max_group + 1)))
      groups.append(g)
      left -= g
    out.append({"input_ids": np.concatenate([prompt, response]).astype(np.int32),
                "prompt_len": p, "groups": groups, "source": "synthetic"})
  return out


def build_synthetic_dataset(out_dir: str, vocab: int, max_group: int, n_train: int = 256,
                            n_val: int = 32, seed: int = 0, overwrite: bool = False) -> str:
  train = synthetic_samples(n_train, vocab, max_group, seed)
  val = synthetic_samples(n_val, vocab, max_group, seed + 1)
  return build_dataset(out_dir, {"train": lambda: train, "validation": lambda: val},
                       max_group=max_group, metadata={"source": "synthetic"}, overwrite=overwrite)


def write_synthetic_corpus(out_dir: str, vocab: int, n: int = 256, seed: int = 0,
                           validation: float = 0.1) -> dict:
  """A token corpus (hamburger_jax.data.tokens.corpus) of `synthetic_samples`, two of them a
  conversation (two responses a sample): what the tiny window trains on without a tokenizer."""
  from hamburger_jax.data.tokens import corpus as token_corpus  # pylint: disable=C0415
  pieces, samples, responses = [], [], []
  start = 0
  parts = synthetic_samples(2 * n, vocab, 4, seed, prompt_len=(3, 8), response_len=(6, 30))
  for i in range(n):
    sample_start = start
    for part in parts[2 * i:2 * i + 2]:
      ids = part["input_ids"]
      p = int(part["prompt_len"])
      responses.append((i, start + p, start + len(ids)))
      pieces.append(ids)
      start += len(ids)
    samples.append((sample_start, start - sample_start))
  rng = np.random.default_rng(seed)
  arrays = {"tokens": np.concatenate(pieces).astype(np.uint16),
            "samples": np.asarray(samples, np.int64),
            "responses": np.asarray(responses, np.int64),
            "split": (rng.random(n) < validation).astype(np.uint8),
            "source": np.zeros(n, np.uint8)}
  resp = arrays["responses"]
  meta = {"vocab_size": vocab, "tokenizer": None, "sources": ["synthetic"],
          "max_len": int(max(l for _, l in samples)),
          "per_source": {"synthetic": {"samples": n,
                                       "response_tokens": int((resp[:, 2] - resp[:, 1]).sum())}}}
  return token_corpus.write_arrays(out_dir, arrays, meta)
