"""Decode benchmarks, measured against a baseline in the same run (results: docs/results/).

  python -m infer.bench                      # our base decode vs transformers' generate
  python -m infer.bench --mode hamburger     # HAMburger vs base in our engine (+ ceiling)
  python -m infer.bench --mode serve         # continuous batching: base vs HAMburger, slots, pool
  python -m infer.bench --mode widths        # a w-row base forward vs a 1-row one, bandwidth
  python -m infer.bench --config configs/llama3_2_1b.yaml --random-weights --batches 1,8
                                             # a config's model, random weights: FLOPs, MFU,
                                             # roofline (docs/results/accelerator_benches.md)

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
from hamburger_jax.decode.requests import (GenerationError, Request, check_settings,
                                            pooled_tokens_per_step)
from hamburger_jax.decode.serving import mean_blocks_held
from infer import cli

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


def run_interleaved(engine, ids, n_new: int, repeats: int, runs: dict[str, dict],
                    engines: dict | None = None):
  """Decodes one batch under each of several engine.generate settings (`runs`: name -> its
  keyword arguments; `engines`: name -> another engine for that run): each is compiled and run
  once, then `repeats` rounds run each once in turn, so the machine's drift hits them alike (run
  one after the other, a ~10% drift on this CPU showed up in their ratio). Returns name -> (best
  decode s, compile s, generations)."""
  engines = engines or {}
  gen = lambda name, kw: engines.get(name, engine).generate(ids, max_new_tokens=n_new, **kw)
  first = {name: gen(name, kw) for name, kw in runs.items()}
  best = {name: (float("inf"), None) for name in runs}
  for _ in range(repeats):
    for name, kw in runs.items():
      g = gen(name, kw)
      if g[0].decode_s < best[name][0]:
        best[name] = (g[0].decode_s, g)
  return {name: (best[name][0], first[name][0].compile_s, best[name][1]) for name in runs}


def bench_base(args) -> None:
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from hamburger_jax import assets, pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  from hamburger_jax.roofline import copy_bandwidth_gb_s  # pylint: disable=C0415

  model, tok = pretrained.load("base", dtype=args.dtype, param_dtype=args.dtype)
  # exactly n new tokens per row
  engine = Engine(model, tok, stop_ids=(), matmul_precision=args.precision)
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
    ours_s, compile_s, gens = run_interleaved(engine, ids, args.new_tokens, args.repeats,
                                              {"base": {"mode": "base"}})["base"]
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
  print("\n| batch | ours tok/s | transformers tok/s | ratio | identical greedy rows | "
        "compile s |")
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
  print("\n".join(launch_lines(engine.runner, 1, 512)))


def step_costs(runner, repeats: int, batch: int = 1) -> dict[str, float]:
  """Seconds of one decode step at this batch size (decode/launches.py's unit steps, in the
  decoding layout `runner`, each with its LM head): "base" (an unmerged input: the exact
  base), "merged" (a merged input: the adapters folded into the kernels; equal to "base"
  without adapters) and "micro" (one micro step, with the model's micro-step head: the full
  one, or its reduced vocabulary). Each runs in widths.step_loop (steps in one jitted loop, its
  token fed back: no host dispatch between them, which would weigh most on the small micro
  step). r = micro / base is docs/SPEC.md 6's cost ratio in the ceiling k / (1 + (k - 1) r)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode import launches  # pylint: disable=import-outside-toplevel
  from infer import widths  # pylint: disable=import-outside-toplevel

  graphdef, params = nnx.split(runner)
  out = {}
  for name, fn in launches.UNIT_STEPS.items():
    x, cache = launches.unit_args(runner, name, batch, widths.KV_ENTRIES)
    loop = widths.step_loop(graphdef, fn)
    state = {"cache": jax.tree.map(jnp.copy, cache)}  # each loop donates its own copy

    def call():
      token, state["cache"] = loop(params, state["cache"], x)
      jax.block_until_ready(token)

    call()
    out[name] = min(_timed(call) for _ in range(max(3, repeats))) / widths.STEPS
  return out


