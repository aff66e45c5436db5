"""Group boundaries at accelerator speed: the batched pass gives the groups the data
preparation's segmentation gives (the same base statistics, the same `confident:p` rule)."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from hamburger_jax import precision, segmentation
from hamburger_jax.config import LlamaConfig
from hamburger_jax.data.tokens.boundaries import boundary_pass, pair_rows
from hamburger_jax.model.llama import Llama

CFG = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, max_position_embeddings=128)


def _groups(starts: np.ndarray) -> list[int]:
  idx = np.flatnonzero(starts)
  return np.diff(np.append(idx, len(starts))).tolist()


def _confident_loop(p, max_group: int, threshold: float) -> list[int]:
  """The rule as docs/method.md states it, token by token: the reference."""
  sizes: list[int] = []
  for j, x in enumerate(p):
    if j and sizes[-1] < max_group and x >= threshold:
      sizes[-1] += 1
    else:
      sizes.append(1)
  return sizes


@pytest.mark.parametrize("threshold", [0.3, 0.6, 0.95])
def test_vectorised_rule_is_the_segmentation_rule(threshold):
  rng = np.random.default_rng(0)
  for _ in range(20):
    n = int(rng.integers(1, 40))
    p = rng.random(n)
    assert segmentation.confident(p, 4, threshold) == _confident_loop(p, 4, threshold)
  # Several responses at once: each opens its own groups; tokens off them open none.
  p = rng.random(30)
  resp, first = np.zeros(30, bool), np.zeros(30, bool)
  resp[3:12] = resp[15:30] = True
  first[[3, 15]] = True
  starts = segmentation.confident_starts(p, resp, first, 4, threshold)
  assert not starts[~resp].any()
  assert _groups(starts[3:12]) == _confident_loop(p[3:12], 4, threshold)
  assert _groups(starts[15:30]) == _confident_loop(p[15:30], 4, threshold)


def test_pair_rows_holds_every_sample_once_within_the_row():
  lengths = np.random.default_rng(1).integers(1, 50, 300)
  rows = pair_rows(lengths, 64)
  assert sorted(i for r in rows for i in r) == list(range(300))
  assert all(lengths[r].sum() <= 64 for r in rows)
  assert len(rows) <= 1.3 * lengths.sum() / 64 + 1  # dense enough to be worth a pass


def test_boundary_pass_equals_the_teacher_pass_segmentation():
  base = Llama(CFG, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(2)
  pieces, samples, responses, pairs = [], [], [], []
  start = 0
  for i in range(9):
    p, r = int(rng.integers(1, 10)), int(rng.integers(1, 25))
    prompt, response = rng.integers(0, CFG.vocab_size, p), rng.integers(0, CFG.vocab_size, r)
    pieces.append(np.concatenate([prompt, response]))
    samples.append((start, p + r))
    responses.append((i, start + p, start + p + r))
    pairs.append((prompt, response))
    start += p + r
  tokens = np.concatenate(pieces).astype(np.uint16)
  samples, responses = np.asarray(samples), np.asarray(responses)
  with precision.matmuls("highest"):
    want = segmentation.response_token_stats(base, pairs)
    # Half the tokens above it: groups of every size.
    threshold = float(np.median(np.concatenate([st.prob[1:] for st in want])))
    starts, stats = boundary_pass(base, tokens, samples, responses, range(9), row_len=64,
                                  rows_per_pass=2, max_group=4, threshold=threshold)
  total = []
  for (_, a, b), st in zip(responses, want):
    got = _groups(starts[a:b])
    assert got == segmentation.confident(st.prob, 4, threshold)
    total += got
  assert max(total) > 1  # merges happened
  assert stats.response_tokens == sum(b - a for _, a, b in responses)
  assert stats.groups == len(total) and stats.passes >= 2
  assert stats.tokens == len(tokens)
  # Tokens off the chosen samples' responses are never group starts.
  assert starts[:responses[0, 1]].sum() == 0
