"""An evaluation: each task decoded greedily by the base and by HAMburger at each confidence,
scored, compared and written out (results.json, results.md, generations.jsonl). `infer.eval`
is its command line; train.pipeline calls `evaluate` directly.

The parts: generation (batched decoding), scoring (per-task scores, results.json entries),
statistics (bootstrap intervals), teacher_forced (the nll task), report (results.md),
disjointness, plots.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import sys
from typing import Any, Callable

from hamburger_jax import files
from hamburger_jax.data import heldout
from hamburger_jax.evaluation import tasks as eval_tasks
from hamburger_jax.evaluation.report import TEACHER_FORCED_TASKS, markdown
from hamburger_jax.evaluation.scoring import SyntheticTask, ckey

TEXT_TASKS = ("gsm_symbolic", "basic_arithmetic", "chain_sum", "letter_counting", "gcd", "lcm",
              "humaneval", "mt_bench", "sharegpt_heldout")
TOKEN_TASKS = ("synthetic", *TEACHER_FORCED_TASKS)
ALL_TASKS = TEXT_TASKS + TOKEN_TASKS
# New-token budgets that fit each task's expected answer (a chain of thought, a function, a
# chat answer, a number); --max-new-tokens overrides them all.
MAX_NEW_TOKENS = {"gsm_symbolic": 256, "basic_arithmetic": 16, "chain_sum": 16,
                  "letter_counting": 24, "gcd": 24, "lcm": 24, "humaneval": 320, "mt_bench": 256,
                  "sharegpt_heldout": 128, "synthetic": 32}
DEFAULT_LIMIT = {"synthetic": 32}  # the other tasks default to their own sizes


class EvalError(ValueError):
  """The evaluation cannot run as asked; the message says what to change."""



@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """What an evaluation runs: tasks (None: the text tasks, or synthetic for a model without a
  tokenizer; plus nll with `data`), confidences, budgets, where it writes."""
  confidences: tuple[float, ...] = (0.6, 0.7, 0.8, 0.9)
  tasks: tuple[str, ...] | None = None
  limit: int | None = None  # examples per task (nll: records); None: the whole task
  batch: int = 8
  max_new_tokens: int | None = None  # None: MAX_NEW_TOKENS per task
  max_group: int | None = None
  micro_rule: str | float = "off"  # when a batch's next micro step runs (decode/micro_rule.py)
  # Each task is also decoded in verify mode at this draft confidence (the base's tokens,
  # drafted by the micro decoder: tokens a forward and speed against the base); None: not
  verify_draft_confidence: float | None = None
  data: str | None = None  # a tfds dataset, for nll (and fidelity: its split instead of the set)
  fidelity_set: str | None = None  # the fidelity task's set (None: the committed one)
  # The fidelity task also measures the untrained merge at each of these layers (model/
  # layer_merge.py: the last token's layer-L state, the exact base reading it)
  merge_layers: tuple[int, ...] = ()
  split: str = "validation"
  train_data: str | None = None  # prompts that must not be evaluation prompts
  out: str = "runs/eval"
  plots: bool = True
  unsafe_exec: bool = False
  command: str = ""  # the command line, as recorded in results.json


def parse_tasks(spec: str) -> list[str]:
  names = [t.strip() for t in spec.split(",") if t.strip()]
  unknown = [t for t in names if t not in ALL_TASKS]
  if unknown or not names:
    raise ValueError(f"unknown task {unknown[0] if unknown else spec!r}: valid tasks are "
                     f"{', '.join(ALL_TASKS)}")
  return list(dict.fromkeys(names))


def task_examples(task, limit: int | None, tokenizer=None) -> list[heldout.Example]:
  n = limit or DEFAULT_LIMIT.get(task.name)
  if isinstance(task, eval_tasks.ReasoningGymTask):
    # Evaluation items come from seeds >= EVAL_SEED (examples() refuses lower ones); training
    # data is drawn below it (ReasoningGymTask.train_items).
    return task.examples(n, seed=heldout.EVAL_SEED)
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
      heldout.assert_disjoint(train_keys, eval_prompt_keys(engine, exs))
    except ValueError as e:
      raise EvalError(f"task {name}: {e}") from None
  return len(train_keys)


def groups_example(tokenizer, task: str, example, gen, confidence: float) -> dict[str, Any]:
  """One HAMburger generation split into its macro steps, for plots.plot_groups_example."""
  from hamburger_jax.evaluation.plots import group_pieces  # pylint: disable=C0415  # matplotlib
  prompt = (example.messages[-1]["content"] if isinstance(example.messages[-1], dict)
            else " ".join(map(str, example.messages)))
  return {"task": task, "id": example.id, "confidence": confidence, "prompt": prompt,
          "pieces": group_pieces(tokenizer, gen.token_ids, gen.groups)}


def run_model_info(config: str, checkpoint: str | None) -> dict[str, Any]:
  """results.json's "model" for the model of a run config (pretrained.load_run's)."""
  from hamburger_jax.run_config import load_run_config  # pylint: disable=import-outside-toplevel
  return {"config": config, "base": load_run_config(config, shared_only=True).model.base,
          "checkpoint": checkpoint, "trained": bool(checkpoint)}


def task_names(settings: EvalSettings, has_tokenizer: bool) -> list[str]:
  """The tasks an evaluation runs (EvalSettings.tasks)."""
  if settings.tasks:
    return list(settings.tasks)
  return ([*TEXT_TASKS] if has_tokenizer else ["synthetic"]) + (["nll"] if settings.data else [])


def evaluate(model, tok, model_info: dict[str, Any], s: EvalSettings,
             log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)
             ) -> dict[str, Any]:
  """Runs every task on `model` (a Hamburger, decoded in both modes by one engine), writes the
  outputs to s.out and returns results.json's content. Raises EvalError on a setting that
  cannot run."""
  import jax  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  from hamburger_jax.evaluation import sandbox  # pylint: disable=import-outside-toplevel

  sandbox.set_unsafe_exec(s.unsafe_exec)
  names = task_names(s, tok is not None)
  if tok is None and set(names) & set(TEXT_TASKS):
    raise EvalError(f"tasks {sorted(set(names) & set(TEXT_TASKS))} need a tokenizer, but this "
                    "model has none: use --tasks synthetic,nll")
  if "nll" in names and s.data is None:
    raise EvalError("task nll needs a dataset (--data DIR, written by train.prepare_data)")
  if s.max_group is not None and s.max_group > model.max_group:
    raise EvalError(f"--max-group={s.max_group} exceeds the model's largest group "
                    f"(graft.max_group={model.max_group}): give 1..{model.max_group}")
  engine = Engine(model, tok, micro_rule=s.micro_rule)
  tasks = {name: SyntheticTask(model.cfg.base.vocab_size, model.max_group) if name == "synthetic"
           else eval_tasks.get_task(name) for name in names if name not in TEACHER_FORCED_TASKS}
  examples = {name: task_examples(task, s.limit, tok) for name, task in tasks.items()}
  if s.train_data:
    n = check_disjoint(s.train_data, engine, examples)
    log(f"checked: no evaluation prompt is among the {n} training prompts of {s.train_data}")

  files.makedirs(s.out)
  results = {"command": s.command,
             "created": datetime.datetime.now().isoformat(timespec="seconds"),
             "config": {**{k: v for k, v in dataclasses.asdict(s).items()
                           if k not in ("confidences", "command")},
                        "confidence": list(s.confidences), "tasks": names, **model_info},
             "model": model_info, "device": str(jax.devices()[0]),
             "tasks": {}, "group_sizes": {}, "example": None}
  group_sizes = {ckey(c): collections.Counter() for c in s.confidences}
  # Generations go out as each task ends: a long evaluation shows its progress on disk (on a
  # bucket, where an object appears whole, once the last task ends).
  with files.open_file(files.join(s.out, "generations.jsonl"), "w", encoding="utf-8") as gen_file:
    _run_tasks(model, tok, engine, s, names, tasks, examples, results, group_sizes, gen_file,
               log)
  results["group_sizes"] = {c: dict(sorted(h.items())) for c, h in group_sizes.items() if h}
  files.write_json_atomic(files.join(s.out, "results.json"), results, indent=2)
  files.write_text_atomic(files.join(s.out, "results.md"), markdown(results))
  if s.plots:
    from hamburger_jax.evaluation import plots  # pylint: disable=import-outside-toplevel
    plots.plot_all(results, s.out)
  return results


def _run_tasks(model, tok, engine, s: EvalSettings, names, tasks, examples, results,
               group_sizes, gen_file, log) -> None:
  from hamburger_jax.evaluation import teacher_forced  # pylint: disable=C0415
  from hamburger_jax.evaluation.scoring import run_task  # pylint: disable=C0415
  for name in names:
    if name == "nll":
      try:
        results["tasks"][name] = teacher_forced.nll_task(model, s.data, s.split, s.limit,
                                                         s.batch)
      except teacher_forced.SplitError as e:
        raise EvalError(str(e)) from None
      continue
    if name == "drafts":
      from hamburger_jax.evaluation import fidelity_set, verify_walk  # pylint: disable=C0415
      try:
        results["tasks"][name] = r = verify_walk.drafts_task(
            model, engine, path=s.fidelity_set, limit=s.limit,
            draft_confidence=(s.verify_draft_confidence
                              if s.verify_draft_confidence is not None else 0.0))
      except fidelity_set.FidelitySetError as e:
        raise EvalError(str(e)) from None
      log(f"drafts: chained {r['chained']:.3f}, walk {r['walk_tokens_per_forward']:.3f}, "
          f"engine {r['engine_tokens_per_forward']:.3f} tokens a forward")
      continue
    if name == "fidelity":
      from hamburger_jax.evaluation import fidelity, fidelity_set  # pylint: disable=C0415
      try:
        results["tasks"][name] = r = fidelity.fidelity_task(
            model, path=s.fidelity_set, data=s.data, split=s.split, limit=s.limit,
            batch=s.batch, merge_layers=s.merge_layers)
      except (fidelity_set.FidelitySetError, teacher_forced.SplitError) as e:
        raise EvalError(str(e)) from None
      log(f"fidelity: agree after merged {r['agree_merged']:.3f}, after single "
          f"{r['agree_single']:.3f}, one merge {r.get('agree_one_merge') or float('nan'):.3f}")
      continue
    max_new = s.max_new_tokens or MAX_NEW_TOKENS[name]
    scored = run_task(engine, tasks[name], examples[name], list(s.confidences), max_new,
                      s.batch, s.max_group, s.verify_draft_confidence)
    results["tasks"][name] = result = scored.result(max_new)
    for rec in scored.records(name):
      gen_file.write(json.dumps(rec) + "\n")
    for c, run in scored.ham.items():
      group_sizes[ckey(c)].update(size for g in run.gens for size in g.groups)
    if results["example"] is None:
      c = s.confidences[0]  # the lowest confidence: the most merging to look at
      results["example"] = groups_example(tok, name, scored.examples[0], scored.ham[c].gens[0], c)
    log(f"{name}: base {result['base']['score']:.3f}; " + "; ".join(
        f"c={c}: {h['score']:.3f} at {h['kv_compression']:.2f}x KV, {h['speed_ratio']:.2f}x "
        "speed" for c, h in result["hamburger"].items()) + (
        f"; verify: {result['verify']['identical']:.0%} identical, "
        f"{result['verify']['tokens_per_forward']:.2f} tokens a forward, "
        f"{result['verify']['speed_ratio']:.2f}x speed" if "verify" in result else ""))
