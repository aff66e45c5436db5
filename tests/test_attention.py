"""Packed rows' attention: cuDNN's fused call (checked through XLA here) against the dense
kernel, the runs it is given, and the run-time choice between them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hamburger_jax.config import LlamaConfig
from hamburger_jax.model import attention
from hamburger_jax.model.attention import (PackedMask, attend, causal_segment_mask,
                                           choose_attention, fused_attention_error,
                                           fused_packed_attention, segment_runs)
from hamburger_jax.model.llama import Llama, set_attention

# Row 0: three segments, then padding (packing puts it last); row 1: two segments, no padding.
SEGMENTS = np.array([[1] * 5 + [2] * 3 + [3] * 4 + [0] * 4,
                     [1] * 11 + [2] * 5], np.int32)
SMOLLM2_HEADS = LlamaConfig(vocab_size=64, hidden_size=576, intermediate_size=64, num_layers=1,
                            num_heads=9, num_kv_heads=3, dtype="bfloat16")
TINY_HEADS = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2, dtype="bfloat16")


def _qkv(fused: bool, h: int = 4, hkv: int = 2, dh: int = 8):
  b, t = SEGMENTS.shape
  keys = jax.random.split(jax.random.key(1), 3)
  q_shape = (b, t, h // hkv, hkv, dh) if fused else (b, t, h, dh)
  return (jax.random.normal(keys[0], q_shape), jax.random.normal(keys[1], (b, t, hkv, dh)),
          jax.random.normal(keys[2], (b, t, hkv, dh)))


def test_segment_runs_are_cudnn_packed_layout():
  lengths, offsets = segment_runs(jnp.asarray(SEGMENTS))
  t = SEGMENTS.shape[1]
  assert lengths.shape == (2, t) and offsets.shape == (2, t + 1)
  np.testing.assert_array_equal(lengths[0, :5], [5, 3, 4, 4, -1])
  np.testing.assert_array_equal(offsets[0, :5], [0, 5, 8, 12, -1])
  np.testing.assert_array_equal(lengths[1, :3], [11, 5, -1])
  np.testing.assert_array_equal(offsets[1, :3], [0, 11, -1])
  assert (lengths[:, 5:] == -1).all() and (offsets[:, 5:] == -1).all()


@pytest.mark.portable
@pytest.mark.parametrize("fused", [False, True])
def test_fused_call_equals_attend_at_segment_tokens(fused):
  """cuDNN's packed call, run through XLA (same operands: layout, runs, scale), equals the
  dense kernel over causal_segment_mask in fp32, GQA, at every token but padding's."""
  q, k, v = _qkv(fused)
  seg = jnp.asarray(SEGMENTS)
  want = attend(q, k, v, causal_segment_mask(seg))
  got = fused_packed_attention(q, k, v, seg, implementation="xla")
  assert got.shape == want.shape
  real = np.asarray(seg > 0)
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5, rtol=1e-5)


def test_packed_mask_forward_equals_dense_mask():
  cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  ids = jax.random.randint(jax.random.key(2), SEGMENTS.shape, 0, 64)
  seg = jnp.asarray(SEGMENTS)
  pos = jnp.broadcast_to(jnp.arange(SEGMENTS.shape[1]), SEGMENTS.shape)
  dense = model.forward(model.embed(ids), pos, causal_segment_mask(seg)).hidden
  packed = model.forward(model.embed(ids), pos, PackedMask(seg)).hidden
  np.testing.assert_array_equal(np.asarray(packed), np.asarray(dense))
  with pytest.raises(ValueError, match="use xla or cudnn"):
    set_attention(model, "flash")


def test_choice_off_a_gpu_is_xla():
  if jax.default_backend() == "gpu":
    pytest.skip("the choice on a GPU is the next test's")
  assert choose_attention("auto", SMOLLM2_HEADS) == ("xla", None)
  assert choose_attention("xla", SMOLLM2_HEADS) == ("xla", None)
  kernel, why = choose_attention("cudnn", SMOLLM2_HEADS)
  assert kernel == "xla" and "not a GPU" in why


