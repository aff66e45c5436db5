"""(Re)draw an evaluation's plots (hamburger_jax/evaluation/plots.py) next to its results.json.

  python -m infer.plots runs/eval/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from hamburger_jax import files
from hamburger_jax.evaluation.plots import plot_all


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m infer.plots", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("results", help="results.json written by python -m infer.eval")
  p.add_argument("--out", default=None, help="directory for the PNGs (default: the JSON's)")
  args = p.parse_args(argv)
  if not files.exists(args.results):
    p.error(f"{args.results} does not exist: run python -m infer.eval first")
  results = json.loads(files.read_text(args.results))
  for path in plot_all(results, args.out or os.path.dirname(files.absolute(args.results))):
    print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
