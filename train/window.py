"""One accelerator window turned into a graft: the init judged by free generation, the base's
own answers made there, training with the teacher in the step, each trained graft judged on the
same suite, the best exported, in a budget of minutes.

  python -m infer.eval --write-suite runs/suite                  # once, on any machine
  python -m train.window --config configs/smollm2_135m_window.yaml --corpus runs/tokens/smollm2 \\
      --suite runs/suite --budget-minutes 8.5 --out runs/window
  python -m train.window --tiny --budget-minutes 2 --out runs/tiny-window     # a CPU rehearsal
  python -m train.window --config configs/smollm2_135m_window.yaml --budget-minutes 8 --plan

The corpus is token ids (python -m train.token_corpus). The window compiles its train step and
times a few steps before it plans: the answers, the steps and the boundary pass then fill the
budget, less what the judge, the export and the evaluation keep (hamburger_jax/window/).
--init-from continues from an earlier window's export (its hamburger.json records the response
tokens its lineage trained on, so windows add up); --answers-in trains on an earlier window's
answers too, so windows add data. Output in --out: report.md (rewritten after every part),
metrics.jsonl, summary.json, answers/ (the answers made, in files of at most 16 MiB) and export/
(the graft in files of at most 16 MiB, each with its sha256 in the report, and the judge's
verdict: proposed to ship or not). --work holds what need not come back (the boundaries).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Sequence

from hamburger_jax.config import ConfigError
from hamburger_jax.data.tokens.answer_files import AnswerFilesError
from hamburger_jax.data.tokens.corpus import CorpusError
from hamburger_jax.evaluation.suite import SuiteError

TINY_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "configs", "tiny.yaml")
# What every window trains with, whatever its config: the distill recipe, its teacher in the step.
WINDOW_OVERRIDES = ("train.recipe=distill", "distill.teacher=online")
# --tiny: the tiny config's rows sized for its synthetic conversations.
THRESHOLD = 0.6
# The tiny random base spreads its probability over 256 tokens (~0.004 each): about half of
# the synthetic responses' tokens then join a group, so merged entries are trained too.
TINY_THRESHOLD = 0.004
TINY_SAMPLES = 3000  # synthetic conversations: ~130k tokens
# The base's own answers (--answers-share): rows at once, longest prompt and answer; --tiny:
# sized for its synthetic conversations (prompts of 3-7 tokens, responses of 6-29).
ANSWER_SIZES = (512, 256, 256)
TINY_ANSWER_SIZES = (16, 16, 24)
ANSWERS_SHARE = 0.8  # the base's own answers: the data a graft generates best from
TINY_SUITE_EXAMPLES = 8  # synthetic suite items of each checker (--tiny)
TINY_OVERRIDES = ("data.tokens=128", "data.entries=128", "data.groups=64", "data.rows=8",
                  "train.warmup_steps=8", "train.log_every=5", "checkpoint.export_dtype=float32")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m train.window", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  _add_run_flags(p)
  _add_data_flags(p)
  _add_judge_flags(p)
  _add_answer_flags(p)
  p.add_argument("--decode-eval", action="store_true",
                 help="also time decode against the base at batch 1 and 32 (its compiles cost "
                      "minutes a window could train)")
  p.add_argument("--decode-tokens", type=int, default=64, help="new tokens a row when timing")
  _add_plan_flags(p)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="config override, e.g. --set data.rows=32 (repeatable)")
  args = p.parse_args(argv)
  _check_settings(p, args)
  _check_inputs(p, args)
  return args


def _add_run_flags(p: argparse.ArgumentParser) -> None:
  """What the window trains, from where, into where, in how long."""
  p.add_argument("--config", help="YAML run config (configs/smollm2_135m_window.yaml)")
  p.add_argument("--tiny", action="store_true",
                 help="configs/tiny.yaml on a synthetic corpus: a rehearsal on a CPU")
  p.add_argument("--corpus", help="token corpus directory (python -m train.token_corpus)")
  p.add_argument("--budget-minutes", type=float, required=True,
                 help="wall-clock minutes for everything, from the command's start")
  p.add_argument("--out", help="where report.md, metrics.jsonl, summary.json and export/ go")
  p.add_argument("--work", help="scratch files (default: OUT/work)")
  p.add_argument("--init-from", help="an earlier window's (or run's) graft export to continue")


def _add_data_flags(p: argparse.ArgumentParser) -> None:
  """The training data: group boundaries, and the share of it that is the base's own answers."""
  p.add_argument("--threshold", type=float,
                 help="group boundaries: a token joins its group where the base gives it at "
                      f"least this probability (segmentation confident:p; default "
                      f"{THRESHOLD}, --tiny {TINY_THRESHOLD})")
  p.add_argument("--answers-share", type=float, default=ANSWERS_SHARE,
                 help="share of the response tokens trained on that are the base's own greedy "
                      "answers to corpus prompts, made in the window (0: the corpus's alone; "
                      f"default {ANSWERS_SHARE})")
  p.add_argument("--answers-in", action="append", default=[], metavar="DIR",
                 help="an earlier window's answers/ directory: trained on beside the answers "
                      "made here, whose prompts are not answered again (repeatable)")


