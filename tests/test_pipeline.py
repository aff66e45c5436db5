"""The pipeline (hamburger_jax/pipeline/, `python -m train.pipeline`): the budget rule, the plan
printed before anything runs, bad input refused before anything is written, and the tiny config
end to end: interrupted in training, resumed by the rerun, then skipped entirely."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hamburger_jax import testing
from hamburger_jax.pipeline import budget, plan as planning, state
from train import pipeline

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
SMOLLM2 = str(REPO / "configs" / "smollm2_135m.yaml")
LINE = re.compile(r"^(\S+)\s+(done|budget|skipped|failed|interrupted|not run)\s+"
                  r"([\d.]+) /\s+([\d.]+) min  (.*)$")


def _plan(argv) -> planning.Plan:
  """The plan of `python -m train.pipeline ARGV`."""
  return planning.make_plan(pipeline.settings(pipeline.parse_args(list(argv))))


# ----------------------------------------------------------------------------- the budget rule


def test_budget_shares_hand_unused_minutes_on():
  shares = {"a": 0.5, "b": 0.25, "c": 0.25}
  assert budget.part_budget(shares, {}, 100, "a") == 50
  # Each part at its share: every later part gets exactly its share.
  assert budget.part_budget(shares, {"a": 50}, 100, "b") == 25
  # "a" used 10 of its 50: the 40 left over go to b and c by their shares.
  assert budget.part_budget(shares, {"a": 10}, 100, "b") == pytest.approx(45)
  assert budget.part_budget(shares, {"a": 10, "b": 45}, 100, "c") == pytest.approx(45)
  # An overrun comes out of the later parts; nothing left gives 0, never a negative budget.
  assert budget.part_budget(shares, {"a": 70}, 100, "b") == pytest.approx(15)
  assert budget.part_budget(shares, {"a": 120}, 100, "b") == 0.0
  # The stages split the training share by their steps; the shares add up to the budget.
  split = budget.part_shares([("train:micro", 300), ("train:merger", 150), ("train:joint", 150)])
  assert list(split) == ["self_distill", "prepare_data", "train:micro", "train:merger",
                         "train:joint", "pick", "export", "eval"]
  assert split["train:micro"] == 2 * split["train:merger"] == pytest.approx(
      budget.SHARES["train"] / 2)
  assert sum(split.values()) == pytest.approx(1.0)
  assert sum(budget.SHARES.values()) == pytest.approx(1.0)


def test_teacher_pass_and_evaluation_are_sized_to_their_minutes():
  # 10 tokens a minute generated: the teacher pass reads TEACHER_SPEEDUP x as many.
  answers = [10] * 10
  fits = lambda minutes: budget.teacher_limit(answers, minutes, rate=10.0)
  assert fits(100) == 10
  assert fits(2 / budget.TEACHER_SPEEDUP) == 2
  assert fits(0) == 2  # the least work: a training and a validation sample
  assert budget.teacher_limit(answers, 1, rate=None) == 10  # no rate measured: all of them
  plan = _plan(["--config", TINY, "--budget-minutes", "1",
               "--eval-limit", "20"])
  from hamburger_jax.evaluation.run import MAX_NEW_TOKENS  # pylint: disable=C0415
  per_example = 2 * MAX_NEW_TOKENS["synthetic"]  # in base mode and at one confidence
  fits = lambda minutes, rate: budget.eval_limit(plan.eval_tasks.split(","), plan.eval_limit,
                                                 minutes, rate)
  assert fits(1.0, rate=5.0 * per_example) == 5
  assert fits(1.0, rate=1e9) == 20  # at most --eval-limit
  assert fits(0.0, rate=1.0) == 1
  assert fits(1.0, rate=None) == 20


@pytest.mark.parametrize("args, message", [
    (["--config", "configs/nowhere.yaml", "--budget-minutes", "5"], "does not exist"),
    (["--config", TINY, "--budget-minutes", "0"], "--budget-minutes=0.0 must be > 0"),
    (["--config", TINY, "--budget-minutes", "-3"], "--budget-minutes=-3.0 must be > 0"),
    (["--config", TINY, "--budget-minutes", "nan"], "must be > 0"),
    (["--config", TINY, "--budget-minutes", "5", "--eval-limit", "0"], "--eval-limit=0"),
    (["--config", TINY, "--budget-minutes", "5", "--mix", "gcd:5"], "has no tokenizer"),
    (["--config", TINY, "--budget-minutes", "5", "--mix", "gsm8k:5"], "NAME:COUNT"),
    (["--config", TINY, "--budget-minutes", "5", "--eval-tasks", "gcd"], "has no tokenizer"),
    (["--config", TINY, "--budget-minutes", "5", "--eval-tasks", "bogus"], "unknown task"),
    (["--config", TINY, "--budget-minutes", "5", "--strategy", "nope"], "nope"),
    (["--config", TINY, "--budget-minutes", "5", "--teacher-top-k", "0"], "--teacher-top-k=0"),
])
def test_bad_input_is_one_error_line_and_writes_nothing(args, message, tmp_path: Path, capsys):
  out = tmp_path / "out"
  assert pipeline.main([*args, "--out", str(out)]) == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
  assert message in captured.err
  assert not out.exists()


def test_an_out_of_another_config_or_of_no_pipeline_is_refused(tmp_path: Path, capsys):
  out = tmp_path / "out"
  plan = _plan(["--config", TINY, "--budget-minutes", "1",
               "--out", str(out)])
  state.write_state(plan, state.read_state(plan))
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  assert pipeline.main(["--config", SMOLLM2, "--budget-minutes", "5", "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "belongs to the pipeline of" in err and "tiny.yaml" in err
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before
  stranger = tmp_path / "stranger"
  stranger.mkdir()
  (stranger / "notes.txt").write_text("mine")
  assert pipeline.main(["--config", TINY, "--budget-minutes", "5", "--out", str(stranger)]) == 2
  assert "not a pipeline's folder" in capsys.readouterr().err
  assert [p.name for p in stranger.iterdir()] == ["notes.txt"]


def test_plan_of_the_staged_config():
  """Every stage reads the pipeline's data and runs in its folder; only the last stage's export
  moves (the config's checkpoint.export is the shipped checkpoint: never written); the teacher
  pass keeps samples that the stages' rows hold."""
  plan = _plan(["--config", SMOLLM2, "--budget-minutes", "60",
               "--out", "/x"])
  assert plan.stages == ["micro", "merger", "joint"]
  assert [c.checkpoint.dir for c in plan.stage_cfgs] == ["/x/train/micro", "/x/train/merger",
                                                         "/x/train/joint"]
  assert [c.checkpoint.export for c in plan.stage_cfgs] == [
      "/x/train/micro/export", "/x/train/merger/export", "/x/train/joint/export"]
  assert {c.data.dir for c in plan.stage_cfgs} == {"/x/data"}
  assert plan.stage_cfgs[-1].train.generate_every > 0  # the config's own checks, kept
  assert plan.max_len == min(min(c.data.entries, c.data.groups) for c in plan.stage_cfgs)
  assert not plan.token_ids and plan.max_new_tokens is None
  tiny = _plan(["--config", TINY, "--budget-minutes", "1",
               "--out", "/y"])
  cfg = tiny.stage_cfgs[0]
  assert tiny.stages == [None] and tiny.token_ids
  assert cfg.train.generate_every == cfg.checkpoint.every  # checks for the pick rule
  assert tiny.parts() == ["self_distill", "prepare_data", "train", "pick", "export", "eval"]


def test_plan_printed_before_the_run_and_one_stage_in_a_few_minutes(capsys):
  """`--plan` prints the parts and the programs they compile, and stops; a staged config whose
  budget leaves under MIN_STAGE_MINUTES a stage trains its last stage alone, from a fresh
  graft, so that it compiles one train and one evaluation step instead of three of each."""
  assert pipeline.main(["--config", TINY, "--budget-minutes", "1", "--plan", "--out", "/y"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0] == "plan: 1 minutes; parts self_distill, prepare_data, train, pick, export, eval"
  assert out[1].startswith("  compiles (train and evaluation steps: 2;")
  assert [l.split()[0] for l in out[2:]] == ["self_distill", "prepare_data", "train", "export",
                                             "eval"]
  staged = str(REPO / "configs" / "smollm2_135m_h100.yaml")
  few = _plan(["--config", staged, "--budget-minutes", "8", "--out", "/z"])
  many = _plan(["--config", staged, "--budget-minutes", "60", "--out", "/z"])
  assert budget.SHARES["train"] * 8 < budget.MIN_STAGE_MINUTES * 3 <= budget.SHARES["train"] * 60
  assert few.one_stage and few.stages == ["joint"] and not many.one_stage
  assert many.stages == ["micro", "merger", "joint"]
  assert few.stage_cfgs[0].train.init_from in ("", None)  # a fresh graft, not a stage's export
  assert many.stage_cfgs[-1].train.init_from
  assert few.parts() == ["self_distill", "prepare_data", "train:joint", "pick", "export", "eval"]
  lines = few.lines()
  assert "train:joint alone, from a fresh graft" in lines[1]
  assert "train and evaluation steps: 2;" in lines[2]
  assert "train and evaluation steps: 6;" in many.lines()[1]


def test_self_distill_prompts_of_token_ids_and_of_a_reasoning_mix():
  """The pipeline's self-distillation prompts: token ids for a base without tokenizer (in its
  vocabulary, the same ids on a rerun), and a mix of reasoning sources, interleaved."""
  from types import SimpleNamespace  # pylint: disable=import-outside-toplevel
  from hamburger_jax.data import self_distill  # pylint: disable=import-outside-toplevel
  args = SimpleNamespace(seed=0, max_prompt_tokens=96, sharegpt_skip=0)
  ids = self_distill.prompts([("synthetic", 5)], args, None, 256)
  low, high = self_distill.SYNTHETIC_PROMPT_LEN
  assert [c.id for c in ids] == [f"synthetic/{i}" for i in range(5)]
  assert all(low <= len(c.prompt_ids) < high and max(c.prompt_ids) < 256 for c in ids)
  assert [c.prompt_ids for c in self_distill.prompts([("synthetic", 3)], args, None, 256)] == [
      c.prompt_ids for c in ids[:3]]
  assert ids[0].prompt_messages[0]["content"] == self_distill.render_ids(ids[0].prompt_ids)
  with pytest.raises(ValueError, match="no tokenizer"):
    self_distill.prompts([("gcd", 1)], args, None, 256)
  mixed = self_distill.prompts([("basic_arithmetic", 2), ("chain_sum", 1)], args, object(), 256)
  assert [c.id for c in mixed] == ["basic_arithmetic/0", "basic_arithmetic/1", "chain_sum/0"]


# ----------------------------------------------------------------------------- end to end


def _summary(stdout: str) -> dict[str, tuple[str, float, float, str]]:
  """The summary lines after the "pipeline OUT (...):" header: part -> (status, used, budget,
  figure)."""
  tail = stdout[stdout.rindex("\npipeline "):].splitlines()[2:]
  out = {}
  for line in tail:
    m = LINE.match(line)
    assert m, line
    out[m.group(1)] = (m.group(2), float(m.group(3)), float(m.group(4)), m.group(5))
  return out


def _mtimes(root: Path) -> dict[str, int]:
  return {str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()
          and p.name != state.STATE_FILE}


@pytest.mark.slow  # three runs of the tiny pipeline, ~2.5 minutes on 2 cores
def test_tiny_pipeline_end_to_end_interrupted_resumed_and_skipped(tmp_path: Path):
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "train.pipeline", "--config", TINY, "--budget-minutes", "2",
         "--out", str(out)]
  env = testing.subprocess_env()

  # 1. SIGTERM once training has saved a step: the stage saves, the run stops, unrecorded.
  with open(tmp_path / "first.out", "w") as log:
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 400
    while not (out / "train" / "checkpoints" / "5").exists():
      assert proc.poll() is None, (tmp_path / "first.out").read_text()[-3000:]
      assert time.monotonic() < deadline, "no training checkpoint in time"
      time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 130
  finally:
    if proc.poll() is None:
      proc.kill()
  first = _summary((tmp_path / "first.out").read_text())
  statuses = {p: status for p, (status, *_) in first.items()}
  assert statuses.pop("self_distill") in ("done", "budget")  # all prompts, or its minutes
  assert statuses.pop("prepare_data") in ("done", "budget")
  assert statuses == {"train": "interrupted", "pick": "not run", "export": "not run",
                      "eval": "not run"}
  recorded = json.loads((out / state.STATE_FILE).read_text())
  assert list(recorded["parts"]) == ["self_distill", "prepare_data"]
  data_written = _mtimes(out / "data")

  # 2. The rerun skips what finished and resumes training from its checkpoint.
  second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
  assert re.search(r"^resumed from step \d+ in ", second.stdout, re.M)
  lines = _summary(second.stdout)
  assert list(lines) == ["self_distill", "prepare_data", "train", "pick", "export", "eval"]
  assert lines["self_distill"][0] == lines["prepare_data"][0] == "skipped"
  assert _mtimes(out / "data") == data_written  # the teacher pass did not run again
  assert all(status in ("done", "budget", "skipped") for status, *_ in lines.values())
  # Each part was given its share of what the parts before it left (the budget rule).
  recorded = json.loads((out / state.STATE_FILE).read_text())
  plan = _plan(cmd[3:])
  used = {}
  for part in plan.parts():
    rec = recorded["parts"][part]
    assert rec["budget"] == pytest.approx(budget.part_budget(plan.shares(), used, 2, part))
    assert lines[part][1:3] == pytest.approx((rec["minutes"], rec["budget"]), abs=0.005)
    used[part] = rec["minutes"]
  assert re.match(r"answers (\d+) of \d+ prompts, (\d+) response tokens",
                  lines["self_distill"][3])
  assert re.search(r"samples \d+, tokens \d+ \(\d+ response\)", lines["prepare_data"][3])
  assert re.match(r"step 20/20, final loss \d+\.\d+", lines["train"][3])
  picked = int(re.match(r"picked step (\d+): ", lines["pick"][3]).group(1))
  assert re.match(rf"step {picked} -> {re.escape(str(out / 'export'))}$", lines["export"][3])
  assert re.search(r"synthetic \d\.\d+ \(base \d\.\d+, \d\.\d+x KV\); nll \d", lines["eval"][3])

  # The export is a graft that hamburger_jax.pretrained loads onto the config's model.
  from hamburger_jax import graft_checkpoint, pretrained  # pylint: disable=C0415
  from hamburger_jax.run_config import load_run_config  # pylint: disable=import-outside-toplevel
  model, _ = pretrained.build_run_model(load_run_config(TINY))
  pretrained.load_graft(model, str(out / "export"))
  assert graft_checkpoint.read_meta(str(out / "export"))["trained_steps"] == picked
  results = json.loads((out / "eval" / "results.json").read_text())
  assert set(results["tasks"]) == {"synthetic", "nll"}

  # 3. Everything finished: the same command again does no work.
  written = _mtimes(out)
  third = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert third.returncode == 0, third.stderr[-3000:]
  again = _summary(third.stdout)
  assert list(again) == list(lines)
  assert all(status == "skipped" for status, *_ in again.values())
  assert "$ python -m" not in third.stdout  # no entry point called
  assert _mtimes(out) == written
