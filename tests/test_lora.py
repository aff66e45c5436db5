"""Base adapters (LoRA): zero at init, merged exactly for decoding, trained as graft, saved."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hamburger_jax import pretrained
from hamburger_jax.config import GraftConfig, HamburgerConfig, LlamaConfig
from hamburger_jax.model import lora
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import GraftParam
from hamburger_jax.testing import sharpen

CFG = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
                  num_kv_heads=2, max_position_embeddings=256)
GRAFT = GraftConfig(merger_head_dim=16, base_lora_rank=4, base_lora_alpha=8.0)
IDS = jnp.asarray([[1, 5, 9, 33, 2, 77, 10, 3]])


def _model(perturb: bool) -> Hamburger:
  m = Hamburger(HamburgerConfig(CFG, GRAFT), rngs=nnx.Rngs(0))
  sharpen(m, 8.0)
  sharpen(m.micro.stop_head, 3.0)
  if perturb:  # a trained-looking adapter (b is zero at init)
    for i, lin in enumerate(lora.base_linears(m.base)):
      lin.lora.b.set_value(0.05 * jax.random.normal(jax.random.key(i), lin.lora.b.shape))
  return m


def test_adapters_start_at_zero_and_cover_every_projection():
  m = _model(perturb=False)
  plain = lora.without_adapters(m, merge=False)
  assert len(lora.base_linears(m.base)) == 7 * CFG.num_layers
  np.testing.assert_array_equal(np.asarray(m.base(IDS)), np.asarray(plain.base(IDS)))
  assert all(isinstance(lin.lora.b, GraftParam) for lin in lora.base_linears(m.base))


def test_merge_and_drop():
  m = _model(perturb=True)
  with_adapters = np.asarray(m.base(IDS))
  merged = np.asarray(lora.without_adapters(m, merge=True).base(IDS))
  dropped = np.asarray(lora.without_adapters(m, merge=False).base(IDS))
  np.testing.assert_allclose(merged, with_adapters, atol=1e-4)
  assert np.abs(dropped - with_adapters).max() > 0.1  # the adapter matters
  # Dropping gives the base back exactly: a model built without adapters, same seed.
  plain = Hamburger(HamburgerConfig(CFG, GraftConfig(merger_head_dim=16)), rngs=nnx.Rngs(0))
  sharpen(plain, 8.0)
  np.testing.assert_array_equal(dropped, np.asarray(plain.base(IDS)))


def test_graft_checkpoint_holds_the_adapters(tmp_path):
  src = _model(perturb=True)
  pretrained.save_graft(src, str(tmp_path / "c"), "random", dtype="float32")
  dst = _model(perturb=False)
  pretrained.load_graft(dst, str(tmp_path / "c"))
  np.testing.assert_array_equal(np.asarray(dst.base(IDS)), np.asarray(src.base(IDS)))
