"""Synthetic data for tests, the tiny config and the notebook (learnable token patterns), and
model fixtures that need no downloaded weights: a tiny quantised GGUF file, Llama-3.2-1B's
architecture."""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
import gguf
from gguf.quants import quantize

from hamburger_jax import pretrained, segmentation
from hamburger_jax.config import LLAMA_3_2_1B, GraftConfig, HamburgerConfig, LlamaConfig
from hamburger_jax.data import teacher_pass
from hamburger_jax.model import lora
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import causal_segment_mask

from hamburger_jax.data.synthetic import synthetic_samples
from hamburger_jax.data.tfds_builder import build_dataset


def build_synthetic_teacher_dataset(out_dir: str, run_cfg, top_k: int = 8, n_train: int = 64,
                                    n_val: int = 16, seed: int = 0) -> str:
  """The synthetic samples with the teacher signals of `run_cfg`'s (random) base, stored as
  train.prepare_data --teacher-top-k stores them: data for the distill recipe's tests."""
  base, _ = pretrained.load_base_for_run(run_cfg.model, run_cfg.train.seed)
  teacher = segmentation.TeacherSpec(
      top_k, run_cfg.graft.resolved_feature_layers(base.cfg.num_layers))
  k = run_cfg.graft.max_group

  def with_signals(samples: list[dict]) -> list[dict]:
    pairs = [(s["input_ids"][:s["prompt_len"]], s["input_ids"][s["prompt_len"]:]) for s in samples]
    stats = segmentation.response_token_stats(base, pairs, teacher=teacher)
    return [{**s, **teacher_pass.teacher_signals(st, s["groups"])} for s, st in zip(samples, stats)]

  train = with_signals(synthetic_samples(n_train, base.cfg.vocab_size, k, seed))
  val = with_signals(synthetic_samples(n_val, base.cfg.vocab_size, k, seed + 1))
  meta, shapes = teacher_pass.teacher_metadata(base, teacher)
  return build_dataset(out_dir, {"train": lambda: train, "validation": lambda: val},
                       max_group=k, metadata={"source": "synthetic", **meta}, teacher=shapes)


def sharpen(model, scale: float = 8.0) -> None:
  """Multiplies every weight matrix by `scale` (norm weights untouched), in place.

  A random model at the usual init (std 0.02) predicts near-uniform distributions, where argmax
  is decided by rounding noise; sharper weights give decisive, varied greedy outputs, so decode
  tests compare real choices.
  """
  for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if var.ndim >= 2:
      var.set_value(var[...] * scale)


# The decode tests' tiny model: small enough to compile in seconds, sharpened so greedy tokens
# are stable and the stop head's logits spread around 0 (groups of 1..4 all occur at c = 0.5).
DECODE_CFG = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=4,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=256)
DECODE_STOP = 96


def tiny_decode_model():
  m = Hamburger(HamburgerConfig(DECODE_CFG, GraftConfig(merger_head_dim=16)), rngs=nnx.Rngs(0))
  sharpen(m, 8.0)
  sharpen(m.micro.stop_head, 3.0)
  return m


# The distill tests' tiny model: DECODE_CFG with rank-4 merged-entry adapters.
DISTILL_GRAFT = GraftConfig(merger_head_dim=16, base_lora_rank=4, base_lora_alpha=8.0)


def tiny_distill_model() -> Hamburger:
  """Sharpened like tiny_decode_model, and with the adapters' b set off zero (their init), so
  that a loss over merged entries sees them act."""
  m = Hamburger(HamburgerConfig(DECODE_CFG, DISTILL_GRAFT), rngs=nnx.Rngs(0))
  sharpen(m, 4.0)
  sharpen(m.micro.stop_head, 3.0)
  for i, lin in enumerate(lora.base_linears(m.base)):
    lin.lora.b.set_value(0.05 * jax.random.normal(jax.random.key(i), lin.lora.b.shape))
  return m


