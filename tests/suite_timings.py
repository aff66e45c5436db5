"""Where the suite's time goes, from the lines tests/conftest.py writes with
HAMBURGER_TEST_TIMINGS=DIR: per file and per test, wall seconds and the part spent compiling.

  HAMBURGER_TEST_TIMINGS=runs/timings python -m pytest -q -n 2 --dist loadfile
  python tests/suite_timings.py runs/timings [--top 40]

With --programs DIR (the run's compilation cache, HAMBURGER_JAX_CACHE_DIR/jax), also the
programs XLA compiled in that run, by jitted function: what the tests' subprocesses compiled too.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys


def read(directory: str) -> list[dict]:
  lines = []
  for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
    with open(path, encoding="utf-8") as f:
      lines += [dict(json.loads(line), worker=os.path.basename(path)[:-6]) for line in f]
  return lines


def tables(lines: list[dict], top: int) -> str:
  files = collections.defaultdict(lambda: {"tests": 0, "wall_s": 0.0, "compile_s": 0.0,
                                           "trace_s": 0.0})
  for line in lines:
    f = files[line["file"]]
    f["tests"] += 1
    for k in ("wall_s", "compile_s", "trace_s"):
      f[k] += line[k]
  total = sum(line["wall_s"] for line in lines)
  compile_s = sum(line["compile_s"] for line in lines)
  trace_s = sum(line["trace_s"] for line in lines)
  workers = collections.Counter()
  for line in lines:
    workers[line["worker"]] += line["wall_s"]
  failed = [line["test"] for line in lines if line.get("outcome") == "failed"]
  out = [f"{len(lines)} tests, {total:.0f} s of test time in all ({compile_s:.0f} s compiling, "
         f"{trace_s:.0f} s tracing and lowering); by worker: " +
         ", ".join(f"{w} {s:.0f} s" for w, s in sorted(workers.items())),
         *([f"failed: {', '.join(failed)}"] if failed else []), "",
         "| file | tests | seconds | compiling | tracing | share |", "|---|---|---|---|---|---|"]
  for name, f in sorted(files.items(), key=lambda kv: -kv[1]["wall_s"])[:top]:
    out.append(f"| {name} | {f['tests']} | {f['wall_s']:.0f} | {f['compile_s']:.0f} | "
               f"{f['trace_s']:.0f} | {f['wall_s'] / max(total, 1e-9):.1%} |")
  out += ["", "| test | seconds | compiling | tracing |", "|---|---|---|---|"]
  for line in sorted(lines, key=lambda l: -l["wall_s"])[:top]:
    out.append(f"| {line['test']} | {line['wall_s']:.1f} | {line['compile_s']:.1f} | "
               f"{line['trace_s']:.1f} |")
  return "\n".join(out)


def programs_table(directory: str, top: int) -> str:
  """The cache's programs by jitted function: how many, and XLA's compile seconds (each
  truncated to a whole second by JAX, so a sum undercounts by up to a second a program)."""
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  entries = cache.cached_programs(directory)
  by = collections.defaultdict(lambda: [0, 0, 0])
  for e in entries:
    by[e.name][0] += 1
    by[e.name][1] += e.compile_s
    by[e.name][2] += e.compile_s >= 6
  total = sum(e.compile_s for e in entries)
  out = [f"{len(entries)} programs in {directory}, {total} s compiling (whole seconds each)", "",
         "| program | programs | compiling | of them >= 6 s | share |", "|---|---|---|---|---|"]
  for name, (n, s, big) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
    out.append(f"| {name} | {n} | {s} | {big} | {s / max(total, 1):.1%} |")
  return "\n".join(out)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("directory")
  p.add_argument("--top", type=int, default=40)
  p.add_argument("--programs", metavar="CACHE_DIR", default=None,
                 help="also table the programs in this compilation cache by jitted function")
  args = p.parse_args(argv)
  lines = read(args.directory)
  if not lines:
    print(f"error: no timings in {args.directory}: run the suite with "
          f"HAMBURGER_TEST_TIMINGS={args.directory}", file=sys.stderr)
    return 1
  print(tables(lines, args.top))
  if args.programs:
    if not os.path.isdir(args.programs):
      print(f"error: {args.programs} is not a directory: give the run's compilation cache "
            "(HAMBURGER_JAX_CACHE_DIR/jax)", file=sys.stderr)
      return 1
    print("\n" + programs_table(args.programs, args.top))
  return 0


if __name__ == "__main__":
  sys.exit(main())
