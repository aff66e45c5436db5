"""A window's first parts: load the run, read the corpus, warm up (boundaries of a first slice),
measure and profile the train step, plan the rest of the budget."""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np

from hamburger_jax import graft_checkpoint
from hamburger_jax.costs import peaks
from hamburger_jax.benchmarks.op_profile import profile_calls
from hamburger_jax.data.tokens import answer_files
from hamburger_jax.data.tokens import boundaries as boundaries_lib
from hamburger_jax.data.tokens.corpus import TokenCorpus, tokenizer_fingerprint
from hamburger_jax.run_config import ConfigError, RunConfig
from hamburger_jax.training.trainer import Trainer, schedules
from hamburger_jax.window import plan as plan_lib
from hamburger_jax.window.state import Data, Progress, Report, Run, Settings
from hamburger_jax.window.stream import RESPONSE_TOKENS, Samples, batches

MEASURE_STEPS = 5  # timed after the compiling one
PROFILE_STEPS = 2  # then traced
PROFILE_OPS = 15  # the report's table
MAX_EPOCHS = 2  # a window may read its corpus twice
VALIDATION_BATCHES = 4


class HostLr:
  """Each group's learning rate at a step of a schedule of `total` steps, fed by the host so a
  window fixes its schedule after measuring (built once per total: asked every step)."""

  def __init__(self, cfg: RunConfig):
    self.cfg, self._total, self._schedules = cfg, None, None

  def __call__(self, step: int, total: int) -> dict[str, float]:
    if self._total != total:
      cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(
          self.cfg.train, steps=max(total, self.cfg.train.warmup_steps, 1)))
      self._total, self._schedules = total, schedules(cfg)
    return {name: float(f(step)) for name, f in self._schedules.items()}


def check_settings(cfg: RunConfig, s: Settings) -> None:
  longest = s.answer_prompt_tokens + s.answer_tokens
  if s.answers_share and longest > cfg.data.row_tokens:
    raise ConfigError(f"a prompt of {s.answer_prompt_tokens} tokens and an answer of "
                      f"{s.answer_tokens} make a sample longer than a row's "
                      f"{cfg.data.row_tokens} tokens (data.tokens): ask for shorter ones")


def load(cfg: RunConfig, s: Settings, out: str, work: str, log) -> Run:
  t = time.monotonic()
  check_settings(cfg, s)
  os.makedirs(out, exist_ok=True)
  os.makedirs(work, exist_ok=True)
  report = Report(os.path.join(out, "report.md"),
                  f"A window of {s.budget_minutes:g} minutes on {jax.devices()[0].device_kind}",
                  log)
  trainer = Trainer(cfg, host_lr=True)
  if not trainer.online_teacher:
    raise ConfigError("a window trains with the teacher in the step: set train.recipe=distill "
                      "and distill.teacher=online in the config")
  init = cfg.train.init_from
  prior = int(graft_checkpoint.read_meta(init).get("trained_tokens", 0)) if init else 0
  run = Run(cfg, s, out, work, report, {"budget_minutes": s.budget_minutes}, trainer, prior,
            peaks.device_peak("bfloat16"), plan_lib.step_flops(cfg, trainer.model.cfg), log)
  d = cfg.data
  report.part("load", [
      f"{cfg.model.base} + graft ({'from ' + init if init else 'fresh'}; its lineage trained on "
      f"{prior:,} response tokens), {cfg.model.dtype} compute, {time.monotonic() - t:.1f} s",
      f"rows {d.rows} x {d.row_tokens} tokens ({d.entries} entries, {d.groups} groups); "
      f"{run.flops / 1e9:,.1f} GFLOP a step; peak {run.peak.flops / 1e12:,.2f} TFLOP/s "
      f"({run.peak.name})",
      f"packed attention: {trainer.attention}'s kernel (model.attention={cfg.model.attention}"
      f"{'; ' + trainer.attention_note if trainer.attention_note else ''})"])
  return run