@pytest.mark.portable
def test_cudnn_matches_xla_on_a_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("cuDNN runs on a GPU")
  assert fused_attention_error(SMOLLM2_HEADS) is None
  assert choose_attention("auto", SMOLLM2_HEADS) == ("cudnn", None)


def _cudnn_standin(causal: bool):
  """cuDNN's packed call as XLA computes it (or, broken, without the causal part)."""
  def call(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type, qkv_layout):
    del kv_seqlen, kv_offsets, mask_type, qkv_layout
    mask = attention.runs_mask(q_seqlen, q_offsets, q.shape[1])
    if not causal:
      mask = mask | mask.transpose(0, 2, 1)
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale,
                                        implementation="xla")
  return call


@pytest.mark.parametrize("causal", [True, False])
def test_check_accepts_agreement_and_names_a_difference(monkeypatch, causal):
  monkeypatch.setattr(attention.cudnn, "dot_product_attention", _cudnn_standin(causal))
  why = fused_attention_error(TINY_HEADS)
  if causal:
    assert why is None
  else:
    assert why.startswith("output differs from XLA's by")


def test_check_reports_an_error_in_one_line(monkeypatch):
  def fails(*args, **kwargs):
    raise NotImplementedError("Packed layout requires a GPU with at least Hopper architecture.\n"
                              "second line")
  monkeypatch.setattr(attention.cudnn, "dot_product_attention", fails)
  assert fused_attention_error(TINY_HEADS) == (
      "NotImplementedError: Packed layout requires a GPU with at least Hopper architecture.")


def test_auto_keeps_cudnn_only_where_it_is_the_faster(monkeypatch):
  """On a GPU where cuDNN's kernel applies and passes its check, "auto" times both kernels at
  the step's shape and keeps the faster; "cudnn" asked for is kept whatever the timing."""
  monkeypatch.setattr(attention, "fused_unavailable", lambda cfg: None)
  monkeypatch.setattr(attention, "fused_attention_error", lambda cfg: None)
  shapes = []
  def timer(seconds):
    def time_it(cfg, rows, t):
      shapes.append((rows, t))
      return seconds
    return time_it
  slow = timer({"cudnn": 0.0125, "xla": 0.0051})
  kernel, why = choose_attention("auto", SMOLLM2_HEADS, shape=(16, 1024), timer=slow)
  assert kernel == "xla" and shapes == [(16, 1024)]
  assert why == ("slower here: 12.50 ms against XLA's 5.10 ms a forward and backward of one "
                 "layer's attention over 16 packed rows of 1024 tokens")
  fast = timer({"cudnn": 0.002, "xla": 0.005})
  assert choose_attention("auto", SMOLLM2_HEADS, shape=(16, 1024), timer=fast) == ("cudnn", None)
  assert choose_attention("cudnn", SMOLLM2_HEADS, shape=(16, 1024), timer=slow) == ("cudnn", None)
  # No device to time on (a compile-only trainer), or no shape: the check's answer alone.
  assert choose_attention("auto", SMOLLM2_HEADS, check=False, shape=(16, 1024),
                          timer=slow) == ("cudnn", None)
  assert len(shapes) == 2


def test_timing_rows_and_timer_run_here():
  """The timing's rows are a few segments and trailing padding; the timer runs XLA's kernel on
  any backend (cuDNN's needs a GPU)."""
  seg = attention.timing_segments(2, 64)
  assert seg.shape == (2, 64) and list(np.unique(seg)) == [0, 1, 2, 3, 4]
  assert (seg[:, -4:] == 0).all() and (seg[:, :16] == 1).all() and (seg[0] == seg[1]).all()
  s = attention.packed_kernel_seconds(TINY_HEADS, 2, 64, repeats=1, kernels=("xla",))
  assert list(s) == ["xla"] and np.isfinite(s["xla"]) and s["xla"] > 0
