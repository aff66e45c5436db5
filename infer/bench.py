"""Decode and serving benchmarks, each against a baseline in the same run (docs/results/).

  python -m infer.bench                      # our base decode vs transformers' generate
  python -m infer.bench --mode hamburger     # HAMburger vs base in our engine (+ ceiling)
  python -m infer.bench --mode hamburger --micro-rule off,auto
                                             # ... with and without the batch-aware micro loop
  python -m infer.bench --mode verify --draft-confidence 0,0.5
                                             # verify mode vs base (the same tokens), and what
                                             # a forward of k tokens costs against 1
  python -m infer.bench --mode serve         # continuous batching: base vs HAMburger, slots, pool
  python -m infer.bench --mode server        # infer.server under concurrent streaming clients
                                             # vs serve() in process, the same requests
  python -m infer.bench --mode widths        # a w-row base forward vs a 1-row one, bandwidth
  python -m infer.bench --mode server-start --starts 2 -- --slots 8
                                             # infer.server's time to /health and to a first
                                             # answer, start after start, one compilation
                                             # cache (what follows -- goes to the server)
  python -m infer.bench --config configs/llama3_2_1b.yaml --random-weights --batches 1,8
                                             # a config's model, random weights: FLOPs, MFU,
                                             # roofline (docs/results/accelerator_benches.md)

Every row decodes exactly --new-tokens tokens (EOS ignored) so tokens/s compare like with like:
a batch's tokens/s = the tokens all its rows generated / the time the batch decoded, its
prefills reported apart (hamburger_jax/benchmarks/timing.py, time_batches). Times exclude
compilation (reported separately); each figure is the best of --repeats runs (serve: its part
(a), in interleaved rounds; parts b, p and c run once).
The compile column counts loads from the persistent compilation cache (on by default) when an
earlier run compiled the same program: HAMBURGER_JAX_NO_COMPILE_CACHE=1 measures compilation.
"""

from __future__ import annotations

import argparse
import sys

from hamburger_jax import cli
from hamburger_jax.config import (DEFAULT_DRAFT_CONFIDENCE, DEFAULT_DRAFT_LOOKUP, LOOKUP_MAX_N,
                                  VERIFY_WIDTHS)
from hamburger_jax.decode.requests import GenerationError, check_settings
from hamburger_jax.benchmarks import (decode_bench, random_weights_bench, serve_bench,
                                      server_bench, server_start_bench, verify_bench,
                                      widths_bench)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m infer.bench", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  _add_run_flags(p)
  _add_random_weights_flags(p)
  cli.add_confidence_flag(p)
  cli.add_micro_rule_flag(p, several=True)
  p.add_argument("--max-group", type=int, default=None,
                 help="hamburger / serve: cap HAMburger's groups at this many tokens (1..K)")
  p.add_argument("--draft-confidence", default=None,
                 help="verify: comma-separated draft confidences (default: the engine's, "
                      f"{DEFAULT_DRAFT_CONFIDENCE:g})")
  p.add_argument("--verify-widths", default=None,
                 help="verify: comma-separated forward layouts to compare, two (widths 1 and K) "
                      "and/or each (every width 1..K) (default: the engine's)")
  p.add_argument("--draft-lookup", default=None,
                 help="verify: comma-separated lookup drafts' shortest matches to compare, 0 "
                      f"(none) or 1..{LOOKUP_MAX_N} (default: the engine's, "
                      f"{DEFAULT_DRAFT_LOOKUP})")
  p.add_argument("--profile", action="store_true",
                 help="hamburger: after the table, where one decode of each batch and setting "
                      "spends the device's time, by kind of operation (a profiler trace)")
  _add_serve_flags(p)
  _add_server_start_flags(p)
  argv = list(sys.argv[1:] if argv is None else argv)
  split = argv.index("--") if "--" in argv else len(argv)
  args, server_args = p.parse_args(argv[:split]), argv[split + 1:]
  if args.mode == "server-start" or split < len(argv):
    _check_server_start_args(p, args, server_args)
    return server_start_bench.bench_server_start(args, server_args)
  _check_args(p, args)
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  cache.enable_compilation_cache()
  if args.random_weights:
    args.batches = args.batches or [1, 8]
    random_weights_bench.bench_random(args)
    return 0
  args.dtype = args.dtype or "float32"
  default_batches = {"base": [1, 8], "widths": list(widths_bench.WIDTHS)}.get(args.mode,
                                                                             [1, 8, 32])
  args.batches = args.batches or default_batches
  try:
    {"base": decode_bench.bench_base, "hamburger": decode_bench.bench_hamburger,
     "verify": verify_bench.bench_verify, "serve": serve_bench.bench_serve,
     "server": server_bench.bench_server, "widths": widths_bench.bench_widths}[args.mode](args)
  except cli.ModelLoadError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


