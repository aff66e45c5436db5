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
token after merged and unmerged entries and per micro step.

`--config RUN.yaml` builds the model of a run config instead (e.g. configs/tiny.yaml: a random
tiny model with no tokenizer, where only the token-id tasks `synthetic` and `nll` make sense).

Writes to --out: results.json (numbers, config, command line), results.md (tables),
generations.jsonl (every generation) and the PNG plots of infer/plots.py.
"""

# Heavy imports (jax, models, data) live inside the functions that need them, so that --help and
# argument errors answer at once.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import shlex
import sys
from typing import Any, Callable, Sequence

import numpy as np

from hamburger_jax.decode.requests import pooled_tokens_per_step
from hamburger_jax.evaluation import tasks as eval_tasks
from hamburger_jax.evaluation.agreement import (DIVERGENCE_KINDS, first_divergence,
                                                token_agreement)

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
# Synthetic eval prompts come from this seed; build_synthetic_dataset's seeds (0, 1) stay below.
SYNTHETIC_SEED = eval_tasks.EVAL_SEED
BOOTSTRAP_RESAMPLES = 1000
# The tasks scored by ROUGE-L against the base's own answers (eval_mt_bench).
VS_BASE_TASKS = ("mt_bench", "sharegpt_heldout")


class EvalError(ValueError):
  """The evaluation cannot run as asked; the message says what to change."""


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m infer.eval", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tasks", default=None,
                 help=f"comma-separated, from: {','.join(ALL_TASKS)} (default: the text tasks, "
                 "or synthetic for a model without tokenizer; plus nll when --data is given)")
  p.add_argument("--confidence", default="0.6,0.7,0.8,0.9",
                 help="comma-separated confidence levels in [0, 1] (docs/SPEC.md 3)")
  p.add_argument("--max-group", type=int, default=None,
                 help="the most tokens a HAMburger macro step may emit, 1..K (default: the "
                 "model's K); a smaller cap merges fewer tokens into each KV entry")
  p.add_argument("--limit", type=int, default=None,
                 help="examples per task (nll: validation records); default: the whole task")
  p.add_argument("--checkpoint", default=None,
                 help="HAMburger graft checkpoint directory (default: the shipped one if present, "
                 "else an UNTRAINED graft, for smoke tests only)")
  p.add_argument("--base", default=None, help="base model: smollm2 | file.gguf | HF directory")
  p.add_argument("--config", default=None,
                 help="build the model of this run config (e.g. configs/tiny.yaml) instead")
  p.add_argument("--max-new-tokens", type=int, default=None,
                 help="new tokens per answer (default: per task, " +
                 ", ".join(f"{k} {v}" for k, v in MAX_NEW_TOKENS.items()) + ")")
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
    from hamburger_jax.evaluation import sandbox  # pylint: disable=import-outside-toplevel
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


def ckey(c: float) -> str:
  """A confidence as a results.json key: 0.6 -> "0.6"."""
  return f"{c:g}"


# ----------------------------------------------------------------------------- statistics


def bootstrap_ci(scores: Sequence[float], n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
  """Percentile-bootstrap interval of the mean of `scores`: the examples are resampled with
  replacement n_resamples times; (nan, nan) without scores. Seeded, so reruns write the same
  results.json."""
  x = np.asarray(scores, np.float64)
  if x.ndim != 1:
    raise ValueError(f"scores must be one number per example, got shape {x.shape}")
  if n_resamples < 1 or not 0.0 < level < 1.0:
    raise ValueError(f"n_resamples={n_resamples} must be >= 1 and level={level} in (0, 1)")
  if len(x) == 0:
    return float("nan"), float("nan")
  rng = np.random.default_rng(seed)
  means = x[rng.integers(0, len(x), size=(n_resamples, len(x)))].mean(axis=1)
  lo, hi = np.percentile(means, [50.0 * (1.0 - level), 50.0 * (1.0 + level)])
  return float(lo), float(hi)


def paired_bootstrap_ci(a: Sequence[float], b: Sequence[float],
                        n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float]:
  """Interval of mean(a) - mean(b) when a[i] and b[i] score the same example: each resample draws
  examples, keeping their pair together, so what the examples share (an easy or a hard prompt)
  cancels and the interval is that of the difference alone: the bootstrap of a - b."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape:
    raise ValueError(f"paired scores need one pair per example, got {a.shape} and {b.shape}")
  return bootstrap_ci(a - b, n_resamples, seed, level)


