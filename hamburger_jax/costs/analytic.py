"""What a step of this model costs: model FLOPs and the bytes a decode step must read (what the
device can do, MFU and the memory-bandwidth roofline: costs/peaks.py).

FLOPs are counted analytically: every matmul and attention einsum the model runs, 2 FLOPs per
multiply-add, at the static shapes a compiled step runs (padded rows and dense attention masks
included: XLA computes them). program_flops.traced_matmul_flops counts the same thing from the
traced program, so the two must agree exactly. XLA's `cost_analysis()` also counts elementwise
work (norms, RoPE, softmax, SiLU, residuals, the optimiser: about one FLOP per element), which
this count leaves out: XLA reads 1-6% above it at the tiny test width (D = 64) and 0.1-1.5% at
D = 2048, where matmuls are O(D^2) per token and elementwise work O(D). (A backend that runs
bfloat16 dots in float32, as XLA:CPU does, adds the converts of the weights: one FLOP each.)
XLA counts a while loop's body once (it does not know trip counts): the counts here take a
`loop_once` argument that counts the chunked LM-head loss the same way, so the benches compare
XLA's figure of the very program they time (no second compilation). On a GPU, XLA counts none
of the matmuls it hands to cuBLAS (program_flops.xla_counts_matmuls): its figure is left out
there.

"Model FLOPs" (MFU's numerator) leave out the rematerialised LM-head forward of the chunked loss
(`losses._chunk_stats` recomputes the logits in the backward pass rather than storing them):
that is hardware work, not model work, as in the PaLM paper's definition of MFU. Backward
passes count what autodiff must compute: the input gradient of a layer whose input depends on
a trained parameter, the weight gradient of a trained parameter.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from hamburger_jax.objectives import losses
from hamburger_jax.config import HamburgerConfig, LlamaConfig

# ----------------------------------------------------------------------------- FLOPs


@dataclasses.dataclass(frozen=True)
class FlopCount:
  """FLOPs of one step: forward, backward and the rematerialised forward the backward reruns."""
  forward: int = 0
  backward: int = 0
  remat: int = 0

  @property
  def model(self) -> int:
    """What the model needs: MFU's numerator."""
    return self.forward + self.backward

  @property
  def executed(self) -> int:
    """What runs, remat included: what XLA's cost analysis (and the traced count) see."""
    return self.forward + self.backward + self.remat

  def __add__(self, other: "FlopCount") -> "FlopCount":
    return FlopCount(self.forward + other.forward, self.backward + other.backward,
                     self.remat + other.remat)

  def __mul__(self, n: int) -> "FlopCount":
    return FlopCount(self.forward * n, self.backward * n, self.remat * n)


def _linear(rows: int, n_in: int, n_out: int, *, d_in: bool = False,
            d_w: bool = False) -> FlopCount:
  """y = x @ W over `rows` rows; backward: dx = dy W^T where `d_in`, dW = x^T dy where `d_w`."""
  f = 2 * rows * n_in * n_out
  return FlopCount(f, f * (d_in + d_w))


def _lora(rows: int, n_in: int, n_out: int, rank: int, *, d_in: bool, d_w: bool) -> FlopCount:
  """delta = (x @ a) @ b. Backward: d(xa) = dy b^T whenever anything below needs it, db where
  trained, da where trained, dx = d(xa) a^T where the input needs a gradient."""
  fwd = 2 * rows * rank * (n_in + n_out)
  bwd = 0
  if d_in or d_w:
    bwd += 2 * rows * rank * n_out  # d(xa)
  if d_w:
    bwd += 2 * rows * rank * (n_out + n_in)  # db, da
  if d_in:
    bwd += 2 * rows * n_in * rank  # dx
  return FlopCount(fwd, bwd)


def _layer_linears(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
  d, f, qd, kvd = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim,
                   cfg.num_kv_heads * cfg.head_dim)
  return {"q": (d, qd), "k": (d, kvd), "v": (d, kvd), "o": (qd, d), "gate": (d, f), "up": (d, f),
          "down": (f, d)}