def launch_lines(runner, batch: int, kv_len: int, model=None) -> list[str]:
  """The launch figures of the programs a decode bench times (decode/launches.py): lowered
  dots per step, and with libtpu installed the fusions on one TPU v5e chip."""
  from hamburger_jax import aot  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode import launches  # pylint: disable=import-outside-toplevel
  figs = cli.phase("launch figures" + (" (TPU v5e compiles)" if aot.libtpu_installed() else ""),
                   lambda: launches.figures(runner, batch, kv_len, model))
  note = "" if aot.libtpu_installed() else ", not counted: libtpu is not installed"
  return [f"\nlaunches per step (batch {batch}, KV {kv_len}; dots: matmuls in the lowered "
          "program, each a kernel launch on a GPU; fusions: the program compiled for one TPU "
          f"v5e chip{note}):\n", *launches.report_lines(figs)]


def with_micro_vocab(model, checkpoint: str | None, size: int):
  """A second HAMburger sharing `model`'s weights whose micro steps use the checkpoint's first
  `size` micro-vocabulary ids; a missing or unfit list is a one-line error."""
  from hamburger_jax import micro_vocab, pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.model.hamburger import sharing_weights  # pylint: disable=C0415
  try:
    ids = pretrained.micro_vocab_ids(checkpoint, size, model.cfg.base.vocab_size)
  except micro_vocab.MicroVocabError as e:
    raise SystemExit(f"error: {e}") from None
  return sharing_weights(model, micro_vocab=ids)