def llama_3_2_1b_config(**overrides) -> LlamaConfig:
  """Llama-3.2-1B(-Instruct)'s architecture (config.LLAMA_3_2_1B): the paper's setting
  (configs/llama3_2_1b.yaml) for shape-only tests, without its weights."""
  return dataclasses.replace(LLAMA_3_2_1B, **overrides)


# Grafted params of HAMburger on Llama-3.2-1B with the paper's graft (K = 4, 4 fresh micro-decoder
# layers, merger head dim 32, no adapters): merger 16.8M + out_proj 4.2M + 4 x 60.8M micro
# layers + stop head 8.4M (test_hamburger_model checks each part).
LLAMA_3_2_1B_GRAFT_PARAMS = 272_664_577


def write_tiny_llama_gguf(path: str, seed: int = 0) -> LlamaConfig:
  """A 2-layer Llama as llama.cpp writes one: Q4_1 and Q8_0 projections, float32 norms, a
  64-token byte-level vocabulary (63 printable characters and "AB", their one merge). Returns its
  config.
  The same `seed` writes the same weights; another seed, other weights of the same size."""
  cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                    rms_norm_eps=float(np.float32(1e-5)),  # GGUF stores float32
                    max_position_embeddings=256, tie_word_embeddings=True)
  d, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(cfg.num_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(d)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_rope_dimension_count(cfg.head_dim)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_vocab_size(cfg.vocab_size)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("gpt2")
  w.add_token_list([chr(33 + i) for i in range(cfg.vocab_size - 1)] + ["AB"])
  w.add_token_types([1] * cfg.vocab_size)
  w.add_token_merges(["A B"])
  w.add_chat_template("{% for m in messages %}{{ m['content'] }}!{% endfor %}")

  def tensor(name: str, shape: tuple[int, ...], qtype=None) -> None:
    x = (0.05 * rng.standard_normal(shape)).astype(np.float32)
    if qtype is None:
      w.add_tensor(name, 1.0 + x)  # a norm weight
    else:
      w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)

  q4, q8 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
  tensor("token_embd.weight", (cfg.vocab_size, d), q8)
  tensor("output_norm.weight", (d,))
  for i in range(cfg.num_layers):
    tensor(f"blk.{i}.attn_norm.weight", (d,))
    tensor(f"blk.{i}.ffn_norm.weight", (d,))
    tensor(f"blk.{i}.attn_q.weight", (d, d), q4)
    tensor(f"blk.{i}.attn_k.weight", (kv, d), q4)
    tensor(f"blk.{i}.attn_v.weight", (kv, d), q8)
    tensor(f"blk.{i}.attn_output.weight", (d, d), q8)
    tensor(f"blk.{i}.ffn_gate.weight", (cfg.intermediate_size, d), q4)
    tensor(f"blk.{i}.ffn_up.weight", (cfg.intermediate_size, d), q4)
    tensor(f"blk.{i}.ffn_down.weight", (d, cfg.intermediate_size), q8)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return cfg


@nnx.jit
def _reference_features(model, x_btd, positions_bt, merged_bt):
  mask = causal_segment_mask(jnp.ones(x_btd.shape[:2], jnp.int32))
  return model.base_features(x_btd, positions_bt, mask, merged_bt=merged_bt)[0]


@nnx.jit
def _reference_micro(model, x_btd):
  t = x_btd.shape[1]
  h, _ = model.micro(x_btd, jnp.arange(t)[None], causal_segment_mask(jnp.ones((1, t), jnp.int32)))
  return model.logits(h), model.stop_logits(h)


def reference_hamburger(model, prompt: list[int], max_new: int, confidence: float,
                        stop: int, pad: int = 64, max_group: int | None = None,
                        micro_ids: list[int] | None = None) -> tuple[list[int], list[int]]:
  """HAMburger decoding (docs/method.md section 3) as a plain per-row Python loop that
  recomputes everything from scratch each step (no KV cache): the decode tests' reference.
  `pad`: the fixed length of its (jitted) uncached forwards; `max_group`: a cap on the tokens
  of one macro step (None: K); `micro_ids`: the tokens micro steps 1..K-1 may choose (the best
  of the full head's logits among them; None: any)."""
  row = _reference_row(model, prompt)
  while not row["done"]:
    group = _reference_group(model, row, max_new, confidence, stop, pad, max_group, micro_ids)
    _reference_emit(model, row, group, max_new, stop)
  return row["tokens"], row["groups"]


