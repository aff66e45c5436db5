"""The whole training recipe in one command, in a time budget, resumable.

  python -m train.pipeline --config configs/smollm2_135m.yaml --budget-minutes 480
  python -m train.pipeline --config configs/tiny.yaml --budget-minutes 3 --out runs/tiny-pipeline

Runs the parts that README "Train" runs by hand (hamburger_jax/pipeline/, each through the
library, in this process), under --out (default: the config's checkpoint.dir + "-pipeline"):

  self_distill   train.self_distill: the base's own greedy answers        -> responses.jsonl
                 (a model without tokenizer answers token-id prompts, --mix synthetic:N)
  prepare_data   train.prepare_data: segmentation + teacher signals        -> data/
  train:STAGE    train.main --stage STAGE, each stage of the config in order (one part
                 "train" for a config without stages)                      -> train/STAGE/
  pick           train.pick's rule on the last stage's generation checks
  export         train.main --export-step PICKED                           -> export/
  eval           infer.eval's tasks at the pick's confidence               -> eval/

Budget: the parts have fixed shares of --budget-minutes (SHARES of hamburger_jax/pipeline/
budget.py; the stages split theirs by their train.steps). A part gets its share of the minutes
still left, among the parts still to run: what a finished part did not use is handed on to the
later ones (and an overrun taken from them). Each part gets its minutes: train.main and
train.self_distill --max-minutes (they stop cleanly and save); the teacher pass reads as many
answers as fit its minutes at budget.py's TEACHER_SPEEDUP x the rate self-distillation generated
them; the evaluation takes as many examples per task (at most --eval-limit) as fit at that rate.
A stage stopped by its minutes is exported where it stood, so that the next stage starts from
it. What a part costs whatever its size (a model load, compilation, a stage's closing validation
and generation check) counts in its minutes but does not shrink with them: a small budget runs
over (SmolLM2-135M on 2 busy cores: 15 minutes ran 21, most of it such costs); the summary shows
by how much.

Resume: <out>/pipeline.json records each finished part (status, minutes, figures), written
atomically after the part; rerunning the same command skips those. A part that was interrupted
(Ctrl-C, SIGTERM, a killed process) is not recorded and reruns through its own resume: the
answers file goes on where it stopped, the teacher pass from its finished shards (given the
same answers: the first attempt's count is kept in the state), a stage from its latest
checkpoint; the pick, the export and the evaluation start over. Minutes of an interrupted
attempt are not counted. The output ends with one summary line per part: part, status (done;
budget: stopped by its minutes; skipped: finished by an earlier run; failed; interrupted; not
run), minutes used / budget, and its figure.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Sequence

from hamburger_jax.pipeline import plan as planning, run, state

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m train.pipeline", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="YAML run config (see configs/)")
  p.add_argument("--budget-minutes", type=float, required=True,
                 help="wall-clock minutes for the whole pipeline, split between its parts")
  p.add_argument("--plan", action="store_true",
                 help="print what the run would do and compile, and stop")
  p.add_argument("--out", default=None,
                 help="the pipeline's folder (default: the config's checkpoint.dir + -pipeline)")
  p.add_argument("--mix", default=None,
                 help=f"self-distillation prompts (default: {planning.TEXT_MIX}; a model without "
                 f"tokenizer: {planning.IDS_MIX})")
  p.add_argument("--strategy", default=planning.STRATEGY,
                 help="segmentation of train.prepare_data")
  p.add_argument("--teacher-top-k", type=int, default=planning.TEACHER_TOP_K,
                 help="teacher log-probabilities stored per response token")
  p.add_argument("--eval-tasks", default=None,
                 help=f"infer.eval tasks (default: {planning.TEXT_EVAL_TASKS}; a model without "
                 f"tokenizer: {planning.IDS_EVAL_TASKS})")
  p.add_argument("--eval-limit", type=int, default=planning.EVAL_LIMIT,
                 help="most examples per evaluation task (fewer when its minutes are short)")
  return p.parse_args(argv)


def settings(args: argparse.Namespace) -> planning.Settings:
  return planning.Settings(args.config, args.budget_minutes, out=args.out,
                           mix=args.mix, strategy=args.strategy,
                           teacher_top_k=args.teacher_top_k, eval_tasks=args.eval_tasks,
                           eval_limit=args.eval_limit)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    plan = planning.make_plan(settings(args))
    recorded = state.read_state(plan)
  except planning.PipelineError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  print("\n".join(plan.lines()), flush=True)
  if args.plan:
    return 0
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  # Before any part compiles: the parts run in this process, and JAX opens the cache once.
  cache.enable_compilation_cache()

  def stop(*_):
    raise KeyboardInterrupt  # unwinds the part's own cleanup; a stage saves by itself
  previous = signal.signal(signal.SIGTERM, stop)
  try:
    code, lines = run.run_pipeline(plan, recorded)
  finally:
    signal.signal(signal.SIGTERM, previous)
  print(f"\npipeline {plan.out} ({plan.config}, {plan.budget:g} minutes):")
  for line in lines:
    print(line)
  return code


if __name__ == "__main__":
  sys.exit(main())