def bench_hamburger(args) -> None:
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel

  from infer import widths  # pylint: disable=import-outside-toplevel

  checkpoint = pretrained.resolve_checkpoint(args.checkpoint)
  model, tok = cli.load_model("both", checkpoint, args.base, untrained_ok=True)
  label = checkpoint or ("UNTRAINED graft (random weights; use --confidence 0 to force K-token "
                         "steps)")
  engine = Engine(model, tok, stop_ids=(), matmul_precision=args.precision)
  engines = {"full": engine}
  if args.micro_vocab is not None:
    engines["reduced"] = Engine(with_micro_vocab(model, checkpoint, args.micro_vocab), tok,
                                stop_ids=(), matmul_precision=args.precision)
  print(f"HAMburger on SmolLM2-135M-Instruct: {label}")
  print(f"greedy, {args.new_tokens} new tokens/row (EOS ignored), confidence {args.confidence}"
        f"{group_cap(args.max_group)}; r = micro step / base step, measured at each batch size "
        f"({widths.STEPS} steps per jitted loop)")
  print(f"engine layout: {'fused' if engine.fused else 'separate'} projections, "
        f"{engine.dtype}; adapter cost = a base step reading a merged entry (the adapters "
        "folded into the kernels) vs an unmerged one; micro vocab = the ids micro steps choose "
        "among (full: the whole vocabulary); same tokens = rows whose tokens equal the full "
        "vocabulary's")
  print("\n| batch | micro vocab | base tok/s | HAMburger tok/s | ratio | tokens/step k | "
        "KV entries/token | r | adapter cost | ceiling | of ceiling | same tokens | "
        "compile s (base, ham) |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  ham = {"mode": "hamburger", "confidence": args.confidence, "max_group": args.max_group}
  for b in args.batches:
    ids = chat_ids(tok, (PROMPTS * (b // len(PROMPTS) + 1))[:b])
    runs = {"base": {"mode": "base"}, **{name: ham for name in engines}}
    out = run_interleaved(engine, ids, args.new_tokens, args.repeats, runs, engines)
    base_s, base_c, _ = out["base"]
    full_tokens = [g.token_ids for g in out["full"][2]]
    for name, eng in engines.items():
      ham_s, ham_c, gens = out[name]
      cost = step_costs(eng.runner, args.repeats, b)
      r = cost["micro"] / cost["base"]
      k = b * args.new_tokens / sum(g.macro_steps for g in gens)
      ceiling = args.new_tokens / lockstep_cost(gens, r)
      ratio = base_s / ham_s
      same = sum(g.token_ids == t for g, t in zip(gens, full_tokens))
      vocab = "full" if name == "full" else str(args.micro_vocab)
      print(f"| {b} | {vocab} | {b * args.new_tokens / base_s:.1f} | "
            f"{b * args.new_tokens / ham_s:.1f} | {ratio:.2f}x | {k:.2f} | {1 / k:.2f} | "
            f"{r:.3f} | {cost['merged'] / cost['base'] - 1:+.1%} | {ceiling:.2f}x | "
            f"{ratio / ceiling:.0%} | {same}/{b} | {base_c:.0f}, {ham_c:.0f} |")
  print("\n".join(launch_lines(engine.runner, 1, widths.KV_ENTRIES, model)))


def group_cap(max_group: int | None) -> str:
  return f", groups of at most {max_group} tokens" if max_group else ""


def lockstep_cost(gens, r: float) -> float:
  """Cost of a batch's decode in base-step units. Rows advance in lockstep: macro step j costs one
  base step plus r per micro step, and it runs micro steps until its largest group is complete.
  At batch 1 this is steps * (1 + (k - 1) r), docs/SPEC.md 6's ceiling k / (1 + (k - 1) r)."""
  steps = max(g.macro_steps for g in gens)
  largest = [max((g.groups[j] for g in gens if j < len(g.groups)), default=1)
             for j in range(steps)]
  return sum(1 + r * (m - 1) for m in largest)


def serve_workload(tok, n: int, new_range: tuple[int, int], seed: int = 0,
                   max_prompt_tokens: int = 192) -> list[tuple[list[int], int]]:
  """A stream of real requests: held-out ShareGPT first turns (up to max_prompt_tokens) and
  gsm_symbolic evaluation questions, alternating, each with max_new_tokens drawn uniformly
  from new_range."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from hamburger_jax.evaluation import tasks  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  count = lambda s: len(tok.encode(s))
  chat = dataclasses.replace(tasks.SHAREGPT_HELDOUT, max_prompt_tokens=max_prompt_tokens)
  sharegpt = chat.examples(n - n // 2, count_tokens=count)
  gsm = tasks.GSM_SYMBOLIC.examples(n // 2)
  mixed = [ex for pair in zip(sharegpt, gsm) for ex in pair] + sharegpt[len(gsm):]
  return [(tok.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=True),
           int(rng.integers(new_range[0], new_range[1] + 1))) for ex in mixed[:n]]


def run_serve(engine, workload, mode: str, slots: int, confidence: float,
              kv_blocks: int | None = None, round_steps: int | None = None,
              max_group: int | None = None) -> dict[str, float]:
  """Serves the workload once (programs compiled beforehand, not timed); every request arrives
  at t = 0, so latency = queueing + prefill + decode."""
  reqs = lambda: [Request(ids, max_new_tokens=n, confidence=confidence, id=i,
                          max_group=max_group) for i, (ids, n) in enumerate(workload)]
  lengths = [len(ids) for ids, _ in workload]
  layout = engine.layout(mode, slots, max(n for _, n in workload), max(lengths), kv_blocks)
  compile_s = engine.compile_programs(layout, [ids for ids, _ in workload], stochastic=False)
  t = time.perf_counter()
  run = engine.serve(reqs(), slots=slots, kv_blocks=kv_blocks, mode=mode,
                     round_steps=round_steps)
  out = list(run)
  wall = time.perf_counter() - t
  if any(g.error for g in out):
    raise RuntimeError(next(g.error for g in out if g.error))
  tokens = sum(g.new_tokens for g in out)
  lat = np.asarray([g.latency_s for g in out])
  stats = run.stats
  return {"tok_s": tokens / wall, "p50": float(np.percentile(lat, 50)),
          "p95": float(np.percentile(lat, 95)), "k": pooled_tokens_per_step(out),
          "in_flight": stats.mean_in_flight, "queued_in_flight": stats.in_flight_while_queued,
          "peak_blocks": max(stats.blocks_used),
          "preemptions": stats.preemptions, "wall": wall, "compile": compile_s,
          "rounds": stats.rounds, "prefill": sum(g.prefill_s for g in out),
          "prefix_hits": stats.prefix_hits, "prefix_tokens": stats.prefix_tokens,
          "kv_per_token": sum(g.kv_entries - g.prompt_tokens for g in out) / tokens,
          "blocks_held": mean_blocks_held(out, engine.block_size)}


def bench_serve(args) -> None:
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel

  checkpoint = pretrained.resolve_checkpoint(args.checkpoint)
  model, tok = cli.load_model("both", checkpoint, args.base, untrained_ok=True,
                              micro_vocab=args.micro_vocab)
  # every request runs its full max_new_tokens
  engine = Engine(model, tok, stop_ids=(), matmul_precision=args.precision)
  workload = serve_workload(tok, args.requests, args.new_range)
  prompt_lens = [len(ids) for ids, _ in workload]
  print(f"continuous batching, {checkpoint or 'UNTRAINED graft'}: {len(workload)} requests "
        f"(ShareGPT held-out + gsm_symbolic; prompts {min(prompt_lens)}-{max(prompt_lens)} "
        f"tokens; max_new_tokens {args.new_range[0]}-{args.new_range[1]}, EOS ignored), all "
        f"arriving at t = 0, greedy, KV blocks of {engine.block_size}")
  # (name, mode, confidence, max_group)
  variants = [("base", "base", 1.0, None),
              (f"HAMburger c={args.confidence}{group_cap(args.max_group)}", "hamburger",
               args.confidence, args.max_group),
              ("HAMburger forced 4-token groups", "hamburger", 0.0, None)]
  if "p" in args.parts:
    serve_prefix_cache(args, engine, workload, variants)
  if "a" in args.parts:
    serve_slots(args, engine, workload, variants)
  if "b" in args.parts:
    serve_fixed_pool(args, engine, workload, variants)
  if args.round_steps:
    serve_rounds(args, engine, workload, variants)
  print("\n".join(launch_lines(engine.runner, 1, 512, model)))


def serve_slots(args, engine, workload, variants) -> None:
  print("\n(a) KV pool holds every slot's longest request\n")
  print("| slots | variant | tok/s | vs base | p50 latency s | p95 latency s | tokens/step | "
        "KV entries/token | decode calls | prefill s | wall s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  curve = {}
  for slots in args.slots:
    base_tps = None
    for name, mode, c, g in variants:
      r = run_serve(engine, workload, mode, slots, c, max_group=g)
      base_tps = base_tps or r["tok_s"]
      curve.setdefault(name, []).append(r["tok_s"])
      print(f"| {slots} | {name} | {r['tok_s']:.1f} | {r['tok_s'] / base_tps:.2f}x | "
            f"{r['p50']:.1f} | {r['p95']:.1f} | {r['k']:.2f} | {r['kv_per_token']:.2f} | "
            f"{r['rounds']} | {r['prefill']:.1f} | {r['wall']:.1f} |", flush=True)
  if args.plot:
    plot_serve(args.slots, curve, args.plot)
    print(f"\nplot: {args.plot}")


def serve_prefix_cache(args, engine, workload, variants) -> None:
  """The same stream with the prefix cache off and on (every chat prompt here starts with the
  same system turn): prefill time and throughput."""
  from hamburger_jax.decode.prefix_cache import PrefixCache  # pylint: disable=C0415
  print("\n(p) prefix cache off vs on, KV pool as in (a)\n")
  print("| slots | variant | prefix cache | prompt tokens copied | prefill s | vs off | tok/s | "
        "vs off |")
  print("|---|---|---|---|---|---|---|---|")
  on = engine.prefix_cache
  for slots in args.slots:
    for name, mode, c, _ in (variants[0], variants[-1]):  # the base and forced 4-token groups
      first = None
      # One engine, its cache swapped: a second engine would compile every program again.
      for label, cache in (("off", PrefixCache(0)), ("on", on)):
        engine.prefix_cache = cache
        cache.clear()
        r = run_serve(engine, workload, mode, slots, c)
        first = first or r
        print(f"| {slots} | {name} | {label} | {r['prefix_tokens']} | {r['prefill']:.1f} | "
              f"{r['prefill'] / first['prefill']:.2f}x | {r['tok_s']:.1f} | "
              f"{r['tok_s'] / first['tok_s']:.2f}x |", flush=True)
  engine.prefix_cache = on


def ratio(x: float, base: float) -> str:
  """x / base as a table cell; "-" where the base is 0 (e.g. no request ever waited)."""
  return f"{x / base:.2f}x" if base > 0 else "-"


def serve_fixed_pool(args, engine, workload, variants) -> None:
  pool_slots = max(args.slots)
  print(f"\n(b) one fixed KV pool of {args.kv_blocks} blocks x {engine.block_size} entries, "
        f"{pool_slots} slots\n")
  print("| variant | mean requests in flight | vs base | in flight while requests wait | "
        "vs base | blocks a live request holds | ceiling vs base | peak blocks | preemptions | "
        "tok/s | vs base |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  base = None
  for name, mode, c, g in variants:
    r = run_serve(engine, workload, mode, pool_slots, c, kv_blocks=args.kv_blocks, max_group=g)
    base = base or r
    print(f"| {name} | {r['in_flight']:.1f} | {r['in_flight'] / base['in_flight']:.2f}x | "
          f"{r['queued_in_flight']:.1f} | "
          f"{ratio(r['queued_in_flight'], base['queued_in_flight'])} | "
          f"{r['blocks_held']:.1f} | {ratio(base['blocks_held'], r['blocks_held'])} | "
          f"{r['peak_blocks']} | "
          f"{r['preemptions']} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x |",
          flush=True)
  print("\nceiling vs base: the base's blocks per live request over the variant's (a pool that "
        "binds holds blocks / that many requests; prompts take one entry per token in every "
        "mode, docs/SPEC.md 1.1)")


def serve_rounds(args, engine, workload, variants) -> None:
  """Refill as each slot finishes (a host round trip then) against rounds of K macro steps
  (fewer round trips; a finished slot idles until its round ends)."""
  slots = max(args.slots)
  print(f"\n(c) when slots are refilled, {slots} slots, KV pool as in (a)\n")
  print("| variant | refill | tok/s | vs refill at finish | decode calls | p50 latency s |")
  print("|---|---|---|---|---|---|")
  for name, mode, c, _ in (variants[0], variants[-1]):  # the base and forced 4-token groups
    first = None
    for k in (None, *args.round_steps):
      r = run_serve(engine, workload, mode, slots, c, round_steps=k)
      first = first or r
      print(f"| {name} | {'at finish' if k is None else f'every {k} steps'} | "
            f"{r['tok_s']:.1f} | {r['tok_s'] / first['tok_s']:.2f}x | {r['rounds']} | "
            f"{r['p50']:.1f} |", flush=True)


def plot_serve(slots: list[int], curve: dict[str, list[float]], path: str) -> None:
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
  fig = Figure(figsize=(6, 4), dpi=120)
  ax = fig.subplots()
  for name, tps in curve.items():
    ax.plot(slots, tps, marker="o", label=name)
  ax.set_xlabel("slots (requests decoded at once)")
  ax.set_ylabel("generated tokens / s")
  ax.set_xticks(slots)
  ax.set_title("Continuous batching throughput (2 CPU cores)")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path)


def bench_random(args) -> None:
  """A run config's model with random weights (no weight files): one macro step timed alone,
  with its FLOPs counted (ours and XLA's), MFU and the fraction of the memory roofline; and the
  engine's decode speed on random prompts, HAMburger with forced K-token groups (confidence 0:
  random weights make no groups worth stopping)."""
  from hamburger_jax import pretrained, roofline  # pylint: disable=import-outside-toplevel
  from hamburger_jax.config import ConfigError  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  from hamburger_jax.model.decode_layout import decode_layout  # pylint: disable=C0415
  from hamburger_jax.run_config import load_run_config  # pylint: disable=C0415

  dtypes = [f"model.dtype={args.dtype}", f"model.param_dtype={args.dtype}"] if args.dtype else []
  try:
    cfg = pretrained.random_run_config(load_run_config(
        args.config, dtypes + ["train.init_from=''"], shared_only=True))
  except (ConfigError, RuntimeError) as e:  # RuntimeError: an asset (the GGUF) not installed
    raise SystemExit(f"error: {e}") from None
  first_peak = cli.device_peak(args, cfg.model.dtype)
  model, _ = cli.phase("building random weights", lambda: pretrained.build_run_model(cfg))
  hcfg = model.cfg
  k = model.max_group
  engine = None if args.no_engine else Engine(model, None, stop_ids=(),
                                                 matmul_precision=args.precision)
  modes = [args.mode] if args.mode else ["base", "hamburger"]
  rng = np.random.default_rng(0)
  results = []
  for b in args.batches:
    engine_s = {}
    if engine is not None:
      ids = rng.integers(0, hcfg.base.vocab_size, (b, args.prompt_len)).tolist()
      engine_s = cli.phase(f"engine, batch {b}", lambda: engine_decode_s(
          engine, ids, args.new_tokens, args.repeats,
          {m: {"mode": m, "confidence": 0.0 if m == "hamburger" else 1.0} for m in modes}))
    for mode in modes:
      written = args.new_tokens if mode == "base" else -(-args.new_tokens // k)
      kv_len = args.prompt_len + written
      r = cli.phase(f"{mode} step, batch {b}",
                    lambda: time_decode_step(model, mode, b, kv_len, args.repeats))
      results.append((mode, b, kv_len, r, engine_s.get(mode)))
  peak = first_peak.best(cli.device_peak(args, cfg.model.dtype))  # measured again, after the steps

  graft = sum(roofline.graft_params(hcfg).values())
  print(f"{args.config}: random weights, base {roofline.base_params(hcfg.base) / 1e6:.1f}M + "
        f"graft {graft / 1e6:.1f}M params, {cfg.model.param_dtype} weights, {cfg.model.dtype} "
        f"compute; prompts of {args.prompt_len} random tokens, {args.new_tokens} new tokens/row "
        f"(EOS ignored); HAMburger: forced {k}-token groups")
  print(f"device: {peak.name}; peak {peak.flops / 1e12:.3g} TFLOP/s, {peak.bandwidth / 1e9:.3g} "
        f"GB/s ({peak.source})")
  print("step: one macro step alone, its KV cache holding what the decode writes (prompt + "
        "one entry per step); MFU = our FLOPs / step time / peak; roofline = bytes the step "
        "must read (weights per pass + KV cache) / step time / peak bandwidth; engine: "
        "Engine.generate, wall time less the prompts' prefill")
  print("\n| mode | batch | tokens/step | KV entries | step ms | step tok/s | engine tok/s | "
        "FLOPs/token (ours) | FLOPs/token (XLA) | XLA / ours | MFU | MB read/step | roofline | "
        "bound | compile s (step, engine) |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for mode, b, kv_len, r, engine_r in results:
    per_step = b * (k if mode == "hamburger" else 1)
    ours = roofline.decode_step_flops(hcfg, mode, b, kv_len)
    read = roofline.decode_step_bytes(hcfg, mode, b, kv_len)
    engine_tps, engine_c = "-", "-"
    if engine_r is not None:
      engine_tps, engine_c = f"{b * args.new_tokens / engine_r[0]:.1f}", f"{engine_r[1]:.0f}"
    print(f"| {mode} | {b} | {per_step} | {kv_len} | {1e3 * r['step_s']:.1f} | "
          f"{per_step / r['step_s']:.1f} | {engine_tps} | {ours / per_step / 1e6:.1f}M | "
          + ("- | - | " if r["xla"] is None else
             f"{r['xla'] / per_step / 1e6:.1f}M | {r['xla'] / ours:.3f} | ") +
          f"{roofline.mfu(ours, r['step_s'], peak):.1%} | {read / 1e6:.0f} | "
          f"{roofline.roofline_fraction(read, r['step_s'], peak):.1%} | "
          f"{roofline.bound(ours, read, peak)} | {r['compile_s']:.0f}, {engine_c} |")
  runner = engine.runner if engine is not None else decode_layout(model)
  print("\n".join(launch_lines(runner, 1, args.prompt_len + args.new_tokens, model)))


def engine_decode_s(engine, ids, n_new: int, repeats: int,
                    runs: dict[str, dict]) -> dict[str, tuple[float, float]]:
  """name -> (best decode seconds of the batch, compile seconds) of engine.generate under each
  setting, interleaved as run_interleaved does. Decode seconds: the call's wall time less its
  prompts' prefill times (the rows are prefilled one by one before the batch decodes, so a
  row's own decode_s would count its batch mates' prefills)."""
  def decode_s(kw) -> float:
    t = time.perf_counter()
    gens = engine.generate(ids, max_new_tokens=n_new, **kw)
    return time.perf_counter() - t - sum(g.prefill_s for g in gens)

  compile_s = {name: engine.generate(ids, max_new_tokens=n_new, **kw)[0].compile_s
               for name, kw in runs.items()}
  best = {name: float("inf") for name in runs}
  for _ in range(repeats):
    for name, kw in runs.items():
      best[name] = min(best[name], decode_s(kw))
  return {name: (best[name], compile_s[name]) for name in runs}


def time_decode_step(model, mode: str, batch: int, kv_len: int, repeats: int) -> dict[str, float]:
  """roofline.decode_step_program compiled (seconds) and timed (the best mean step time of
  `repeats` runs, each long enough to average over calls), with XLA's FLOPs for it (None on a
  GPU, where XLA does not count the matmuls cuBLAS runs)."""
  import jax  # pylint: disable=import-outside-toplevel
  from hamburger_jax import roofline  # pylint: disable=import-outside-toplevel
  step, (params, state) = roofline.decode_step_program(model, mode, batch, kv_len)
  t = time.perf_counter()
  compiled = step.lower(params, state).compile()  # the calls below reuse it
  compile_s = time.perf_counter() - t
  # The state is donated: each call takes the previous one's. Its cache length runs past
  # kv_len; the writes past the end are dropped and the step reads all kv_len slots either way.
  box = {"state": state}

  def run(n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
      box["state"] = compiled(params, box["state"])
    jax.block_until_ready(box["state"])
    return (time.perf_counter() - t) / n

  run(1)  # the first call places the arguments
  calls = max(1, min(20, int(0.5 / run(1))))
  step_s = min(run(calls) for _ in range(repeats))
  xla = roofline.xla_flops(compiled) if roofline.xla_counts_matmuls() else None
  return {"step_s": step_s, "compile_s": compile_s, "xla": xla}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m infer.bench", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mode", choices=("base", "hamburger", "serve", "widths"), default=None,
                 help="default: base (with --random-weights: base and hamburger)")
  p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None,
                 help="comma-separated batch sizes (default: 1,8 for base and --random-weights; "
                 "1,8,32 for hamburger)")
  p.add_argument("--new-tokens", type=int, default=None,
                 help="new tokens per row (default 128; --random-weights: 32)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="weights and compute (default float32; --random-weights: the config's)")
  cli.add_model_flags(p, checkpoint_help="hamburger / serve: graft checkpoint (default: the "
                     "shipped one, else an untrained graft)", micro_vocab=True)
  p.add_argument("--config", default=None,
                 help="--random-weights: the run config whose model (base architecture, graft) "
                 "to build, e.g. configs/llama3_2_1b.yaml")
  p.add_argument("--random-weights", action="store_true",
                 help="random weights of --config's model (no weight files): step FLOPs (ours "
                 "and XLA's), MFU, memory roofline, engine tokens/s")
  p.add_argument("--prompt-len", type=int, default=64,
                 help="--random-weights: random prompt tokens per row")
  p.add_argument("--no-engine", action="store_true",
                 help="--random-weights: time the step alone (skips compiling the engine)")
  cli.add_peak_flags(p, when="--random-weights: ")
  cli.add_precision_flag(p)
  p.add_argument("--confidence", type=float, default=DEFAULT_CONFIDENCE)
  p.add_argument("--max-group", type=int, default=None,
                 help="hamburger / serve: cap HAMburger's groups at this many tokens (1..K)")
  p.add_argument("--slots", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32],
                 help="serve: comma-separated slot counts")
  p.add_argument("--requests", type=int, default=48, help="serve: requests in the stream")
  p.add_argument("--new-range", type=lambda s: tuple(int(x) for x in s.split(",")),
                 default=(32, 256), help="serve: min,max of per-request max_new_tokens")
  p.add_argument("--kv-blocks", type=int, default=160,
                 help="serve (b): the fixed KV pool, in blocks of 16 entries")
  p.add_argument("--plot", default=None, help="serve: write the throughput-vs-slots PNG here")
  p.add_argument("--parts", default="ab",
                 help="serve: any of a (slots sweep), b (fixed pool), p (prefix cache off vs "
                      "on); c runs with --round-steps")
  p.add_argument("--round-steps", type=lambda s: [int(x) for x in s.split(",")], default=[],
                 help="serve (c): refill every K macro steps, against refill at each finish")
  args = p.parse_args(argv)
  check_random_weights_flags(p, args)
  if not args.random_weights:
    args.mode = args.mode or "base"
  if args.mode == "base" and args.base and not args.random_weights:
    p.error("--base applies to --mode hamburger and serve: --mode base compares our decode of "
            "SmolLM2 with transformers' on the same GGUF file")
  if not args.parts or not set(args.parts) <= {"a", "b", "p"}:
    p.error(f"--parts={args.parts!r}: use any of a, b and p (e.g. ab)")
  if any(k < 1 for k in args.round_steps):
    p.error(f"--round-steps {args.round_steps}: each K must be >= 1")
  if args.batches is not None and (not args.batches or min(args.batches) < 1):
    p.error(f"--batches {args.batches}: each batch size must be >= 1")
  if args.repeats < 1:
    p.error(f"--repeats {args.repeats} must be >= 1")
  args.new_tokens = args.new_tokens or (32 if args.random_weights else 128)
  try:
    check_settings(args.new_tokens, args.confidence, args.max_group)
  except GenerationError as e:
    p.error(str(e))
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  cache.enable_compilation_cache()
  if args.random_weights:
    args.batches = args.batches or [1, 8]
    bench_random(args)
    return 0
  args.dtype = args.dtype or "float32"
  default_batches = {"base": [1, 8], "widths": list(WIDTHS)}.get(args.mode, [1, 8, 32])
  args.batches = args.batches or default_batches
  {"base": bench_base, "hamburger": bench_hamburger, "serve": bench_serve,
   "widths": bench_widths}[args.mode](args)
  return 0


WIDTHS = (1, 2, 4, 8, 16)


def bench_widths(args) -> None:
  """A base forward of w rows against one of 1 row (infer/widths.py): the decode loop's cost
  and bandwidth per width, then the layers' projections alone in other layouts and dtypes."""
  from hamburger_jax import pretrained, roofline  # pylint: disable=import-outside-toplevel
  from infer import widths  # pylint: disable=import-outside-toplevel
  from hamburger_jax.model.decode_layout import decode_layout  # pylint: disable=C0415
  base, _ = cli.load_model("base", None, args.base, dtype=args.dtype, param_dtype=args.dtype)
  bw = cli.phase("copy bandwidth", roofline.copy_bandwidth_gb_s)
  layouts = {"fused": decode_layout(base), "separate": base}
  costs = {name: cli.phase(f"w-row forwards, {name} projections", lambda m=m: widths.measure(
      m, args.batches, widths.KV_ENTRIES, args.repeats)) for name, m in layouts.items()}
  bw = max(bw, roofline.copy_bandwidth_gb_s())  # measured again, after the forwards
  print(f"{pretrained.describe('base', None, args.base)}, {args.dtype} weights and compute; "
        f"{roofline.cpu_model()}, {os.cpu_count()} cores; copy bandwidth {bw:.1f} GB/s (the roofline)")
  print(f"step = a base forward with its LM head and argmax, KV cache of "
        f"{widths.KV_ENTRIES} entries, {widths.STEPS} steps per jitted call, best of "
        f"{args.repeats} interleaved rounds; MB read = weights once + each sequence's KV cache")
  for name, c in costs.items():
    print(f"\n{name} projections (the engine decodes fused: model/decode_layout.py)\n")
    print("\n".join(widths.report(c, bw)))
  best = cli.phase("projection variants", lambda: widths.measure_variants(
      base.cfg, args.batches, args.repeats))
  print("\nthe decoder layers' projections alone (random weights, no attention, norms or "
        "cache), per layout and weight dtype:\n")
  print("\n".join(widths.report_variants(base.cfg, best, bw)))
  print("\n".join(launch_lines(layouts["fused"], 1, widths.KV_ENTRIES)))


def check_random_weights_flags(p: argparse.ArgumentParser, args) -> None:
  """--random-weights and the flags that go (or never go) with it: one-line errors."""
  if not args.random_weights:
    only = [f for f, v in (("--config", args.config), ("--no-engine", args.no_engine),
                           ("--peak-tflops", args.peak_tflops), ("--peak-gb-s", args.peak_gb_s))
            if v]
    if only:
      p.error(f"{only[0]} applies with --random-weights: add --random-weights (and --config "
              "CONFIG) to bench a config's model with random weights")
    return
  if not args.config:
    p.error("--random-weights builds a run config's model: add --config CONFIG (e.g. "
            "configs/llama3_2_1b.yaml)")
  if args.mode == "serve":
    p.error("--mode serve streams real chat requests through a tokenizer: with "
            "--random-weights use --mode base or hamburger (default: both)")
  if args.checkpoint or args.base:
    p.error("--random-weights builds --config's model with random weights: drop --checkpoint "
            "and --base (without --random-weights they load real weights)")
  if args.prompt_len < 1:
    p.error(f"--prompt-len {args.prompt_len} must be >= 1")
  cli.check_peak_flags(p, args)


if __name__ == "__main__":
  sys.exit(main())
