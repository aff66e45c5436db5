"""infer.bench --mode server-start: the server's time to /health and to a first answer, start
after start, against one compilation cache.

  python -m infer.bench --mode server-start -- --slots 4
  python -m infer.bench --mode server-start --starts 3 -- --slots 8 --modes hamburger

Everything after `--` goes to `python -m infer.server`. The first start compiles and writes
every program; each later one, with the same layout, should read them all back: its row shows
the cache hits and misses its /health reported, for the programs that answer every request (the
ready phase) and for the rest, prepared while it serves. Converted weights stay in the usual
cache.
"""

from __future__ import annotations

import os
import sys
import tempfile


def bench_server_start(args, server_args: list[str]) -> int:
  """Starts `python -m infer.server SERVER_ARGS` args.starts times and prints a row per start;
  a start that fails is one line on stderr and exit status 1."""
  from hamburger_jax.benchmarks.server_start import time_starts  # pylint: disable=C0415
  with tempfile.TemporaryDirectory() as tmp:
    try:
      rows = time_starts(server_args, args.cache_dir or os.path.join(tmp, "jax"), args.starts,
                         tmp, timeout_s=args.timeout)
    except RuntimeError as e:
      print(f"error: {e}", file=sys.stderr)
      return 1
  cache = f"the compilation cache {args.cache_dir}" if args.cache_dir else (
      "one fresh compilation cache")
  print(f"python -m infer.server {' '.join(server_args)}: {args.starts} starts against "
        f"{cache} ({os.cpu_count()} CPU cores)")
  print("| start | to /health (s) | first chat answer (s) | every program prepared (s) | "
        "ready phase: compiling (s), from the cache, compiled | the rest: compiling (s), from "
        "the cache, compiled |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['start']} | {r['health_s']:.1f} | {r['answer_s']:.1f} | "
          f"{r['prepared_s']:.1f} | {r['seconds']:.1f}, {r['cache_hits']}, "
          f"{r['cache_misses']} | {r['prepared_seconds']:.1f}, {r['prepared_cache_hits']}, "
          f"{r['prepared_cache_misses']} |")
  return 0