def layer_flops(cfg: LlamaConfig, rows: int, keys: int, *, lora_rank: int = 0,
                grad_in: bool = False, train_w: bool = False,
                train_lora: bool = False) -> FlopCount:
  """One decoder layer (model/llama.py: DecoderLayer) over `rows` query rows (all batch rows
  together), each attending `keys` key slots (dense: masked slots cost the same).

  `lora_rank`: merged-entry adapters computed on every row (the layer computes them wherever a
  merged mask is passed, and selects per row). Backward: `grad_in`, the layer's input needs a
  gradient; `train_w`, its kernels and norms are trained; `train_lora`, its adapters are."""
  act = grad_in or train_w or train_lora  # activations past the input carry gradients
  out = FlopCount()
  for name, (n_in, n_out) in _layer_linears(cfg).items():
    # q, k and v read the input norm, whose weight trains with the kernels.
    d_in = (grad_in or train_w) if name in ("q", "k", "v") else act
    out += _linear(rows, n_in, n_out, d_in=d_in, d_w=train_w)
    if lora_rank:
      out += _lora(rows, n_in, n_out, lora_rank, d_in=d_in, d_w=train_lora)
  attn = 4 * rows * keys * cfg.num_heads * cfg.head_dim  # scores and probs @ values
  return out + FlopCount(attn, 2 * attn if act else 0)  # dP, dV, dQ, dK


def stack_flops(cfg: LlamaConfig, layers: int, rows: int, keys: int, *, lora_rank: int = 0,
                grad_in: bool = False, train_w: bool = False,
                train_lora: bool = False) -> FlopCount:
  """`layers` decoder layers in a row (layer_flops): past the first, the input carries a
  gradient wherever an earlier layer trains."""
  kw = dict(lora_rank=lora_rank, train_w=train_w, train_lora=train_lora)
  if layers == 0:
    return FlopCount()
  return (layer_flops(cfg, rows, keys, grad_in=grad_in, **kw)
          + layer_flops(cfg, rows, keys, grad_in=grad_in or train_w or train_lora, **kw)
          * (layers - 1))


def head_flops(cfg: LlamaConfig, rows: int) -> int:
  """The LM head (tied or not) over `rows` rows."""
  return 2 * rows * cfg.hidden_size * cfg.vocab_size


def stop_head_flops(d: int, rows: int, *, grad_in: bool = False,
                    train_w: bool = False) -> FlopCount:
  """micro_step_decoder.StopHead: Linear(D, D) - SiLU - Linear(D, D) - SiLU - Linear(D, 1)."""
  return (_linear(rows, d, d, d_in=grad_in, d_w=train_w)
          + _linear(rows, d, d, d_in=grad_in or train_w, d_w=train_w)
          + _linear(rows, d, 1, d_in=grad_in or train_w, d_w=train_w))


def embedder_flops(d: int, k: int, groups: int, *, grad_embeddings: bool = False,
                   train_w: bool = False) -> FlopCount:
  """compositional_embedder.CompositionalEmbedder over `groups` groups of K slots (it runs on
  every group, single tokens too, and selects after). Keys and values read [embedding ;
  position] of D + D/2; the heads span D. Backward: the position table and kernels where
  trained, the token embeddings where `grad_embeddings` (a trained embedding table)."""
  kv_in = d + d // 2
  act = train_w or grad_embeddings
  out = (_linear(groups, d, d, d_in=grad_embeddings, d_w=train_w)  # q_proj of the mean
         + _linear(groups * k, kv_in, d, d_in=act, d_w=train_w) * 2  # k_proj, v_proj
         + _linear(groups, d, d, d_in=act, d_w=train_w))  # out_proj
  attn = 4 * groups * k * d
  return out + FlopCount(attn, 2 * attn if act else 0)


def base_forward_flops(cfg: LlamaConfig, batch: int, tokens: int) -> int:
  """The uncached base forward `Llama.__call__` (a prefill): `tokens` per row attending to each
  other densely, the LM head on every position."""
  rows = batch * tokens
  return (cfg.num_layers * layer_flops(cfg, rows, tokens).forward + head_flops(cfg, rows))


