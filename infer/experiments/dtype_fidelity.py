"""How closely decoding in bfloat16 follows float32, on the shipped graft.

bfloat16 is the GPU and TPU default (hamburger_jax/precision.py). On the decode benches' chat
prompts:

- how much of each merged-entry adapter the bfloat16 fold loses,
  ||round(W + BA) - round(W) - BA|| / ||BA|| (model/decode_layout.py: fold_errors);
- teacher-forced agreement with float32, base and HAMburger, merge decisions forced equal
  (hamburger_jax/evaluation/dtype_agreement.py).

  python -m infer.experiments.dtype_fidelity --tokens 64 --confidence 0.5,0

Prints markdown tables (the figures in docs/results/fidelity.md); --kernels adds every
adapted kernel's row.
"""

from __future__ import annotations

import argparse
import collections
import sys

import numpy as np

from hamburger_jax import cli


def fold_table(errors: dict[str, float], every_kernel: bool) -> list[str]:
  """Mean and max of the fold errors per projection over the layers, then over all (and each
  kernel's, with `every_kernel`), as markdown lines."""
  by_proj = collections.defaultdict(list)
  for path, e in errors.items():
    by_proj[path.rsplit(".", 1)[-1]].append(e)
  out = ["| adapted kernel | n | mean | max |", "|---|---|---|---|"]
  rows = sorted(by_proj.items()) + [("all", list(errors.values()))]
  out += [f"| {name} | {len(v)} | {np.mean(v):.3f} | {np.max(v):.3f} |" for name, v in rows]
  if every_kernel:
    out += ["", "| kernel | relative error |", "|---|---|"]
    out += [f"| {path} | {e:.4f} |" for path, e in errors.items()]
  return out


def agreement_table(results: dict[str, dict]) -> list[str]:
  """One row per run (dtype_agreement.agreement's dicts), then the target's verdict."""
  pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"
  out = ["| run | tokens | agree | after a merged entry (tokens) | after the others "
         "| float32 forced = decoded |", "|---|---|---|---|---|---|"]
  for name, r in results.items():
    out.append(f"| {name} | {r['tokens']} | {pct(r['agree'])} | {pct(r['merged'])} "
               f"({r['merged_tokens']}) | {pct(r['unmerged'])} | {pct(r['forced_vs_decoded'])} |")
  base = results["base"]["agree"]
  worst = min(r["agree"] for name, r in results.items() if name != "base")
  verdict = "met" if worst >= base - 0.01 else "missed"
  out += ["", f"Target, HAMburger within 1 point of the base's agreement: {verdict} (lowest "
          f"{100 * worst:.1f}% against {100 * base:.1f}%)."]
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m infer.experiments.dtype_fidelity",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dtype", choices=("bfloat16",), default="bfloat16",
                 help="the decoding dtype compared with float32")
  p.add_argument("--prompts", type=int, default=8, help="chat prompts (default 8, at most 8)")
  p.add_argument("--tokens", type=int, default=64, help="new tokens a prompt (default 64)")
  p.add_argument("--confidence", default="0.5,0",
                 help="HAMburger confidences, comma-separated (0: every group K tokens)")
  p.add_argument("--kernels", action="store_true", help="also every adapted kernel's row")
  cli.add_model_flags(p, checkpoint_help="graft export (default: the shipped one)")
  args = p.parse_args(argv)
  try:
    confidences = [float(c) for c in args.confidence.split(",")]
  except ValueError:
    p.error(f"--confidence {args.confidence!r}: give numbers in [0, 1], comma-separated")
  if not all(0 <= c <= 1 for c in confidences):
    p.error(f"--confidence {args.confidence}: each must be in [0, 1]")
  if not (1 <= args.prompts <= 8 and args.tokens >= 1):
    p.error("--prompts must be in 1..8 and --tokens >= 1")
  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks.prompts import PROMPTS, chat_ids
  from hamburger_jax.evaluation import dtype_agreement
  from hamburger_jax.model.decode_layout import fold_errors
  try:
    model, tok = cli.load_model("hamburger", args.checkpoint, args.base)
  except cli.ModelLoadError as e:
    raise SystemExit(f"error: {e}") from None
  print(f"## Adapters after the {args.dtype} fold: ||F - W' - BA|| / ||BA||\n")
  print("\n".join(fold_table(fold_errors(model, args.dtype), args.kernels)))
  seqs = dtype_agreement.float32_sequences(model, chat_ids(tok, PROMPTS[:args.prompts]),
                                           args.tokens, confidences)
  results = {name: dtype_agreement.agreement(model, s, args.dtype) for name, s in seqs.items()}
  print(f"\n## Teacher-forced agreement of {args.dtype} with float32, {args.prompts} prompts x "
        f"{args.tokens} tokens\n")
  print("\n".join(agreement_table(results)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
