"""Merged-entry base adapters (LoRA): zero at init, acting only where the input is a merged
entry, folded exactly on request, trained as graft, saved."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax import graft_checkpoint, pretrained
from hamburger_jax.config import GraftConfig, HamburgerConfig, LlamaConfig
from hamburger_jax.model import lora
from hamburger_jax.model.hamburger import Hamburger, without_adapters
from hamburger_jax.model.llama import GraftParam
from hamburger_jax.testing import sharpen

CFG = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
                  num_kv_heads=2, max_position_embeddings=256)
GRAFT = GraftConfig(merger_head_dim=16, base_lora_rank=4, base_lora_alpha=8.0)
IDS = jnp.asarray([[1, 5, 9, 33, 2, 77, 10, 3]])
EVERYWHERE = jnp.ones(IDS.shape, bool)


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
  plain = without_adapters(m, merge=False)
  assert len(lora.base_linears(m.base)) == 7 * CFG.num_layers
  np.testing.assert_array_equal(np.asarray(m.base(IDS, merged_bt=EVERYWHERE)),
                                np.asarray(plain.base(IDS)))
  assert all(isinstance(lin.lora.b, GraftParam) for lin in lora.base_linears(m.base))


def test_merge_and_drop():
  m = _model(perturb=True)
  with_adapters = np.asarray(m.base(IDS, merged_bt=EVERYWHERE))
  merged = np.asarray(without_adapters(m, merge=True).base(IDS))
  dropped = np.asarray(without_adapters(m, merge=False).base(IDS))
  np.testing.assert_allclose(merged, with_adapters, atol=1e-4)
  assert np.abs(dropped - with_adapters).max() > 0.1  # the adapter matters
  # Dropping gives the base back exactly: a model built without adapters, same seed.
  plain = Hamburger(HamburgerConfig(CFG, GraftConfig(merger_head_dim=16)), rngs=nnx.Rngs(0))
  sharpen(plain, 8.0)
  np.testing.assert_array_equal(dropped, np.asarray(plain.base(IDS)))


def test_graft_checkpoint_holds_the_adapters(tmp_path):
  src = _model(perturb=True)
  graft_checkpoint.save_graft(src, str(tmp_path / "c"), "random", dtype="float32")
  dst = _model(perturb=False)
  pretrained.load_graft(dst, str(tmp_path / "c"))
  np.testing.assert_array_equal(np.asarray(dst.base(IDS, merged_bt=EVERYWHERE)),
                                np.asarray(src.base(IDS, merged_bt=EVERYWHERE)))


def test_adapters_act_only_at_merged_entries():
  """Unmarked inputs run the exact base weights; a marked (merged) entry changes its own output
  and, through attention, what follows it, never what precedes it."""
  m = _model(perturb=True)
  plain = np.asarray(without_adapters(m, merge=False).base(IDS))
  np.testing.assert_array_equal(np.asarray(m.base(IDS)), plain)  # None: the exact base
  nothing = jnp.zeros(IDS.shape, bool)
  np.testing.assert_array_equal(np.asarray(m.base(IDS, merged_bt=nothing)), plain)
  merged = nothing.at[0, 3].set(True)
  got = np.asarray(m.base(IDS, merged_bt=merged))
  np.testing.assert_array_equal(got[0, :3], plain[0, :3])
  assert np.abs(got[0, 3] - plain[0, 3]).max() > 0.1  # the gate is really there
  assert np.abs(got[0, 4:] - plain[0, 4:]).max() > 1e-3  # later tokens read the merged entry
  # Rows are gated independently.
  two = jnp.concatenate([IDS, IDS])
  rows = np.asarray(m.base(two, merged_bt=jnp.concatenate([nothing, merged])))
  np.testing.assert_array_equal(rows[0], plain[0])
  np.testing.assert_array_equal(rows[1], got[0])


def _loss_batch(groups: list[int]) -> dict:
  from hamburger_jax import layout  # pylint: disable=import-outside-toplevel
  prompt = [1, 5, 9, 33]
  response = [(7 * i + 3) % 90 + 2 for i in range(sum(groups))]
  s = layout.layout_sample(prompt, response, groups, GRAFT.max_group)
  return {k: jnp.asarray(v) for k, v in layout.pack_rows([[s]], 16, 8, GRAFT.max_group)
          .as_dict().items() if v is not None}


def test_training_forward_runs_the_exact_base_where_nothing_is_merged():
  from hamburger_jax.objectives.losses import hamburger_loss  # pylint: disable=import-outside-toplevel
  m = _model(perturb=True)
  bare = without_adapters(m, merge=False)
  single = _loss_batch([1] * 6)
  np.testing.assert_array_equal(np.asarray(hamburger_loss(m, single)[0]),
                                np.asarray(hamburger_loss(bare, single)[0]))
  merged = _loss_batch([2, 1, 3])
  assert abs(float(hamburger_loss(m, merged)[0]) - float(hamburger_loss(bare, merged)[0])) > 1e-3
