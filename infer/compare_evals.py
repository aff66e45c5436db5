"""Two infer.eval runs of the same examples, compared example by example.

  python -m infer.compare_evals runs/eval-reduced runs/eval-full

Reads each run's generations.jsonl and pairs the records that score the same example (task,
example id, mode, confidence). For each task and HAMburger confidence prints the score of A and
of B, A - B with a paired 95% bootstrap interval (the same examples resampled for both), the KV
compression (tokens per macro step) of each, and the share of examples whose tokens are
identical. Used to measure what a decoding option (e.g. --micro-vocab) changes against the
same graft without it.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

from hamburger_jax import files


def read_run(directory: str) -> dict[tuple, dict]:
  path = files.join(directory, "generations.jsonl")
  if not files.isfile(path):
    raise SystemExit(f"error: {path} does not exist: give an infer.eval --out directory")
  out = {}
  with files.open_file(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      try:
        r = json.loads(line)
        out[(r["task"], r["id"], r["mode"], r["confidence"])] = r
      except (ValueError, KeyError, TypeError):
        raise SystemExit(f"error: {path} line {n} is not an infer.eval generation record") from None
  return out


def compare(a: dict[tuple, dict], b: dict[tuple, dict]) -> list[dict]:
  """Per (task, confidence) of HAMburger records present in both runs: the paired comparison."""
  from hamburger_jax.evaluation import statistics  # pylint: disable=import-outside-toplevel
  groups = collections.defaultdict(list)
  for key in sorted(set(a) & set(b), key=str):
    if key[2] == "hamburger":
      groups[(key[0], key[3])].append((a[key], b[key]))
  rows = []
  for (task, c), pairs in sorted(groups.items(), key=str):
    sa = [ra["score"] for ra, _ in pairs]
    sb = [rb["score"] for _, rb in pairs]
    k = lambda rs: sum(len(r["token_ids"]) for r in rs) / max(1, sum(r["macro_steps"] for r in rs))
    rows.append({"task": task, "confidence": c, "n": len(pairs),
                 "a": sum(sa) / len(sa), "b": sum(sb) / len(sb),
                 "delta_ci95": statistics.paired_bootstrap_ci(sa, sb),
                 "k_a": k([ra for ra, _ in pairs]), "k_b": k([rb for _, rb in pairs]),
                 "identical": sum(ra["token_ids"] == rb["token_ids"] for ra, rb in pairs)
                 / len(pairs)})
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m infer.compare_evals", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("a", help="infer.eval --out directory (A)")
  p.add_argument("b", help="infer.eval --out directory of the same examples (B)")
  args = p.parse_args(argv)
  rows = compare(read_run(args.a), read_run(args.b))
  if not rows:
    raise SystemExit("error: the runs share no HAMburger example (same tasks, --limit and "
                     "confidences?)")
  print(f"A = {args.a}, B = {args.b}; HAMburger records paired by task, example and confidence\n")
  print("| task | c | n | A | B | A - B [paired 95%] | k A | k B | identical tokens |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    lo, hi = r["delta_ci95"]
    print(f"| {r['task']} | {r['confidence']} | {r['n']} | {r['a']:.3f} | {r['b']:.3f} | "
          f"{r['a'] - r['b']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {r['k_a']:.2f} | {r['k_b']:.2f} | "
          f"{r['identical']:.3f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