def decode_step_flops(hcfg: HamburgerConfig, mode: str, batch: int, kv_len: int) -> int:
  """One macro step at decode, as decode/step_program.py (and the engine) run it: the LM head
  on each row's predicting features; in HAMburger mode the stop head there, all K - 1 micro steps
  (forced groups: each with its LM head and, but for the last, its stop head; step 1 reads the
  F features and e(t0) in one pass), the group smashed into one input; then the base forward of
  that one entry over the `kv_len` cache slots and itself (the merged-entry adapters folded
  into the kernels: no extra FLOPs). Attention is dense over every slot, masked ones too."""
  b, g = hcfg.base, hcfg.graft
  d = b.hidden_size
  base = b.num_layers * layer_flops(b, batch, kv_len + 1).forward
  if mode == "base":
    return head_flops(b, batch) + base
  k, f = g.max_group, g.num_features
  micro = 0
  if k > 1:
    slots = f + k - 1  # the micro cache; each step's new inputs attend to it and to themselves
    micro = g.micro_layers * (layer_flops(b, batch * (f + 1), slots + f + 1).forward
                              + (k - 2) * layer_flops(b, batch, slots + 1).forward)
    micro += (k - 1) * stop_head_flops(d, batch).forward
  return (k * head_flops(b, batch) + micro + embedder_flops(d, k, batch).forward + base)


TRAINED_EMBEDDER = ("graft", "all", "merger")
TRAINED_MICRO = ("graft", "all", "micro")
TRAINED_STOP = ("graft", "all", "micro", "stop")


