"""Evaluate HAMburger against its base model: quality, KV compression and decode speed.

  python -m infer.eval --tasks basic_arithmetic,chain_sum,mt_bench,sharegpt_heldout --limit 40
  python -m infer.eval --tasks gsm_symbolic,humaneval --confidence 0.6,0.7,0.8,0.9 --batch 8
  python -m infer.eval --tasks nll --data runs/data/smollm2-distill
  python -m infer.eval --config configs/tiny.yaml --tasks synthetic,nll --data runs/tiny-data

Each task is decoded greedily in mode "base" (the base weights alone) and in mode "hamburger" at
each confidence c, in batches, with the same engine. Reported per task: the score, the KV
compression (generated tokens / macro steps = tokens per KV entry, docs/SPEC.md 3) and the decode
tokens/s ratio HAMburger / base (the engine's decode time; compilation excluded). Scores carry a
95% percentile-bootstrap interval over the examples (`ci95`), and HAMburger's difference to the
base a paired one (`delta_ci95`, the same examples resampled for both); HAMburger's greedy tokens
are compared with the base's (`identical`, `prefix_agreement`, and `diverge_*`: whether the first
difference is a micro token or a token read after a merged / a single-token entry). MT-Bench has
no judge offline: HAMburger's answers are scored by ROUGE-L against the base's own answers (so
the base scores 1.0 by definition); `sharegpt_heldout` does the same on ShareGPT prompts that
training never reads. `nll` is teacher-forced: the held-out NLL and per-micro-step accuracy of
HAMburger on a tfds split, next to the base's NLL on the same response tokens; on data with
teacher signals (train.prepare_data --teacher-top-k) also the agreement with the teacher's greedy
token after merged and unmerged entries and per micro step. The nll numbers come from the
trainer's own validation evaluator (hamburger_jax/evaluation/teacher_forced.py, which says how
each metric is pooled over the split).

`--config RUN.yaml` builds the model of a run config instead (e.g. configs/tiny.yaml: a random
tiny model with no tokenizer, where only the token-id tasks `synthetic` and `nll` make sense).

Writes to --out: results.json (numbers, config, command line), results.md (tables),
generations.jsonl (every generation) and the PNG plots of infer/plots.py.
"""


# Heavy imports (jax, models, data) live inside the functions that need them, so that --help and
# argument errors answer at once. The work itself is in hamburger_jax/evaluation/: generation
# (batched decoding), scoring (per-task scores, results.json entries), statistics (bootstrap
# intervals), teacher_forced (the nll task), report (results.md), disjointness.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import shlex
import sys
from typing import Any, Sequence

from hamburger_jax.evaluation import tasks as eval_tasks
from hamburger_jax.evaluation.report import markdown
from hamburger_jax.evaluation.scoring import SyntheticTask, ckey
from hamburger_jax import cli

TEXT_TASKS = ("gsm_symbolic", "basic_arithmetic", "chain_sum", "letter_counting", "gcd", "lcm",
              "humaneval", "mt_bench", "sharegpt_heldout")
TOKEN_TASKS = ("synthetic", "nll")
ALL_TASKS = TEXT_TASKS + TOKEN_TASKS
# New-token budgets that fit each task's expected answer (a chain of thought, a function, a
# chat answer, a number); --max-new-tokens overrides them all.
MAX_NEW_TOKENS = {"gsm_symbolic": 256, "basic_arithmetic": 16, "chain_sum": 16,
                  "letter_counting": 24, "gcd": 24, "lcm": 24, "humaneval": 320, "mt_bench": 256,
                  "sharegpt_heldout": 128, "synthetic": 32}
DEFAULT_LIMIT = {"synthetic": 32}  # the other tasks default to their own sizes


