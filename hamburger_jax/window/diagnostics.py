"""A window's diagnostics: the teacher-forced evaluation of its graft on held-out samples, and
(when asked) decode speed against the base. Neither decides what ships (window/judging.py)."""

from __future__ import annotations

import time

from hamburger_jax.benchmarks.timing import time_batches
from hamburger_jax.decode.engine import Engine
from hamburger_jax.window.setup import VALIDATION_BATCHES
from hamburger_jax.window.state import Data, Run
from hamburger_jax.window.stream import RESPONSE_TOKENS, batches

DECODE_BATCHES = (1, 32)
DECODE_PROMPT_TOKENS = 128
TEACHER_FORCED = ("val_kl", "val_agree_s1", "val_agree_s2", "val_agree_merged",
                  "val_tf_tokens_per_step_c50", "val_tf_accepted_agree_c50",
                  "val_tf_tokens_per_step_c80", "val_tf_accepted_agree_c80")


def evaluate(run: Run, trainer, data: Data) -> None:
  val = list(batches(data.samples, data.val_ids, run.cfg, []))
  for b in val:
    b.pop(RESPONSE_TOKENS)
  t = time.monotonic()
  m = trainer.evaluate(iter(val), VALIDATION_BATCHES)
  run.summary["evaluation"] = {k: m[k] for k in TEACHER_FORCED if k in m}
  run.report.part("evaluate", [
      f"teacher-forced on {min(len(val), VALIDATION_BATCHES)} batches of held-out samples "
      f"({time.monotonic() - t:.1f} s), diagnostics only:",
      "", "| metric | value |", "|---|---|",
      *(f"| {k} | {m[k]:.4f} |" for k in TEACHER_FORCED if k in m)])


def decode(run: Run, model, data: Data) -> None:
  # Without prefix caching, and prompts of one prefill plan: the engine compiles one prefill
  # program and the decode loops per layout (with prompts of every length it compiled a
  # prefill program per chunk size, and prefix programs: most of this part's minutes).
  engine = Engine(model, run.trainer.tokenizer, stop_ids=(), prefix_cache_tokens=0)
  by_plan: dict[tuple, list] = {}
  for i in data.val_ids:
    ids = data.samples.prompt(int(i)).tolist()
    if 0 < len(ids) <= DECODE_PROMPT_TOKENS:
      by_plan.setdefault(tuple(c for *_, c in engine.prompt_plan(ids)[1]), []).append(ids)
  if not by_plan:
    run.report.part("decode", ["no held-out prompt is short enough: skipped"])
    return
  prompts = max(by_plan.values(), key=len)
  n = run.s.decode_tokens
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
  run.summary["decode"] = rows
  lines += ["", f"{len(prompts)} distinct prompts of one prefill plan; {engine.compilations} "
            f"programs compiled; {time.monotonic() - t:.0f} s in all"]
  run.report.part("decode", lines)