def lm_head_rows(rows: int, per_row: int, ce_chunk: int, loop_once: bool = False) -> int:
  """Tokens the chunked loss (losses.chunked_token_stats) runs the LM head on: `rows` batch
  rows of `per_row` tokens, each row padded to whole chunks. `loop_once`: the tokens XLA's cost
  analysis sees, which counts the chunk loop's body once (one chunk)."""
  c = losses.chunk_tokens(rows, per_row, ce_chunk)
  if loop_once:
    return rows * c
  return rows * -(-per_row // c) * c


def train_step_flops(hcfg: HamburgerConfig, rows: int, entries: int, groups: int,
                     trainable: str, ce_chunk: int, loop_once: bool = False) -> FlopCount:
  """One optimiser step of hamburger_jax/training on one micro-batch of `rows` packed rows of
  `entries` base-input entries and `groups` predicted groups, either recipe (the distill
  recipe's extra terms are elementwise). Stage `micro` runs no base forward. `loop_once`: what
  XLA's cost analysis counts (lm_head_rows).""" 
  b, g = hcfg.base, hcfg.graft
  d, k, f = b.hidden_size, g.max_group, g.num_features
  train_base = trainable == "all"
  train_graft = trainable in TRAINED_EMBEDDER  # the embedder and the merged-entry adapters
  out = FlopCount()
  base_grads = False  # the base's features carry a gradient
  if trainable != "micro":
    out += embedder_flops(d, k, rows * entries, grad_embeddings=train_base, train_w=train_graft)
    base_grads = train_base or train_graft
    out += stack_flops(b, b.num_layers, rows * entries, entries, lora_rank=g.base_lora_rank,
                       grad_in=base_grads, train_w=train_base,
                       train_lora=train_graft and g.base_lora_rank > 0)
  n = rows * groups  # predicted groups; the micro decoder reads F + K - 1 inputs for each
  micro_w = trainable in TRAINED_MICRO
  micro_in = base_grads or train_base  # features, and the teacher tokens' embeddings
  t = f + k - 1
  if k > 1:
    out += stack_flops(b, g.micro_layers, n * t, t, grad_in=micro_in, train_w=micro_w)
  h_grad = micro_in or micro_w  # the hidden states the heads read carry a gradient
  head = head_flops(b, lm_head_rows(rows, groups * k, ce_chunk, loop_once))
  head_bwd = head * (h_grad + train_base)  # dh; the (tied or untied) head matrix in "all"
  out += FlopCount(head, head_bwd, head if head_bwd else 0)
  out += stop_head_flops(d, n * k, grad_in=h_grad, train_w=trainable in TRAINED_STOP)
  return out


def sft_step_flops(cfg: LlamaConfig, rows: int, width: int, ce_chunk: int,
                   loop_once: bool = False) -> FlopCount:
  """train.bench's baseline: plain SFT of the whole base on rows of `width` tokens."""
  out = stack_flops(cfg, cfg.num_layers, rows * width, width, grad_in=True, train_w=True)
  head = head_flops(cfg, lm_head_rows(rows, width, ce_chunk, loop_once))
  return out + FlopCount(head, 2 * head, head)


# ----------------------------------------------------------------------------- params, bytes


def layer_params(cfg: LlamaConfig) -> int:
  return sum(i * o for i, o in _layer_linears(cfg).values()) + 2 * cfg.hidden_size


def base_params(cfg: LlamaConfig) -> int:
  """Parameters of the base (a tied head counted once)."""
  vd = cfg.vocab_size * cfg.hidden_size
  return vd * (1 if cfg.tie_word_embeddings else 2) + cfg.num_layers * layer_params(
      cfg) + cfg.hidden_size


def graft_params(hcfg: HamburgerConfig) -> dict[str, int]:
  """Grafted parameters by module: embedder, micro decoder layers, stop head, base adapters."""
  b, g = hcfg.base, hcfg.graft
  d = b.hidden_size
  kv_in = d + d // 2
  return {"embedder": g.max_group * (d // 2) + 2 * (d * d + d) + 2 * (kv_in * d + d),
          "micro": g.micro_layers * layer_params(b),
          "stop_head": 2 * (d * d + d) + d + 1,
          "adapters": b.num_layers * g.base_lora_rank * sum(
              i + o for i, o in _layer_linears(b).values())}


def kv_bytes(cfg: LlamaConfig, layers: int, batch: int, entries: int) -> int:
  """Bytes of `entries` KV-cache entries (keys and values, every layer) for each of `batch`
  rows, in the compute dtype (the engine's cache dtype)."""
  return (2 * layers * batch * entries * cfg.num_kv_heads * cfg.head_dim
          * np.dtype(_np_dtype(cfg.dtype)).itemsize)


def micro_step_bytes(hcfg: HamburgerConfig, batch: int, head_rows: int | None = None) -> int:
  """Bytes one micro step must read: the micro decoder's layers, the stop head, the LM head's
  `head_rows` rows (None: the whole vocabulary; a reduced micro-step vocabulary reads fewer)
  and the micro cache it attends to (F + K - 1 entries). Where bytes bound a step (batch-1
  decode on a CPU), r = this over a base step's `decode_step_bytes`."""
  b, g = hcfg.base, hcfg.graft
  p = np.dtype(_np_dtype(b.param_dtype)).itemsize
  graft = graft_params(hcfg)
  rows = b.vocab_size if head_rows is None else head_rows
  return ((graft["micro"] + graft["stop_head"] + rows * b.hidden_size) * p
          + kv_bytes(b, g.micro_layers, batch, g.num_features + g.max_group - 1))


def decode_step_bytes(hcfg: HamburgerConfig, mode: str, batch: int, kv_len: int) -> int:
  """Bytes one macro step (as `decode_step_flops` counts it) must read from memory: every
  weight it multiplies by, once per pass that uses it (the LM head and the micro decoder once
  per micro step: a step cannot start before the previous token is chosen), and the KV cache in
  use. The merged step reads the base's kernels with the adapters folded in: the same bytes as
  the plain ones. Gathers of a few embedding rows and the activations are left out
  (kilobytes)."""
  b, g = hcfg.base, hcfg.graft
  p = np.dtype(_np_dtype(b.param_dtype)).itemsize
  vd = b.vocab_size * b.hidden_size
  body = base_params(b) - vd * (1 if b.tie_word_embeddings else 2)  # layers and final norm
  kv = kv_bytes(b, b.num_layers, batch, kv_len)
  if mode == "base":
    return (body + vd) * p + kv
  first = (body + graft_params(hcfg)["embedder"] + vd) * p + kv  # token 0: the base's own head
  return first + (g.max_group - 1) * micro_step_bytes(hcfg, batch)


def _np_dtype(name: str):
  return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)
