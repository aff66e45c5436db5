"""Train-step cost: a HAMburger step vs a plain SFT step of the base on the same samples, each
step's FLOPs (ours and XLA's) and MFU, and the input pipeline's rate beside them.

  python -m train.bench --config configs/smollm2_135m_paper.yaml [--data DIR] [--steps 3]
  python -m train.bench --config configs/smollm2_135m.yaml --stage micro --data DIR  # stage 1
  python -m train.bench --config configs/llama3_2_1b.yaml --random-weights --rows 1 \
      --entries 128 --trainable graft --no-sft                 # the 1B model, no weights needed

Both steps see the same packed rows of samples: HAMburger as merged entries + groups, SFT as
the plain token sequence with the loss on response tokens. Both use AdamW. The SFT step always
trains the whole base (the run a user would do instead); --trainable picks HAMburger's set (all:
the same base weights plus the graft; graft: graft and adapters only). Times are the best of
--steps after a compiled warm-up; the HAMburger / SFT ratio is the graft's training overhead.

Without --data the samples are synthetic, at lengths scaled to the config's rows, written as a
dataset so that the real grain pipeline (shuffle, layout, packing, prefetch) reads them: its
rate, measured alone, says whether input or compute bounds training. --random-weights builds
the config's model with random weights (its base architecture from the GGUF metadata, an HF
config.json, or config.KNOWN_ARCHITECTURES for a base that is not on this machine). Steps run
data-parallel over the local devices (mesh data=-1; --set mesh.fsdp=N shards).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from hamburger_jax import cli
from hamburger_jax.run_config import RECIPES, TRAINABLE


def check_flags(p: argparse.ArgumentParser, args) -> None:
  for flag in ("steps", "rows", "entries", "groups", "input_batches"):
    v = getattr(args, flag)
    if v is not None and v < 1:
      p.error(f"--{flag.replace('_', '-')} {v} must be >= 1")
  if args.entries and args.groups and args.groups > args.entries:
    p.error(f"--groups {args.groups} > --entries {args.entries}: each predicted group needs its "
            "own entry; lower --groups")
  cli.check_peak_flags(p, args)


def shape_overrides(args, raw_data: dict) -> list[str]:
  """--rows / --entries / --groups as config overrides; --entries alone keeps the config's
  groups-per-entry ratio."""
  out = [f"data.rows={args.rows}"] if args.rows else []
  if args.entries:
    out.append(f"data.entries={args.entries}")
    if not args.groups:
      entries, groups = int(raw_data.get("entries", 256)), int(raw_data.get("groups", 128))
      out.append(f"data.groups={max(1, min(args.entries, args.entries * groups // entries))}")
  if args.groups:
    out.append(f"data.groups={args.groups}")
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m train.bench", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True)
  p.add_argument("--stage", default=None, help="a stage of a staged config (its trainable set)")
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--data", default=None, help="tfds dataset dir (default: synthetic samples)")
  p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
  p.add_argument("--trainable", default=None, choices=TRAINABLE,
                 help="HAMburger's trained set: all, graft, or a distill stage's (micro: stage "
                 "1, on stored teacher features; merger: stage 2)")
  p.add_argument("--recipe", default=None, choices=RECIPES,
                 help="default: the config's (micro needs distill and a teacher dataset)")
  p.add_argument("--random-weights", action="store_true",
                 help="the config's model with random weights (no weight files)")
  p.add_argument("--rows", type=int, default=None, help="packed rows per step (data.rows)")
  p.add_argument("--entries", type=int, default=None,
                 help="base-input entries per row, the sequence length (data.entries)")
  p.add_argument("--groups", type=int, default=None,
                 help="predicted groups per row (data.groups; default with --entries: the "
                 "config's ratio)")
  p.add_argument("--no-sft", action="store_true",
                 help="skip the SFT baseline (a second optimiser state of the whole base)")
  p.add_argument("--input-batches", type=int, default=20,
                 help="batches the input pipeline's rate is timed over")
  cli.add_peak_flags(p)
  cli.add_precision_flag(p)
  args = p.parse_args(argv)
  check_flags(p, args)

  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks import train_step  # pylint: disable=import-outside-toplevel
  from hamburger_jax.config import ConfigError, load_yaml  # pylint: disable=C0415
  from hamburger_jax.run_config import load_run_config  # pylint: disable=C0415

  recipe = [f"train.recipe={args.recipe}"] if args.recipe else []
  trainable = [] if args.stage and args.trainable is None else [
      f"train.trainable={args.trainable or 'all'}"]
  mesh = ["mesh.data=-1", "mesh.fsdp=1", "mesh.tensor=1"]  # before --set: the user's win
  try:
    shapes = shape_overrides(args, load_yaml(args.config).get("data") or {})
    cfg = load_run_config(args.config, mesh + args.set + shapes + recipe + trainable + [
        "data.accum=1", "train.init_from=''", f"train.precision={args.precision}"],
                          stage=args.stage)
    if args.random_weights:
      cfg = pretrained.random_run_config(cfg)
  except (ConfigError, RuntimeError) as e:  # RuntimeError: an asset (the GGUF) not installed
    raise SystemExit(f"error: {e}") from None
  if cfg.train.recipe == "distill" and not args.data:
    raise SystemExit("error: recipe distill trains on the teacher's stored signals, which "
                     "synthetic samples lack: pass --data DIR (train.prepare_data "
                     "--teacher-top-k) or --recipe paper")
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  cache.enable_compilation_cache()
  bench = train_step.TrainBench(args.config, args.steps, args.data, args.random_weights,
                                not args.no_sft, args.input_batches)
  with tempfile.TemporaryDirectory(prefix="train-bench-") as tmp:
    try:
      lines = train_step.run(bench, cfg, tmp, lambda: cli.device_peak(args, cfg.model.dtype))
    except train_step.BenchError as e:
      print(f"error: {e}", file=sys.stderr)
      return 1
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
