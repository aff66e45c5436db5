"""A window turned into a graft (train.window): the tiny rehearsal end to end and continued from
its own export, the plan a config's window would follow, the plan's arithmetic, and the host-fed
learning rate that lets a window fix its schedule after compiling."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hamburger_jax import graft_checkpoint, pretrained
from hamburger_jax.run_config import load_run_config
from hamburger_jax.training.trainer import Trainer
from hamburger_jax.window import plan as plan_lib
from train import window

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("load", "corpus", "judge init", "warm-up", "measure", "profile", "plan", "answers",
         "boundaries", "train", "judge", "export", "evaluate", "decode", "done")


def _report(out: str) -> str:
  with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
    return f.read()


def test_tiny_window_end_to_end_then_continued(tmp_path, capsys):
  first, second = str(tmp_path / "w1"), str(tmp_path / "w2")
  # 3 minutes: on 2 busy cores the compiles alone (the train step, the judge's engine programs,
  # the teacher-forced evaluation) take about two.
  assert window.main(["--tiny", "--budget-minutes", "3", "--out", first]) == 0
  out = capsys.readouterr().out
  assert re.search(r"step \d+/\d+ .*tokens/s .*MFU", out)  # progress while training
  text = _report(first)
  for part in PARTS:
    assert (f"## {part}\n" in text) == (part != "decode"), part  # decode: with --decode-eval
  meta = graft_checkpoint.read_meta(os.path.join(first, "export"))
  with open(os.path.join(first, "summary.json"), encoding="utf-8") as f:
    summary = json.load(f)
  assert meta["trained_tokens"] == summary["response_tokens"] > 10_000
  assert summary["steps"] > 6  # trained past the measured steps
  # The base's own answers were made (the tiny rows hold 24-token answers) and trained on.
  answers = summary["answers"]
  assert answers["prompts"] > 100 and answers["tokens"] == 24 * answers["prompts"]
  assert summary["plan"]["answer_tokens"] > 0 and "training re-planned" in _report(first)
  # Two steps traced: the device's time by operation (here the CPU's XLA threads).
  assert "device time by operation over 2 calls" in text and summary["profile"]["ops_ms"]
  for name in os.listdir(os.path.join(first, "export")):
    assert os.path.getsize(os.path.join(first, "export", name)) <= 16 * 2**20
  # The export is a graft of the tiny run: it loads, and differs from a fresh graft.
  model, _ = pretrained.load_run(window.TINY_CONFIG, os.path.join(first, "export"))
  fresh, _ = pretrained.load_run(window.TINY_CONFIG)
  trained, initial = _graft(model), _graft(fresh)
  assert trained.keys() == initial.keys()
  changed = [k for k in trained if not np.allclose(trained[k], initial[k])]
  assert any("micro" in k for k in changed) and any("embedder" in k for k in changed)
  # Judged by free generation on the synthetic suite, the init before training and the trained
  # graft after: the verdict is in the export and the summary.
  judge = summary["judge"]
  assert {"init", "train", "best", "ship"} <= set(judge) and judge["best"] == "train"
  assert set(judge["init"]) == {"c0.5", "c0.7", "c0.8", "merit"}
  assert meta["window"]["ship"] == summary["ship"] and "verdict: " in text
  assert "| init | 0.8 |" in text and "| train | 0.8 |" in text
  # The answers made come back as files, for the next window.
  assert os.path.isfile(os.path.join(first, "answers", "answers-00001.npz"))
  # A second window continues the first: its lineage adds up; it trains on the first's answers
  # too, and shares its minutes between two arms judged on the same suite.
  # It times decode too (--decode-eval), with what its budget leaves.
  assert window.main(["--tiny", "--budget-minutes", "3.5", "--out", second, "--init-from",
                      os.path.join(first, "export"), "--answers-in",
                      os.path.join(first, "answers"), "--answers-share", "0",
                      "--arms", "graft;stop:train.trainable=stop", "--decode-eval"]) == 0
  meta2 = graft_checkpoint.read_meta(os.path.join(second, "export"))
  text2 = _report(second)
  assert meta2["window"]["init_from"] == os.path.join(first, "export")
  assert meta2["trained_tokens"] == meta["trained_tokens"] + meta2["window"]["response_tokens"]
  assert "answers of earlier windows" in text2
  assert "## decode\n" in text2
  assert "## graft\n" in text2 and "## stop\n" in text2
  assert "| graft | 0.8 |" in text2 and "| stop | 0.8 |" in text2
  with open(os.path.join(second, "summary.json"), encoding="utf-8") as f:
    summary2 = json.load(f)
  # The export is the arm of highest merit (max keeps the first of equal merits, as the verdict
  # does: the arms in their order).
  merits = {arm: summary2["judge"][arm]["merit"] for arm in ("graft", "stop")}
  assert meta2["window"]["arm"] == summary2["judge"]["best"] == max(merits, key=merits.get)
  # Both arms started alike: from the init at step 0, their first step before equal shares.
  arms = summary2["arms"]
  assert arms["graft"]["share_s"] == arms["stop"]["share_s"] > 0
  assert all(arms[a]["first_step_s"] > 0 for a in ("graft", "stop"))
  for arm in ("graft", "stop"):
    with open(os.path.join(second, arm, "metrics.jsonl"), encoding="utf-8") as f:
      first_logged = json.loads(f.readline())["step"]
    assert first_logged == 5, (arm, first_logged)  # tiny: train.log_every=5 from step 0
  # The judge's timings are in the summary, for a later window's plan (--rates-from).
  assert plan_lib.measured_rates(summary).judge_measured
  if "| batch | base tok/s |" in text2:  # else skipped for lack of time, which it says
    # Prompts of one prefill plan, no prefix caching: per mode and batch size one prefill
    # program and the decode loops of the views (one here).
    assert int(re.search(r"(\d+) programs compiled", text2).group(1)) <= 2 * 2 * 2
  else:
    assert "skipped: too little of the budget left" in text2


def _graft(model) -> dict:
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from hamburger_jax.model.llama import GraftParam  # pylint: disable=import-outside-toplevel
  return {".".join(map(str, p)): np.asarray(v[...])
          for p, v in nnx.to_flat_state(nnx.state(model, GraftParam))}


def _planned(out: str, part: str) -> int:
  return int(re.search(part + r": .*?([\d,]+) (response )?tokens", out).group(1).replace(",", ""))


def test_window_plan_of_the_smollm2_config(tmp_path, capsys):
  argv = ["--config", os.path.join(REPO, "configs", "smollm2_135m_window.yaml"), "--plan"]
  # The judge of a suite of the default size at the H200's timings (282 s for the init, 73 s
  # for the trained graft) leaves 8 minutes no time to train.
  assert window.main([*argv, "--budget-minutes", "8"]) == 0
  out = capsys.readouterr().out
  assert "judged on a suite of 928 items" in out and "kept for the judge ~355 s" in out
  assert _planned(out, "training") == 0
  assert window.main([*argv, "--budget-minutes", "12"]) == 0
  out = capsys.readouterr().out
  for part in ("warm-up", "measure", "answers", "boundaries", "train", "judge", "export",
               "evaluate"):
    assert part in out
  trained, answers = _planned(out, "training"), _planned(out, "answers")
  # At the assumed 30% MFU of an H100 and 50k answer tokens/s, 12 minutes hold 8M+ tokens, 80%
  # of them the base's own answers (the default --answers-share).
  assert trained > 8_000_000 and answers == pytest.approx(0.8 * trained, rel=0.01)
  assert window.main([*argv, "--budget-minutes", "12", "--answers-share", "0"]) == 0
  out = capsys.readouterr().out
  assert "answers:" not in out and _planned(out, "training") > 1.5 * trained
  # A suite of 100 items: the judge keeps 185 s of compiles and 7 passes of 100 items.
  from hamburger_jax.evaluation import suite as suite_lib  # pylint: disable=C0415
  item = suite_lib.SuiteItem("t", "t/1", (1,), 4, "tokens", (2,))
  suite_lib.save(suite_lib.Suite((item,) * 100, {"vocab_size": 49152}), str(tmp_path))
  assert window.main([*argv, "--budget-minutes", "12", "--suite", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  judge = plan_lib.ASSUMED_JUDGE_COMPILE_S + 7 * 100 * plan_lib.ASSUMED_JUDGE_ITEM_S
  assert f"{tmp_path}'s 100 items" in out and f"kept for the judge ~{judge:.0f} s" in out
  assert _planned(out, "training") > trained


def test_plan_from_an_earlier_window_s_rates(tmp_path, capsys):
  summary = {"step_s": 0.5, "compile_s": 60.0, "boundaries_tokens_per_s": 100_000.0,
             "answer_tokens_per_s": 40_000.0,
             "plan": {"steps": 100, "boundary_tokens": 500_000, "response_tokens": 700_000,
                      "answer_tokens": 350_000}}
  rates = plan_lib.measured_rates(summary)
  # Half the planned tokens were answers: the corpus samples of a step held 10,000 tokens.
  assert rates.tokens_per_step == 10_000 and rates.response_per_step == 7_000
  assert rates.answers_measured and rates.answer_tokens_per_s == 40_000
  path = tmp_path / "summary.json"
  path.write_text(json.dumps(summary))
  # 12 minutes: 8 leave nothing to train past the judge of a suite of the default size.
  argv = ["--config", os.path.join(REPO, "configs", "smollm2_135m_window.yaml"),
          "--budget-minutes", "12", "--plan", "--rates-from", str(path)]
  assert window.main(argv) == 0
  out = capsys.readouterr().out
  assert "rates (measured): train step 500 ms" in out and "(measured 40,000 tokens/s)" in out
  path.write_text(json.dumps({"step_s": 0.5}))
  assert window.main(argv) == 2
  assert "not a window's summary.json" in capsys.readouterr().err


def test_plan_fills_the_budget_or_the_data():
  rates = plan_lib.Rates(step_s=0.1, tokens_per_step=1000, response_per_step=700,
                         boundary_tokens_per_s=10_000, compile_s=5)
  p = plan_lib.make_plan(100.0, rates, 10**9, reserve=20.0)
  assert p.limited_by == "budget" and p.steps == 400  # 80 s at 0.1 + 1000 / 10000 s a step
  assert p.response_tokens == 400 * 700 and p.boundary_tokens == 400 * 1000
  assert p.train_s + p.boundary_s <= 80.0 + 1e-9
  p = plan_lib.make_plan(100.0, rates, 50_500, reserve=20.0)
  assert p.limited_by == "data" and p.steps == 50
  assert plan_lib.make_plan(10.0, rates, 10**9, reserve=20.0).steps == 0
  # Half the response tokens the base's own answers, made at 7,000 tokens/s after a compile of
  # 0.3 x 5 s: a step costs 0.1 s + half its boundary pass + 350 answer tokens (0.05 s).
  rates = dataclasses.replace(rates, answer_tokens_per_s=7000)
  p = plan_lib.make_plan(100.0, rates, 10**9, reserve=20.0, answers_share=0.5)
  assert p.steps == 392 and p.answer_tokens == 392 * 350 and p.boundary_tokens == 392 * 500
  assert p.answer_s == pytest.approx(1.5 + 392 * 350 / 7000)
  assert p.answer_s + p.boundary_s + p.train_s <= 80.0 + 1e-9
  # Made already: only the boundary pass is halved.
  p = plan_lib.make_plan(100.0, rates, 10**9, reserve=20.0, answers_share=0.5, to_answer=False)
  assert p.steps == 533 and p.answer_tokens == 0 and p.answer_s == 0
  with pytest.raises(ValueError, match="answers_share"):
    plan_lib.make_plan(100.0, rates, 10**9, reserve=20.0, answers_share=1.5)


def test_plan_keeps_the_judge_s_and_the_arms_starts_seconds():
  from hamburger_jax.window.state import Arm  # pylint: disable=import-outside-toplevel
  rates = plan_lib.Rates(step_s=0.1, tokens_per_step=1000, response_per_step=700,
                         boundary_tokens_per_s=10_000, compile_s=5, judge_compile_s=30.0,
                         judge_item_s=0.01)
  # A suite of 100 items: the compile, the base's pass and the init's three (one a confidence),
  # then three for each trained graft, whose judge reuses the programs.
  assert plan_lib.judge_s(rates, 100, grafts=2) == pytest.approx(30 + (1 + 3 + 2 * 3) * 1.0)
  assert plan_lib.judge_s(rates, 100, grafts=2, init=False) == pytest.approx(6.0)
  # Arms: a compile and first step for each arm with overrides; the first arm without takes the
  # measured trainer's programs (one step); no arms, nothing (training goes on).
  arms = (Arm("a"), Arm("b", ("train.trainable=all",)), Arm("c", ("train.trainable=stop",)))
  assert plan_lib.arms_start_s(arms, rates) == pytest.approx(2 * 5 + 0.1)
  assert plan_lib.arms_start_s((), rates) == 0.0
  # 200 s less 20 of reserve, 40 of judge and 10.1 of starts: 129.9 s at 0.2 s a step.
  p = plan_lib.make_plan(200.0, rates, 10**9, reserve=20.0, judge=40.0, start=10.1)
  assert p.steps == 649 and (p.reserve_s, p.judge_s, p.start_s) == (20.0, 40.0, 10.1)
  assert p.train_s + p.boundary_s + p.reserve_s + p.judge_s + p.start_s <= 200.0 + 1e-9
  lines = p.lines(rates)
  assert lines[-1] == ("kept for the judge ~40 s (assumed 10 ms an item a pass), export and "
                       "evaluation: 20 s")
  assert lines[-2].startswith("training:") and lines[-3].startswith("arms:")
  # An earlier window's judge timings, from its summary: 3 passes of 100 items in 30 s.
  summary = {"step_s": 0.5, "compile_s": 60.0, "boundaries_tokens_per_s": 100_000.0,
             "plan": {"steps": 10, "boundary_tokens": 10_000, "response_tokens": 7_000},
             "judge_compile_s": 50.0, "judge_init_decode_s": 30.0,
             "judge": {"suite": {"items": 100}}}
  measured = plan_lib.measured_rates(summary)
  assert measured.judge_measured and measured.judge_compile_s == 50.0
  assert measured.judge_item_s == pytest.approx(0.1)
  assert not plan_lib.measured_rates({**summary, "judge": {}}).judge_measured


def test_window_judges_as_the_entry_points_decode(tmp_path, monkeypatch):
  """The window judges the init and the trained graft with the init's micro vocabulary at the
  entry points' default size where the init stores that many ids (else both on the full
  vocabulary), says which, and its export carries the init's list."""
  from hamburger_jax import micro_vocab  # pylint: disable=import-outside-toplevel
  from hamburger_jax.evaluation import suite as suite_lib  # pylint: disable=C0415
  from hamburger_jax.evaluation import suite_judge  # pylint: disable=import-outside-toplevel
  from hamburger_jax.window import judging  # pylint: disable=import-outside-toplevel
  from hamburger_jax.window.state import Progress, Report, Run, Settings  # pylint: disable=C0415
  item = suite_lib.SuiteItem("synthetic", "s/1", (3, 4, 5), 4, "tokens", (6, 7, 8, 9))
  suite_lib.save(suite_lib.Suite((item,), {"vocab_size": 256}), str(tmp_path / "suite"))
  model, _ = pretrained.load_run(window.TINY_CONFIG)
  init = str(tmp_path / "init")
  graft_checkpoint.save_graft(model, init, "random", dtype="float32")
  # The tiny vocabulary holds 256 ids: a default of 64 is what 2,048 is to SmolLM2's.
  monkeypatch.setattr(micro_vocab, "DEFAULT_SIZE", 64)
  seen = []

  def judge(engine, suite, base, name, **_):
    ids = engine.model.micro_ids
    seen.append((name, None if ids is None else np.asarray(ids[...]).tolist()))
    return suite_judge.Judgement(name, {0.8: {"merit": 1.0}}, {0.8: [1.0]}, suite.tasks, 1.0)

  monkeypatch.setattr(suite_judge, "compile_judge", lambda *a, **k: 0.0)
  monkeypatch.setattr(suite_judge, "run_base", lambda *a, **k: suite_judge.BaseRun([], [], 1.0))
  monkeypatch.setattr(suite_judge, "judge", judge)
  monkeypatch.setattr(suite_judge, "table", lambda judgements: [])
  for stored, want in ((128, list(range(64))), (32, None)):
    micro_vocab.save(init, np.arange(256, 0, -1), stored, ["test"])
    out = tmp_path / f"out{stored}"
    cfg = load_run_config(window.TINY_CONFIG, [*window.WINDOW_OVERRIDES, *window.TINY_OVERRIDES,
                                               f"train.init_from={init}"])
    run = Run(cfg, Settings(1.0, time.monotonic(), suite=str(tmp_path / "suite"),
                            judge_batch=4), str(out), str(out), Report(str(out / "report.md"),
                                                                        "window", print),
              {}, types.SimpleNamespace(tokenizer=None), 0, None, 0.0)
    os.makedirs(out)
    seen.clear()
    j = judging.judge_init(run, model)
    judging.judge_graft(run, j, model, "train")
    assert seen == [("init", want), ("train", want)]
    assert run.summary["judge"]["micro_vocab"] == (want and len(want))
    text = (out / "report.md").read_text(encoding="utf-8")
    assert ("micro steps on the first 64 ids of the micro vocabulary" in text) == bool(want)
    assert ("micro steps on the full vocabulary (the init stores no micro vocabulary of 64 ids)"
            in text) == (not want)
    judging.export(run, model, Progress(), "train", False)
    assert (out / "export" / micro_vocab.FILE).read_text(encoding="utf-8") == \
        (tmp_path / "init" / micro_vocab.FILE).read_text(encoding="utf-8")


