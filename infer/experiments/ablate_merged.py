"""What a merged entry carries: the base's agreement with every merged entry made three ways.

Teacher-forced agreement with the base, as infer.eval's nll task measures it on data with
teacher signals:

  python -m infer.experiments.ablate_merged --data runs/data/smollm2-teacher3 --limit 48

- graft: as the graft makes it (compositional embedder, then the base with its merged-entry
  adapters on at that position);
- no_adapters: the embedder's output through the exact base (adapters off);
- last_token: the group's last token alone through the exact base, its other tokens dropped:
  what one KV entry per group keeps with no learned merging (the entry keeps its position, the
  last token's, as in docs/SPEC.md 1.2).
Prints a markdown table (the one in docs/results/fidelity.md); --json writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hamburger_jax import cli

VARIANTS = ("graft", "no_adapters", "last_token")  # model/hamburger.py: MERGED_ENTRIES
METRICS = ("merged", "unmerged", "s2", "s3", "s4")


def run(model, data_dir: str, split: str, limit: int | None, batch: int,
        variants=VARIANTS) -> dict[str, dict]:
  """{variant: {"nll", "merged", "unmerged", "s2".., }} from infer.eval's nll task
  (teacher_forced.nll_task)."""
  from hamburger_jax.evaluation.teacher_forced import nll_task  # pylint: disable=C0415
  from hamburger_jax.model.hamburger import with_merged_entry  # pylint: disable=C0415
  out = {}
  for kind in variants:
    r = nll_task(with_merged_entry(model, kind), data_dir, split, limit, batch)
    agreement = r.get("teacher_agreement")
    if not agreement or "skipped" in agreement:
      raise ValueError(f"{data_dir} has no usable teacher signals "
                       f"({(agreement or {}).get('skipped', 'none stored')}): prepare it with "
                       "train.prepare_data --teacher-top-k K")
    out[kind] = {"nll": r["hamburger"]["score"], "n": r["n"],
                 **{m: agreement.get(m) for m in METRICS}}
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m infer.experiments.ablate_merged",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--data", required=True, help="a dataset with teacher signals (prepare_data "
                 "--teacher-top-k)")
  p.add_argument("--split", default="validation")
  p.add_argument("--limit", type=int, default=48, help="records (default 48)")
  p.add_argument("--batch", type=int, default=8)
  cli.add_model_flags(p, checkpoint_help="graft export (default: the shipped one)")
  p.add_argument("--json", default=None, help="also write the numbers to this file")
  args = p.parse_args(argv)
  if not os.path.isdir(args.data):
    p.error(f"--data {args.data} does not exist")
  if args.limit < 1 or args.batch < 1:
    p.error("--limit and --batch must be >= 1")
  if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
    p.error(f"--checkpoint {args.checkpoint} does not exist")
  try:
    model, _ = cli.load_model("hamburger", args.checkpoint, args.base)
  except cli.ModelLoadError as e:
    raise SystemExit(f"error: {e}") from None
  try:
    out = run(model, args.data, args.split, args.limit, args.batch)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  print("| merged entry | n | HAMburger NLL | " + " | ".join(f"agree {m}" for m in METRICS) + " |")
  print("|---" * (3 + len(METRICS)) + "|")
  for kind, r in out.items():
    cells = " | ".join("-" if r[m] is None else f"{r[m]:.3f}" for m in METRICS)
    print(f"| {kind} | {r['n']} | {r['nll']:.3f} | {cells} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
