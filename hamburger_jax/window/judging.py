"""A window's judge: free generation on a suite (evaluation/suite.py) decides what it exports.

The init graft is judged before training, every trained graft (one per arm) after it, on the
same suite and the same base answers (decoded once, on this device, in its dtype). The export is
the trained graft with the highest merit (evaluation/suite_judge.py); it is proposed to ship only
when it does not lose to its init at c = 0.8 beyond the paired interval and its merit is above
the init's. Teacher-forced figures stay in the report as diagnostics."""

from __future__ import annotations

import dataclasses
import os
import time

import jax

from hamburger_jax import graft_checkpoint
from hamburger_jax.decode.engine import Engine
from hamburger_jax.evaluation import suite as suite_lib
from hamburger_jax.evaluation import suite_judge
from hamburger_jax.window.state import EXPORT_SHARD_MB, Progress, Run


@dataclasses.dataclass
class Judge:
  suite: suite_lib.Suite
  engine: Engine
  base: suite_judge.BaseRun
  judgements: list  # suite_judge.Judgement, the init's first


def judge_init(run: Run, model) -> Judge | None:
  """Loads the suite and judges the init graft (None without a suite: the window is then not
  judged by free generation, and says so)."""
  if not run.s.suite:
    run.report.part("judge init", ["no suite (--suite DIR, written by python -m infer.eval "
                                   "--write-suite DIR): the export is not judged by free "
                                   "generation and is not proposed to ship"])
    return None
  tok = run.trainer.tokenizer
  fingerprint = None
  if tok is not None:
    from hamburger_jax.data.tokens.corpus import tokenizer_fingerprint  # pylint: disable=C0415
    fingerprint = tokenizer_fingerprint(tok)
  suite = suite_lib.load(run.s.suite, model.cfg.base.vocab_size, fingerprint)
  t = time.monotonic()
  engine = Engine(model, tok, stop_ids=tok.stop_ids if tok is not None else ())
  compile_s = suite_judge.compile_judge(engine, suite, run.s.judge_batch, run.log)
  base = suite_judge.run_base(engine, suite, run.s.judge_batch, run.log)
  base_s = time.monotonic() - t
  t = time.monotonic()
  init = suite_judge.judge(engine, suite, base, "init", batch=run.s.judge_batch, log=run.log)
  decode_s = time.monotonic() - t
  # The trained grafts' judges reuse these programs: the plan keeps their time for each.
  run.summary["judge_init_decode_s"] = init.seconds
  run.summary["judge"] = {"suite": {"items": len(suite.items), "tasks": suite.tasks,
                                    "base_same_as_suite": base.same_as_suite},
                          "init": init.numbers()}
  run.report.part("judge init", [
      f"suite {run.s.suite}: {len(suite.items)} items ({', '.join(suite.tasks)}); the base's "
      f"and HAMburger's programs compiled together in {compile_s:.0f} s; the base decoded here "
      f"in {base_s - compile_s:.0f} s, {base.same_as_suite:.0%} of its answers equal the "
      f"suite's stored ones", f"init graft judged in {decode_s:.0f} s", "",
      *suite_judge.table([init])])
  return Judge(suite, engine, base, [init])


def judge_graft(run: Run, judge: Judge, model, name: str) -> suite_judge.Judgement:
  judge.engine.set_model(model)
  j = suite_judge.judge(judge.engine, judge.suite, judge.base, name, batch=run.s.judge_batch,
                        log=run.log)
  judge.judgements.append(j)
  run.summary["judge"][name] = j.numbers()
  return j


def verdict(run: Run, judge: Judge | None, names: list[str]) -> tuple[str, bool]:
  """(the trained graft to export, whether it is proposed to ship), reported with the table."""
  if judge is None:
    run.summary["ship"] = False
    return names[0], False
  init, trained = judge.judgements[0], judge.judgements[1:]
  best = max(trained, key=lambda j: j.merit())
  loses, delta, (lo, hi) = suite_judge.loses_to(best, init, judge.suite)
  ship = not loses and best.merit() > init.merit()
  why = ("loses to its init at c = 0.8 beyond the paired interval: never proposed to ship"
         if loses else "not better than its init by merit: not proposed to ship"
         if not ship else "better than its init: proposed to ship")
  run.summary["judge"].update(best=best.name, ship=ship, vs_init_c08={
      "delta": delta, "delta_ci95": [lo, hi], "loses": loses})
  run.summary["ship"] = ship
  run.report.part("judge", [
      f"free generation, greedy, c in {{{', '.join(f'{c:g}' for c in init.by_c)}}}; scores "
      "(difference to the base, the base's score); merit = mean over c of KV compression x "
      "quality (number tasks relative to the base, chat ROUGE-L)", "",
      *suite_judge.table(judge.judgements), "",
      f"best trained graft: {best.name}, merit {best.merit():.3f} (init {init.merit():.3f}); "
      f"at c = 0.8 against its init on the number tasks {delta:+.3f} [{lo:+.3f}, {hi:+.3f}]",
      f"verdict: {why}"])
  return best.name, ship


def export(run: Run, model, progress: Progress, name: str, ship: bool,
           include_base: bool = False) -> str:
  """The graft in files of at most 16 MiB, with its lineage's response tokens and the judge's
  verdict (and the base, for an arm that trained it); the report lists its files with the sha256
  save_graft recorded."""
  path = os.path.join(run.out, "export")
  lineage = run.prior_tokens + progress.tokens
  graft_checkpoint.save_graft(
      model, path, run.cfg.model.base, dtype=run.cfg.checkpoint.export_dtype,
      max_shard_mb=EXPORT_SHARD_MB, include_base=include_base,
      extra={"trained_tokens": lineage, "window": {
          "steps": progress.steps, "response_tokens": progress.tokens, "arm": name,
          "init_from": run.cfg.train.init_from or None, "ship": ship,
          "judge": run.summary.get("judge", {}).get(name),
          "device": jax.devices()[0].device_kind}})
  meta = graft_checkpoint.read_meta(path)
  lines = [f"`{f['file']}` {f['bytes']:,} bytes, sha256 {f['sha256']}"
           for table in meta.get("shards", {}).values() for f in table.get("files", [])]
  run.summary.update(export=path, trained_tokens=lineage)
  run.report.part("export", [f"{path}: the {name} graft; trained_tokens {lineage:,} (this "
                             f"window {progress.tokens:,}); proposed to ship: "
                             f"{'yes' if ship else 'no'}", *lines])
  return path