# ----------------------------------------------------------------------------- model


def load_model(args) -> tuple[Any, Any, dict[str, Any]]:
  """(Hamburger, tokenizer or None, a description for results.json)."""
  from hamburger_jax import pretrained
  if args.config:
    from hamburger_jax.run_config import load_run_config
    cfg = load_run_config(args.config, shared_only=True)
    model, tok = pretrained.build_run_model(cfg)
    if args.checkpoint:
      pretrained.load_graft(model, args.checkpoint)
    return model, tok, {"config": args.config, "base": cfg.model.base,
                        "checkpoint": args.checkpoint, "trained": bool(args.checkpoint)}
  checkpoint = pretrained.resolve_checkpoint(args.checkpoint)
  if checkpoint is None:
    print("warning: no HAMburger checkpoint (none at " + pretrained.DEFAULT_CHECKPOINT + "): "
          "evaluating an UNTRAINED graft; its HAMburger scores are meaningless except at c = 1",
          file=sys.stderr)
  model, tok = pretrained.load_hamburger(checkpoint or pretrained.UNTRAINED, args.base)
  return model, tok, {"base": args.base or pretrained.DEFAULT_BASE, "checkpoint": checkpoint,
                      "trained": checkpoint is not None}


# ----------------------------------------------------------------------------- generation


@dataclasses.dataclass
class ModeRun:
  """All generations of one task in one mode (and confidence)."""
  gens: list  # hamburger_jax.decode.engine.Generation, one per example
  decode_s: float  # summed over batches; compilation excluded
  compile_s: float

  @property
  def tokens(self) -> int:
    return sum(g.new_tokens for g in self.gens)

  @property
  def macro_steps(self) -> int:
    return sum(g.macro_steps for g in self.gens)

  def summary(self, scores: list[float]) -> dict[str, Any]:
    return {"score": float(np.mean(scores)) if scores else float("nan"),
            "ci95": list(bootstrap_ci(scores)),
            "tokens": self.tokens, "macro_steps": self.macro_steps,
            "kv_compression": pooled_tokens_per_step(self.gens),
            "decode_s": self.decode_s, "compile_s": self.compile_s,
            "tokens_per_s": self.tokens / self.decode_s if self.decode_s > 0 else float("nan"),
            "group_sizes": dict(sorted(collections.Counter(
                s for g in self.gens for s in g.groups).items()))}


def generate(engine, prompts: list, *, mode: str, confidence: float, max_new: int, batch: int,
             bar, max_group: int | None = None) -> ModeRun:
  gens, decode_s, compile_s = [], 0.0, 0.0
  batch = min(batch, len(prompts))
  run = lambda rows: engine.generate(rows, max_new_tokens=max_new, mode=mode,
                                     confidence=confidence, max_group=max_group)
  for i in range(0, len(prompts), batch):
    chunk = prompts[i:i + batch]
    # A short last batch is filled with copies of its last prompt, so that it reuses the compiled
    # program of the full batches (a new batch size would compile anew); copies are dropped.
    rows = chunk + [chunk[-1]] * (batch - len(chunk))
    out = run(rows)
    if out[0].compile_s > 0:
      # Programs just compiled: their first run also pays one-time costs (buffer allocation, thread
      # pools); time a second, identical run (greedy, so the same tokens).
      compile_s += out[0].compile_s
      out = run(rows)
    gens += out[:len(chunk)]
    decode_s += out[0].decode_s
    bar.update(1)
  return ModeRun(gens, decode_s, compile_s)


