"""What a HAMburger macro step costs over a base step when nothing merges, part by part.

  python -m infer.experiments.ablate_step --batch 1 --rounds 6

Decodes the bench prompts (hamburger_jax.benchmarks.prompts, EOS ignored) in base mode and in
HAMburger mode with parts of the HAMburger step taken out (decode/step.py: StepVariant), each
variant its own engine, then `--rounds` rounds that run every variant once in turn (the
machine's drift hits them alike). Variants:
- hamburger: the engine as it is;
- no_adapters: the merged-entry adapters never act (the plain base weights everywhere);
- token0_only: the proposal cut to token 0 (no stop head, no micro-step switch);
- no_micro_steps: the stop head runs (its decision is computed), the micro-step switch does not;
- all_out: both, and the compositional embedder replaced by token 0's embedding.
At a confidence where no group continues (the default 0.8 on these prompts: k = 1.00) every
variant emits the base's tokens, so the differences are the step's overhead alone. Prints ms per
token (median over rounds) and the overhead against base mode.
"""

from __future__ import annotations

import argparse
import sys

from hamburger_jax import cli

VARIANTS = ("hamburger", "no_adapters", "token0_only", "no_micro_steps", "all_out")


def step_variant(name: str):
  """The decode step of variant `name` (decode/step.py: StepVariant)."""
  from hamburger_jax.decode.step import StepVariant  # pylint: disable=import-outside-toplevel
  return {"hamburger": StepVariant(), "no_adapters": StepVariant(adapters=False),
          "token0_only": StepVariant(proposal="token0"),
          "no_micro_steps": StepVariant(proposal="stop_only"),
          "all_out": StepVariant(adapters=False, proposal="token0", embedder="token0")}[name]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m infer.experiments.ablate_step",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  cli.add_model_flags(p, checkpoint_help="graft checkpoint (default: the shipped one)")
  p.add_argument("--batch", type=int, default=1, help="prompts decoded together")
  p.add_argument("--new-tokens", type=int, default=128)
  cli.add_confidence_flag(p)
  p.add_argument("--rounds", type=int, default=6)
  args = p.parse_args(argv)
  for flag, v in (("--batch", args.batch), ("--new-tokens", args.new_tokens),
                  ("--rounds", args.rounds)):
    if v < 1:
      p.error(f"{flag} {v} must be >= 1")
  if not 0.0 <= args.confidence <= 1.0:
    p.error(f"--confidence {args.confidence} must be in [0, 1]")
  import numpy as np  # pylint: disable=import-outside-toplevel
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.requests import pooled_tokens_per_step  # pylint: disable=C0415
  from hamburger_jax.benchmarks.prompts import PROMPTS, chat_ids  # pylint: disable=C0415

  checkpoint = pretrained.resolve_checkpoint(args.checkpoint)
  try:
    model, tok = cli.load_model("both", checkpoint, args.base)
  except cli.ModelLoadError as e:
    raise SystemExit(f"error: {e}") from None
  ids = chat_ids(tok, (PROMPTS * (args.batch // len(PROMPTS) + 1))[:args.batch])
  runs = {"base": ("hamburger", "base")} | {v: (v, "hamburger") for v in VARIANTS}
  engines, steps = {}, {}
  for name, (variant, mode) in runs.items():
    engine = Engine(model, tok, stop_ids=(), variant=step_variant(variant))
    g = cli.phase(f"compiling {name}", lambda: engine.generate(
        ids, max_new_tokens=args.new_tokens, mode=mode, confidence=args.confidence))
    engines[name], steps[name] = engine, g
  ms = {name: [] for name in runs}
  for _ in range(args.rounds):
    for name, (_, mode) in runs.items():
      g = engines[name].generate(ids, max_new_tokens=args.new_tokens, mode=mode,
                                 confidence=args.confidence)
      ms[name].append(1e3 * g[0].decode_s / args.new_tokens)
  k = pooled_tokens_per_step(steps["hamburger"])
  base = float(np.median(ms["base"]))
  print(f"{pretrained.describe('hamburger', checkpoint, args.base)}; batch {args.batch}, "
        f"{args.new_tokens} tokens, confidence {args.confidence} (HAMburger k = {k:.2f}); "
        f"median of {args.rounds} interleaved rounds\n")
  print("| variant | ms / token | vs base mode | min - max |")
  print("|---|---|---|---|")
  for name, t in ms.items():
    med = float(np.median(t))
    print(f"| {name} | {med:.2f} | {med / base - 1:+.1%} | {min(t):.2f} - {max(t):.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