def _add_judge_flags(p: argparse.ArgumentParser) -> None:
  """The suite that judges the grafts, and the arms it chooses between."""
  p.add_argument("--suite", metavar="DIR",
                 help="the free-generation suite (python -m infer.eval --write-suite DIR) that "
                      "judges the init graft and the trained ones, and picks the export "
                      "(--tiny: a synthetic one is written in --work)")
  p.add_argument("--judge-batch", type=int, default=64, help="rows decoded at once by the judge")
  p.add_argument("--arms", metavar="SPEC",
                 help="recipes sharing the training minutes, each from the same init on the "
                      "same data and judged by the suite: 'NAME[:KEY=VALUE[,KEY=VALUE]];...', "
                      "e.g. 'frozen;all:train.trainable=all' (2-3 arms; an arm without "
                      "overrides is the config as it is)")


def _add_answer_flags(p: argparse.ArgumentParser) -> None:
  """The sizes the base's own answers are made in (defaults: ANSWER_SIZES, TINY_ANSWER_SIZES)."""
  p.add_argument("--answer-rows", type=int,
                 help=f"answers made at once (default {ANSWER_SIZES[0]}, --tiny "
                      f"{TINY_ANSWER_SIZES[0]})")
  p.add_argument("--answer-tokens", type=int,
                 help=f"the longest answer (default {ANSWER_SIZES[2]}, --tiny "
                      f"{TINY_ANSWER_SIZES[2]}); prompts of at most --answer-prompt-tokens")
  p.add_argument("--answer-prompt-tokens", type=int,
                 help=f"the longest prompt answered (default {ANSWER_SIZES[1]}, --tiny "
                      f"{TINY_ANSWER_SIZES[1]})")


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument("--plan", action="store_true",
                 help="print the parts and the tokens each would see at assumed rates, and exit")
  p.add_argument("--rates-from", metavar="SUMMARY",
                 help="--plan: the rates an earlier window measured (its summary.json) instead "
                      "of assumed ones")
  p.add_argument("--peak-tflops", type=float, default=989.5,
                 help="--plan: the accelerator's dense bf16 TFLOP/s (default: an H100/H200)")