def run_modes(engine, examples, confidences: list[float], max_new: int, batch: int,
              name: str, max_group: int | None = None) -> tuple[ModeRun, dict[float, ModeRun]]:
  """The base run and one HAMburger run per confidence (groups capped at `max_group` tokens),
  over the examples' prompts."""
  from tqdm import tqdm
  prompts = [ex.messages for ex in examples]
  n_batches = -(-len(prompts) // min(batch, len(prompts)))
  with tqdm(total=n_batches * (1 + len(confidences)), desc=name, unit="batch",
            file=sys.stderr) as bar:
    kw = dict(max_new=max_new, batch=batch, bar=bar)
    base = generate(engine, prompts, mode="base", confidence=1.0, **kw)
    ham = {c: generate(engine, prompts, mode="hamburger", confidence=c, max_group=max_group, **kw)
           for c in confidences}
  return base, ham


@dataclasses.dataclass
class Scored:
  """A generation task's runs and per-example scores."""
  metric: str
  examples: list  # tasks.Example
  base: ModeRun
  ham: dict[float, ModeRun]
  base_scores: list[float]
  ham_scores: dict[float, list[float]]

  def result(self, max_new: int) -> dict[str, Any]:
    """results.json's entry; speed ratio = HAMburger decode tokens/s over the base's; delta =
    HAMburger's score minus the base's, with its paired interval; token agreement with the base."""
    result = {"metric": self.metric, "n": len(self.examples), "max_new_tokens": max_new,
              "base": self.base.summary(self.base_scores), "hamburger": {}}
    base_ids = [g.token_ids for g in self.base.gens]
    for c, run in self.ham.items():
      summary = run.summary(self.ham_scores[c])
      summary["speed_ratio"] = summary["tokens_per_s"] / result["base"]["tokens_per_s"]
      summary["delta"] = summary["score"] - result["base"]["score"]
      summary["delta_ci95"] = list(paired_bootstrap_ci(self.ham_scores[c], self.base_scores))
      summary.update(token_agreement(base_ids, [g.token_ids for g in run.gens]))
      summary.update(first_divergence(base_ids, [g.token_ids for g in run.gens],
                                      [g.groups for g in run.gens]))
      result["hamburger"][ckey(c)] = summary
    return result

  def records(self, task: str):
    """generations.jsonl lines: one per example and mode."""
    runs = [("base", None, self.base, self.base_scores)] + [
        ("hamburger", c, run, self.ham_scores[c]) for c, run in self.ham.items()]
    for mode, c, run, scores in runs:
      for ex, g, s in zip(self.examples, run.gens, scores):
        yield {"task": task, "id": ex.id, "mode": mode, "confidence": c, "score": s,
               "text": g.text, "token_ids": g.token_ids, "groups": g.groups,
               "macro_steps": g.macro_steps, "prompt_tokens": g.prompt_tokens}


# ----------------------------------------------------------------------------- task families


def eval_scored_task(engine, task, examples, confidences, max_new, batch,
                     max_group=None) -> Scored:
  """reasoning-gym exact match and HumanEval pass@1: task.score(text, example) per generation."""
  base, ham = run_modes(engine, examples, confidences, max_new, batch, task.name, max_group)
  score = lambda run: [task.score(g.text, ex) for g, ex in zip(run.gens, examples)]
  return Scored("pass@1" if task.name == "humaneval" else "exact_match", examples, base, ham,
                score(base), {c: score(run) for c, run in ham.items()})


def eval_mt_bench(engine, task, examples, confidences, max_new, batch, max_group=None) -> Scored:
  """ROUGE-L of HAMburger's answers against the base's own answers (attached as references):
  mt_bench and sharegpt_heldout (tasks.VsReferenceTask)."""
  base, ham = run_modes(engine, examples, confidences, max_new, batch, task.name, max_group)
  examples = [task.with_reference(ex, g.text) for ex, g in zip(examples, base.gens)]
  return Scored("rouge_l_vs_base", examples, base, ham,
                [1.0] * len(examples),  # the base against itself, by definition
                {c: [task.score(g.text, ex) for g, ex in zip(run.gens, examples)]
                 for c, run in ham.items()})


class SyntheticTask:
  """Prompts of hamburger_jax.testing.synthetic_samples (token ids, for tokenizer-less models);
  score = fraction of the expected continuation's first max_new tokens generated exactly."""

  name = "synthetic"

  def __init__(self, vocab: int, max_group: int):
    self.vocab, self.max_group = vocab, max_group

  def examples(self, n: int) -> list[eval_tasks.Example]:
    from hamburger_jax.testing import synthetic_samples
    samples = synthetic_samples(n, self.vocab, self.max_group, seed=SYNTHETIC_SEED)
    # `messages` holds token ids here: the engine takes a list of ints as a raw prompt.
    return [eval_tasks.Example(f"synthetic/{SYNTHETIC_SEED}/{i}", s["input_ids"][:s["prompt_len"]].tolist(),
                    s["input_ids"][s["prompt_len"]:].tolist()) for i, s in enumerate(samples)]

  @staticmethod
  def score(token_ids: list[int], example, max_new: int) -> float:
    expected = example.reference[:max_new]
    return sum(a == b for a, b in zip(token_ids, expected)) / max(len(expected), 1)


def eval_synthetic(engine, task: SyntheticTask, examples, confidences, max_new, batch,
                   max_group=None) -> Scored:
  base, ham = run_modes(engine, examples, confidences, max_new, batch, task.name, max_group)
  score = lambda run: [task.score(g.token_ids, ex, max_new) for g, ex in zip(run.gens, examples)]
  return Scored("token_match", examples, base, ham, score(base),
                {c: score(run) for c, run in ham.items()})


def teacher_agreement_weights(batch: dict[str, np.ndarray], max_group: int) -> dict[str, int]:
  """How many groups of `batch` each agreement metric of distillation.distill_loss averages over
  (agree_merged: groups predicted from a merged entry; agree_unmerged: the other real groups;
  agree_s{i}: windows with an i-th token), so that batch means pool into dataset means."""
  live = batch["window_size"] > 0  # padding groups have none
  rows = np.arange(live.shape[0])[:, None]
  merged = (batch["input_size"][rows, batch["pred_index"]] >= 2) & live
  weights = {"merged": int(merged.sum()), "unmerged": int((live & ~merged).sum())}
  for i in range(1, max_group + 1):
    weights[f"s{i}"] = int((batch["window_size"] >= i).sum())
  return weights


def nll_batches(records: Sequence[dict[str, Any]], max_group: int, batch: int,
                position_offset: int = 0):
  """The records in file order as packed training-layout batches of `batch` rows, shaped to fit
  the largest record (rounded up to a multiple of 16, so that few shapes compile), merged
  entries at the model's `position_offset`."""
  from hamburger_jax.data import pipeline
  layouts = [pipeline.record_layout(r, max_group, position_offset) for r in records]
  round_up = lambda n, m: -(-n // m) * m
  entries = round_up(max(lay.num_entries for lay in layouts), 16)
  groups = round_up(max(lay.num_groups for lay in layouts), 16)
  return pipeline.packed_dataset(records, batch_rows=batch, entries=entries, groups=groups,
                                 max_group=max_group, seed=None, num_epochs=1, prefetch=0,
                                 position_offset=position_offset)


def teacher_mismatch(model, data_dir: str) -> str | None:
  """Why the teacher signals of `data_dir` cannot be compared with this model, or None: another
  base made them (its greedy tokens are not this base's), or for other feature layers."""
  from hamburger_jax.data import pipeline
  from hamburger_jax.data.prepare import base_fingerprint
  meta = pipeline.dataset_metadata(data_dir)
  layers = (meta.get("teacher") or {}).get("feature_layers")
  if layers is not None and list(layers) != list(model.feature_layers):
    return (f"{data_dir} stores the teacher's features of layers {list(layers)} but the graft "
            f"reads layers {list(model.feature_layers)}: prepare the data with this model's config")
  stored = meta.get("base_fingerprint")
  if stored and stored != base_fingerprint(model.base):
    return (f"{data_dir} was segmented with another base ({meta.get('base', '?')}, fingerprint "
            f"{stored}), so its teacher is not this model's base: prepare the data with this base")
  return None


def eval_nll(model, data_dir: str, split: str, limit: int | None, batch: int) -> dict[str, Any]:
  """Teacher-forced NLL (nats per response token) of HAMburger (docs/SPEC.md 2.2's lm loss, with its
  per-micro-step accuracies and stop accuracy) and of the base's plain forward, same tokens.

  On data with teacher signals, also "teacher_agreement": how often HAMburger's micro-step argmax
  is the teacher's greedy token (distill_loss's agree_* metrics), on the first token of groups
  predicted from a merged entry (`merged`) or an unmerged one (`unmerged`) and per micro step
  (`s1`..`sK`), each pooled over the groups it counts ("groups")."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from tqdm import tqdm
  from hamburger_jax.data import pipeline
  from hamburger_jax.distillation import acceptance_metrics, distill_loss
  from hamburger_jax.losses import chunked_cross_entropy, hamburger_loss
  from hamburger_jax.model.llama import causal_segment_mask
  from hamburger_jax.run_config import DistillConfig

  k = model.max_group
  try:
    source = pipeline.open_split(data_dir, split, k)
  except ValueError as e:  # no such split, or segmented for a larger max_group
    raise EvalError(str(e)) from None
  records = [source[i] for i in range(min(limit or len(source), len(source)))]
  round_up = lambda n, m: -(-n // m) * m  # a few static shapes across datasets
  graphdef, params = nnx.split(model)
  skipped = teacher_mismatch(model, data_dir) if "teacher_features" in records[0] else None
  if skipped:
    print(f"warning: no teacher agreement: {skipped}", file=sys.stderr)
  teacher = "teacher_features" in records[0] and skipped is None

  @jax.jit
  def ham_metrics(params, batch):
    # One program for both losses, so that XLA may share their HAMburger forward.
    ham = nnx.merge(graphdef, params)
    return (hamburger_loss(ham, batch)[1],
            distill_loss(ham, batch, DistillConfig())[1] if teacher else {})

  @jax.jit
  def base_sums(params, tokens_bt, lens_b, prompt_lens_b):
    base = nnx.merge(graphdef, params).base
    b, t = tokens_bt.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    segments = (pos < lens_b[:, None]).astype(jnp.int32)
    hidden = base.forward(base.embed(tokens_bt), pos, causal_segment_mask(segments)).hidden
    ce, correct = chunked_cross_entropy(hidden.reshape(b * t, -1), base.head_dv(),
                                        jnp.roll(tokens_bt, -1, axis=1).reshape(-1), 1024,
                                        hidden.dtype)
    # Position t predicts token t + 1: response tokens are predicted from prompt_len - 1 on.
    mask = ((pos >= prompt_lens_b[:, None] - 1) & (pos < lens_b[:, None] - 1)).reshape(-1)
    return jnp.sum(ce * mask), jnp.sum(correct * mask), jnp.sum(mask)

  # HAMburger: packed batches of the training layout; token-weighted sums of the batch means.
  sums: dict[str, float] = collections.defaultdict(float)
  weights: dict[str, float] = collections.defaultdict(float)
  agree_sums: dict[str, float] = collections.defaultdict(float)
  agree_groups: dict[str, int] = collections.defaultdict(int)
  accept_counts: dict[str, float] = collections.defaultdict(float)
  n_batches = -(-len(records) // batch)
  # Packing puts several records in a row, so HAMburger runs fewer batches than the base.
  packed = list(nll_batches(records, k, batch, model.cfg.graft.position_offset))
  bar = tqdm(total=len(packed) + n_batches, desc="nll", unit="batch", file=sys.stderr)
  for b in packed:
    m, t = jax.device_get(ham_metrics(params, b))
    if teacher:
      # Each agree_* is a mean over its own groups (max(count, 1) of them): weight it back.
      for name, n in teacher_agreement_weights(b, k).items():
        agree_sums[name] += float(t[f"agree_{name}"]) * n
        agree_groups[name] += n
      for name, v in t.items():
        if name.startswith("n_tf_"):
          accept_counts[name] += float(v)
    sizes = np.minimum(b["target_size"], k)
    for name, value in m.items():
      if name in ("tokens", "groups"):
        continue
      # acc_s{i}: mean over the groups that have an i-th token; the rest: over all tokens.
      w = float((sizes >= int(name[5:])).sum()) if name.startswith("acc_s") else float(m["tokens"])
      sums[name] += float(value) * w
      weights[name] += w
    bar.update(1)
  ham = {name: sums[name] / max(weights[name], 1.0) for name in sums}

  # Base: one record per row, padded to a fixed length (rows past the records are empty).
  width = round_up(max(len(r["input_ids"]) for r in records), 64)
  ce_sum = correct_sum = count = 0.0
  for i in range(0, len(records), batch):
    chunk = records[i:i + batch]
    tokens = np.zeros((batch, width), np.int32)
    lens, prompt_lens = np.zeros((batch,), np.int32), np.zeros((batch,), np.int32)
    for j, r in enumerate(chunk):
      tokens[j, :len(r["input_ids"])] = r["input_ids"]
      lens[j], prompt_lens[j] = len(r["input_ids"]), r["prompt_len"]
    ce, correct, n = jax.device_get(base_sums(params, tokens, lens, prompt_lens))
    ce_sum, correct_sum, count = ce_sum + float(ce), correct_sum + float(correct), count + float(n)
    bar.update(1)
  bar.close()
  response_tokens = sum(len(r["input_ids"]) - int(r["prompt_len"]) for r in records)
  data_groups = sum(len(r["groups"]) for r in records)
  result = {"metric": "nll", "n": len(records), "split": split, "data": data_dir,
            "tokens": int(count),
            "base": {"score": ce_sum / max(count, 1.0), "accuracy": correct_sum / max(count, 1.0)},
            "hamburger": {"score": ham["lm_loss"],
                          **{name: v for name, v in sorted(ham.items()) if name != "lm_loss"}},
            "data_kv_compression": response_tokens / max(data_groups, 1)}
  if skipped:
    result["teacher_agreement"] = {"skipped": skipped}
  elif teacher:
    # None where no group counts (e.g. data without merged groups), rather than a made-up 0.
    result["teacher_agreement"] = {
        **{name: agree_sums[name] / n if n else None for name, n in agree_groups.items()},
        "groups": dict(agree_groups)}
    # None where nothing was accepted at a confidence: the share is undefined, not 0.
    result["teacher_acceptance"] = {
        name: None if name.startswith("tf_accepted_agree_")
        and not accept_counts["n_tf_accepted_" + name.rsplit("_", 1)[1]] else float(v)
        for name, v in acceptance_metrics(accept_counts).items()}
  return result


# ----------------------------------------------------------------------------- disjointness


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


def prompt_key(ids: Sequence[int], tokenizer) -> str:
  """A comparable form of a templated prompt: its text when there is a tokenizer (so the same
  prompt tokenised two ways still matches), else its ids."""
  return tokenizer.decode(list(ids)) if tokenizer is not None else " ".join(map(str, ids))


def training_prompt_keys(path: str, tokenizer) -> list[str]:
  """Prompt keys of a training set: a tfds directory (split "train") or a JSONL file."""
  from hamburger_jax.data import pipeline, sources
  if os.path.isdir(path):
    split = pipeline.open_split(path, "train")
    return [prompt_key(np.asarray(r["input_ids"])[:int(r["prompt_len"])], tokenizer)
            for r in (split[i] for i in range(len(split)))]
  keys = []
  for conv in sources.jsonl_conversations(path):
    if conv.prompt_ids is not None:
      keys.append(prompt_key(conv.prompt_ids, tokenizer))
    elif tokenizer is None:
      raise EvalError(f"{path} holds text prompts but the model has no tokenizer to compare them")
    else:
      keys.append(prompt_key(tokenizer.encode(tokenizer.apply_chat_template(
          conv.prompt_messages, add_generation_prompt=True, tokenize=False)), tokenizer))
  return keys


def eval_prompt_keys(engine, examples) -> list[str]:
  """Each example's templated prompt, and for reasoning-gym items also the bare question (the
  form of the gsm_symbolic training source)."""
  keys = []
  for ex in examples:
    keys.append(prompt_key(engine.encode_prompt(ex.messages), engine.tokenizer))
    if isinstance(ex.reference, dict) and "question" in ex.reference:
      keys.append(prompt_key(engine.encode_prompt(ex.reference["question"]), engine.tokenizer))
  return keys


# ----------------------------------------------------------------------------- output


def fmt(x: float | None, digits: int = 3) -> str:
  return "-" if x is None or x != x else f"{x:.{digits}f}"


def fmt_ci(x: float | None, ci: Sequence[float] | None, digits: int = 3) -> str:
  """0.525 [0.46, 0.59]: a value and its interval (one digit fewer: it is rougher)."""
  if not ci or any(v is None or v != v for v in ci):
    return fmt(x, digits)
  d = max(digits - 1, 1)
  return f"{fmt(x, digits)} [{ci[0]:.{d}f}, {ci[1]:.{d}f}]"


def markdown(results: dict[str, Any]) -> str:
  cs = results["config"]["confidence"]
  gen_tasks = {n: r for n, r in results["tasks"].items() if r["metric"] != "nll"}
  lines = ["# HAMburger evaluation", "",
           f"Model: base {results['model']['base']}, checkpoint "
           f"{results['model']['checkpoint'] or 'NONE (untrained graft)'}; greedy; "
           f"batches of up to {results['config']['batch']} prompts"
           + (f"; HAMburger groups of at most {results['config']['max_group']} tokens"
              if results["config"].get("max_group") else "")
           + f"; {results['created']}.", "",
           f"`{results['command']}`", ""]
  if gen_tasks:
    head = (["task", "base"] + [f"HAMburger @ {c:g}" for c in cs] +
            [f"KV compression @ {c:g}" for c in cs] + [f"speed ratio @ {c:g}" for c in cs])
    lines += ["Scores: exact match / pass@1 / token match; mt_bench and sharegpt_heldout: ROUGE-L "
              "against the base's own answers (so the base scores 1 by definition); in brackets "
              "the 95% bootstrap interval over the examples. KV compression = generated "
              "tokens / macro steps; speed ratio = HAMburger / base decode tokens/s "
              "(compilation excluded).", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in gen_tasks.items():
      ham = [r["hamburger"][ckey(c)] for c in cs]
      row = ([f"{name} ({r['metric']}, n={r['n']})",
              fmt_ci(r["base"]["score"], r["base"].get("ci95"))] +
             [fmt_ci(h["score"], h.get("ci95")) for h in ham] +
             [f"{h['kv_compression']:.2f}x" for h in ham] +
             [f"{h['speed_ratio']:.2f}x" for h in ham])
      lines.append("| " + " | ".join(row) + " |")
    head = ([f"delta @ {c:g}" for c in cs] + [f"identical @ {c:g}" for c in cs] +
            [f"prefix agreement @ {c:g}" for c in cs])
    lines += ["", "HAMburger against the base on the same examples: delta = HAMburger's score "
              "minus the base's [paired 95% bootstrap interval]; identical = fraction of examples "
              "where HAMburger emits exactly the base's greedy tokens; prefix agreement = mean "
              "share of the base's tokens HAMburger reproduces before its first different one.",
              "", "| task | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for name, r in gen_tasks.items():
      ham = [r["hamburger"][ckey(c)] for c in cs]
      row = ([fmt_ci(h.get("delta"), h.get("delta_ci95")) for h in ham] +
             [fmt(h.get("identical")) for h in ham] + [fmt(h.get("prefix_agreement")) for h in ham])
      lines.append(f"| {name} | " + " | ".join(row) + " |")
    head = [f"{k.replace('_', ' ')} @ {c:g}" for c in cs for k in DIVERGENCE_KINDS]
    lines += ["", "Where HAMburger's answer first leaves the base's (fraction of the examples): at "
              "a micro token (chosen by the micro decoder, accepted by the stop head), or at a "
              "group's first token right after a merged entry, or after a single-token entry "
              "(with merged entries further back).", "",
              "| task | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for name, r in gen_tasks.items():
      row = [fmt(r["hamburger"][ckey(c)].get(f"diverge_{k}")) for c in cs
             for k in DIVERGENCE_KINDS]
      lines.append(f"| {name} | " + " | ".join(row) + " |")
    lines += ["", "Decode tokens/s (whole batches):", "",
              "| task | base | " + " | ".join(f"HAMburger @ {c:g}" for c in cs) + " |",
              "|---|---|" + "---|" * len(cs)]
    for name, r in gen_tasks.items():
      lines.append(f"| {name} | {r['base']['tokens_per_s']:.1f} | " + " | ".join(
          f"{r['hamburger'][ckey(c)]['tokens_per_s']:.1f}" for c in cs) + " |")
  if "nll" in results["tasks"]:
    r = results["tasks"]["nll"]
    h = r["hamburger"]
    accs = sorted((n for n in h if n.startswith("acc_s")), key=lambda n: int(n[5:]))
    lines += ["", f"Teacher-forced NLL on {r['data']} ({r['split']}, {r['n']} records, "
              f"{r['tokens']} response tokens; nats/token, lower is better):", "",
              "| base NLL | HAMburger NLL | base acc | " + " | ".join(accs) +
              " | stop acc | data tokens/group |", "|---|---|---|" + "---|" * (len(accs) + 2),
              f"| {fmt(r['base']['score'])} | {fmt(h['score'])} | "
              f"{fmt(r['base']['accuracy'])} | " + " | ".join(fmt(h[a]) for a in accs) +
              f" | {fmt(h.get('stop_acc'))} | {r['data_kv_compression']:.2f} |"]
    agree = r.get("teacher_agreement")
    if agree and "skipped" in agree:
      lines += ["", f"Teacher agreement: not measured ({agree['skipped']})."]
    elif agree:
      names = [n for n in agree if n != "groups"]
      lines += ["", "Teacher-forced agreement of HAMburger's micro-step argmax with the teacher's "
                "greedy token (the base on the unmerged sequence, stored in the data): merged / "
                "unmerged = the first token of groups predicted from a merged / an unmerged "
                "entry; s_i = micro step i of each group's window (in parentheses: the groups "
                "counted).",
                "", "| " + " | ".join(names) + " |", "|" + "---|" * len(names),
                "| " + " | ".join(f"{fmt(agree[n])} ({agree['groups'][n]})" for n in names) +
                " |"]
    accept = r.get("teacher_acceptance")
    if accept:
      tags = sorted({n.rsplit("_", 1)[1] for n in accept}, key=lambda t: int(t[1:]))
      lines += ["", "Teacher-forced acceptance: what decoding at each confidence would do on "
                "these windows, without generating (tokens per macro step; share of the "
                "accepted micro-step tokens that are the teacher's greedy token).", "",
                "| confidence | " + " | ".join(f"{int(t[1:]) / 100:g}" for t in tags) + " |",
                "|---|" + "---|" * len(tags),
                "| tokens per step | " + " | ".join(
                    fmt(accept[f"tf_tokens_per_step_{t}"]) for t in tags) + " |",
                "| accepted tokens that are the base's | " + " | ".join(
                    fmt(accept[f"tf_accepted_agree_{t}"]) for t in tags) + " |"]
  return "\n".join(lines) + "\n"


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
  from hamburger_jax.evaluation import sandbox

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
    train_keys = training_prompt_keys(args.train_data, tok)
    for name, exs in examples.items():
      try:
        eval_tasks.assert_disjoint(train_keys, eval_prompt_keys(engine, exs))
      except ValueError as e:
        raise EvalError(f"task {name}: {e}") from None
    print(f"checked: no evaluation prompt is among the {len(train_keys)} training prompts of "
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
        results["tasks"][name] = eval_nll(model, args.data, args.split, args.limit, args.batch)
        continue
      max_new = args.max_new_tokens or MAX_NEW_TOKENS[name]
      family: Callable = (eval_mt_bench if name in VS_BASE_TASKS else
                          eval_synthetic if name == "synthetic" else eval_scored_task)
      scored = family(engine, tasks[name], examples[name], args.confidence, max_new, args.batch,
                      args.max_group)
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
