"""Teacher-forced agreement across decoding dtypes (evaluation/dtype_agreement.py): forcing a
decoded sequence with its own groups predicts what decoding emitted, so that bfloat16 and
float32 are compared at the same inputs and merge decisions."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from hamburger_jax.config import GraftConfig, HamburgerConfig
from hamburger_jax.evaluation import dtype_agreement
from hamburger_jax.model import lora
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.testing import DECODE_CFG, sharpen

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]


@pytest.fixture(scope="module")
def decoded():
  """A sharpened tiny HAMburger with non-zero adapters, and its float32 sequences."""
  model = Hamburger(HamburgerConfig(DECODE_CFG, GraftConfig(merger_head_dim=16, base_lora_rank=4)),
                    rngs=nnx.Rngs(0))
  sharpen(model, 8.0)
  sharpen(model.micro.stop_head, 3.0)
  for i, lin in enumerate(lora.base_linears(model.base)):
    lin.lora.b.set_value(0.05 * jax.random.normal(jax.random.key(i), lin.lora.b.shape))
  return model, dtype_agreement.float32_sequences(model, PROMPTS, 12, (0.5, 0.0))


def test_forcing_a_sequence_predicts_what_decoding_emitted(decoded):
  model, seqs = decoded
  assert set(seqs) == {"base", "hamburger c=0.5", "hamburger c=0"}
  assert all(s.groups == (1,) * 12 for s in seqs["base"])
  assert any(max(s.groups) == model.max_group for s in seqs["hamburger c=0"])
  for name, rows in seqs.items():
    r = dtype_agreement.agreement(model, rows, "float32")
    assert r["forced_vs_decoded"] == 1.0, name
    assert (r["tokens"], r["agree"]) == (12 * len(PROMPTS), 1.0), name


def test_bfloat16_agreement_counts_tokens_after_merged_entries(decoded):
  model, seqs = decoded
  base = dtype_agreement.agreement(model, seqs["base"], "bfloat16")
  assert base["merged"] is None and base["merged_tokens"] == 0
  forced = dtype_agreement.agreement(model, seqs["hamburger c=0"], "bfloat16")
  assert forced["merged_tokens"] > 0 and 0.0 <= forced["merged"] <= 1.0
  n = forced["tokens"]
  mixed = (forced["merged"] * forced["merged_tokens"]
           + forced["unmerged"] * (n - forced["merged_tokens"])) / n
  assert forced["agree"] == pytest.approx(mixed)
