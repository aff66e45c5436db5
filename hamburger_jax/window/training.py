"""A window's data and training parts: the base's own answers (made there, kept as files for the
next window), the boundary pass over the corpus samples to train on, and the steps, through the
training loop's host-fed stepping (training/loop.hosted_steps), for each arm."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from hamburger_jax.data.tokens import answer_files
from hamburger_jax.data.tokens import boundaries as boundaries_lib
from hamburger_jax.data.tokens.answers import self_distilled_answers
from hamburger_jax.training.loop import MetricsLog, hosted_steps
from hamburger_jax.training.trainer import TrainState
from hamburger_jax.window import plan as plan_lib
from hamburger_jax.window.setup import MAX_EPOCHS, HostLr, plan, run_boundaries
from hamburger_jax.window.state import Data, Progress, Run
from hamburger_jax.window.stream import RESPONSE_TOKENS, Prefetch, batches, mix

ANSWERS_LOG_EVERY = 10  # batches between progress lines
ANSWERS_DIR = "answers"  # in --out: the answers made, for the next window (--answers-in)


def _answerable(run: Run, data: Data) -> tuple[list[int], Iterator[np.ndarray]]:
  """The training samples whose prompts the answers program takes, in training order, and not
  answered by an earlier window; their ids are recorded as the program consumes them."""
  taken: list[int] = []

  def prompts():
    for i in data.train_ids:
      i = int(i)
      if i >= data.corpus_samples or i in data.answered:
        continue
      p = data.samples.prompt(i)
      if 0 < len(p) <= run.s.answer_prompt_tokens:
        taken.append(i)
        yield p

  return taken, prompts()


def answers(run: Run, data: Data, p: plan_lib.Plan, rates: plan_lib.Rates
            ) -> tuple[Data, plan_lib.Plan]:
  """The base's own answers to training prompts for the plan's seconds, written to OUT/answers/;
  then the training order mixes them (and the earlier windows' answers) with corpus samples at
  the share asked, and the steps are planned again for the time left."""
  s = run.s
  carried = data.carried_answers
  if not p.answer_tokens:
    if not len(carried):
      run.report.part("answers", [f"none (answers share {s.answers_share:g})"])
      return data, p
    made_ids, st = np.zeros(0, np.int64), None
  else:
    tok = run.trainer.tokenizer

    def log(st) -> None:
      if st.batches % ANSWERS_LOG_EVERY == 0:
        run.log(f"answers: {st.batches} batches, {st.prompts:,} answers, {st.tokens:,} tokens, "
                f"{st.tokens_per_s:,.0f} tokens/s after the first batch")

    taken, prompts = _answerable(run, data)
    made, st = self_distilled_answers(
        run.trainer.model.base, prompts, rows=s.answer_rows, prompt_len=s.answer_prompt_tokens,
        max_new=s.answer_tokens, stop_ids=tok.stop_ids if tok is not None else (),
        max_group=run.cfg.graft.max_group, threshold=s.threshold,
        deadline=time.monotonic() + p.answer_s, progress=log)
    written = answer_files.save(made, taken[:len(made.samples)],
                                os.path.join(run.out, ANSWERS_DIR),
                                vocab_size=run.trainer.model.cfg.base.vocab_size,
                                tokenizer=data.corpus_meta.get("tokenizer"),
                                corpus=data.corpus_fingerprint)
    n0 = len(data.samples.samples)
    data = dataclasses.replace(data, samples=data.samples.extended(
        made.tokens, made.samples, made.responses, made.starts))
    made_ids = np.arange(n0, n0 + len(made.samples))
    run.summary.update(answers=dataclasses.asdict(st), answer_tokens_per_s=st.tokens_per_s,
                       answer_files=[os.path.basename(w) for w in written])
  answer_ids = np.concatenate([made_ids, carried])
  corpus_ids = data.train_ids[data.train_ids < data.corpus_samples]
  data = dataclasses.replace(data, train_ids=mix(answer_ids, corpus_ids, data.samples,
                                                 s.answers_share,
                                                 np.random.default_rng(s.seed + 1)))
  # The steps for the time left, the boundary pass reading the corpus samples among them: the
  # answers hold their share of the tokens, or less if fewer were made than planned.
  have = int(data.samples.response_lengths(answer_ids).sum())
  trained = plan(run, data, rates, to_answer=False, share=0.0).response_tokens
  p = plan(run, data, rates, to_answer=False, share=min(s.answers_share, have / max(trained, 1)))
  lines = [f"answers of earlier windows: {len(carried):,} samples"] if len(carried) else []
  if st is not None:
    lines = [
        f"{st.prompts:,} answers of at most {s.answer_tokens} tokens to prompts of at most "
        f"{s.answer_prompt_tokens} ({st.skipped:,} longer skipped), {s.answer_rows} rows at "
        f"once: {st.tokens:,} tokens, {st.ended:,} ended by a stop token; mean group "
        f"{st.mean_group:.2f} at confident:{s.threshold}",
        f"{st.batches} batches: the first (compiling) {st.compile_seconds:.1f} s, then "
        f"{st.tokens_per_s:,.0f} tokens/s; ended by the {st.stopped_by}",
        f"kept for the next window (--answers-in): {ANSWERS_DIR}/ "
        f"({', '.join(run.summary['answer_files'])})", *lines]
  run.report.part("answers", [
      *lines, f"answers' share of the response tokens to train on: "
      f"{min(s.answers_share, have / max(trained, 1)):.0%}",
      "training re-planned: " + p.lines(rates)[-2].strip()])
  return data, p


def boundaries(run: Run, data: Data, p: plan_lib.Plan, rates: plan_lib.Rates) -> np.ndarray:
  """The samples the steps will read (a little more than planned: packing's lookahead, rows not
  quite full), their corpus samples' group starts computed; the answers came with theirs."""
  lengths = np.cumsum(data.samples.lengths(data.train_ids))
  per_arm = p.steps // max(len(run.s.arms), 1)
  n = int(np.searchsorted(lengths, 1.1 * per_arm * rates.tokens_per_step)) + 1
  epoch_ids = data.train_ids[:min(n, len(data.train_ids)) if per_arm else 0]
  corpus = epoch_ids[epoch_ids < data.corpus_samples]
  stats = run_boundaries(run, data, corpus) if len(corpus) else boundaries_lib.BoundaryStats()
  run.summary["boundaries_tokens_per_s"] = stats.tokens_per_s
  run.report.part("boundaries", [
      f"{len(corpus):,} corpus samples of {len(epoch_ids):,}, {stats.tokens:,} tokens in "
      f"{stats.compile_seconds + stats.seconds:.1f} s ({stats.tokens_per_s:,.0f} tokens/s after "
      f"the first pass), mean group {stats.mean_group:.2f}"])
  return epoch_ids


def _epochs(run: Run, data: Data, epoch_ids: np.ndarray, left_out: list):
  for epoch in range(MAX_EPOCHS):
    for b in batches(data.samples, epoch_ids, run.cfg, left_out if epoch == 0 else []):
      yield b, b.pop(RESPONSE_TOKENS)


def _copy(trainer, params: dict) -> dict:
  return jax.jit(lambda p: jax.tree.map(jnp.copy, p),
                 out_shardings=trainer.param_shardings)(params)


def snapshot(trainer) -> dict:
  """A copy of the trainer's params (its steps donate them), on their devices: an arm's init."""
  return _copy(trainer, trainer.state.params)


def reset(trainer, params: dict) -> None:
  """The trainer back at step 0 with `params` (a snapshot, copied again: its steps donate them)
  and a fresh optimiser state; its compiled programs are kept."""
  shardings = trainer.state_shardings
  params = _copy(trainer, params)
  trainer.state = TrainState(
      step=jax.device_put(jnp.int32(0), shardings.step), params=params,
      opt_state=jax.jit(trainer.tx.init, out_shardings=shardings.opt_state)(params))


def train(run: Run, trainer, data: Data, epoch_ids: np.ndarray, progress: Progress, steps: int,
          stop_at: float, lr: HostLr, name: str = "train", share: float | None = None
          ) -> Progress:
  """`steps` more steps of `trainer` on the samples `epoch_ids` (twice at most), until
  `stop_at`; a line every log_every steps, metrics in OUT/metrics.jsonl (per arm: name).

  With `share` (an arm's seconds): the first step (where a new trainer compiles) runs before
  the arm's clock starts, which then stops at the first of `stop_at` and `share` seconds later,
  so that arms compare by what they trained in the same time."""
  left_out: list = []  # samples larger than a row (data.groups), left out
  stream = Prefetch(_epochs(run, data, epoch_ids, left_out))
  metrics_dir = run.out if name == "train" else os.path.join(run.out, name)
  log = MetricsLog(metrics_dir, True, tensorboard=False)
  total, first_s, start = progress.steps + steps, None, progress
  try:
    if share is not None:
      t = time.monotonic()
      item = next(stream, None) if steps else None
      if item is not None:
        batch, response = item
        jax.block_until_ready(trainer.step_async([batch], lr(progress.steps, total)))
        progress = dataclasses.replace(progress, steps=progress.steps + 1,
                                       tokens=progress.tokens + response)
      first_s = time.monotonic() - t
      stop_at = min(stop_at, time.monotonic() + share)
    done = hosted_steps(trainer, stream, lr, first=progress.steps, total=total,
                        tokens=progress.tokens, stop_at=stop_at, metrics_log=log,
                        log_every=run.cfg.train.log_every, flops=run.flops, peak=run.peak,
                        log=run.log)
  finally:
    stream.close()
    log.close()
  new = done.steps - progress.steps
  rate, record = "", {}
  if new:
    from hamburger_jax.costs import peaks  # pylint: disable=import-outside-toplevel
    tps = (done.tokens - progress.tokens) / done.seconds
    mfu = peaks.mfu(run.flops, done.seconds / new, run.peak)
    record = dict(train_tokens_per_s=tps, train_mfu=mfu)
    rate = f"; {tps:,.0f} tokens/s and MFU {mfu:.1%} over {done.seconds:.0f} s"
  start_line = ""
  if first_s is not None:
    record.update(first_step_s=first_s, share_s=share)
    start_line = (f"; from the init: its first step (compiling) {first_s:.1f} s before its share "
                  f"of {share:.0f} s")
  run.summary.setdefault("arms", {})[name] = dict(
      steps=done.steps, response_tokens=done.tokens, train_s=done.seconds, ended=done.ended,
      **record)
  skipped = ""
  if left_out:
    skipped = (f"; {len(left_out)} samples larger than a row left out "
               f"({sum(x.response_tokens for x in left_out):,} response tokens)")
  after = "after measuring" if first_s is None else "after the first"
  run.report.part(name, [f"{done.steps} steps ({new} {after}, ended by {done.ended}), "
                         f"{done.tokens:,} response tokens{rate}{start_line}{skipped}"])
  return dataclasses.replace(start, steps=done.steps, tokens=done.tokens)
