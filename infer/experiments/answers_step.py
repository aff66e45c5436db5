"""The self-distilled answers' program by its decode step: in place against the engine's.

hamburger_jax/data/tokens/answers.py: "in_place" (its default: each layer writes its entry in
place, then reads the cache in one pass) against "engine" (Llama.forward over a KVCache, as the
serving engine steps), in the same run: answer tokens/s, compile time, the whole-array copies
its decode loop makes each step, and whether both answer alike.

  python -m infer.experiments.answers_step --config configs/tiny.yaml --rows 64
  python -m infer.experiments.answers_step --config configs/smollm2_135m_window.yaml --rows 64 \\
      --dtype float32 --prompt-len 64 --max-new 32
"""

from __future__ import annotations

import argparse

import numpy as np

from hamburger_jax import cli


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="python -m infer.experiments.answers_step",
                              description="\n\n".join(__doc__.split("\n\n")[:2]))
  p.add_argument("--config", default="configs/tiny.yaml", help="a run config: its base model")
  p.add_argument("--dtype", default=None, help="override model.dtype (and param_dtype)")
  p.add_argument("--rows", type=int, default=64)
  p.add_argument("--prompt-len", type=int, default=64)
  p.add_argument("--max-new", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args(argv)
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks.answers import time_answers  # pylint: disable=C0415
  from hamburger_jax.data.tokens.answers import STEPS  # pylint: disable=C0415
  from hamburger_jax.run_config import load_run_config  # pylint: disable=C0415
  import jax  # pylint: disable=import-outside-toplevel

  sets = [f"model.dtype={args.dtype}", f"model.param_dtype={args.dtype}"] if args.dtype else []
  cfg = load_run_config(args.config, sets, shared_only=True)
  base, _ = cli.phase("loading the base", lambda: pretrained.load_base_for_run(cfg.model))
  runs = cli.phase(f"{' and '.join(STEPS)}: compiling, then timing", lambda: time_answers(
      base, args.rows, args.prompt_len, args.max_new, args.repeats))
  print(f"{args.config} base ({base.cfg.dtype}), {args.rows} rows, prompts of "
        f"{args.prompt_len // 2}..{args.prompt_len} random tokens, {args.max_new} answer "
        f"tokens each; {jax.devices()[0].device_kind}, fastest of {args.repeats} interleaved")
  print("| decode step | answer tok/s | s a call | compile s | copies in the decode loop |")
  print("|---|---|---|---|---|")
  for r in runs:
    copies = ", ".join(f"{n} x {shape}" for shape, n in sorted(r.loop_copies.items())) or "none"
    print(f"| {r.step} | {r.tokens_per_s:,.0f} | {r.seconds:.3f} | {r.compile_s:.1f} | "
          f"{copies} |")
  same = all(np.array_equal(r.answer, runs[0].answer) for r in runs)
  print(f"speed-up of {runs[0].step} over {runs[-1].step}: "
        f"{runs[0].tokens_per_s / runs[-1].tokens_per_s:.2f}x; answers equal: {same}")


if __name__ == "__main__":
  main()