class EvalError(ValueError):
  """The evaluation cannot run as asked; the message says what to change."""


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m infer.eval", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tasks", default=None,
                 help=f"comma-separated, from: {','.join(ALL_TASKS)} (default: the text tasks, "
                 "or synthetic for a model without tokenizer; plus nll when --data is given)")
  # A comma list, where the other CLIs take one number: not cli.add_decode_flags' --confidence.
  p.add_argument("--confidence", default="0.6,0.7,0.8,0.9",
                 help="comma-separated confidence levels in [0, 1] (docs/SPEC.md 3)")
  cli.add_decode_flags(p, max_new_tokens=None, confidence=False, sampling=False,
                       max_new_help="new tokens per answer (default: per task, " +
                       ", ".join(f"{k} {v}" for k, v in MAX_NEW_TOKENS.items()) + ")")
  p.add_argument("--limit", type=int, default=None,
                 help="examples per task (nll: validation records); default: the whole task")
  cli.add_model_flags(p, checkpoint_help="HAMburger graft checkpoint directory (default: the "
                      "shipped one if present, else an UNTRAINED graft, for smoke tests only)",
                     micro_vocab=True)
  p.add_argument("--config", default=None,
                 help="build the model of this run config (e.g. configs/tiny.yaml) instead")
  p.add_argument("--batch", type=int, default=8, help="prompts decoded together")
  p.add_argument("--data", default=None, help="tfds dataset directory for the nll task")
  p.add_argument("--split", default="validation", help="split of --data for nll")
  p.add_argument("--train-data", default=None,
                 help="training data (JSONL or tfds directory): check no eval prompt is in it")
  p.add_argument("--out", default="runs/eval", help="output directory")
  p.add_argument("--no-plots", action="store_true")
  p.add_argument("--unsafe-exec", action="store_true",
                 help="humaneval: run model-written code as a plain subprocess when no OS sandbox "
                 "(namespaces through util-linux's unshare) is available; only for trusted code")
  args = p.parse_args(argv)
  try:
    args.confidence = parse_confidences(args.confidence)
    args.tasks = parse_tasks(args.tasks) if args.tasks is not None else None
  except ValueError as e:
    p.error(str(e))
  # Checked here rather than by cli.check_decode_flags, which takes one confidence; the same
  # rules (positive counts, confidences in [0, 1]), with eval's messages.
  for name in ("limit", "batch", "max_new_tokens", "max_group"):
    value = getattr(args, name)
    if value is not None and value < 1:
      p.error(f"--{name.replace('_', '-')}={value} must be a positive integer")
  if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
    p.error(f"checkpoint {args.checkpoint} does not exist: pass a directory written by "
            "train.main's export (or hamburger_jax.pretrained.save_graft)")
  if args.tasks and "nll" in args.tasks and args.data is None:
    p.error("task nll needs --data DIR (a tfds dataset written by train.prepare_data)")
  if args.data is not None and not os.path.isdir(args.data):
    p.error(f"--data {args.data} does not exist")
  if args.train_data is not None and not os.path.exists(args.train_data):
    p.error(f"--train-data {args.train_data} does not exist")
  if (args.tasks is None or "humaneval" in args.tasks) and not args.unsafe_exec:
    from hamburger_jax.evaluation import sandbox
    isolated, reason = sandbox.isolation_status()
    if not isolated:
      p.error(f"humaneval runs model-written code, and there is no OS sandbox here ({reason}): "
              "leave humaneval out of --tasks, or pass --unsafe-exec to run it without isolation")
  return args


def parse_confidences(spec: str) -> list[float]:
  try:
    values = [float(x) for x in spec.split(",") if x.strip()]
  except ValueError:
    raise ValueError(f"--confidence {spec!r}: give comma-separated numbers, e.g. 0.6,0.8") from None
  bad = [v for v in values if not 0.0 <= v <= 1.0]
  if not values or bad:
    raise ValueError(f"--confidence {spec!r}: every confidence must be in [0, 1]"
                     + (f" (got {bad[0]:g})" if bad else ""))
  return sorted(set(values))


def parse_tasks(spec: str) -> list[str]:
  names = [t.strip() for t in spec.split(",") if t.strip()]
  unknown = [t for t in names if t not in ALL_TASKS]
  if unknown or not names:
    raise ValueError(f"unknown task {unknown[0] if unknown else spec!r}: valid tasks are "
                     f"{', '.join(ALL_TASKS)}")
  return list(dict.fromkeys(names))


# ----------------------------------------------------------------------------- model and data


