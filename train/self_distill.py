"""Self-distillation: replace training responses by the base model's own greedy responses.

For a small base this keeps HAMburger's target equal to the base's behaviour (the graft learns to
predict what the base would say, not a stronger model's text). Batched through our decode engine;
appends to a JSONL file and resumes where a killed run stopped.

  python -m train.self_distill --mix gsm_symbolic:1000,sharegpt:1500,basic_arithmetic:150,chain_sum:150 \
      --out runs/distill/responses.jsonl --max-new-tokens 160 --batch 16

With --checkpoint the answers are a trained HAMburger's own (on-policy), at the confidences given
(cycled over the prompts), and each line records the groups it emitted them in: prepared with
`train.prepare_data --strategy given`, the teacher then teaches the graft on the text and the
merged entries its own decoding produces, not only on the base's.

With --config the base is a run config's (configs/tiny.yaml: a random model without tokenizer,
whose prompts are the token ids of `--mix synthetic:N`, its answers rendered as their numbers);
--max-minutes stops cleanly at a time budget (a rerun goes on where it stopped).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from hamburger_jax import cli
from hamburger_jax.data import self_distill


def parse_confidences(spec: str | None, checkpoint: str | None) -> tuple[float, ...] | None:
  if checkpoint is None:
    if spec is not None:
      raise SystemExit("error: --confidence applies to a HAMburger's answers; add --checkpoint")
    return None
  if spec is None:
    raise SystemExit("error: --checkpoint needs --confidence (e.g. 0.5,0.6,0.7): the "
                     "confidences its answers are decoded at")
  try:
    cli.parse_confidences(spec)  # the checks; the order given is the order cycled
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  return tuple(float(c) for c in spec.split(",") if c.strip())


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m train.self_distill", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mix", required=True,
                 help="e.g. gsm_symbolic:1000,sharegpt:1500 (synthetic:N: token-id prompts)")
  p.add_argument("--out", required=True, help="JSONL output (appended to; resumable)")
  p.add_argument("--max-new-tokens", type=int, default=160)
  p.add_argument("--max-prompt-tokens", type=int, default=96)
  p.add_argument("--batch", type=int, default=16, help="slots served at once (continuous batching)")
  p.add_argument("--seed", type=int, default=0,
                 help="first reasoning-gym seed of each reasoning source")
  p.add_argument("--sharegpt-skip", type=int, default=0, metavar="N",
                 help="start after the first N ShareGPT prompts (with --seed: prompts that an "
                      "earlier run, e.g. the shipped graft's training data, did not use)")
  cli.add_model_flags(p, checkpoint_help="a HAMburger graft: its own answers (on-policy) "
                     "instead of the base's")
  p.add_argument("--config", default=None,
                 help="the base of this run config instead of --base (e.g. configs/tiny.yaml)")
  cli.add_confidences_flag(p, default=None, help_="with --checkpoint: confidences to decode "
                           "at, cycled over the prompts (e.g. 0.5,0.6,0.7)")
  p.add_argument("--max-minutes", type=float, default=None,
                 help="stop after the first answer that ends past this many minutes (a rerun "
                      "goes on)")
  args = p.parse_args(argv)
  if args.sharegpt_skip < 0:
    p.error(f"--sharegpt-skip={args.sharegpt_skip} must be >= 0 (how many prompts to skip)")
  if args.max_minutes is not None and not args.max_minutes >= 0:
    p.error(f"--max-minutes={args.max_minutes} must be >= 0 (0: stop after one answer)")
  if args.config and (args.base or args.checkpoint):
    p.error("--config names the base: leave out --base and --checkpoint")
  args.confidences = parse_confidences(args.confidence, args.checkpoint)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  names = {f.name for f in dataclasses.fields(self_distill.Settings)}
  try:
    self_distill.run(self_distill.Settings(**{k: v for k, v in vars(args).items() if k in names}))
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  return 0


if __name__ == "__main__":
  sys.exit(main())
