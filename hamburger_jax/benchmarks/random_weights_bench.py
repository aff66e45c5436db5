"""infer.bench --random-weights: a run config's model on random weights (no weight files): one
macro step timed alone with its FLOPs (ours and XLA's), MFU and the fraction of the memory
roofline, and the engine's decode speed."""

from __future__ import annotations

import argparse

import numpy as np

from hamburger_jax.benchmarks.timing import time_batches, time_decode_step
from hamburger_jax import cli
from hamburger_jax.benchmarks.report import launch_lines


def bench_random(args) -> None:
  """A run config's model with random weights (no weight files): one macro step timed alone,
  with its FLOPs counted (ours and XLA's), MFU and the fraction of the memory roofline; and the
  engine's decode speed on random prompts, HAMburger with forced K-token groups (confidence 0:
  random weights make no groups worth stopping)."""
  from hamburger_jax import pretrained  # pylint: disable=C0415
  from hamburger_jax.costs import analytic, peaks
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
      engine_s = cli.phase(f"engine, batch {b}", lambda: time_batches(
          engine, ids, args.new_tokens, args.repeats,
          {m: {"mode": m, "confidence": 0.0 if m == "hamburger" else 1.0} for m in modes}))
    for mode in modes:
      written = args.new_tokens if mode == "base" else -(-args.new_tokens // k)
      kv_len = args.prompt_len + written
      r = cli.phase(f"{mode} step, batch {b}",
                    lambda: time_decode_step(model, mode, b, kv_len, args.repeats))
      results.append((mode, b, kv_len, r, engine_s.get(mode)))
  peak = first_peak.best(cli.device_peak(args, cfg.model.dtype))  # measured again, after the steps

  graft = sum(analytic.graft_params(hcfg).values())
  print(f"{args.config}: random weights, base {analytic.base_params(hcfg.base) / 1e6:.1f}M + "
        f"graft {graft / 1e6:.1f}M params, {cfg.model.param_dtype} weights, {cfg.model.dtype} "
        f"compute; prompts of {args.prompt_len} random tokens, {args.new_tokens} new tokens/row "
        f"(EOS ignored); HAMburger: forced {k}-token groups")
  print(f"device: {peak.name}; peak {peak.flops / 1e12:.3g} TFLOP/s, {peak.bandwidth / 1e9:.3g} "
        f"GB/s ({peak.source})")
  print("step: one macro step alone, its KV cache holding what the decode writes (prompt + "
        "one entry per step); MFU = our FLOPs / step time / peak; roofline = bytes the step "
        "must read (weights per pass + KV cache) / step time / peak bandwidth; engine: "
        "Engine.generate, tokens all rows generated / the time the batch decoded (the "
        "prompts' prefills apart)")
  print("\n| mode | batch | tokens/step | KV entries | step ms | step tok/s | engine tok/s | "
        "FLOPs/token (ours) | FLOPs/token (XLA) | XLA / ours | MFU | MB read/step | roofline | "
        "bound | compile s (step, engine) |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for mode, b, kv_len, r, engine_r in results:
    per_step = b * (k if mode == "hamburger" else 1)
    ours = analytic.decode_step_flops(hcfg, mode, b, kv_len)
    read = analytic.decode_step_bytes(hcfg, mode, b, kv_len)
    engine_tps, engine_c = "-", "-"
    if engine_r is not None:
      engine_tps, engine_c = f"{engine_r.tokens_per_s:.1f}", f"{engine_r.compile_s:.0f}"
    print(f"| {mode} | {b} | {per_step} | {kv_len} | {1e3 * r['step_s']:.1f} | "
          f"{per_step / r['step_s']:.1f} | {engine_tps} | {ours / per_step / 1e6:.1f}M | "
          + ("- | - | " if r["xla"] is None else
             f"{r['xla'] / per_step / 1e6:.1f}M | {r['xla'] / ours:.3f} | ") +
          f"{peaks.mfu(ours, r['step_s'], peak):.1%} | {read / 1e6:.0f} | "
          f"{peaks.roofline_fraction(read, r['step_s'], peak):.1%} | "
          f"{peaks.bound(ours, read, peak)} | {r['compile_s']:.0f}, {engine_c} |")
  runner = engine.runner if engine is not None else decode_layout(model)
  print("\n".join(launch_lines(runner, 1, args.prompt_len + args.new_tokens, model,
                               tpu_fusions=not args.no_tpu_fusions)))

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