def reference_hamburger_batch(model, prompts: list[list[int]], max_new: list[int],
                              confidences: list[float], stop: int, r: float, m: float = 0.0,
                              r1: float | None = None, pad: int = 64
                              ) -> list[tuple[list[int], list[int]]]:
  """HAMburger decoding of rows in lockstep with the batch-aware micro loop at cost ratios `r`
  (micro steps 2 and later) and `r1` (micro step 1; default r) (decode/micro_rule.py: pays, the same
  at every micro batch) and merge cost `m`, as plain Python: each macro step, every live row's
  group by the per-row rule (reference_hamburger's), then micro step i + 1 runs only while
  n_go >= min(c, 1) * n_live rows go on (n_go: the rows whose group has more than i + 1
  tokens; c = r, or for micro step 1 r1, plus m when some live row stops at token 0), so each
  group is cut to 1 + the micro steps run. (tokens, groups) a row."""
  r1 = r if r1 is None else r1
  rows = [_reference_row(model, p) for p in prompts]
  while not all(row["done"] for row in rows):
    live = [i for i, row in enumerate(rows) if not row["done"]]
    groups = {i: _reference_group(model, rows[i], max_new[i], confidences[i], stop, pad)
              for i in live}
    length = 1
    while any(len(g) > length for g in groups.values()):
      n_go = sum(len(g) > length for g in groups.values())
      c = r if length > 1 else r1 + (m if n_go < len(live) else 0.0)
      if n_go < min(c, 1.0) * len(live):
        break
      length += 1
    for i in live:
      _reference_emit(model, rows[i], groups[i][:length], max_new[i], stop)
  return [(row["tokens"], row["groups"]) for row in rows]


def _reference_row(model, prompt: list[int]) -> dict:
  """A row of the reference loops: its base inputs, their positions and merged flags (the
  prompt's are unmerged entries), its tokens and groups; for a merge at layer L > 0 its tokens
  plain, with which of them the upper layers hide (a merged group's but its last) and where
  they adapt (a merged group's last)."""
  return {"prompt": prompt, "inputs": list(model.base.embed(jnp.asarray(prompt))),
          "positions": list(range(len(prompt))), "merged": [False] * len(prompt),
          "plain": list(prompt), "hidden": [False] * len(prompt),
          "adapted": [False] * len(prompt), "tokens": [], "groups": [], "done": False}


@functools.partial(nnx.jit, static_argnums=4)
def _masked_features(model, ids_bt, hidden_bt, adapted_bt, merge_layer: int):
  """A merge at layer L as ONE uncached forward of the tokens plain: layers < L exact and
  causal; at layers >= L a token reads no key of a `hidden` token but its own, and the
  adapters act at `adapted` tokens. Features [B, T, F, D]; rows past a row's tokens are pad."""
  base = model.base
  b, t = ids_bt.shape
  x = base.embed(ids_bt)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  causal = jnp.tril(jnp.ones((t, t), bool))[None]
  upper = causal & (~hidden_bt[:, None, :] | jnp.eye(t, dtype=bool)[None])
  out = {}
  for i, layer in enumerate(base.decoder.layers):
    x, _ = layer(x, pos, causal if i < merge_layer else upper,
                 merged_bt=None if i < merge_layer else adapted_bt)
    out[i] = x
  return jnp.stack([out[i] for i in model.feature_layers[:-1]] + [base.norm(x)], axis=2)