def _check_settings(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Checks --config or --tiny and the numbers, filling in the defaults that depend on --tiny."""
  if bool(args.config) == args.tiny:
    p.error("give either --config CONFIG or --tiny")
  if not 0 < args.budget_minutes:
    p.error(f"--budget-minutes must be > 0, got {args.budget_minutes}")
  if args.threshold is None:
    args.threshold = TINY_THRESHOLD if args.tiny else THRESHOLD
  if not 0 < args.threshold <= 1:
    p.error(f"--threshold must be in (0, 1], got {args.threshold}")
  if not 0 <= args.answers_share <= 1:
    p.error(f"--answers-share must be in [0, 1], got {args.answers_share}")
  sizes = TINY_ANSWER_SIZES if args.tiny else ANSWER_SIZES
  for name, default in zip(("answer_rows", "answer_prompt_tokens", "answer_tokens"), sizes):
    if getattr(args, name) is None:
      setattr(args, name, default)
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def _check_inputs(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Checks the directories read and written, the judge's batch and the arms (parsed in place)."""
  if not args.plan:
    if not args.out:
      p.error("--out is required (where the graft and the report go)")
    if not args.corpus and not args.tiny:
      p.error("--corpus is required: build one with python -m train.token_corpus --out DIR")
  if args.init_from and not os.path.isfile(os.path.join(args.init_from, "hamburger.json")):
    p.error(f"--init-from {args.init_from} is not a graft export (no hamburger.json there)")
  for d in args.answers_in:
    if not os.path.isfile(os.path.join(d, "answers-00001.npz")):
      p.error(f"--answers-in {d} holds no answers-00001.npz: give the answers/ directory of an "
              "earlier window's --out")
  if args.suite and not os.path.isfile(os.path.join(args.suite, "suite.json")):
    p.error(f"--suite {args.suite} holds no suite.json: write one with python -m infer.eval "
            "--write-suite DIR")
  if args.judge_batch < 1:
    p.error(f"--judge-batch must be >= 1, got {args.judge_batch}")
  try:
    args.arms = parse_arms(args.arms) if args.arms else ()
  except ValueError as e:
    p.error(str(e))


def parse_arms(spec: str):
  """'NAME[:KEY=VALUE[,KEY=VALUE]];...' -> window.state.Arm tuples (2-3 distinct names)."""
  from hamburger_jax.window.state import Arm  # pylint: disable=import-outside-toplevel
  arms = []
  for part in (x.strip() for x in spec.split(";") if x.strip()):
    name, _, rest = part.partition(":")
    overrides = tuple(o.strip() for o in rest.split(",") if o.strip())
    bad = [o for o in overrides if "=" not in o]
    if not name.strip().isidentifier() or bad:
      raise ValueError(f"--arms: {part!r} is not NAME[:KEY=VALUE[,KEY=VALUE]] (e.g. "
                       "'all:train.trainable=all')")
    arms.append(Arm(name.strip(), overrides))
  if not 2 <= len(arms) <= 3 or len({a.name for a in arms}) != len(arms):
    raise ValueError(f"--arms needs 2 or 3 arms with distinct names, got {spec!r}")
  return tuple(arms)


def main(argv: Sequence[str] | None = None) -> int:
  started = time.monotonic()
  args = parse_args(argv)
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.run_config import load_run_config  # pylint: disable=import-outside-toplevel
  from hamburger_jax.window import plan as plan_lib  # pylint: disable=import-outside-toplevel
  from hamburger_jax.window.run import WindowSettings, run_window  # pylint: disable=import-outside-toplevel
  overrides = [*WINDOW_OVERRIDES, *(TINY_OVERRIDES if args.tiny else ()), *args.set]
  if args.init_from:
    overrides.append(f"train.init_from={args.init_from}")
  try:
    cfg = load_run_config(TINY_CONFIG if args.tiny else args.config, overrides, shared_only=True)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.plan:
    if args.rates_from:
      try:
        with open(args.rates_from, encoding="utf-8") as f:
          rates = plan_lib.measured_rates(json.load(f))
      except (OSError, ValueError) as e:
        print(f"error: --rates-from {args.rates_from}: {e}", file=sys.stderr)
        return 2
    else:
      hcfg = pretrained.abstract_run_model(cfg).cfg
      rates = plan_lib.assumed_rates(cfg, hcfg, args.peak_tflops * 1e12)
    try:
      items, suite = planned_suite(args)
    except SuiteError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    budget = 60 * args.budget_minutes - rates.compile_s
    p = plan_lib.make_plan(budget, rates, 10**12,
                           plan_lib.reserve_s(args.decode_eval, rates.compile_s),
                           args.answers_share,
                           judge=plan_lib.judge_s(rates, items, max(len(args.arms), 1)),
                           start=plan_lib.arms_start_s(args.arms, rates))
    print(f"window of {args.budget_minutes:g} minutes, {cfg.model.base}, rows {cfg.data.rows} x "
          f"{cfg.data.row_tokens} tokens; parts: load, corpus, judge init, warm-up, measure "
          f"(compile ~{rates.compile_s:.0f} s), plan, answers, boundaries, train, judge, export, "
          f"evaluate (decode with --decode-eval); judged on {suite}")
    print("\n".join(p.lines(rates)))
    return 0
  work = args.work or os.path.join(args.out, "work")
  corpus = args.corpus
  if args.tiny and not corpus:
    from hamburger_jax.data.synthetic import write_synthetic_corpus  # pylint: disable=import-outside-toplevel
    corpus = os.path.join(work, "corpus")
    write_synthetic_corpus(corpus, cfg.model.random.vocab_size, TINY_SAMPLES, seed=args.seed)
  suite = args.suite
  if args.tiny and not suite:
    suite = os.path.join(work, "suite")
    write_tiny_suite(suite)
  settings = WindowSettings(args.budget_minutes, started, args.threshold, args.decode_eval,
                            args.decode_tokens, args.seed, args.answers_share, args.answer_rows,
                            args.answer_prompt_tokens, args.answer_tokens,
                            tuple(args.answers_in), suite, args.judge_batch, args.arms)
  config_for = lambda extra: load_run_config(TINY_CONFIG if args.tiny else args.config,
                                             [*overrides, *extra], shared_only=True)
  try:
    summary = run_window(cfg, corpus, args.out, work, settings, config_for=config_for)
  except (ConfigError, CorpusError, SuiteError, AnswerFilesError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"graft: {summary['export']} ({summary['trained_tokens']:,} response tokens in its "
        f"lineage; proposed to ship: {'yes' if summary.get('ship') else 'no'}); report: "
        f"{os.path.join(args.out, 'report.md')}")
  return 0


def planned_suite(args: argparse.Namespace) -> tuple[int, str]:
  """--plan: the items of the suite the window will be judged on, and what it is: --suite's,
  --tiny's synthetic one, else one of infer.eval --write-suite's default size (a window on an
  accelerator is judged by one; without it, it is not judged, and has the judge's minutes)."""
  from hamburger_jax.evaluation import suite as suite_lib  # pylint: disable=import-outside-toplevel
  from hamburger_jax.window import plan as plan_lib  # pylint: disable=import-outside-toplevel
  if args.suite:
    items = len(suite_lib.load(args.suite).items)
    return items, f"{args.suite}'s {items} items"
  if args.tiny:
    return 2 * TINY_SUITE_EXAMPLES, f"the synthetic suite's {2 * TINY_SUITE_EXAMPLES} items"
  return plan_lib.DEFAULT_SUITE_ITEMS, (f"a suite of {plan_lib.DEFAULT_SUITE_ITEMS} items "
                                        "(--write-suite's default size; --suite DIR for yours)")


def write_tiny_suite(directory: str) -> None:
  """A synthetic suite for the tiny config's random model (no tokenizer): the rehearsal's judge."""
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  from hamburger_jax.evaluation import suite  # pylint: disable=import-outside-toplevel
  model, tok = pretrained.load_run(TINY_CONFIG)
  suite.save(suite.build(Engine(model, tok), task_examples=TINY_SUITE_EXAMPLES,
                         batch=TINY_SUITE_EXAMPLES), directory)


if __name__ == "__main__":
  sys.exit(main())
