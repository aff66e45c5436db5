"""Where the suite's time goes, from the lines tests/conftest.py writes with
HAMBURGER_TEST_TIMINGS=DIR: per file and per test, wall seconds and the part spent compiling.

  HAMBURGER_TEST_TIMINGS=runs/timings python -m pytest -q -n 2 --dist loadfile
  python tests/suite_timings.py runs/timings [--top 40]
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


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("directory")
  p.add_argument("--top", type=int, default=40)
  args = p.parse_args(argv)
  lines = read(args.directory)
  if not lines:
    print(f"error: no timings in {args.directory}: run the suite with "
          f"HAMBURGER_TEST_TIMINGS={args.directory}", file=sys.stderr)
    return 1
  print(tables(lines, args.top))
  return 0


if __name__ == "__main__":
  sys.exit(main())
