"""`python -m infer.eval` end to end on the tiny random model (synthetic + nll tasks): the output
files, the numbers' invariants, the disjointness check and clear errors for bad arguments.

The scorers themselves are tested on known strings in test_evaluation.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infer.eval import SyntheticTask

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("quality_vs_compression.png", "speed.png", "group_sizes.png", "groups_example.png")
LIMIT = 6


def _eval(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "infer.eval", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_eval(tiny_data_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
  out = tmp_path_factory.mktemp("eval")
  proc = _eval("--config", TINY, "--tasks", "synthetic,nll", "--data", tiny_data_dir,
               "--confidence", "0.3,1.0", "--limit", str(LIMIT), "--batch", "4",
               "--max-new-tokens", "12", "--train-data", tiny_data_dir, "--out", str(out))
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "no evaluation prompt is among" in proc.stderr  # --train-data was checked
  assert "| synthetic" in proc.stdout  # the markdown table is printed too
  return out


def test_writes_results_generations_and_pngs(tiny_eval: Path):
  for name in ("results.json", "results.md", "generations.jsonl", *PLOTS):
    path = tiny_eval / name
    assert path.exists() and path.stat().st_size > 0, name
  for name in PLOTS:
    assert (tiny_eval / name).read_bytes()[:8] == PNG_MAGIC, name


def test_results_json_numbers(tiny_eval: Path):
  results = json.loads((tiny_eval / "results.json").read_text())
  assert {"command", "config", "model", "tasks", "group_sizes", "example"} <= set(results)
  assert results["command"].startswith("python -m infer.eval --config")
  assert results["config"]["confidence"] == [0.3, 1.0]
  syn = results["tasks"]["synthetic"]
  assert syn["n"] == LIMIT and syn["metric"] == "token_match"
  assert set(syn["hamburger"]) == {"0.3", "1"}
  for summary in (syn["base"], *syn["hamburger"].values()):
    assert 0.0 <= summary["score"] <= 1.0
    assert summary["kv_compression"] >= 1.0
    assert summary["tokens_per_s"] > 0
  assert syn["base"]["kv_compression"] == 1.0
  for h in syn["hamburger"].values():
    assert h["speed_ratio"] > 0
    assert sum(h["group_sizes"].values()) == h["macro_steps"]
  # c = 1 stops every group after one token: exactly the base's tokens (SPEC.md 3).
  assert syn["hamburger"]["1"]["kv_compression"] == 1.0
  assert syn["hamburger"]["1"]["score"] == syn["base"]["score"]
  assert syn["hamburger"]["0.3"]["kv_compression"] >= syn["hamburger"]["1"]["kv_compression"]

  nll = results["tasks"]["nll"]
  assert nll["n"] == LIMIT and nll["tokens"] > 0
  assert 0 < nll["base"]["score"] < 20 and 0 < nll["hamburger"]["score"] < 20
  assert 0 <= nll["hamburger"]["acc_s1"] <= 1 and 0 <= nll["hamburger"]["stop_acc"] <= 1
  assert 1.0 <= nll["data_kv_compression"] <= 4.0
  assert results["example"]["pieces"]


def test_results_md_and_generations(tiny_eval: Path):
  md = (tiny_eval / "results.md").read_text()
  for column in ("| task | base | HAMburger @ 0.3 | HAMburger @ 1 | KV compression @ 0.3",
                 "speed ratio @ 1 |", "| base NLL | HAMburger NLL |"):
    assert column in md
  rows = [json.loads(line) for line in (tiny_eval / "generations.jsonl").read_text().splitlines()]
  assert len(rows) == LIMIT * 3  # base + two confidences
  base = {r["id"]: r["token_ids"] for r in rows if r["mode"] == "base"}
  same = {r["id"]: r["token_ids"] for r in rows if r["confidence"] == 1.0}
  assert base == same
  assert all(sum(r["groups"]) == len(r["token_ids"]) for r in rows)


def test_overlapping_training_prompts_are_an_error(tmp_path: Path):
  """A training JSONL that holds an evaluation prompt (by its ids) stops the evaluation."""
  prompt = SyntheticTask(256, 4).examples(1)[0].messages
  train = tmp_path / "train.jsonl"
  train.write_text(json.dumps({"prompt": "x", "response": "y", "prompt_ids": prompt,
                               "response_ids": [5, 6]}) + "\n")
  proc = _eval("--config", TINY, "--tasks", "synthetic", "--limit", "2", "--train-data",
               str(train), "--out", str(tmp_path / "out"))
  assert proc.returncode == 1
  assert "error: task synthetic: 1 training question(s) also in the evaluation set" in proc.stderr
  assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--tasks", "synthetic,bogus"], "unknown task 'bogus': valid tasks are gsm_symbolic, "
     "basic_arithmetic, chain_sum, letter_counting, gcd, lcm, humaneval, mt_bench, synthetic, "
     "nll"),
    (["--tasks", "synthetic", "--confidence", "0.5,1.5"], "every confidence must be in [0, 1]"),
    (["--tasks", "synthetic", "--confidence", "high"], "give comma-separated numbers"),
    (["--tasks", "synthetic", "--checkpoint", "/nonexistent/ckpt"],
     "checkpoint /nonexistent/ckpt does not exist"),
    (["--tasks", "nll"], "task nll needs --data DIR"),
    (["--tasks", "synthetic", "--limit", "0"], "--limit=0 must be a positive integer"),
])
def test_bad_arguments_exit_2_with_an_error_line(args: list[str], message: str):
  proc = _eval("--config", TINY, *args, timeout=60)
  assert proc.returncode == 2
  error = [line for line in proc.stderr.splitlines() if "error:" in line]
  assert error and message in error[-1], proc.stderr


def test_text_task_on_a_model_without_tokenizer_is_an_error(tmp_path: Path):
  proc = _eval("--config", TINY, "--tasks", "basic_arithmetic", "--out", str(tmp_path))
  assert proc.returncode == 1
  assert "error: tasks ['basic_arithmetic'] need a tokenizer" in proc.stderr
  assert "use --tasks synthetic,nll" in proc.stderr
