"""Training curves of a run, from its metrics.jsonl, as one PNG.

  python -m train.curves runs/smollm2-hamburger [--out curves.png]
  python -m train.curves --compare paper=runs/p distill=runs/d/micro,runs/d/merger --out cmp.png
  python -m train.curves --tradeoff teacher=runs/t/micro segments=runs/s/micro --out stop.png
  python -m train.curves --fidelity control=runs/arms/control ctx=runs/arms/contextual --out f.png

The panels are hamburger_jax/training/curves.py's: loss, token accuracy per micro step,
stop-head accuracy, group sizes and tokens per macro step.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from hamburger_jax import cli
from hamburger_jax.training.curves import (plot_comparison, plot_curves, plot_fidelity,
                                           plot_tradeoff)
from hamburger_jax.training.loop import read_metrics


def named(flag: str, usage: str):
  """A parser of one NAME=VALUE argument of `flag` into (name, value)."""
  def parse(spec: str) -> tuple[str, str]:
    name, eq, value = spec.partition("=")
    if not eq or not name or not value:
      raise ValueError(f"{flag} {spec!r}: use {usage}")
    return name, value
  return parse


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m train.curves", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("run_dir", nargs="?")
  p.add_argument("--compare", nargs="+", metavar="NAME=DIR[,DIR...]",
                 help="instead of one run: recipes to compare, each its stages' run dirs in "
                 "order, e.g. paper=runs/p distill=runs/d/micro,runs/d/merger (needs --out)")
  p.add_argument("--tradeoff", nargs="+", metavar="NAME=DIR",
                 help="instead: each run's tokens per step vs agreement with the base across "
                 "the tracked confidences, from its last validation (needs --out)")
  p.add_argument("--fidelity", nargs="+", metavar="NAME=DIR",
                 help="instead: runs' learning curves on the fidelity set (their fid_* metrics, "
                 "train.fidelity_every), one line a run (needs --out)")
  p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curves.png)")
  cli.add_confidence_flag(p, help_="--compare: the tracked confidence of the acceptance "
                          "panels (default %(default)s)")
  p.add_argument("--smooth", type=int, default=5, help="moving-average window for train series")
  args = p.parse_args(argv)
  if (bool(args.run_dir) + bool(args.compare) + bool(args.tradeoff) + bool(args.fidelity) != 1
      or ((args.compare or args.tradeoff or args.fidelity) and not args.out)):
    p.error("give a RUN_DIR, or --compare, --tradeoff or --fidelity NAME=DIR... with --out")
  try:
    if args.fidelity:
      runs = {name: read_metrics(run_dir)
              for name, run_dir in map(named("--fidelity", "NAME=DIR"), args.fidelity)}
      path = plot_fidelity(runs, args.out)
    elif args.tradeoff:
      runs = {name: read_metrics(run_dir)
              for name, run_dir in map(named("--tradeoff", "NAME=DIR"), args.tradeoff)}
      path = plot_tradeoff(runs, args.out)
    elif args.compare:
      recipes = {name: [read_metrics(d) for d in dirs.split(",")]
                 for name, dirs in map(named("--compare", "NAME=DIR[,DIR...]"), args.compare)}
      path = plot_comparison(recipes, args.out, args.confidence)
    else:
      rows = read_metrics(args.run_dir)
      path = plot_curves(rows, args.out or os.path.join(args.run_dir, "curves.png"), args.smooth)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