def load_model(args) -> tuple[Any, Any, dict[str, Any]]:
  """(Hamburger, tokenizer or None, a description for results.json)."""
  from hamburger_jax import pretrained
  if args.config:
    from hamburger_jax.run_config import load_run_config
    cfg = load_run_config(args.config, shared_only=True)
    model, tok = cli.phase(f"building the model of {args.config}",
                           lambda: pretrained.build_run_model(cfg))
    if args.checkpoint:
      pretrained.load_graft(model, args.checkpoint)
    if args.micro_vocab is not None:
      from hamburger_jax import micro_vocab
      try:
        model.set_micro_vocab(pretrained.micro_vocab_ids(args.checkpoint, args.micro_vocab,
                                                         model.cfg.base.vocab_size))
      except micro_vocab.MicroVocabError as e:
        raise SystemExit(f"error: {e}") from None
    return model, tok, {"config": args.config, "base": cfg.model.base,
                        "checkpoint": args.checkpoint, "trained": bool(args.checkpoint)}
  checkpoint = pretrained.resolve_checkpoint(args.checkpoint)
  if checkpoint is None:
    print("warning: no HAMburger checkpoint (none at " + pretrained.DEFAULT_CHECKPOINT + "): "
          "evaluating an UNTRAINED graft; its HAMburger scores are meaningless except at c = 1",
          file=sys.stderr)
  # "both": one HAMburger model, decoded in base mode and in HAMburger mode.
  model, tok = cli.load_model("both", checkpoint, args.base, untrained_ok=True,
                              micro_vocab=args.micro_vocab)
  return model, tok, {"base": args.base or pretrained.DEFAULT_BASE, "checkpoint": checkpoint,
                      "trained": checkpoint is not None}


def task_examples(task, limit: int | None, tokenizer=None) -> list[eval_tasks.Example]:
  n = limit or DEFAULT_LIMIT.get(task.name)
  if isinstance(task, eval_tasks.ReasoningGymTask):
    # Evaluation items come from seeds >= EVAL_SEED (examples() refuses lower ones); training
    # data is drawn below it (ReasoningGymTask.train_items).
    return task.examples(n, seed=eval_tasks.EVAL_SEED)
  if isinstance(task, eval_tasks.ShareGPTHeldoutTask) and tokenizer is not None:
    # The prompt length cap in the model's tokens, as train.self_distill counts them.
    return task.examples(n, count_tokens=lambda text: len(tokenizer.encode(text)))
  return task.examples(n)


def check_disjoint(path: str, engine, examples: dict[str, list]) -> int:
  """Raises EvalError when a training prompt of `path` is also an evaluation prompt; returns
  the number of training prompts compared."""
  from hamburger_jax.evaluation.disjointness import eval_prompt_keys, training_prompt_keys
  try:
    train_keys = training_prompt_keys(path, engine.tokenizer)
  except ValueError as e:
    raise EvalError(str(e)) from None
  for name, exs in examples.items():
    try:
      eval_tasks.assert_disjoint(train_keys, eval_prompt_keys(engine, exs))
    except ValueError as e:
      raise EvalError(f"task {name}: {e}") from None
  return len(train_keys)


def groups_example(tokenizer, task: str, example, gen, confidence: float) -> dict[str, Any]:
  """One HAMburger generation split into its macro steps, for plots.plot_groups_example."""
  from infer.plots import group_pieces
  prompt = (example.messages[-1]["content"] if isinstance(example.messages[-1], dict)
            else " ".join(map(str, example.messages)))
  return {"task": task, "id": example.id, "confidence": confidence, "prompt": prompt,
          "pieces": group_pieces(tokenizer, gen.token_ids, gen.groups)}


# ----------------------------------------------------------------------------- main


