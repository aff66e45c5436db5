"""Evaluate HAMburger against its base model: quality, KV compression and decode speed.

  python -m infer.eval --tasks basic_arithmetic,chain_sum,mt_bench,sharegpt_heldout --limit 40
  python -m infer.eval --tasks gsm_symbolic,humaneval --confidence 0.6,0.7,0.8,0.9 --batch 8
  python -m infer.eval --tasks nll --data runs/data/smollm2-distill
  python -m infer.eval --config configs/tiny.yaml --tasks synthetic,nll --data runs/tiny-data
  python -m infer.eval --tasks fidelity --checkpoint C
  python -m infer.eval --tasks fidelity --data runs/data/D --split train --limit 96
  python -m infer.eval --tasks fidelity --merge-layer 0,2,4,8,15,22
  python -m infer.eval --replot runs/eval/results.json     # its plots again, from the JSON

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
each metric is pooled over the split). `fidelity` is teacher-forced too, on the committed
fidelity set (the base's own greedy answers to held-out prompts; --fidelity-set another, --data
a prepared split instead): how often the token after a merged entry, after a single one, after
one merged entry in a plain context and at micro steps 2-4 is the base's own, with the KL, each
by group size (hamburger_jax/evaluation/fidelity.py).

`--config RUN.yaml` builds the model of a run config instead (e.g. configs/tiny.yaml: a random
tiny model with no tokenizer, where only the token-id tasks `synthetic` and `nll` make sense).

Writes to --out: results.json (numbers, config, command line), results.md (tables),
generations.jsonl (every generation) and the PNG plots of hamburger_jax/evaluation/plots.py;
`--replot RESULTS_JSON` draws an earlier run's plots again from its results.json alone (into
--out if given, else beside it).
"""

# Heavy imports (jax, models, data) live inside the functions that need them, so that --help and
# argument errors answer at once. The evaluation itself is hamburger_jax/evaluation/run.py.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any, Sequence

from hamburger_jax import cli
from hamburger_jax.cli import parse_confidences
from hamburger_jax.evaluation.run import (ALL_TASKS, MAX_NEW_TOKENS, EvalSettings, parse_tasks,
                                          run_model_info)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m infer.eval", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  _add_task_flags(p)
  _add_model_flags(p)
  _add_data_flags(p)
  _add_suite_flags(p)
  p.add_argument("--out", default=None,
                 help="output directory (default runs/eval; --replot: the JSON's)")
  p.add_argument("--no-plots", action="store_true")
  p.add_argument("--replot", default=None, metavar="RESULTS_JSON",
                 help="draw an earlier evaluation's plots again from its results.json, and exit")
  p.add_argument("--unsafe-exec", action="store_true",
                 help="humaneval: run model-written code as a plain subprocess when no OS sandbox "
                 "(namespaces through util-linux's unshare) is available; only for trusted code")
  args = p.parse_args(argv)
  if args.replot:
    _check_replot(p, args)
    return args
  args.out = args.out or "runs/eval"
  _check_suite_flags(p, args)
  _check_decode_flags(p, args)
  _check_paths(p, args)
  if args.tasks == "none":
    args.tasks = None
  elif (args.tasks is None or "humaneval" in args.tasks) and not args.unsafe_exec:
    from hamburger_jax.evaluation import sandbox
    isolated, reason = sandbox.isolation_status()
    if not isolated:
      p.error(f"humaneval runs model-written code, and there is no OS sandbox here ({reason}): "
              "leave humaneval out of --tasks, or pass --unsafe-exec to run it without isolation")
  return args