def _row_features(model, row: dict, pad: int) -> jax.Array:
  """The features [F, D] that predict the row's next group, uncached."""
  if model.merge_layer:
    n = len(row["plain"])
    put = lambda v, dt: jnp.zeros((1, pad), dt).at[0, :n].set(jnp.asarray(v, dt))
    return _masked_features(model, put(row["plain"], jnp.int32), put(row["hidden"], bool),
                            put(row["adapted"], bool), model.merge_layer)[0, n - 1]
  n = len(row["inputs"])
  x = jnp.zeros((1, pad, model.cfg.base.hidden_size)).at[0, :n].set(jnp.stack(row["inputs"]))
  pos = jnp.zeros((1, pad), jnp.int32).at[0, :n].set(jnp.asarray(row["positions"]))
  gate = jnp.zeros((1, pad), bool).at[0, :n].set(jnp.asarray(row["merged"]))
  return _reference_features(model, x, pos, gate)[0, n - 1]  # predicting position


def _reference_group(model, row: dict, max_new: int, confidence: float, stop: int, pad: int,
                     max_group: int | None = None, micro_ids: list[int] | None = None
                     ) -> list[int]:
  """The group the row's next macro step emits by the per-row rule."""
  k, f = model.max_group, model.num_features
  cap = max_group or k
  feats = _row_features(model, row, pad)  # [F, D]
  group: list[int] = []
  for i in range(k):
    if i == 0:  # the skip connection
      logits, stop_logit = model.logits(feats[-1]), model.stop_logits(feats[-1])
    else:
      seq = jnp.concatenate([feats, model.base.embed(jnp.asarray(group))])
      padded = jnp.zeros((1, f + k - 1, model.cfg.base.hidden_size)).at[0, :len(seq)].set(seq)
      logits, stop_logit = _reference_micro(model, padded)
      logits, stop_logit = logits[0, len(seq) - 1], stop_logit[0, len(seq) - 1]
    if i and micro_ids is not None:
      tok = int(micro_ids[int(jnp.argmax(logits[jnp.asarray(micro_ids)]))])
    else:
      tok = int(jnp.argmax(logits))
    group.append(tok)
    p_continue = float(jax.nn.sigmoid(-stop_logit))
    if (tok == stop or len(row["tokens"]) + len(group) >= max_new or confidence >= 1.0
        or p_continue < confidence or len(group) >= cap):
      break
  return group


def _reference_emit(model, row: dict, group: list[int], max_new: int, stop: int) -> None:
  """The row emits `group`; unless it is done, the group becomes its next base input."""
  k = model.max_group
  row["tokens"] += group
  row["groups"].append(len(group))
  if row["tokens"][-1] == stop or len(row["tokens"]) >= max_new:
    row["done"] = True
    return
  ids = jnp.zeros((k,), jnp.int32).at[:len(group)].set(jnp.asarray(group))
  row["inputs"].append(model.smash(ids[None], jnp.asarray([len(group)]))[0])
  row["positions"].append(len(row["prompt"]) - 1 + len(row["tokens"])
                          + model.cfg.graft.position_offset)
  row["merged"].append(len(group) >= 2)
  row["plain"] += group
  row["hidden"] += [len(group) >= 2] * (len(group) - 1) + [False]
  row["adapted"] += [False] * (len(group) - 1) + [len(group) >= 2]


def markdown_tables(text: str) -> list[list[dict[str, str]]]:
  """The markdown tables in a command's output, each a list of rows keyed by its header."""
  blocks, current = [], []
  for line in text.splitlines() + [""]:
    if line.startswith("|"):
      current.append(line)
    elif current:
      blocks.append(current)
      current = []
  split = lambda l: [c.strip() for c in l.strip("|").split("|")]
  return [[dict(zip(split(b[0]), split(l))) for l in b[2:]] for b in blocks]


REPO_ROOT = Path(__file__).resolve().parents[1]


def subprocess_env(**extra: str) -> dict[str, str]:
  """The environment of an entry point a test runs as a subprocess: this process's, on the CPU
  with one device (no XLA_FLAGS: a test that wants a fake mesh adds its own), the repository
  importable, and the compilation cache of the test processes (tests/conftest.py: the
  per-user one) keeping every program; `extra` added last."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT),
             JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir or "",
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  env.update(extra)
  return env
