"""Decode benchmarks, measured against a baseline in the same run (results go to BENCHMARKS.md).

  python -m infer.bench                      # our base decode vs transformers' generate
  python -m infer.bench --mode hamburger     # HAMburger vs base in our engine (+ ceiling)

Every row decodes exactly --new-tokens tokens (EOS ignored) so tokens/s compare like with like.
Times exclude compilation (reported separately); each figure is the best of --repeats runs.
The compile column counts loads from the persistent compilation cache (on by default) when an
earlier run compiled the same program: HAMBURGER_JAX_NO_COMPILE_CACHE=1 measures compilation.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

from hamburger_jax.config import DEFAULT_CONFIDENCE

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that checks whether a number is prime.",
    "Explain in simple terms why the sky is blue.",
    "Give me three tips for learning a new language.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What are the main differences between a list and a tuple in Python?",
    "Write a short poem about the autumn rain.",
]


def copy_bandwidth_gb_s(size_mb: int = 512, repeats: int = 5) -> float:
  """Memory bandwidth of a memcpy (read + write) between two preallocated large buffers.

  Preallocated on purpose: a jitted copy allocates (and page-faults) a fresh output every call,
  which measured ~5x below this machine's real bandwidth."""
  src = np.ones(size_mb * 2**20 // 4, np.float32)
  dst = np.empty_like(src)
  np.copyto(dst, src)
  best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
  return 2 * src.nbytes / best / 1e9


def _timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def weight_bytes(model) -> int:
  """Bytes of weights one decode step reads (the tied head counts once: same matrix)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  return sum(v.size * v.dtype.itemsize for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def chat_ids(tok, prompts: list[str]) -> list[list[int]]:
  return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True)
          for p in prompts]


def run_ours(engine, ids, n_new: int, mode: str, repeats: int,
             confidence: float = DEFAULT_CONFIDENCE):
  """(best decode s, compile s, generations) for one batch."""
  first = engine.generate(ids, max_new_tokens=n_new, mode=mode, confidence=confidence)
  best, gens = min(((g[0].decode_s, g) for g in (
      engine.generate(ids, max_new_tokens=n_new, mode=mode, confidence=confidence)
      for _ in range(repeats))), key=lambda x: x[0])
  return best, first[0].compile_s, gens


def bench_base(args) -> None:
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from hamburger_jax import assets, pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel

  model, tok = pretrained.load_llama("smollm2", dtype=args.dtype, param_dtype=args.dtype)
  engine = Engine(model, tok, stop_ids=())  # exactly n new tokens per row
  path = assets.smollm2_gguf()
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
  # No EOS on either side, so rows run the full length without min_new_tokens (which would mask
  # EOS out of the argmax and make greedy rows differ from ours).
  ref.generation_config.eos_token_id = None
  bw = copy_bandwidth_gb_s()
  wbytes = weight_bytes(model)
  print(f"SmolLM2-135M-Instruct, weights {args.dtype} ({wbytes / 1e6:.0f} MB), greedy, "
        f"{args.new_tokens} new tokens/row, torch threads {torch.get_num_threads()}, "
        f"copy bandwidth {bw:.1f} GB/s")
  rows = []
  for b in args.batches:
    ids = chat_ids(tok, (PROMPTS * (b // len(PROMPTS) + 1))[:b])
    ours_s, compile_s, gens = run_ours(engine, ids, args.new_tokens, "base", args.repeats)
    ours_tps = b * args.new_tokens / ours_s
    # transformers: left-padded batch, same prompts, same number of new tokens.
    width = max(map(len, ids))
    input_ids = torch.full((b, width), tok.pad_id or 0, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, row in enumerate(ids):
      input_ids[i, width - len(row):] = torch.tensor(row)
      mask[i, width - len(row):] = 1
    kwargs = dict(attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                  pad_token_id=tok.pad_id)
    with torch.no_grad():
      ref.generate(input_ids, **kwargs)  # warm-up
      hf_s = min(_timed(lambda: ref.generate(input_ids, **kwargs)) for _ in range(args.repeats))
      hf_out = ref.generate(input_ids, **kwargs)[:, width:].tolist()
    if any(len(h) != args.new_tokens for h in hf_out):
      raise RuntimeError("transformers stopped early: the EOS override did not take effect")
    hf_tps = b * args.new_tokens / hf_s
    same = sum(g.token_ids == h for g, h in zip(gens, hf_out))
    rows.append((b, ours_tps, hf_tps, compile_s, same))
  print(f"\n| batch | ours tok/s | transformers tok/s | ratio | identical greedy rows | "
        f"compile s |")
  print("|---|---|---|---|---|---|")
  for b, o, h, c, same in rows:
    print(f"| {b} | {o:.1f} | {h:.1f} | {o / h:.2f}x | {same}/{b} | {c:.1f} |")
  b1 = [r for r in rows if r[0] == 1]
  if b1:
    roofline = bw * 1e9 / wbytes
    print(f"\nbatch-1 roofline: {bw:.1f} GB/s / {wbytes / 1e6:.0f} MB per token = "
          f"{roofline:.1f} tok/s; ours {b1[0][1]:.1f} tok/s = {b1[0][1] / roofline:.0%} of it")
  by_b = {r[0]: r[1] for r in rows}
  if 1 in by_b and 8 in by_b:
    print(f"batch 8 throughput / batch 1: {by_b[8] / by_b[1]:.2f}x")


def step_costs(model, repeats: int, batch: int = 1) -> dict[str, float]:
  """Seconds of one jitted decode step at this batch size, each with its LM head: "base" (an
  unmerged input: the exact base), "merged" (a merged input: the base with its merged-entry
  adapters acting, unfolded; equal to "base" without adapters) and "micro" (one micro step).
  r = micro / base is SPEC.md 6's cost ratio in the ceiling k / (1 + (k - 1) r)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from hamburger_jax.model.kv_cache import KVCache  # pylint: disable=import-outside-toplevel

  cfg = model.cfg.base
  graphdef, params = nnx.split(model)
  slots = 512

  def base_step(params, cache, x, merged):
    m = nnx.merge(graphdef, params)
    pos = cache.length[:, None]
    feats, cache = m.base_features(x, pos, cache.mask(pos), cache, pos, merged)
    return m.logits(feats[:, :, -1]), cache

  def micro_step(params, cache, x):
    m = nnx.merge(graphdef, params)
    pos = jnp.full((batch, 1), 4, jnp.int32)
    h, cache = m.micro(x, pos, cache.mask(pos), cache, pos)
    return m.logits(h), m.stop_logits(h), cache

  x = jnp.zeros((batch, 1, cfg.hidden_size), jnp.float32)
  base_cache = KVCache.init(cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim)
  base_cache = base_cache.replace(length=jnp.full((batch,), 200, jnp.int32))
  micro_cache = KVCache.init(len(model.micro.decoder.layers), batch, model.num_features +
                             model.max_group - 1, cfg.num_kv_heads, cfg.head_dim)
  steps = {"base": functools.partial(jax.jit(base_step), params, base_cache, x, None),
           "merged": functools.partial(jax.jit(base_step), params, base_cache, x,
                                       jnp.ones((batch, 1), bool)),
           "micro": functools.partial(jax.jit(micro_step), params, micro_cache, x)}
  n, out = 20, {}
  for name, fn in steps.items():
    jax.block_until_ready(fn())
    out[name] = min(_timed(lambda: [jax.block_until_ready(fn()) for _ in range(n)])
                    for _ in range(repeats)) / n
  return out


def bench_hamburger(args) -> None:
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel

  checkpoint = pretrained.resolve_checkpoint(args.checkpoint)
  model, tok = pretrained.load_hamburger(checkpoint or pretrained.UNTRAINED)
  label = checkpoint or "UNTRAINED graft (random weights; use --confidence 0 to force K-token steps)"
  engine = Engine(model, tok, stop_ids=())
  print(f"HAMburger on SmolLM2-135M-Instruct: {label}")
  print(f"greedy, {args.new_tokens} new tokens/row (EOS ignored), confidence {args.confidence}; "
        "r = micro step / base step, measured at each batch size")
  print("adapter cost = a base step reading a merged entry (merged-entry adapters acting, "
        "unfolded) vs an unmerged one")
  print("\n| batch | base tok/s | HAMburger tok/s | ratio | tokens/step k | KV entries/token | r | "
        "adapter cost | ceiling | of ceiling | compile s (base, ham) |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for b in args.batches:
    ids = chat_ids(tok, (PROMPTS * (b // len(PROMPTS) + 1))[:b])
    base_s, base_c, _ = run_ours(engine, ids, args.new_tokens, "base", args.repeats)
    ham_s, ham_c, gens = run_ours(engine, ids, args.new_tokens, "hamburger", args.repeats,
                                  args.confidence)
    cost = step_costs(model, args.repeats, b)
    r = cost["micro"] / cost["base"]
    k = b * args.new_tokens / sum(g.macro_steps for g in gens)
    ceiling = args.new_tokens / lockstep_cost(gens, r)
    ratio = base_s / ham_s
    print(f"| {b} | {b * args.new_tokens / base_s:.1f} | {b * args.new_tokens / ham_s:.1f} | "
          f"{ratio:.2f}x | {k:.2f} | {1 / k:.2f} | {r:.3f} | "
          f"{cost['merged'] / cost['base'] - 1:+.1%} | {ceiling:.2f}x | "
          f"{ratio / ceiling:.0%} | {base_c:.0f}, {ham_c:.0f} |")


def lockstep_cost(gens, r: float) -> float:
  """Cost of a batch's decode in base-step units. Rows advance in lockstep: macro step j costs one
  base step plus r per micro step, and it runs micro steps until its largest group is complete.
  At batch 1 this is steps * (1 + (k - 1) r), SPEC.md 6's ceiling k / (1 + (k - 1) r)."""
  steps = max(g.macro_steps for g in gens)
  largest = [max((g.groups[j] for g in gens if j < len(g.groups)), default=1)
             for j in range(steps)]
  return sum(1 + r * (m - 1) for m in largest)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m infer.bench", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mode", choices=("base", "hamburger"), default="base")
  p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None,
                 help="comma-separated batch sizes (default: 1,8 for base; 1,8,32 for hamburger)")
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--checkpoint", default=None)
  p.add_argument("--confidence", type=float, default=DEFAULT_CONFIDENCE)
  args = p.parse_args(argv)
  args.batches = args.batches or ([1, 8] if args.mode == "base" else [1, 8, 32])
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  cache.enable_compilation_cache()
  (bench_base if args.mode == "base" else bench_hamburger)(args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