def _add_task_flags(p: argparse.ArgumentParser) -> None:
  """The tasks, the confidences they are decoded at, and how much of each."""
  p.add_argument("--tasks", default=None,
                 help=f"comma-separated, from: {','.join(ALL_TASKS)} (default: the text tasks, "
                 "or synthetic for a model without tokenizer; plus nll when --data is given)")
  # A comma list, where the other CLIs take one number: not cli.add_decode_flags' --confidence.
  cli.add_confidences_flag(p, default=None, help_=(
      "comma-separated confidence levels in [0, 1] (docs/SPEC.md 3; default 0.6,0.7,0.8,0.9, "
      "with --suite 0.5,0.7,0.8)"))
  cli.add_decode_flags(p, max_new_tokens=None, confidence=False, sampling=False, lookup=False,
                       max_new_help="new tokens per answer (default: per task, " +
                       ", ".join(f"{k} {v}" for k, v in MAX_NEW_TOKENS.items()) + ")")
  p.add_argument("--limit", type=int, default=None,
                 help="examples per task (nll: validation records); default: the whole task")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
  """The model evaluated and how it decodes."""
  cli.add_model_flags(p, checkpoint_help="HAMburger graft checkpoint directory (default: the "
                      "shipped one if present, else an UNTRAINED graft, for smoke tests only)",
                     micro_vocab=True)
  p.add_argument("--config", default=None,
                 help="build the model of this run config (e.g. configs/tiny.yaml) instead")
  p.add_argument("--batch", type=int, default=8, help="prompts decoded together")
  cli.add_micro_rule_flag(p)
  p.add_argument("--verify", type=float, default=None, metavar="DRAFT_CONFIDENCE",
                 help="also decode each task in verify mode at this draft confidence (e.g. 0): "
                      "the base's tokens drafted by the micro decoder, their tokens a forward "
                      "and speed against the base")


def _add_data_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument("--data", default=None, help="tfds dataset directory for the nll task")
  p.add_argument("--split", default="validation", help="split of --data for nll")
  p.add_argument("--fidelity-set", default=None, metavar="PATH",
                 help="the fidelity task's set (default: the committed one, "
                      "hamburger_jax/evaluation/fidelity_set.json)")
  p.add_argument("--merge-layer", default=None, metavar="L,L,...",
                 help="fidelity task: also the untrained merge at each of these base layers (the "
                      "group's last token's layer-L state read by the exact base; 0: its "
                      "embedding), e.g. 0,2,4,8,15,22")
  p.add_argument("--write-fidelity-set", default=None, metavar="PATH",
                 help="write a fidelity set (the base's greedy answers to held-out prompts, "
                      "grouped) to PATH, and exit")
  p.add_argument("--train-data", default=None,
                 help="training data (a token corpus, a tfds directory or JSONL): check that no "
                      "eval prompt is in it")


def _add_suite_flags(p: argparse.ArgumentParser) -> None:
  """Writing the free-generation suite, or judging grafts on one."""
  p.add_argument("--write-suite", metavar="DIR",
                 help="write the free-generation suite (the four number tasks, --suite-examples "
                      "each, and 128 held-out chat prompts, as token ids with their checkers and "
                      "the base's greedy answers) to DIR/suite.json, and exit; train.window "
                      "--suite judges with it")
  p.add_argument("--suite-examples", type=int, default=None,
                 help="--write-suite: examples of each number task (default 200)")
  p.add_argument("--suite-chat", type=int, default=None,
                 help="--write-suite: held-out chat prompts (default 128: the 80 MT-Bench first "
                      "turns, then held-out ShareGPT ones)")
  p.add_argument("--suite", metavar="DIR",
                 help="judge on a suite instead of --tasks: the graft (--checkpoint) and any "
                      "--against grafts, greedy, at --confidence (default 0.5,0.7,0.8)")
  p.add_argument("--against", action="append", default=[], metavar="CHECKPOINT",
                 help="--suite: another graft judged on the same suite and base answers; each is "
                      "compared with --checkpoint at c = 0.8 (paired interval)")


