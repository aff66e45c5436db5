"""One accelerator window turned into a graft (`python -m train.window`).

Within a budget of minutes, in order, each part printing one line as it ends:
  load      the run's model (base + a fresh graft, or --init-from an earlier window's export)
  corpus    a token-id corpus (hamburger_jax.data.tokens.corpus), its sources' response tokens
  warm-up   group boundaries of a first slice of the training samples and of the validation ones
  measure   the train step compiled and timed on that slice (tokens/s, MFU)
  profile   two more steps under the profiler: the device's time by operation
  plan      the answers, steps and boundary tokens the rest of the budget holds (window/plan.py)
  answers   the base's own greedy answers to training prompts, hundreds of rows at once, their
            groups from the probabilities it chose them with (hamburger_jax.data.tokens.answers): a
            share of the tokens trained on, mixed with the corpus's responses
  boundaries the pass over the corpus samples the steps will train on
  train     the steps, the teacher in each (hamburger_jax.online_teacher), the learning rate
            fed by the host so the cosine ends at the last step; a line every log_every steps
  export    the graft in files of at most 16 MiB, with the response tokens its lineage saw
  evaluate  teacher-forced on held-out samples: agreement, tokens per step at c = 0.5 and 0.8
  decode    tok/s of the base and HAMburger (c = 0.5, 0.8) at batch 1 and 32
report.md is rewritten after every part, so a window stopped from outside keeps what it did.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Callable

import jax
import numpy as np

from hamburger_jax import graft_checkpoint, peaks
from hamburger_jax.benchmarks.op_profile import profile_calls
from hamburger_jax.benchmarks.timing import time_batches
from hamburger_jax.decode.engine import Engine
from hamburger_jax.data.tokens import boundaries as boundaries_lib
from hamburger_jax.data.tokens.answers import self_distilled_answers
from hamburger_jax.data.tokens.corpus import TokenCorpus, tokenizer_fingerprint
from hamburger_jax.files import write_json_atomic, write_text_atomic
from hamburger_jax.run_config import ConfigError, RunConfig
from hamburger_jax.training.trainer import Trainer, schedules
from hamburger_jax.window import plan as plan_lib
from hamburger_jax.window.stream import RESPONSE_TOKENS, Prefetch, Samples, batches, mix

EXPORT_SHARD_MB = 16  # files come back from a GPU machine at 16 MiB at most
MEASURE_STEPS = 5  # timed after the compiling one
PROFILE_STEPS = 2  # then traced
PROFILE_OPS = 15  # the report's table
ANSWERS_LOG_EVERY = 10  # batches between progress lines
MAX_EPOCHS = 2  # a window may read its corpus twice
VALIDATION_BATCHES = 4
DECODE_BATCHES = (1, 32)
DECODE_PROMPT_TOKENS = 128


@dataclasses.dataclass
class WindowSettings:
  budget_minutes: float
  started: float  # time.monotonic() when the command started: the budget counts from there
  threshold: float = 0.6  # confident:p, the boundaries' rule
  decode_eval: bool = True
  decode_tokens: int = 64
  seed: int = 0
  # The base's own answers: their share of the response tokens trained on (0: the corpus's
  # alone), rows answered at once, and the longest prompt and answer.
  answers_share: float = 0.5
  answer_rows: int = 512
  answer_prompt_tokens: int = 256
  answer_tokens: int = 256


class Report:
  """report.md: a heading per part, rewritten whole after each."""

  def __init__(self, path: str, title: str, log: Callable[[str], None]):
    self.path, self.log = path, log
    self.lines = [f"# {title}", ""]

  def part(self, name: str, lines: list[str]) -> None:
    self.lines += [f"## {name}", "", *lines, ""]
    for line in lines:
      self.log(f"[{name}] {line}")
    write_text_atomic(self.path, "\n".join(self.lines))


class Window:
  """The state of one window's parts (see the module docstring)."""

  def __init__(self, cfg: RunConfig, corpus_dir: str, out_dir: str, work_dir: str,
               settings: WindowSettings, log: Callable[[str], None] = print):
    self.cfg, self.s, self.log = cfg, settings, log
    self.out, self.work = out_dir, work_dir
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(work_dir, exist_ok=True)
    self.deadline = settings.started + 60 * settings.budget_minutes
    longest = settings.answer_prompt_tokens + settings.answer_tokens
    if settings.answers_share and longest > cfg.data.row_tokens:
      raise ConfigError(f"a prompt of {settings.answer_prompt_tokens} tokens and an answer of "
                        f"{settings.answer_tokens} make a sample longer than a row's "
                        f"{cfg.data.row_tokens} tokens (data.tokens): ask for shorter ones")
    self.report = Report(os.path.join(out_dir, "report.md"),
                         f"A window of {settings.budget_minutes:g} minutes on "
                         f"{jax.devices()[0].device_kind}", log)
    self.corpus_dir = corpus_dir
    self.metrics_path = os.path.join(out_dir, "metrics.jsonl")
    self.summary: dict[str, Any] = {"budget_minutes": settings.budget_minutes}
    self._schedules: tuple = (None, None)  # (total steps, schedules(...)) of Window.lr

  def elapsed(self) -> float:
    return time.monotonic() - self.s.started

  # ------------------------------------------------------------------ parts

  def load(self) -> None:
    t = time.monotonic()
    self.trainer = Trainer(self.cfg, host_lr=True)
    if not self.trainer.online_teacher:
      raise ConfigError("a window trains with the teacher in the step: set train.recipe=distill "
                        "and distill.teacher=online in the config")
    self.hcfg = self.trainer.model.cfg
    init = self.cfg.train.init_from
    self.prior_tokens = int(graft_checkpoint.read_meta(init).get("trained_tokens", 0)) \
        if init else 0
    self.peak = peaks.device_peak("bfloat16")
    self.flops = plan_lib.step_flops(self.cfg, self.hcfg)
    self.report.part("load", [
        f"{self.cfg.model.base} + graft ({'from ' + init if init else 'fresh'}; its lineage "
        f"trained on {self.prior_tokens:,} response tokens), {self.cfg.model.dtype} compute, "
        f"{time.monotonic() - t:.1f} s",
        f"rows {self.cfg.data.rows} x {self.cfg.data.row_tokens} tokens ({self.cfg.data.entries} "
        f"entries, {self.cfg.data.groups} groups); {self.flops / 1e9:,.1f} GFLOP a step; peak "
        f"{self.peak.flops / 1e12:,.2f} TFLOP/s ({self.peak.name})"])

  def read_corpus(self) -> None:
    c = TokenCorpus.load(self.corpus_dir)
    tok = self.trainer.tokenizer
    if c.meta["vocab_size"] > self.hcfg.base.vocab_size:
      raise ConfigError(f"the corpus {self.corpus_dir} has ids up to {c.meta['vocab_size']} but "
                        f"the model's vocabulary is {self.hcfg.base.vocab_size}")
    if tok is not None and tokenizer_fingerprint(tok) != c.meta["tokenizer"]:
      raise ConfigError(f"the corpus {self.corpus_dir} was tokenised by another tokenizer "
                        f"({c.meta['tokenizer']}): rebuild it with python -m train.token_corpus")
    self.corpus = c
    self.corpus_samples = len(c.samples)  # the base's answers are numbered after them
    self.samples = Samples(c.tokens, c.samples, c.responses, np.zeros(len(c.tokens), np.uint8))
    rng = np.random.default_rng(self.s.seed)
    self.train_ids = rng.permutation(c.sample_ids("train"))
    self.val_ids = c.sample_ids("validation")
    lines = [f"{name}: {v['samples']:,} samples, {v['response_tokens']:,} response tokens"
             for name, v in c.meta["per_source"].items()]
    self.report.part("corpus", [f"{self.corpus_dir}: {c.meta['tokens']:,} tokens, "
                                f"{c.meta['response_tokens']:,} response tokens", *lines])

  def _boundaries(self, ids: np.ndarray) -> boundaries_lib.BoundaryStats:
    d = self.cfg.data
    rows = max(1, (2 * d.rows * d.entries) // d.row_tokens)  # a pass about two steps' tokens
    s = self.samples
    _, stats = boundaries_lib.boundary_pass(
        self.trainer.model.base, s.tokens, s.samples, s.responses, ids, row_len=d.row_tokens,
        rows_per_pass=rows, max_group=self.cfg.graft.max_group, threshold=self.s.threshold,
        out=s.starts)
    return stats

  def warm_up(self) -> None:
    d = self.cfg.data
    # The compiling, measured and traced steps' tokens, thrice (rows are not packed full).
    need = 3 * (1 + MEASURE_STEPS + PROFILE_STEPS) * d.rows * d.row_tokens
    lengths = np.cumsum(self.samples.lengths(self.train_ids))
    n = int(np.searchsorted(lengths, need)) + 1
    self.warm_ids, self.train_ids = self.train_ids[:n], self.train_ids[n:]
    self.val_ids = self.val_ids[:VALIDATION_BATCHES * d.rows * 4]
    stats = self._boundaries(np.concatenate([self.warm_ids, self.val_ids]))
    self.boundary_rate = stats.tokens_per_s if stats.seconds > 0 else \
        plan_lib.ASSUMED_BOUNDARY_TOKENS_PER_S
    self.report.part("warm-up", [
        f"boundaries of {len(self.warm_ids):,} training and {len(self.val_ids):,} validation "
        f"samples: {stats.tokens:,} tokens, {stats.passes} passes, compile "
        f"{stats.compile_seconds:.1f} s, then {self.boundary_rate:,.0f} tokens/s; mean group "
        f"{stats.mean_group:.2f} at confident:{self.s.threshold}"])

  def lr(self, step: int, total: int) -> dict[str, float]:
    """Each group's learning rate at `step` of a schedule of `total` steps (built once a total:
    the training loop asks every step)."""
    if self._schedules[0] != total:
      cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(
          self.cfg.train, steps=max(total, self.cfg.train.warmup_steps, 1)))
      self._schedules = (total, schedules(cfg))
    return {name: float(f(step)) for name, f in self._schedules[1].items()}

  def measure(self) -> None:
    self._warm = it = batches(self.samples, self.warm_ids, self.cfg, [])
    t = time.monotonic()
    first = next(it)
    self.tokens_trained = first.pop(RESPONSE_TOKENS)
    jax.block_until_ready(self.trainer.step_async([first], self.lr(0, self.cfg.train.steps)))
    compile_s = time.monotonic() - t
    timed = [next(it) for _ in range(MEASURE_STEPS)]
    resp = [b.pop(RESPONSE_TOKENS) for b in timed]
    tokens = [int((b["token_segment"] > 0).sum()) for b in timed]
    t = time.monotonic()
    for i, b in enumerate(timed, start=1):
      m = self.trainer.step_async([b], self.lr(i, self.cfg.train.steps))
    jax.block_until_ready(m)
    step_s = (time.monotonic() - t) / MEASURE_STEPS
    self.tokens_trained += sum(resp)
    self.steps_done = 1 + MEASURE_STEPS
    self.rates = plan_lib.Rates(step_s=step_s, tokens_per_step=float(np.mean(tokens)),
                                response_per_step=float(np.mean(resp)),
                                boundary_tokens_per_s=self.boundary_rate, compile_s=compile_s)
    mfu = peaks.mfu(self.flops, step_s, self.peak)
    self.summary.update(step_s=step_s, mfu=mfu, compile_s=compile_s)
    self.report.part("measure", [
        f"compile and first step {compile_s:.1f} s; then {step_s * 1e3:.1f} ms a step, "
        f"{np.mean(resp) / step_s:,.0f} response tokens/s, MFU {mfu:.1%} (padded rows; "
        f"{np.mean(tokens) / (self.cfg.data.rows * self.cfg.data.row_tokens):.0%} of row tokens "
        "used)"])

  def _plan(self, to_answer: bool, share: float | None = None) -> plan_lib.Plan:
    left = self.deadline - time.monotonic()
    available = MAX_EPOCHS * int(self.samples.lengths(self.train_ids).sum())
    return plan_lib.make_plan(left, self.rates, available,
                              plan_lib.reserve_s(self.s.decode_eval, self.rates.compile_s),
                              self.s.answers_share if share is None else share, to_answer)

  def profile(self) -> None:
    """Steps (they train) traced by the profiler; a profiler that fails is reported, and the
    window goes on."""
    todo = [b for b in (next(self._warm, None) for _ in range(PROFILE_STEPS)) if b is not None]
    if not todo:
      self.report.part("profile", ["no warm-up batch left to trace"])
      return
    n = len(todo)

    def step():
      b = todo.pop(0)
      self.tokens_trained += b.pop(RESPONSE_TOKENS)
      self.steps_done += 1
      return self.trainer.step_async([b], self.lr(self.steps_done - 1, self.cfg.train.steps))

    try:
      prof = profile_calls(step, n, os.path.join(self.work, "profile"))
    except Exception as e:  # pylint: disable=broad-except
      self.report.part("profile", [f"the profiler failed ({type(e).__name__}: {e}); "
                                   "nothing traced"])
      return
    self.summary["profile"] = {"where": prof.where, "step_ms": 1e3 * prof.wall_s / n,
                               "ops_ms": {o.name: 1e3 * o.seconds / n
                                          for o in prof.ops[:PROFILE_OPS]}}
    self.report.part("profile", prof.lines(PROFILE_OPS))

  def make_plan(self) -> None:
    self.plan = self._plan(to_answer=True)
    self.summary["plan"] = dataclasses.asdict(self.plan)
    self.report.part("plan", self.plan.lines(self.rates, self.steps_done))

  def _prompts(self):
    for i in self.train_ids:
      yield self.samples.prompt(int(i))

  def _answers_progress(self, st) -> None:
    if st.batches % ANSWERS_LOG_EVERY == 0:
      self.log(f"answers: {st.batches} batches, {st.prompts:,} answers, {st.tokens:,} tokens, "
               f"{st.tokens_per_s:,.0f} tokens/s after the first batch")

  def answers(self) -> None:
    """The base's own answers to the first training samples' prompts, for the plan's seconds;
    then the training ids mix them with corpus samples at the share asked."""
    s = self.s
    if not self.plan.answer_tokens:
      self.report.part("answers", [f"none (answers share {s.answers_share:g})"])
      return
    tok = self.trainer.tokenizer
    answers, st = self_distilled_answers(
        self.trainer.model.base, self._prompts(), rows=s.answer_rows,
        prompt_len=s.answer_prompt_tokens, max_new=s.answer_tokens,
        stop_ids=tok.stop_ids if tok is not None else (), max_group=self.cfg.graft.max_group,
        threshold=s.threshold, deadline=time.monotonic() + self.plan.answer_s,
        progress=self._answers_progress)
    n0 = len(self.samples.samples)
    self.samples = self.samples.extended(answers.tokens, answers.samples, answers.responses,
                                         answers.starts)
    self.train_ids = mix(np.arange(n0, n0 + len(answers.samples)), self.train_ids, self.samples,
                         s.answers_share, np.random.default_rng(s.seed + 1))
    # The steps for the time left, the boundary pass reading the corpus samples among them: the
    # answers made hold their share of the tokens, or less if fewer were made than planned.
    trained = self._plan(to_answer=False, share=0.0).response_tokens
    self.plan = self._plan(to_answer=False,
                           share=min(s.answers_share, st.tokens / max(trained, 1)))
    self.summary.update(answers=dataclasses.asdict(st), answer_tokens_per_s=st.tokens_per_s)
    self.report.part("answers", [
        f"{st.prompts:,} answers of at most {s.answer_tokens} tokens to prompts of at most "
        f"{s.answer_prompt_tokens} ({st.skipped:,} longer skipped), {s.answer_rows} rows at "
        f"once: {st.tokens:,} tokens, {st.ended:,} ended by a stop token; mean group "
        f"{st.mean_group:.2f} at confident:{s.threshold}",
        f"{st.batches} batches: the first (compiling) {st.compile_seconds:.1f} s, then "
        f"{st.tokens_per_s:,.0f} tokens/s; ended by the {st.stopped_by}",
        "training re-planned: " + self.plan.lines(self.rates, self.steps_done)[-2].strip()])

  def boundaries(self) -> None:
    lengths = np.cumsum(self.samples.lengths(self.train_ids))
    # A little more than planned: packing's lookahead, and rows not quite full.
    n = int(np.searchsorted(lengths, 1.1 * self.plan.steps * self.rates.tokens_per_step)) + 1
    n = min(n, len(self.train_ids)) if self.plan.steps else 0
    self.epoch_ids = self.train_ids[:n]
    # The base's answers came with their groups.
    corpus = self.epoch_ids[self.epoch_ids < self.corpus_samples]
    stats = self._boundaries(corpus) if len(corpus) else boundaries_lib.BoundaryStats()
    self.summary["boundaries_tokens_per_s"] = stats.tokens_per_s
    self.report.part("boundaries", [
        f"{len(corpus):,} corpus samples of {len(self.epoch_ids):,}, {stats.tokens:,} tokens in "
        f"{stats.compile_seconds + stats.seconds:.1f} s ({stats.tokens_per_s:,.0f} tokens/s "
        f"after the first pass), mean group {stats.mean_group:.2f}"])

  def _epochs(self):
    for epoch in range(MAX_EPOCHS):
      yield from batches(self.samples, self.epoch_ids, self.cfg,
                         self.left_out if epoch == 0 else [])

  def train(self) -> None:
    total = self.steps_done + self.plan.steps
    stop_at = self.deadline - self.plan.reserve_s
    every = self.cfg.train.log_every
    self.left_out: list = []  # samples larger than a row (data.groups), left out
    stream = Prefetch(self._epochs())
    t0, tok0, step0 = time.monotonic(), self.tokens_trained, self.steps_done
    mark = (t0, self.tokens_trained, self.steps_done)
    ended = "the plan's last step"
    try:
      with open(self.metrics_path, "a", encoding="utf-8") as f:
        for step in range(self.steps_done, total):
          if time.monotonic() > stop_at:
            ended = "the clock (the budget's reserve reached)"
            break
          batch = next(stream, None)
          if batch is None:
            ended = "the data"
            break
          self.tokens_trained += batch.pop(RESPONSE_TOKENS)
          metrics = self.trainer.step_async([batch], self.lr(step, total))
          self.steps_done = step + 1
          if self.steps_done % every == 0 or self.steps_done == total:
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.monotonic()
            dt = now - mark[0]
            m.update(step=self.steps_done, response_tokens=self.tokens_trained,
                     tokens_per_s=(self.tokens_trained - mark[1]) / dt,
                     mfu=peaks.mfu(self.flops, dt / (self.steps_done - mark[2]), self.peak))
            mark = (now, self.tokens_trained, self.steps_done)
            f.write(json.dumps(m) + "\n")
            f.flush()
            self.log(f"step {self.steps_done}/{total}  loss {m['loss']:.3f}  kl {m['kl']:.3f}  "
                     f"agree merged {m.get('agree_merged', float('nan')):.3f}  tokens/step "
                     f"c0.5 {m['tf_tokens_per_step_c50']:.2f} c0.8 {m['tf_tokens_per_step_c80']:.2f}"
                     f"  {m['tokens_per_s']:,.0f} tokens/s  MFU {m['mfu']:.1%}")
        jax.block_until_ready(self.trainer.state.step)
    finally:
      stream.close()
    dt = time.monotonic() - t0
    steps = self.steps_done - step0
    self.summary.update(steps=self.steps_done, response_tokens=self.tokens_trained)
    rate = ""
    if steps:
      tps = (self.tokens_trained - tok0) / dt
      mfu = peaks.mfu(self.flops, dt / steps, self.peak)
      self.summary.update(train_tokens_per_s=tps, train_mfu=mfu)
      rate = f"; {tps:,.0f} tokens/s and MFU {mfu:.1%} over {dt:.0f} s"
    skipped = ""
    if self.left_out:
      skipped = (f"; {len(self.left_out)} samples larger than a row left out "
                 f"({sum(s.response_tokens for s in self.left_out):,} response tokens)")
    self.report.part("train", [
        f"{self.steps_done} steps ({steps} after measuring, ended by {ended}), "
        f"{self.tokens_trained:,} response tokens{rate}{skipped}"])

  def export(self) -> str:
    path = os.path.join(self.out, "export")
    self.model = self.trainer.current_model()
    lineage = self.prior_tokens + self.tokens_trained
    graft_checkpoint.save_graft(
        self.model, path, self.cfg.model.base, dtype=self.cfg.checkpoint.export_dtype,
        max_shard_mb=EXPORT_SHARD_MB,
        extra={"trained_tokens": lineage, "window": {
            "steps": self.steps_done, "response_tokens": self.tokens_trained,
            "init_from": self.cfg.train.init_from or None, "corpus": self.corpus.meta["tokenizer"],
            "device": jax.devices()[0].device_kind}})
    lines = []
    for name in sorted(os.listdir(path)):
      with open(os.path.join(path, name), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
      lines.append(f"`{name}` {os.path.getsize(os.path.join(path, name)):,} bytes, sha256 "
                   f"{digest}")
    self.summary.update(export=path, trained_tokens=lineage)
    self.report.part("export", [f"{path}: trained_tokens {lineage:,} (this window "
                                f"{self.tokens_trained:,})", *lines])
    return path

  def evaluate(self) -> None:
    val = list(batches(self.samples, self.val_ids, self.cfg, []))
    for b in val:
      b.pop(RESPONSE_TOKENS)
    t = time.monotonic()
    m = self.trainer.evaluate(iter(val), VALIDATION_BATCHES)
    keep = ("val_kl", "val_agree_s1", "val_agree_s2", "val_agree_merged",
            "val_tf_tokens_per_step_c50", "val_tf_accepted_agree_c50",
            "val_tf_tokens_per_step_c80", "val_tf_accepted_agree_c80")
    self.summary["evaluation"] = {k: m[k] for k in keep if k in m}
    self.report.part("evaluate", [
        f"teacher-forced on {min(len(val), VALIDATION_BATCHES)} batches of held-out samples "
        f"({time.monotonic() - t:.1f} s):",
        "", "| metric | value |", "|---|---|",
        *(f"| {k} | {m[k]:.4f} |" for k in keep if k in m)])

  def decode(self) -> None:
    # Without prefix caching, and prompts of one prefill plan: the engine compiles one prefill
    # program and the decode loops per layout (with prompts of every length it compiled a
    # prefill program per chunk size, and prefix programs: most of this part's minutes).
    engine = Engine(self.model, self.trainer.tokenizer, stop_ids=(), prefix_cache_tokens=0)
    by_plan: dict[tuple, list] = {}
    for i in self.val_ids:
      ids = self.samples.prompt(int(i)).tolist()
      if 0 < len(ids) <= DECODE_PROMPT_TOKENS:
        by_plan.setdefault(tuple(c for *_, c in engine.prompt_plan(ids)[1]), []).append(ids)
    if not by_plan:
      self.report.part("decode", ["no held-out prompt is short enough: skipped"])
      return
    prompts = max(by_plan.values(), key=len)
    n = self.s.decode_tokens
    runs = {"base": {"mode": "base"},
            **{f"c{c}": {"mode": "hamburger", "confidence": c} for c in (0.5, 0.8)}}
    lines = [f"{engine.dtype} decoding, {n} new tokens a row (end of turn ignored), held-out "
             "prompts; tok/s over the batch's decode (prefills excluded)", "",
             "| batch | base tok/s | c = 0.5 tok/s | vs base | c = 0.8 tok/s | vs base |",
             "|---|---|---|---|---|---|"]
    rows = {}
    t = time.monotonic()
    for b in DECODE_BATCHES:
      ids = (prompts * (b // len(prompts) + 1))[:b]
      tps = {k: v.tokens_per_s for k, v in time_batches(engine, ids, n, 2, runs).items()}
      rows[b] = tps
      lines.append(f"| {b} | {tps['base']:,.0f} | {tps['c0.5']:,.0f} | "
                   f"{tps['c0.5'] / tps['base']:.2f}x | {tps['c0.8']:,.0f} | "
                   f"{tps['c0.8'] / tps['base']:.2f}x |")
    self.summary["decode"] = rows
    lines += ["", f"{len(prompts)} distinct prompts of one prefill plan; {engine.compilations} "
              f"programs compiled; {time.monotonic() - t:.0f} s in all"]
    self.report.part("decode", lines)

  def finish(self) -> None:
    self.summary["seconds"] = self.elapsed()
    write_json_atomic(os.path.join(self.out, "summary.json"), self.summary, indent=1,
                      sort_keys=True)
    self.report.part("done", [f"{self.elapsed():.0f} s of {60 * self.s.budget_minutes:.0f}"])


def run_window(cfg: RunConfig, corpus_dir: str, out_dir: str, work_dir: str,
               settings: WindowSettings, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Runs every part of a window (module docstring); returns its summary (summary.json)."""
  w = Window(cfg, corpus_dir, out_dir, work_dir, settings, log)
  for part in (w.load, w.read_corpus, w.warm_up, w.measure, w.profile, w.make_plan, w.answers,
               w.boundaries, w.train, w.export, w.evaluate):
    part()
  if settings.decode_eval:
    if time.monotonic() + plan_lib.DECODE_COMPILES * w.rates.compile_s < w.deadline + 30:
      w.decode()
    else:
      w.report.part("decode", ["skipped: too little of the budget left"])
  w.finish()
  return w.summary
