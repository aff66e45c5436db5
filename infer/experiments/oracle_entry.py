"""The oracle entry: how well any compositional embedder could do, on the fidelity set.

hamburger_jax/evaluation/oracle_entry.py: a free input vector per merged slot of the fidelity
set's one-merge contexts, optimised against the frozen base and the graft's adapters; its
agreement with the base bounds what any compositional embedder could reach.

  python -m infer.experiments.oracle_entry --checkpoint checkpoints/smollm2-135m-hamburger \\
      --slots 256

Prints the learning curve (agreement and KL by step; step 0 is the graft's own embedder) and
writes it to --out as JSON.
"""

# pylint: disable=import-outside-toplevel

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from hamburger_jax import cli


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m infer.experiments.oracle_entry",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  cli.add_model_flags(p, checkpoint_help="the graft whose reading side is bounded (default: the "
                      "shipped one)")
  p.add_argument("--fidelity-set", default=None, help="default: the committed one")
  p.add_argument("--slots", type=int, default=256, help="merged slots optimised")
  p.add_argument("--steps", type=int, default=150, help="Adam steps per slot")
  p.add_argument("--lr", type=float, default=0.05, help="Adam's step, relative to the "
                 "embeddings' RMS")
  p.add_argument("--out", default="runs/oracle_entry.json")
  args = p.parse_args(argv)
  for name in ("slots", "steps"):
    if getattr(args, name) < 1:
      p.error(f"--{name}={getattr(args, name)} must be a positive integer")
  if not args.lr > 0:
    p.error(f"--lr={args.lr} must be > 0")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  from hamburger_jax import cache, files
  from hamburger_jax.evaluation import fidelity, fidelity_set, oracle_entry
  cache.enable_compilation_cache()
  log = lambda line: print(line, file=sys.stderr)
  try:
    model, _ = cli.load_model("hamburger", args.checkpoint, args.base)
    fset = fidelity_set.load(args.fidelity_set)
    fidelity_set.check_fits(fset, model.base, model.max_group)
    records = fidelity.teacher_records(model, fset.records)
    curve = oracle_entry.optimise(model, records, slots=args.slots, steps=args.steps,
                                  lr=args.lr, log=log)
  except (fidelity_set.FidelitySetError, cli.ModelLoadError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"| step | agreement | KL |  ({curve.slots} one-merge slots)")
  print("|---|---|---|")
  for s, a, k in zip(curve.steps, curve.agree, curve.kl):
    print(f"| {s} | {a:.3f} | {k:.3f} |")
  print(f"by group size, the embedder's -> the oracle's: " + ", ".join(
      f"{s}: {curve.by_size['agree_0'][s]:.3f} -> {curve.by_size['agree_final'][s]:.3f}"
      for s in curve.by_size["agree_0"]))
  print(f"the optimised entries moved {curve.relative_change:.2f} of their norm")
  files.makedirs(os.path.dirname(args.out) or ".")
  command = ["python", "-m", "infer.experiments.oracle_entry", *(argv or sys.argv[1:])]
  files.write_json_atomic(args.out, {"command": " ".join(command),
                                     **dataclasses.asdict(curve)}, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
