"""A window's judge: free generation on a suite (evaluation/suite.py) decides what it exports.

The init graft is judged before training, every trained graft (one per arm) after it, on the
same suite and the same base answers (decoded once, on this device, in its dtype). The export is
the trained graft with the highest merit (evaluation/suite_judge.py); it is proposed to ship only
when it does not lose to its init at c = 0.8 beyond the paired interval and its merit is above
the init's. Teacher-forced figures stay in the report as diagnostics.

Every graft is judged as the entry points decode it (cli.micro_vocab_size): micro steps on the
first micro_vocab.DEFAULT_SIZE ids of the init's micro vocabulary where the init stores that
many, else on the full vocabulary; the trained grafts alike, as their exports carry the init's
list (graft_checkpoint.save_graft)."""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np

from hamburger_jax import cli, graft_checkpoint, micro_vocab
from hamburger_jax.config import ConfigError
from hamburger_jax.decode.engine import Engine
from hamburger_jax.evaluation import suite as suite_lib
from hamburger_jax.evaluation import suite_judge
from hamburger_jax.window.state import EXPORT_SHARD_MB, Progress, Run


@dataclasses.dataclass
class Judge:
  suite: suite_lib.Suite
  engine: Engine
  base: suite_judge.BaseRun | None
  judgements: list  # suite_judge.Judgement, the init's first
  micro_ids: np.ndarray | None = None  # the micro vocabulary every graft is judged with


def micro_vocab_ids(run: Run, vocab_size: int) -> np.ndarray | None:
  """The micro vocabulary the entry points decode the init with by default, and the trained
  grafts' exports with (None: the full vocabulary)."""
  init = run.cfg.train.init_from or None
  size = cli.micro_vocab_size(None, init, "both", shipped=False)
  if size is None:
    return None
  try:
    return micro_vocab.load(init, size, vocab_size)
  except micro_vocab.MicroVocabError as e:
    raise ConfigError(f"--init-from {init}: {e}") from None


def _as_decoded(model, ids: np.ndarray | None):
  """`model` with micro steps on `ids` (None: as it is), its arrays shared, nothing copied."""
  if ids is None:
    return model
  from hamburger_jax.model.hamburger import sharing_weights  # pylint: disable=C0415
  return sharing_weights(model, micro_vocab=ids)


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
  ids = micro_vocab_ids(run, model.cfg.base.vocab_size)
  vocab = suite_judge.describe_micro_vocab(None if ids is None else len(ids))
  t = time.monotonic()
  engine = Engine(_as_decoded(model, ids), tok, stop_ids=tok.stop_ids if tok is not None else ())
  judge = Judge(suite, engine, None, [], ids)
  compile_s = suite_judge.compile_judge(engine, suite, run.s.judge_batch, run.log)
  judge.base = suite_judge.run_base(engine, suite, run.s.judge_batch, run.log)
  base_s = time.monotonic() - t
  t = time.monotonic()
  init = suite_judge.judge(engine, suite, judge.base, "init", batch=run.s.judge_batch,
                           log=run.log)
  judge.judgements.append(init)
  decode_s = time.monotonic() - t
  # The trained grafts' judges reuse these programs: the plan keeps their time for each, and a
  # later window's plan (plan.measured_rates) the whole judge's.
  run.summary.update(judge_init_decode_s=init.seconds, judge_compile_s=compile_s,
                     judge_base_s=base_s - compile_s)
  run.summary["judge"] = {"suite": {"items": len(suite.items), "tasks": suite.tasks,
                                    "base_same_as_suite": judge.base.same_as_suite},
                          "micro_vocab": None if ids is None else len(ids),
                          "init": init.numbers()}
  source = (f"the init's ({run.cfg.train.init_from})" if ids is not None else
            f"the init stores no micro vocabulary of {micro_vocab.DEFAULT_SIZE} ids")
  run.report.part("judge init", [
      f"suite {run.s.suite}: {len(suite.items)} items ({', '.join(suite.tasks)}); the base's "
      f"and HAMburger's programs compiled together in {compile_s:.0f} s; the base decoded here "
      f"in {base_s - compile_s:.0f} s, {judge.base.same_as_suite:.0%} of its answers equal the "
      f"suite's stored ones",
      f"every graft decoded as the entry points decode it: micro steps on {vocab} ({source})",
      f"init graft judged in {decode_s:.0f} s", "", *suite_judge.table([init])])
  return judge


def judge_graft(run: Run, judge: Judge, model, name: str) -> suite_judge.Judgement:
  judge.engine.set_model(_as_decoded(model, judge.micro_ids))
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
  """The graft in files of at most 16 MiB, with its lineage's response tokens, the judge's
  verdict and the init's micro vocabulary (and the base, for an arm that trained it); the report
  lists its files with the sha256 save_graft recorded."""
  path = os.path.join(run.out, "export")
  lineage = run.prior_tokens + progress.tokens
  graft_checkpoint.save_graft(
      model, path, run.cfg.model.base, dtype=run.cfg.checkpoint.export_dtype,
      max_shard_mb=EXPORT_SHARD_MB, include_base=include_base,
      micro_vocab_from=run.cfg.train.init_from or None,
      extra={"trained_tokens": lineage, "window": {
          "steps": progress.steps, "response_tokens": progress.tokens, "arm": name,
          "init_from": run.cfg.train.init_from or None, "ship": ship,
          "judge": run.summary.get("judge", {}).get(name),
          "device": jax.devices()[0].device_kind}})
  meta = graft_checkpoint.read_meta(path)
  lines = [f"`{f['file']}` {f['bytes']:,} bytes, sha256 {f['sha256']}"
           for table in meta.get("shards", {}).values() for f in table.get("files", [])]
  if micro_vocab.carried(run.cfg.train.init_from, model.cfg.base.vocab_size):
    lines.append(f"`{micro_vocab.FILE}`: the init's micro vocabulary, which the judge decoded "
                 "with where it holds the default's ids")
  run.summary.update(export=path, trained_tokens=lineage)
  run.report.part("export", [f"{path}: the {name} graft; trained_tokens {lineage:,} (this "
                             f"window {progress.tokens:,}); proposed to ship: "
                             f"{'yes' if ship else 'no'}", *lines])
  return path