def _add_run_flags(p: argparse.ArgumentParser) -> None:
  """Which benchmark, its batches and lengths, and the weights it loads."""
  p.add_argument("--mode", choices=("base", "hamburger", "verify", "serve", "server", "widths",
                                    "server-start"), default=None,
                 help="default: base (with --random-weights: base and hamburger)")
  p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None,
                 help="comma-separated batch sizes (default: 1,8 for base and --random-weights; "
                 "1,8,32 for hamburger)")
  p.add_argument("--new-tokens", type=int, default=None,
                 help="new tokens per row (default 128; --random-weights: 32)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="weights and compute (default float32; --random-weights: the config's)")
  cli.add_model_flags(p, checkpoint_help="hamburger / serve: graft checkpoint (default: the "
                     "shipped one, else an untrained graft)", micro_vocab=True)


def _add_random_weights_flags(p: argparse.ArgumentParser) -> None:
  """--random-weights: a config's model without weight files, its FLOPs and roofline."""
  p.add_argument("--config", default=None,
                 help="--random-weights: the run config whose model (base architecture, graft) "
                 "to build, e.g. configs/llama3_2_1b.yaml")
  p.add_argument("--random-weights", action="store_true",
                 help="random weights of --config's model (no weight files): step FLOPs (ours "
                 "and XLA's), MFU, memory roofline, engine tokens/s")
  p.add_argument("--prompt-len", type=int, default=64,
                 help="--random-weights: random prompt tokens per row")
  p.add_argument("--no-engine", action="store_true",
                 help="--random-weights: time the step alone (skips compiling the engine)")
  cli.add_peak_flags(p, when="--random-weights: ")
  cli.add_precision_flag(p)
  p.add_argument("--no-tpu-fusions", action="store_true",
                 help="skip compiling the timed programs for a TPU v5e chip (their fusions; "
                 "the lowered dots are always counted)")


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
  """--mode serve and server: the request stream, the slots and the KV pool."""
  p.add_argument("--slots", type=lambda s: [int(x) for x in s.split(",")], default=None,
                 help="serve: comma-separated slot counts (default 8,16,32); server: the "
                 "server's slots (default 8)")
  p.add_argument("--requests", type=int, default=None,
                 help="serve / server: requests in the stream (default 48 / 32)")
  p.add_argument("--clients", type=int, default=32,
                 help="server: concurrent streaming clients")
  p.add_argument("--new-range", type=lambda s: tuple(int(x) for x in s.split(",")),
                 default=(32, 256), help="serve: min,max of per-request max_new_tokens")
  p.add_argument("--kv-blocks", type=int, default=160,
                 help="serve (b): the fixed KV pool, in blocks of 16 entries")
  p.add_argument("--plot", default=None, help="serve: write the throughput-vs-slots PNG here")
  p.add_argument("--parts", default="ab",
                 help="serve: any of a (slots sweep), b (fixed pool), p (prefix cache off vs "
                      "on); c runs with --round-steps")
  p.add_argument("--round-steps", type=lambda s: [int(x) for x in s.split(",")], default=[],
                 help="serve (c): refill every K macro steps, against refill at each finish")


def _add_server_start_flags(p: argparse.ArgumentParser) -> None:
  """--mode server-start: how many server starts, and the compilation cache they share."""
  p.add_argument("--starts", type=int, default=2,
                 help="server-start: server starts, one after the other")
  p.add_argument("--timeout", type=float, default=1800,
                 help="server-start: seconds a start may take")
  p.add_argument("--cache-dir", default=None,
                 help="server-start: the compilation cache the starts share, kept afterwards "
                 "(default: a fresh temporary one)")


def _check_server_start_args(p: argparse.ArgumentParser, args: argparse.Namespace,
                             server_args: list[str]) -> None:
  """--mode server-start takes its own flags before `--` and the server's after it: a server
  flag before `--` would be a bench flag of the same name, silently unused."""
  if args.mode != "server-start":
    p.error("the arguments after `--` go to the server of --mode server-start: add "
            "--mode server-start, or drop them")
  defaults = vars(p.parse_args([]))
  own = {"mode", "starts", "timeout", "cache_dir"}
  other = [f"--{k.replace('_', '-')}" for k, v in vars(args).items()
           if k not in own and v != defaults[k]]
  if other:
    p.error(f"--mode server-start takes --starts, --timeout and --cache-dir; the server's flags "
            f"go after `--` (e.g. -- {other[0]} ...), not {', '.join(other)} before it")
  if args.starts < 1:
    p.error("--starts must be >= 1")
  if any(a == "--port" or a.startswith("--port=") for a in server_args):
    p.error("leave out --port: each start listens on a free port of its own")


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Checks the flags, filling in the defaults that depend on --mode and --random-weights, and
  parses --micro-rule."""
  random_weights_bench.check_random_weights_flags(p, args)
  if not args.random_weights:
    args.mode = args.mode or "base"
  if not args.parts or not set(args.parts) <= {"a", "b", "p"}:
    p.error(f"--parts={args.parts!r}: use any of a, b and p (e.g. ab)")
  if any(k < 1 for k in args.round_steps):
    p.error(f"--round-steps {args.round_steps}: each K must be >= 1")
  if args.batches is not None and (not args.batches or min(args.batches) < 1):
    p.error(f"--batches {args.batches}: each batch size must be >= 1")
  if args.repeats < 1:
    p.error(f"--repeats {args.repeats} must be >= 1")
  if args.profile and args.mode != "hamburger":
    p.error("--profile is for --mode hamburger")
  args.new_tokens = args.new_tokens or (32 if args.random_weights else 128)
  server = args.mode == "server"
  args.slots = args.slots or ([8] if server else [8, 16, 32])
  args.requests = args.requests or (32 if server else 48)
  if min(args.slots) < 1 or args.requests < 1 or args.clients < 1:
    p.error("--slots, --requests and --clients must be >= 1")
  try:
    check_settings(args.new_tokens, args.confidence, args.max_group)
    args.micro_rule = cli.parse_micro_rules(args.micro_rule)
    args.draft_confidences = (cli.parse_confidences(args.draft_confidence)
                              if args.draft_confidence else [DEFAULT_DRAFT_CONFIDENCE])
    args.verify_widths = (args.verify_widths.split(",") if args.verify_widths else [None])
    bad = [w for w in args.verify_widths if w not in (None, *VERIFY_WIDTHS)]
    if bad:
      raise ValueError(f"--verify-widths {bad[0]!r}: use {' and/or '.join(VERIFY_WIDTHS)}")
    args.draft_lookups = [None]
    if args.draft_lookup:
      args.draft_lookups = [int(v) for v in args.draft_lookup.split(",")
                            if v.strip().isdigit() and int(v) <= LOOKUP_MAX_N]
      if len(args.draft_lookups) != len(args.draft_lookup.split(",")):
        raise ValueError(f"--draft-lookup {args.draft_lookup!r}: use comma-separated values "
                         f"in 0..{LOOKUP_MAX_N}")
  except (GenerationError, ValueError) as e:
    p.error(str(e).replace("--confidence", "--draft-confidence"))


if __name__ == "__main__":
  sys.exit(main())
