"""Which saved step of a stage to ship (the rule: hamburger_jax/training/pick.py).

  python -m train.pick runs/s8/joint

Prints the stage's generation checks as a markdown table, the pick and the command that
exports it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from hamburger_jax.training.loop import read_metrics
from hamburger_jax.training.pick import pick_step, saved_steps, table


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m train.pick", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("run_dir", help="a stage's run folder (<checkpoint.dir>/<stage>)")
  args = p.parse_args(argv)
  try:
    rows = read_metrics(args.run_dir)
    saved = saved_steps(args.run_dir)
    pick = pick_step(rows, saved)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(table(rows, pick, saved))
  why = ("no step kept the start's prefix agreement "
         f"{pick.start_agreement:.3f}: fallback to the best agreement" if pick.fallback else
         f"most tokens per step at prefix agreement >= the start's {pick.start_agreement:.3f}")
  print(f"\npick: step {pick.step} ({why})")
  print(f"export: python -m train.main --config CONFIG --stage STAGE [the run's --set ...] "
        f"--export-step {pick.step}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