def read_corpus(run: Run, corpus_dir: str) -> Data:
  """The corpus's samples, then the answers earlier windows made (Settings.answers_in)."""
  c = TokenCorpus.load(corpus_dir)
  tok, vocab = run.trainer.tokenizer, run.trainer.model.cfg.base.vocab_size
  if c.meta["vocab_size"] > vocab:
    raise ConfigError(f"the corpus {corpus_dir} has ids up to {c.meta['vocab_size']} but the "
                      f"model's vocabulary is {vocab}")
  if tok is not None and tokenizer_fingerprint(tok) != c.meta["tokenizer"]:
    raise ConfigError(f"the corpus {corpus_dir} was tokenised by another tokenizer "
                      f"({c.meta['tokenizer']}): rebuild it with python -m train.token_corpus")
  samples = Samples(c.tokens, c.samples, c.responses, np.zeros(len(c.tokens), np.uint8))
  n = len(c.samples)
  rng = np.random.default_rng(run.s.seed)
  train_ids = rng.permutation(c.sample_ids("train"))
  lines = [f"{corpus_dir}: {c.meta['tokens']:,} tokens, {c.meta['response_tokens']:,} "
           "response tokens",
           *(f"{name}: {v['samples']:,} samples, {v['response_tokens']:,} response tokens"
             for name, v in c.meta["per_source"].items())]
  carried, answered = np.zeros(0, np.int64), frozenset()
  fingerprint = answer_files.corpus_fingerprint(c.tokens, c.samples, c.responses)
  if run.s.answers_in:
    a, prompts = answer_files.load(run.s.answers_in, vocab_size=vocab,
                                   tokenizer=c.meta["tokenizer"], corpus=fingerprint)
    samples = samples.extended(a.tokens, a.samples, a.responses, a.starts)
    carried = np.arange(n, n + len(a.samples))
    answered = frozenset(int(i) for i in prompts)
    lines.append(f"answers of earlier windows ({', '.join(run.s.answers_in)}): "
                 f"{len(a.samples):,} samples, "
                 f"{int((a.responses[:, 2] - a.responses[:, 1]).sum()):,} response tokens")
  run.report.part("corpus", lines)
  return Data(samples, n, train_ids, c.sample_ids("validation"), c.meta, answered, carried,
              fingerprint)