def test_arms_start_alike(tmp_path, monkeypatch):
  """Arms compare by merit only when they start alike: each from the init at step 0 (not the
  measured trainer's steps), its first step (where a new trainer compiles) before its share of
  the minutes, the shares equal; the first arm without overrides takes the measured trainer,
  back at the init, the other builds its own."""
  from hamburger_jax.data.synthetic import write_synthetic_corpus  # pylint: disable=C0415
  from hamburger_jax.data.tokens.corpus import TokenCorpus  # pylint: disable=C0415
  from hamburger_jax.window import run as run_lib  # pylint: disable=import-outside-toplevel
  from hamburger_jax.window import setup, training  # pylint: disable=import-outside-toplevel
  from hamburger_jax.window.state import (Arm, Data, Progress, Report, Run,  # pylint: disable=C0415
                                          Settings)
  from hamburger_jax.window.stream import Samples  # pylint: disable=import-outside-toplevel
  compile_s, step_s, share_s = 1.0, 0.05, 1.5
  config_for = lambda overrides: load_run_config(window.TINY_CONFIG, [
      *window.WINDOW_OVERRIDES, *window.TINY_OVERRIDES, *overrides])
  cfg = config_for(())
  write_synthetic_corpus(str(tmp_path / "c"), 256, 1000)
  c = TokenCorpus.load(str(tmp_path / "c"))
  starts = (np.arange(len(c.tokens)) % 2 == 0).astype(np.uint8)
  data = Data(Samples(c.tokens, c.samples, c.responses, starts), len(c.samples),
              c.sample_ids("train"), c.sample_ids("validation"), c.meta)

  class FakeTrainer:
    """Steps that take `step_s`, the first `compile_s` unless compiled already."""

    def __init__(self, cfg, host_lr=True, compiled=False):
      self.cfg, self.compiled, self.lrs, self.trains_base = cfg, compiled, [], False
      self.state = types.SimpleNamespace(step=jnp.int32(0))

    def step_async(self, batches, lr):
      time.sleep(step_s if self.compiled else compile_s)
      self.compiled = True
      self.lrs.append(lr)
      return {"loss": jnp.float32(1.0)}

    def current_model(self):
      return self

  measured, built, resets = FakeTrainer(cfg, compiled=True), [], []
  monkeypatch.setattr(run_lib, "Trainer", lambda c, host_lr: built.append(FakeTrainer(c)) or
                      built[-1])
  monkeypatch.setattr(training, "reset", lambda trainer, init: resets.append((trainer, init)))
  arms = (Arm("graft"), Arm("stop", ("train.trainable=stop",)))
  rates = plan_lib.Rates(step_s=step_s, tokens_per_step=1000, response_per_step=500,
                         boundary_tokens_per_s=1e6, compile_s=compile_s)
  p = plan_lib.Plan(steps=10**5, boundary_tokens=0, response_tokens=0, boundary_s=0, train_s=0,
                    reserve_s=0.0, limited_by="budget",
                    start_s=plan_lib.arms_start_s(arms, rates))
  s = Settings((p.start_s + 2 * share_s) / 60, time.monotonic(), arms=arms)
  run = Run(cfg, s, str(tmp_path), str(tmp_path), Report(str(tmp_path / "report.md"), "w",
                                                         lambda line: None),
            {}, measured, 0, types.SimpleNamespace(flops=1e12), 1e9, log=lambda line: None)
  # The measured trainer stands at step 8: the arms do not go on from there.
  trained = run_lib._train_arms(run, data, data.train_ids, Progress(8, 12_345, rates), p,
                                setup.HostLr(cfg), config_for, init="the init's params")
  assert resets == [(measured, "the init's params")] and len(built) == 1
  assert built[0].cfg.train.trainable == "stop"
  assert trained["graft"][2] is measured and trained["stop"][2] is built[0]
  summary = run.summary["arms"]
  total = p.steps // 2
  for name, trainer in (("graft", measured), ("stop", built[0])):
    arm = summary[name]
    # The first step at step 0 of the arm's schedule; the first logged one, log_every after.
    assert trainer.lrs[0] == setup.HostLr(trainer.cfg)(0, total), name
    with open(tmp_path / name / "metrics.jsonl", encoding="utf-8") as f:
      assert json.loads(f.readline())["step"] == cfg.train.log_every, name
    assert arm["steps"] == len(trainer.lrs) == trained[name][1].steps, name
    # The share starts after the first step: the clock ends each arm's training after it.
    assert arm["share_s"] == pytest.approx(share_s, abs=0.3), name
    assert arm["ended"].startswith("the clock"), name
    assert arm["train_s"] <= arm["share_s"] + 4 * step_s + 0.2, name
  assert summary["stop"]["first_step_s"] >= compile_s > summary["graft"]["first_step_s"]
  assert summary["graft"]["share_s"] == summary["stop"]["share_s"]
  steps = [summary[name]["steps"] for name in ("graft", "stop")]
  assert abs(steps[0] - steps[1]) <= 0.3 * steps[0], steps


