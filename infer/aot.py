"""Check a TPU serving setup without a TPU or weights: what each engine program needs per chip.

  python -m infer.aot --topology v5e:2x2 --batches 1,32              # the shipped graft
  python -m infer.aot --topology v5p:2x2x1 --config configs/llama3_2_1b.yaml --batches 1,64

Compiles, with the TPU compiler (libtpu), the programs the engine runs at each batch size
(slots), sharded as the engine shards them (--tensor N: the weights split over N chips): the
prefill of a prompt's chunks, the decode loop in base and HAMburger modes, that loop serving
from a shared paged pool, and one macro step alone. Prints per program: memory per chip
against its HBM, FLOPs, bytes accessed, fusions. `--lower-only`: the programs lowered as the
engine shards them, in seconds, not compiled.
"""

from __future__ import annotations

import argparse
import sys

from hamburger_jax import aot, platforms


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m infer.aot", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--topology", required=True,
                 help=f"TPU slice: GENERATION:AxB[xC], one of {', '.join(aot.GENERATIONS)}")
  src = p.add_mutually_exclusive_group()
  src.add_argument("--config", default=None, help="a run config's model and graft")
  src.add_argument("--checkpoint", default=None,
                   help="a graft checkpoint's (default: the shipped one)")
  p.add_argument("--batches", type=lambda s: tuple(int(x) for x in s.split(",")), default=(1, 32),
                 help="comma-separated slot counts (default 1,32)")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="weights and compute (default: the TPU's, bfloat16)")
  p.add_argument("--tensor", type=int, default=1, help="chips the weights are split over")
  p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per slot")
  p.add_argument("--max-new", type=int, default=None, help="new tokens per slot")
  p.add_argument("--lower-only", action="store_true",
                 help="lower the programs (shapes and shardings checked); no compile")
  args = p.parse_args(argv)
  if not args.batches or min(args.batches) < 1:
    p.error(f"--batches {args.batches}: each must be >= 1")
  for flag in ("tensor", "prompt_len", "max_new"):
    v = getattr(args, flag)
    if v is not None and v < 1:
      p.error(f"--{flag.replace('_', '-')} {v} must be >= 1")
  platforms.use_cpu_backend()  # before jax starts a backend

  from hamburger_jax.config import ConfigError  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode import aot as engine_aot  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.requests import GenerationError  # pylint: disable=C0415
  lowering = dict(
      config=args.config, checkpoint=args.checkpoint, batches=args.batches, dtype=args.dtype,
      tensor=args.tensor, prompt_len=args.prompt_len or engine_aot.DEFAULT_PROMPT_LEN,
      max_new=args.max_new or engine_aot.DEFAULT_MAX_NEW,
      progress=lambda what: print(f"{what} ...", file=sys.stderr, flush=True))
  try:
    if args.lower_only:
      print("\n".join(engine_aot.lowering_lines(engine_aot.lower_engine(args.topology,
                                                                        **lowering))))
      return 0
    check = engine_aot.check_engine(args.topology, **lowering)
  except (ConfigError, aot.AotError, GenerationError, RuntimeError, ValueError) as e:
    raise SystemExit(f"error: {e}") from None
  print("\n".join(engine_aot.report_lines(check)))
  too_big = [f"{b} slots: {name} needs {aot.gib(r.total)} GiB of {aot.gib(check.hbm)}"
             for b, name, r in check.reports if r.total > check.hbm]
  for line in too_big:
    print(f"error: does not fit: {line}; fewer slots, a shorter row, or more --tensor chips",
          file=sys.stderr)
  return 1 if too_big else 0


if __name__ == "__main__":
  sys.exit(main())