def run_boundaries(run: Run, data: Data, ids: np.ndarray) -> boundaries_lib.BoundaryStats:
  """Group starts of the samples `ids`, written into data.samples.starts."""
  d = run.cfg.data
  rows = max(1, (2 * d.rows * d.entries) // d.row_tokens)  # a pass about two steps' tokens
  s = data.samples
  _, stats = boundaries_lib.boundary_pass(
      run.trainer.model.base, s.tokens, s.samples, s.responses, ids, row_len=d.row_tokens,
      rows_per_pass=rows, max_group=run.cfg.graft.max_group, threshold=run.s.threshold,
      out=s.starts)
  return stats


def warm_up(run: Run, data: Data) -> tuple[Data, np.ndarray, float]:
  """Boundaries of a first slice of the training samples (the measured steps') and of the
  validation ones: (data without that slice, the slice, the boundary pass's tokens/s)."""
  d = run.cfg.data
  # The compiling, measured and traced steps' tokens, thrice (rows are not packed full).
  need = 3 * (1 + MEASURE_STEPS + PROFILE_STEPS) * d.rows * d.row_tokens
  n = int(np.searchsorted(np.cumsum(data.samples.lengths(data.train_ids)), need)) + 1
  warm = data.train_ids[:n]
  data = dataclasses.replace(data, train_ids=data.train_ids[n:],
                             val_ids=data.val_ids[:VALIDATION_BATCHES * d.rows * 4])
  stats = run_boundaries(run, data, np.concatenate([warm, data.val_ids]))
  rate = stats.tokens_per_s if stats.seconds > 0 else plan_lib.ASSUMED_BOUNDARY_TOKENS_PER_S
  run.report.part("warm-up", [
      f"boundaries of {len(warm):,} training and {len(data.val_ids):,} validation samples: "
      f"{stats.tokens:,} tokens, {stats.passes} passes, compile {stats.compile_seconds:.1f} s, "
      f"then {rate:,.0f} tokens/s; mean group {stats.mean_group:.2f} at "
      f"confident:{run.s.threshold}"])
  return data, warm, rate


def measure(run: Run, data: Data, warm: np.ndarray, boundary_rate: float, lr: HostLr
            ) -> tuple[Progress, list]:
  """The train step compiled and timed on the warm-up slice; returns the progress and the
  slice's batches left (for the profile)."""
  cfg, trainer = run.cfg, run.trainer
  it = batches(data.samples, warm, cfg, [])
  t = time.monotonic()
  first = next(it)
  tokens_trained = first.pop(RESPONSE_TOKENS)
  jax.block_until_ready(trainer.step_async([first], lr(0, cfg.train.steps)))
  compile_s = time.monotonic() - t
  timed = [next(it) for _ in range(MEASURE_STEPS)]
  resp = [b.pop(RESPONSE_TOKENS) for b in timed]
  tokens = [int((b["token_segment"] > 0).sum()) for b in timed]
  t = time.monotonic()
  for i, b in enumerate(timed, start=1):
    m = trainer.step_async([b], lr(i, cfg.train.steps))
  jax.block_until_ready(m)
  step_s = (time.monotonic() - t) / MEASURE_STEPS
  rates = plan_lib.Rates(step_s=step_s, tokens_per_step=float(np.mean(tokens)),
                         response_per_step=float(np.mean(resp)),
                         boundary_tokens_per_s=boundary_rate, compile_s=compile_s)
  mfu = peaks.mfu(run.flops, step_s, run.peak)
  run.summary.update(step_s=step_s, mfu=mfu, compile_s=compile_s)
  run.report.part("measure", [
      f"compile and first step {compile_s:.1f} s; then {step_s * 1e3:.1f} ms a step, "
      f"{np.mean(resp) / step_s:,.0f} response tokens/s, MFU {mfu:.1%} (padded rows; "
      f"{np.mean(tokens) / (cfg.data.rows * cfg.data.row_tokens):.0%} of row tokens used)"])
  left = [b for b in (next(it, None) for _ in range(PROFILE_STEPS)) if b is not None]
  return Progress(1 + MEASURE_STEPS, tokens_trained + sum(resp), rates), left


def profile(run: Run, progress: Progress, todo: list, lr: HostLr) -> Progress:
  """Steps (they train) traced by the profiler; a profiler that fails is reported, and the
  window goes on."""
  if not todo:
    run.report.part("profile", ["no warm-up batch left to trace"])
    return progress
  n, done = len(todo), [progress.steps, progress.tokens]

  def step():
    b = todo.pop(0)
    done[1] += b.pop(RESPONSE_TOKENS)
    done[0] += 1
    return run.trainer.step_async([b], lr(done[0] - 1, run.cfg.train.steps))

  try:
    prof = profile_calls(step, n, os.path.join(run.work, "profile"))
  except Exception as e:  # pylint: disable=broad-except
    run.report.part("profile", [f"the profiler failed ({type(e).__name__}: {e}); nothing "
                                "traced"])
    return dataclasses.replace(progress, steps=done[0], tokens=done[1])
  run.summary["profile"] = {"where": prof.where, "step_ms": 1e3 * prof.wall_s / n,
                            "ops_ms": {o.name: 1e3 * o.seconds / n
                                       for o in prof.ops[:PROFILE_OPS]}}
  run.report.part("profile", prof.lines(PROFILE_OPS))
  return dataclasses.replace(progress, steps=done[0], tokens=done[1])


def plan(run: Run, data: Data, rates: plan_lib.Rates, to_answer: bool,
         share: float | None = None) -> plan_lib.Plan:
  """The steps (and answers) that fit the time left, keeping for the judge of each trained
  graft what the init's judge took without its compiles (it was judged before: its time is
  spent), and for each arm its start (plan_lib.arms_start_s)."""
  left = run.s.deadline - time.monotonic()
  available = MAX_EPOCHS * int(data.samples.lengths(data.train_ids).sum())
  rates = plan_lib.with_judge(rates, run.summary)
  items = run.summary.get("judge", {}).get("suite", {}).get("items", 0)
  judge_s = plan_lib.judge_s(rates, items, max(len(run.s.arms), 1), init=False)
  return plan_lib.make_plan(left, rates, available,
                            plan_lib.reserve_s(run.s.decode_eval, rates.compile_s),
                            run.s.answers_share if share is None else share, to_answer,
                            judge=judge_s, start=plan_lib.arms_start_s(run.s.arms, rates))