def _check_replot(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """--replot draws plots and exits: any flag of an evaluation beside it would go unused."""
  from hamburger_jax import files
  defaults = vars(p.parse_args([]))
  other = [f"--{k.replace('_', '-')}" for k, v in vars(args).items()
           if k not in ("replot", "out") and v != defaults[k]]
  if other:
    p.error(f"--replot draws an earlier evaluation's plots and exits: leave out "
            f"{', '.join(other)} (only --out goes with it)")
  try:
    if not files.exists(args.replot):
      p.error(f"{args.replot} does not exist: run python -m infer.eval first")
    if args.out is not None:
      files.check_writable(args.out, "--out")
  except files.StorageError as e:
    p.error(str(e))


def _check_suite_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Checks --write-suite, --suite and --against; a suite's tasks become "none"."""
  suite_mode = args.write_suite or args.suite
  if args.write_suite and args.suite:
    p.error("give --write-suite DIR (write a suite) or --suite DIR (judge on one), not both")
  if args.against and not args.suite:
    p.error("--against needs --suite DIR: it compares grafts on one suite")
  if suite_mode and args.tasks is not None:
    p.error("--tasks does not apply to a suite (its items are fixed when it is written)")
  for name in ("suite_examples", "suite_chat"):
    value = getattr(args, name)
    if value is not None and value < (1 if name == "suite_examples" else 0):
      p.error(f"--{name.replace('_', '-')}={value} must be a positive integer")
  if args.suite and not os.path.isfile(os.path.join(args.suite, "suite.json")):
    p.error(f"--suite {args.suite} holds no suite.json: write one with --write-suite DIR")
  for path in args.against:
    if not os.path.isfile(os.path.join(path, "hamburger.json")):
      p.error(f"--against {path} is not a graft checkpoint (no hamburger.json there)")
  if args.write_fidelity_set and (suite_mode or args.tasks is not None):
    p.error("--write-fidelity-set writes a set and exits: leave out --tasks, --suite and "
            "--write-suite")
  if suite_mode or args.write_fidelity_set:
    args.tasks = "none"  # parse_args then skips the humaneval sandbox check


def _check_decode_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Parses --confidence (its default depends on --suite), --tasks and --micro-rule, and checks
  the counts."""
  if args.confidence is None:
    args.confidence = "0.5,0.7,0.8" if args.suite else "0.6,0.7,0.8,0.9"
  try:
    args.confidence = parse_confidences(args.confidence)
    args.tasks = parse_tasks(args.tasks) if args.tasks not in (None, "none") else args.tasks
    from hamburger_jax.decode import micro_rule
    args.micro_rule = micro_rule.parse(args.micro_rule)
  except ValueError as e:
    p.error(str(e))
  # Checked here rather than by cli.check_decode_flags, which takes one confidence; the same
  # rules (positive counts, confidences in [0, 1]), with eval's messages.
  if args.verify is not None and not 0 <= args.verify <= 1:
    p.error(f"--verify={args.verify}: a draft confidence must be in [0, 1]")
  for name in ("limit", "batch", "max_new_tokens", "max_group"):
    value = getattr(args, name)
    if value is not None and value < 1:
      p.error(f"--{name.replace('_', '-')}={value} must be a positive integer")


def _check_paths(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Checks --checkpoint, --out, --data and --train-data."""
  from hamburger_jax import files
  from hamburger_jax.run_config import DATASET_READER
  try:  # a bucket that cannot be reached fails here, before the model loads
    if args.checkpoint is not None and not files.isdir(args.checkpoint):
      why = files.missing_bucket(args.checkpoint)
      p.error(f"checkpoint {args.checkpoint} {f'is not there, {why}' if why else 'does not exist'}"
              ": pass a directory written by train.main's export (or "
              "hamburger_jax.graft_checkpoint.save_graft)")
    files.check_writable(args.out, "--out")
    for flag, path in (("--data", args.data), ("--train-data", args.train_data)):
      if path is not None:
        files.check_local(path, flag, DATASET_READER)
  except files.StorageError as e:
    p.error(str(e))
  if args.fidelity_set is not None and not os.path.isfile(args.fidelity_set):
    p.error(f"--fidelity-set {args.fidelity_set} does not exist: write one with "
            "--write-fidelity-set PATH, or leave the flag out for the committed set")
  if args.merge_layer is not None:
    try:
      args.merge_layer = tuple(int(v) for v in args.merge_layer.split(",") if v.strip())
    except ValueError:
      args.merge_layer = ()
    if not args.merge_layer or min(args.merge_layer) < 0:
      p.error("--merge-layer takes base layer counts >= 0, comma-separated (e.g. 0,8,15)")
    if not args.tasks or "fidelity" not in args.tasks:
      p.error("--merge-layer sweeps the fidelity task: add --tasks fidelity")
  if args.tasks and "nll" in args.tasks and args.data is None:
    p.error("task nll needs --data DIR (a tfds dataset written by train.prepare_data)")
  if args.data is not None and not os.path.isdir(args.data):
    p.error(f"--data {args.data} does not exist")
  if args.train_data is not None and not os.path.exists(args.train_data):
    p.error(f"--train-data {args.train_data} does not exist")


def model_to_evaluate(args) -> tuple[Any, Any, dict[str, Any]]:
  """(Hamburger, tokenizer or None, a description for results.json)."""
  from hamburger_jax import pretrained
  if args.config:
    model, tok = cli.load_model("both", args.checkpoint, None, config=args.config,
                                micro_vocab=args.micro_vocab)
    return model, tok, run_model_info(args.config, args.checkpoint)
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


def settings(args, argv: Sequence[str]) -> EvalSettings:
  return EvalSettings(
      confidences=tuple(args.confidence), tasks=tuple(args.tasks) if args.tasks else None,
      limit=args.limit, batch=args.batch, max_new_tokens=args.max_new_tokens,
      max_group=args.max_group, micro_rule=args.micro_rule, data=args.data, split=args.split,
      fidelity_set=args.fidelity_set, merge_layers=args.merge_layer or (),
      verify_draft_confidence=args.verify,
      train_data=args.train_data, out=args.out, plots=not args.no_plots,
      unsafe_exec=args.unsafe_exec,
      command=" ".join(shlex.quote(a) for a in ["python", "-m", "infer.eval", *argv]))


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.replot:
    return replot(args)
  # Imported after argument checks so bad arguments fail fast.
  from hamburger_jax import cache, files
  from hamburger_jax.assets import AssetError
  from hamburger_jax.config import ConfigError
  from hamburger_jax.convert.mapping import WeightsError
  from hamburger_jax.data.sources import SourceError
  from hamburger_jax.decode.engine import GenerationError
  from hamburger_jax.evaluation.report import markdown
  from hamburger_jax.evaluation.run import EvalError, evaluate
  from hamburger_jax.evaluation.sandbox import SandboxUnavailable
  cache.enable_compilation_cache()
  if args.write_fidelity_set:
    return write_fidelity_set(args, argv)
  if args.write_suite or args.suite:
    return run_suite(args, argv)
  try:
    model, tok, info = model_to_evaluate(args)
    results = evaluate(model, tok, {**info, "micro_vocab": model.micro_vocab_size},
                       settings(args, argv))
  except (EvalError, AssetError, ConfigError, SourceError, WeightsError, GenerationError,
          FileNotFoundError, SandboxUnavailable, cli.ModelLoadError, files.StorageError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(markdown(results))
  print(f"wrote {args.out}/results.json, results.md, generations.jsonl" +
        ("" if args.no_plots else " and the plots"), file=sys.stderr)
  return 0


def replot(args) -> int:
  """--replot RESULTS_JSON: the evaluation's plots drawn again from its results.json alone, each
  PNG's path printed."""
  import json
  from hamburger_jax import files
  from hamburger_jax.evaluation.plots import plot_all
  results = json.loads(files.read_text(args.replot))
  for path in plot_all(results, args.out or os.path.dirname(files.absolute(args.replot))):
    print(path)
  return 0


def write_fidelity_set(args, argv: Sequence[str]) -> int:
  """--write-fidelity-set PATH: the base's greedy answers to the held-out prompts, grouped."""
  from hamburger_jax.assets import AssetError
  from hamburger_jax.decode.engine import Engine, GenerationError
  from hamburger_jax.evaluation import fidelity_set
  log = lambda line: print(line, file=sys.stderr)
  try:
    model, tok, _ = model_to_evaluate(args)
    command = " ".join(shlex.quote(a) for a in ["python", "-m", "infer.eval", *argv])
    fset = fidelity_set.build(Engine(model, tok), batch=args.batch, command=command, log=log)
  except (fidelity_set.FidelitySetError, AssetError, GenerationError, cli.ModelLoadError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  path = fidelity_set.save(fset, args.write_fidelity_set)
  tokens = sum(len(r.response) for r in fset.records)
  groups = sum(len(r.groups) for r in fset.records)
  print(f"wrote {path}: {len(fset.records)} records, {tokens} answer tokens in {groups} groups")
  return 0


def suite_micro_vocab(args) -> int | None:
  """The --micro-vocab every graft of --suite is loaded with (0: the full vocabulary; None: the
  entry points' default): the flag's value, which each must store, else the default, which must
  come out the same for each. Grafts judged together share one engine's programs, and their
  scores compare only where they decode alike; a SuiteError (one line) names the graft that
  cannot and what to do."""
  from hamburger_jax import micro_vocab, pretrained
  from hamburger_jax.evaluation.suite import SuiteError
  if not args.against:
    return args.micro_vocab
  shipped = args.config is None  # as model_to_evaluate and cli.load_model resolve them
  checkpoint = pretrained.resolve_checkpoint(args.checkpoint) if shipped else args.checkpoint
  grafts = [("--checkpoint", checkpoint), *(("--against", path) for path in args.against)]
  if args.micro_vocab:
    for flag, path in grafts:
      stored = micro_vocab.stored_size(path) if path else 0
      if stored < args.micro_vocab:
        raise SuiteError(f"--micro-vocab {args.micro_vocab}: {flag} {path} stores {stored} micro "
                         f"vocabulary ids ({micro_vocab.FILE}): judge every graft with the full "
                         "vocabulary (--micro-vocab 0) or with at most the ids each stores")
    return args.micro_vocab
  sizes = [cli.micro_vocab_size(args.micro_vocab, path, "both", shipped=False)
           for _, path in grafts]
  if len(set(sizes)) == 1:
    return args.micro_vocab
  (have_flag, have), (lack_flag, lack) = (next(g for g, n in zip(grafts, sizes) if bool(n) == want)
                                          for want in (True, False))
  raise SuiteError(
      f"{have_flag} {have} decodes by default with the first {micro_vocab.DEFAULT_SIZE} ids of "
      f"its micro vocabulary ({micro_vocab.FILE}) but {lack_flag} {lack} stores none that long, "
      "and grafts judged together must decode alike: pass --micro-vocab 0 to judge both with the "
      f"full vocabulary, or, if {lack} was trained from {have}, copy its {micro_vocab.FILE} there "
      "(a run's export carries its init's)")


def run_suite(args, argv: Sequence[str]) -> int:
  """--write-suite DIR, or the grafts judged on --suite DIR (results in --out)."""
  from hamburger_jax import files
  from hamburger_jax.assets import AssetError
  from hamburger_jax.data.sources import SourceError
  from hamburger_jax.decode.engine import Engine, GenerationError
  from hamburger_jax.evaluation import suite as suite_lib
  from hamburger_jax.evaluation import suite_judge
  log = lambda line: print(line, file=sys.stderr)
  try:
    if args.suite:  # before any weights load
      args.micro_vocab = suite_micro_vocab(args)
    model, tok, info = model_to_evaluate(args)
    if args.write_suite:
      command = " ".join(shlex.quote(a) for a in ["python", "-m", "infer.eval", *argv])
      s = suite_lib.build(Engine(model, tok), task_examples=args.suite_examples or
                          suite_lib.TASK_EXAMPLES, chat=suite_lib.chat_sources(args.suite_chat),
                          batch=args.batch, command=command, log=log)
      print(f"wrote {suite_lib.save(s, args.write_suite)}: {len(s.items)} items "
            f"({', '.join(s.tasks)})")
      return 0
    from hamburger_jax.data.tokens.corpus import tokenizer_fingerprint
    suite = suite_lib.load(args.suite, model.cfg.base.vocab_size,
                           tokenizer_fingerprint(tok) if tok is not None else None)
    models = {info.get("checkpoint") or "graft": model}
    for path in args.against:
      other, _ = cli.load_model("both", path, args.base, config=args.config,
                                micro_vocab=args.micro_vocab)
      models[path] = other
    out = suite_judge.judge_grafts(models, tok, suite, args.confidence, args.batch, log=log)
  except (suite_lib.SuiteError, AssetError, SourceError, GenerationError, FileNotFoundError,
          cli.ModelLoadError, files.StorageError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  files.makedirs(args.out)
  files.write_json_atomic(files.join(args.out, "suite-results.json"),
                          {k: v for k, v in out.items() if k != "lines"}, indent=2)
  files.write_text_atomic(files.join(args.out, "suite-results.md"), "\n".join(out["lines"]))
  print("\n".join(out["lines"]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