def test_a_trainer_back_at_the_init_steps_as_a_new_one(tmp_path):
  """The arm that takes the measured trainer: reset to the params snapshot before it stepped, its
  next step is the first step of a trainer at the init (same loss, same params after)."""
  from hamburger_jax.data.synthetic import write_synthetic_corpus  # pylint: disable=C0415
  from hamburger_jax.data.tokens.corpus import TokenCorpus  # pylint: disable=C0415
  from hamburger_jax.window import setup, training  # pylint: disable=import-outside-toplevel
  from hamburger_jax.window.stream import RESPONSE_TOKENS, Samples, batches  # pylint: disable=C0415
  cfg = load_run_config(window.TINY_CONFIG, [*window.WINDOW_OVERRIDES, *window.TINY_OVERRIDES])
  write_synthetic_corpus(str(tmp_path / "c"), 256, 120)
  c = TokenCorpus.load(str(tmp_path / "c"))
  starts = (np.arange(len(c.tokens)) % 3 == 0).astype(np.uint8)
  it = batches(Samples(c.tokens, c.samples, c.responses, starts), range(120), cfg)
  first, second = next(it), next(it)
  for b in (first, second):
    b.pop(RESPONSE_TOKENS)
  lr = setup.HostLr(cfg)
  trainer = Trainer(cfg, host_lr=True)
  init = training.snapshot(trainer)
  want = trainer.step([first], lr(0, 10))
  trainer.step([second], lr(1, 10))
  training.reset(trainer, init)
  assert int(trainer.state.step) == 0
  got = trainer.step([first], lr(0, 10))
  assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
  fresh = Trainer(cfg, host_lr=True)
  fresh.step([first], lr(0, 10))
  for a, b in zip(jax.tree.leaves(trainer.state), jax.tree.leaves(fresh.state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  training.reset(trainer, init)  # the snapshot survives a reset (the steps donate a copy)
  assert trainer.step([first], lr(0, 10))["loss"] == pytest.approx(want["loss"], rel=1e-6)


def test_host_fed_learning_rate_is_the_compiled_schedule(tmp_path):
  """Three steps of a Trainer whose step reads its learning rate from the host equal three steps
  of one with the schedule compiled in (AdamW's update times lr is AdamW at lr), on a window's
  batches (the teacher in the step)."""
  from hamburger_jax.data.synthetic import write_synthetic_corpus  # pylint: disable=import-outside-toplevel
  from hamburger_jax.data.tokens.corpus import TokenCorpus  # pylint: disable=import-outside-toplevel
  from hamburger_jax.window.stream import RESPONSE_TOKENS, Samples, batches  # pylint: disable=import-outside-toplevel
  cfg = load_run_config(window.TINY_CONFIG, [*window.WINDOW_OVERRIDES, *window.TINY_OVERRIDES,
                                             "train.steps=5", "train.warmup_steps=2"])
  write_synthetic_corpus(str(tmp_path / "c"), 256, 120)
  c = TokenCorpus.load(str(tmp_path / "c"))
  starts = (np.arange(len(c.tokens)) % 3 == 0).astype(np.uint8)  # groups of 3: merged entries
  it = batches(Samples(c.tokens, c.samples, c.responses, starts), range(120), cfg)
  compiled, host = Trainer(cfg), Trainer(cfg, host_lr=True)
  for step in range(3):
    batch = next(it)
    batch.pop(RESPONSE_TOKENS)
    want = compiled.step([batch])
    got = host.step([batch], lr={name: float(f(step)) for name, f in host.schedules.items()})
    assert got["lr_graft"] == pytest.approx(want["lr_graft"]) and got["loss"] == pytest.approx(
        want["loss"], rel=1e-5)
  for a, b in zip(jax.tree.leaves(compiled.state.params), jax.tree.leaves(host.state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_answers_extend_the_samples_and_mix_in_at_their_share():
  from hamburger_jax.window.stream import Samples, mix  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  # 50 corpus samples: a 4-token prompt, then a response of 10..29 tokens.
  lengths = rng.integers(10, 30, 50)
  starts = np.concatenate([[0], np.cumsum(lengths + 4)[:-1]])
  tokens = rng.integers(0, 100, int((lengths + 4).sum())).astype(np.uint16)
  corpus = Samples(tokens, np.stack([starts, lengths + 4], 1),
                   np.stack([np.arange(50), starts + 4, starts + 4 + lengths], 1),
                   np.zeros(len(tokens), np.uint8))
  assert corpus.prompt(3).tolist() == tokens[starts[3]:starts[3] + 4].tolist()
  # 10 answers of 20 tokens to prompts of 4, their groups given.
  a_tokens = rng.integers(0, 100, 240)
  a_samples = np.stack([np.arange(10) * 24, np.full(10, 24)], 1)
  a_resp = np.stack([np.arange(10), np.arange(10) * 24 + 4, np.arange(10) * 24 + 24], 1)
  a_starts = np.ones(240, np.uint8)
  both = corpus.extended(a_tokens, a_samples, a_resp, a_starts)
  assert len(both.samples) == 60
  s = both(55)
  assert s.tokens.tolist() == a_tokens[120:144].tolist() and s.spans == ((4, 24),)
  assert s.group_start.all() and both(3).spans == corpus(3).spans
  assert both.response_lengths([55, 3]).tolist() == [20, int(lengths[3])]
  order = mix(np.arange(50, 60), np.arange(50), both, 0.25, np.random.default_rng(1))
  assert sorted(order.tolist()) == list(range(60))
  # The shuffled front holds the answers and corpus samples 0..k-1; the rest follow in order.
  k = min(i for i in range(51) if order[10 + i:].tolist() == list(range(i, 50)))
  assert sorted(order[:10 + k].tolist()) == [*range(k), *range(50, 60)]
  # Those corpus samples hold about three times the answers' 200 tokens (k is ambiguous by one
  # sample when sample k - 1 happens to end the shuffle: two samples of at most 30 tokens).
  assert 600 - 2 * 30 <= both.response_lengths(range(k)).sum() <= 600
