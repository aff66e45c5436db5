"""infer.bench --mode serve: continuous batching of a stream of real requests, base against
HAMburger: a sweep of slot counts, a fixed KV pool, the prefix cache off and on, refill
rounds."""

from __future__ import annotations

import os

from hamburger_jax.benchmarks.prompts import serve_workload
from hamburger_jax.benchmarks.serving import run_serve
from hamburger_jax import cli
from hamburger_jax.benchmarks.report import group_cap, launch_lines


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
  print("\n".join(launch_lines(engine.runner, 1, 512, model,
                               tpu_fusions=not args.no_tpu_fusions)))

def serve_slots(args, engine, workload, variants) -> None:
  """Part (a): each slot count, the base and each HAMburger variant (HAMburger at the
  confidence once per --micro-rule), in --repeats interleaved rounds, each row its best round:
  the machine's speed drifts between runs of a minute (the same prefills have taken 12.1 s in
  one run and 9.8 s in the next), and a ratio of two runs apart would carry that drift."""
  print(f"\n(a) KV pool holds every slot's longest request; best of {args.repeats} interleaved "
        "rounds\n")
  print("| slots | variant | tok/s | vs base | p50 latency s | p95 latency s | tokens/step | "
        "KV entries/token | decode calls | prefill s | wall s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  curve = {}
  rules = args.micro_rule
  for slots in args.slots:
    runs = []  # (label, engine, mode, confidence, max_group)
    for name, mode, c, g in variants:
      ruled = mode == "hamburger" and c > 0  # forced groups go on whatever the rule
      for rule in (rules if ruled else ["off"]):
        label = f"{name}, micro rule {rule}" if ruled and rules != ["off"] else name
        eng = engine.with_micro_rule(rule)
        eng.micro_costs(eng.layout(mode, slots, 1, 1))  # "auto" times its steps here, untimed
        runs.append((label, eng, mode, c, g))
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
      for label, eng, mode, c, g in runs:
        r = run_serve(eng, workload, mode, slots, c, max_group=g)
        if label not in best or r["tok_s"] > best[label]["tok_s"]:
          best[label] = r
    base_tps = best[runs[0][0]]["tok_s"]
    for label, r in best.items():
      curve.setdefault(label, []).append(r["tok_s"])
      print(f"| {slots} | {label} | {r['tok_s']:.1f} | {r['tok_s'] / base_tps:.2f}x | "
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
  from hamburger_jax.evaluation.plots import save_figure  # pylint: disable=C0415
  fig = Figure(figsize=(6, 4), dpi=120)
  ax = fig.subplots()
  for name, tps in curve.items():
    ax.plot(slots, tps, marker="o", label=name)
  ax.set_xlabel("slots (requests decoded at once)")
  ax.set_ylabel("generated tokens / s")
  ax.set_xticks(slots)
  ax.set_title(f"Continuous batching throughput ({os.cpu_count()} CPU cores)")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  save_figure(fig, path)