def evaluate(args) -> dict[str, Any]:
  """Runs every task, writes the outputs to args.out and returns results.json's content."""
  import jax
  from infer import plots
  from hamburger_jax.decode.engine import Engine
  from hamburger_jax.evaluation import sandbox, teacher_forced
  from hamburger_jax.evaluation.scoring import run_task

  sandbox.set_unsafe_exec(getattr(args, "unsafe_exec", False))
  model, tok, model_info = load_model(args)
  names = args.tasks or ([*TEXT_TASKS] if tok is not None else ["synthetic"]) + (
      ["nll"] if args.data else [])
  if tok is None and set(names) & set(TEXT_TASKS):
    raise EvalError(f"tasks {sorted(set(names) & set(TEXT_TASKS))} need a tokenizer, but the "
                     f"model of {args.config} has none: use --tasks synthetic,nll")
  if args.max_group is not None and args.max_group > model.max_group:
    raise EvalError(f"--max-group={args.max_group} exceeds the model's largest group "
                    f"(graft.max_group={model.max_group}): give 1..{model.max_group}")
  engine = Engine(model, tok)
  tasks = {name: SyntheticTask(model.cfg.base.vocab_size, model.max_group) if name == "synthetic"
           else eval_tasks.get_task(name) for name in names if name != "nll"}
  examples = {name: task_examples(task, args.limit, tok) for name, task in tasks.items()}
  if args.train_data:
    n = check_disjoint(args.train_data, engine, examples)
    print(f"checked: no evaluation prompt is among the {n} training prompts of "
          f"{args.train_data}", file=sys.stderr)

  os.makedirs(args.out, exist_ok=True)
  results = {"command": " ".join(shlex.quote(a) for a in ["python", "-m", "infer.eval",
                                                          *args.argv]),
             "created": datetime.datetime.now().isoformat(timespec="seconds"),
             "config": {k: v for k, v in vars(args).items() if k != "argv"},
             "model": model_info, "device": str(jax.devices()[0]),
             "tasks": {}, "group_sizes": {}, "example": None}
  results["config"]["tasks"] = names
  group_sizes = {ckey(c): collections.Counter() for c in args.confidence}
  with open(os.path.join(args.out, "generations.jsonl"), "w") as gen_file:
    for name in names:
      if name == "nll":
        try:
          results["tasks"][name] = teacher_forced.nll_task(model, args.data, args.split,
                                                           args.limit, args.batch)
        except teacher_forced.SplitError as e:
          raise EvalError(str(e)) from None
        continue
      max_new = args.max_new_tokens or MAX_NEW_TOKENS[name]
      scored = run_task(engine, tasks[name], examples[name], args.confidence, max_new,
                        args.batch, args.max_group)
      results["tasks"][name] = result = scored.result(max_new)
      for rec in scored.records(name):
        gen_file.write(json.dumps(rec) + "\n")
      for c, run in scored.ham.items():
        group_sizes[ckey(c)].update(s for g in run.gens for s in g.groups)
      if results["example"] is None:
        c = args.confidence[0]  # the lowest confidence: the most merging to look at
        results["example"] = groups_example(tok, name, scored.examples[0], scored.ham[c].gens[0],
                                            c)
      print(f"{name}: base {result['base']['score']:.3f}; " + "; ".join(
          f"c={c}: {h['score']:.3f} at {h['kv_compression']:.2f}x KV, {h['speed_ratio']:.2f}x "
          "speed" for c, h in result["hamburger"].items()), file=sys.stderr)
  results["group_sizes"] = {c: dict(sorted(h.items())) for c, h in group_sizes.items() if h}
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(markdown(results))
  if not args.no_plots:
    plots.plot_all(results, args.out)
  return results


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  args.argv = argv
  # Imported after argument checks so bad arguments fail fast.
  from hamburger_jax.assets import AssetError
  from hamburger_jax.config import ConfigError
  from hamburger_jax.data.sources import SourceError
  from hamburger_jax.convert.mapping import WeightsError
  from hamburger_jax.decode.engine import GenerationError
  from hamburger_jax import cache
  from hamburger_jax.evaluation.sandbox import SandboxUnavailable
  cache.enable_compilation_cache()
  try:
    results = evaluate(args)
  except (EvalError, AssetError, ConfigError, SourceError, WeightsError, GenerationError,
          FileNotFoundError, SandboxUnavailable) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(markdown(results))
  print(f"wrote {args.out}/results.json, results.md, generations.jsonl" +
        ("" if args.no_plots else " and the plots"), file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
