"""`python -m infer.eval` end to end on the tiny random model (synthetic + nll tasks): the output
files, the numbers' invariants, the disjointness check and clear errors for bad arguments. Also
the statistics it reports on known samples (bootstrap intervals, token agreement), the
teacher-agreement split of the nll task on a synthetic teacher dataset against a direct
computation, and the trainer's validation reporting the nll task's numbers.

The scorers themselves are tested on known strings in test_evaluation.py, the teacher-forced
evaluator's pooling in test_teacher_forced.py.
"""

from __future__ import annotations

import collections
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import pytest

from hamburger_jax import pretrained
from hamburger_jax.data import pipeline
from hamburger_jax.objectives.distillation import TRACKED_CONFIDENCES, micro_step_losses
from hamburger_jax.evaluation import agreement, report, scoring, teacher_forced
from hamburger_jax.evaluation.scoring import SyntheticTask
from hamburger_jax.evaluation.statistics import bootstrap_ci, paired_bootstrap_ci
from hamburger_jax.model.llama import causal_segment_mask
from hamburger_jax.run_config import DistillConfig, load_run_config
from hamburger_jax.testing import build_synthetic_teacher_dataset

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


def test_plots_redrawn_from_results_json(tiny_eval: Path, tmp_path: Path, capsys):
  """`python -m infer.eval --replot RESULTS` draws the evaluation's plots again, from its JSON
  alone; an evaluation's flag beside it is refused, not ignored."""
  from infer import eval as eval_cli  # pylint: disable=import-outside-toplevel
  assert eval_cli.main(["--replot", str(tiny_eval / "results.json"), "--out", str(tmp_path)]) == 0
  written = capsys.readouterr().out.split()
  assert sorted(os.path.basename(p) for p in written) == sorted(PLOTS)
  for name in PLOTS:
    assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC, name
  with pytest.raises(SystemExit):
    eval_cli.main(["--replot", str(tmp_path / "nowhere.json")])
  assert "run python -m infer.eval first" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    eval_cli.main(["--replot", str(tiny_eval / "results.json"), "--tasks", "synthetic"])
  assert "leave out --tasks" in capsys.readouterr().err


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
  # c = 1 stops every group after one token: exactly the base's tokens (docs/SPEC.md 3).
  assert syn["hamburger"]["1"]["kv_compression"] == 1.0
  assert syn["hamburger"]["1"]["score"] == syn["base"]["score"]
  assert syn["hamburger"]["0.3"]["kv_compression"] >= syn["hamburger"]["1"]["kv_compression"]
  for summary in (syn["base"], *syn["hamburger"].values()):
    lo, hi = summary["ci95"]
    assert 0.0 <= lo <= summary["score"] <= hi <= 1.0
  for h in syn["hamburger"].values():
    assert h["delta"] == pytest.approx(h["score"] - syn["base"]["score"])
    assert h["delta_ci95"][0] <= h["delta"] <= h["delta_ci95"][1]
    assert 0.0 <= h["identical"] <= h["prefix_agreement"] <= 1.0
    diverged = sum(h[f"diverge_{k}"] for k in ("micro_token", "after_merged", "after_single"))
    assert diverged <= 1.0 - h["identical"] + 1e-9
  # At c = 1 nothing is merged and nothing diverges.
  assert syn["hamburger"]["1"]["diverge_after_single"] == 0.0
  # At c = 1 every answer is the base's: no difference, full agreement.
  assert syn["hamburger"]["1"]["delta_ci95"] == [0.0, 0.0]
  assert (syn["hamburger"]["1"]["identical"], syn["hamburger"]["1"]["prefix_agreement"]) == (1, 1)

  nll = results["tasks"]["nll"]
  assert nll["n"] == LIMIT and nll["tokens"] > 0
  assert "teacher_agreement" not in nll  # tiny_data_dir carries no teacher signals
  assert 0 < nll["base"]["score"] < 20 and 0 < nll["hamburger"]["score"] < 20
  assert 0 <= nll["hamburger"]["acc_s1"] <= 1 and 0 <= nll["hamburger"]["stop_acc"] <= 1
  assert 1.0 <= nll["data_kv_compression"] <= 4.0
  assert results["example"]["pieces"]


def test_results_md_and_generations(tiny_eval: Path):
  md = (tiny_eval / "results.md").read_text()
  for column in ("| task | base | HAMburger @ 0.3 | HAMburger @ 1 | KV compression @ 0.3",
                 "speed ratio @ 1 |", "| base NLL | HAMburger NLL |",
                 "| task | delta @ 0.3 | delta @ 1 | identical @ 0.3 | identical @ 1 | "
                 "prefix agreement @ 0.3 | prefix agreement @ 1 |",
                 "| task | micro token @ 0.3 | after merged @ 0.3 | after single @ 0.3 |"):
    assert column in md
  rows = [json.loads(line) for line in (tiny_eval / "generations.jsonl").read_text().splitlines()]
  assert len(rows) == LIMIT * 3  # base + two confidences
  base = {r["id"]: r["token_ids"] for r in rows if r["mode"] == "base"}
  same = {r["id"]: r["token_ids"] for r in rows if r["confidence"] == 1.0}
  assert base == same
  assert all(sum(r["groups"]) == len(r["token_ids"]) for r in rows)

  # The reported intervals and agreements are those of the written generations.
  results = json.loads((tiny_eval / "results.json").read_text())
  syn = results["tasks"]["synthetic"]
  ids = list(base)
  scores = lambda c: [r["score"] for r in rows if r["confidence"] == c]
  low = {r["id"]: r["token_ids"] for r in rows if r["confidence"] == 0.3}
  assert syn["base"]["ci95"] == list(bootstrap_ci(scores(None)))
  assert syn["hamburger"]["0.3"]["delta_ci95"] == list(paired_bootstrap_ci(scores(0.3),
                                                                            scores(None)))
  prefix = [next((i for i, (a, b) in enumerate(zip(base[k], low[k])) if a != b),
                 min(len(base[k]), len(low[k]))) / max(len(base[k]), 1) for k in ids]
  assert syn["hamburger"]["0.3"]["identical"] == pytest.approx(
      np.mean([base[k] == low[k] for k in ids]))
  assert syn["hamburger"]["0.3"]["prefix_agreement"] == pytest.approx(
      np.mean([1.0 if base[k] == low[k] else p for k, p in zip(ids, prefix)]))
  groups = {r["id"]: r["groups"] for r in rows if r["confidence"] == 0.3}
  split = agreement.first_divergence([base[k] for k in ids], [low[k] for k in ids],
                              [groups[k] for k in ids])
  assert {k: syn["hamburger"]["0.3"][k] for k in split} == split
  lo, hi = syn["base"]["ci95"]
  assert f"| {syn['base']['score']:.3f} [{lo:.2f}, {hi:.2f}] |" in md


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


def test_max_group_caps_every_hamburger_group(tmp_path: Path):
  out = tmp_path / "out"
  proc = _eval("--config", TINY, "--tasks", "synthetic", "--limit", "4", "--batch", "4",
               "--confidence", "0.0", "--max-new-tokens", "10", "--max-group", "2", "--no-plots",
               "--out", str(out))
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
  ham = [r for r in rows if r["mode"] == "hamburger"]
  # confidence 0 would emit K = 4 tokens a step; the cap makes every full step 2.
  assert ham and all(max(r["groups"]) == 2 for r in ham)
  assert "HAMburger groups of at most 2 tokens" in (out / "results.md").read_text()
  proc = _eval("--config", TINY, "--tasks", "synthetic", "--limit", "2", "--max-group", "5",
               "--out", str(tmp_path / "bad"))
  assert proc.returncode == 1
  assert "error: --max-group=5 exceeds the model's largest group (graft.max_group=4)" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--tasks", "synthetic,bogus"], "unknown task 'bogus': valid tasks are gsm_symbolic, "
     "basic_arithmetic, chain_sum, letter_counting, gcd, lcm, humaneval, mt_bench, "
     "sharegpt_heldout, synthetic, nll"),
    (["--tasks", "synthetic", "--confidence", "0.5,1.5"], "every confidence must be in [0, 1]"),
    (["--tasks", "synthetic", "--confidence", "high"], "give comma-separated numbers"),
    (["--tasks", "synthetic", "--checkpoint", "/nonexistent/ckpt"],
     "checkpoint /nonexistent/ckpt does not exist"),
    (["--tasks", "nll"], "task nll needs --data DIR"),
    (["--tasks", "synthetic", "--limit", "0"], "--limit=0 must be a positive integer"),
    (["--tasks", "synthetic", "--max-group", "0"], "--max-group=0 must be a positive integer"),
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


# ----------------------------------------------------------------------------- statistics


def _reference_percentile_ci(x: list[float], n_resamples: int, seed: int) -> tuple[float, float]:
  """The percentile bootstrap written out slowly: resample, sort the means, interpolate the
  2.5% and 97.5% points linearly between order statistics (numpy's default)."""
  rng = random.Random(seed)
  means = sorted(sum(rng.choice(x) for _ in x) / len(x) for _ in range(n_resamples))

  def point(q: float) -> float:
    pos = q * (len(means) - 1)
    i = math.floor(pos)
    return means[i] + (pos - i) * (means[min(i + 1, len(means) - 1)] - means[i])

  return point(0.025), point(0.975)


def test_bootstrap_ci_known_cases():
  assert bootstrap_ci([0.7] * 50) == (pytest.approx(0.7), pytest.approx(0.7))
  coin = [0.0, 1.0] * 100  # mean 0.5, n = 200: 1.96 x sqrt(0.25 / 200) = 0.069 either side
  lo, hi = bootstrap_ci(coin)
  assert lo == pytest.approx(0.5 - 0.069, abs=0.012) and hi == pytest.approx(0.5 + 0.069, abs=0.012)
  assert bootstrap_ci(coin) == (lo, hi)  # seeded
  assert bootstrap_ci(coin, seed=1) != (lo, hi)
  assert all(math.isnan(v) for v in bootstrap_ci([]))
  with pytest.raises(ValueError, match="one number per example"):
    bootstrap_ci([[1.0, 2.0]])


def test_bootstrap_ci_matches_a_slow_reference_on_a_skewed_sample():
  # Skewed scores: the percentile interval is asymmetric about the mean (a normal approximation
  # would not be), and an independent resampler lands on the same interval.
  x = np.random.default_rng(3).lognormal(0.0, 1.5, 60).tolist()
  lo, hi = bootstrap_ci(x, n_resamples=4000)
  ref_lo, ref_hi = _reference_percentile_ci(x, 4000, seed=0)
  width = ref_hi - ref_lo
  assert abs(lo - ref_lo) < 0.06 * width and abs(hi - ref_hi) < 0.06 * width
  mean = float(np.mean(x))
  assert hi - mean > 1.2 * (mean - lo)  # the long right tail


def test_paired_bootstrap_ci_resamples_pairs_together():
  rng = np.random.default_rng(0)
  base = rng.uniform(0.0, 1.0, 200)  # examples differ a lot in difficulty
  ham = base + rng.normal(0.05, 0.01, 200)  # HAMburger: a little better on each
  lo, hi = paired_bootstrap_ci(ham, base)
  assert lo < 0.05 < hi
  # Resampling the two sides independently would carry the examples' spread (width ~0.11).
  base_lo, base_hi = bootstrap_ci(base)
  assert hi - lo < 0.05 * (base_hi - base_lo)
  assert (lo, hi) == bootstrap_ci(ham - base)
  assert paired_bootstrap_ci([1.0, 0.5, 0.0], [0.5, 0.0, -0.5]) == (
      pytest.approx(0.5), pytest.approx(0.5))
  with pytest.raises(ValueError, match="one pair per example"):
    paired_bootstrap_ci([1.0, 0.0], [1.0])


def test_token_agreement():
  token_agreement = agreement.token_agreement
  assert scoring.token_agreement is token_agreement  # infer.eval reports the library's measure
  base = [[1, 2, 3, 4], [5, 6], [7], [], [1, 2]]
  ham = [[1, 2, 3, 4], [5, 9, 9], [8], [], [1, 2, 3]]
  # identical: examples 0 and 3; prefixes 4/4, 1/2, 0/1, (both empty) 1, 2/2 (ham runs on).
  assert token_agreement(base, ham) == {"identical": pytest.approx(2 / 5),
                                           "prefix_agreement": pytest.approx(3.5 / 5)}
  with pytest.raises(ValueError, match="compare the same examples"):
    token_agreement(base, ham[:2])


def test_first_divergence():
  assert scoring.first_divergence is agreement.first_divergence
  base = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2], [1, 2, 3]]
  ham = [[1, 2, 3, 4], [1, 9, 3, 4], [1, 2, 9, 4], [1, 2, 3, 9], [1, 2, 3], [1, 2, 3, 4, 5]]
  groups = [[4], [2, 2], [2, 2], [1, 1, 1, 1], [2, 1], [3, 1, 1]]
  # 0 identical; 1 differs at token 1, inside a group (micro token); 2 at token 2, the first of a
  # group after a merged one; 3 at token 3, after a single-token entry; 4 and 5 run past the
  # base's end (one is the other cut short): counted in none.
  assert agreement.first_divergence(base, ham, groups) == {
      "diverge_micro_token": pytest.approx(1 / 6), "diverge_after_merged": pytest.approx(1 / 6),
      "diverge_after_single": pytest.approx(1 / 6)}
  with pytest.raises(ValueError, match="compare the same examples"):
    agreement.first_divergence(base, ham, groups[:2])


# ----------------------------------------------------------------------------- teacher agreement

TEACHER_BATCH = 2  # rows per batch: several batches over the 16 validation records


@pytest.fixture(scope="module")
def teacher_nll(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
  """The nll task of the tiny random model on a synthetic dataset carrying its base's teacher
  signals (as tests/test_training.py's teacher_data_dir)."""
  cfg = load_run_config(TINY, ["graft.base_lora_rank=4"])
  data = build_synthetic_teacher_dataset(str(tmp_path_factory.mktemp("teacher") / "data"), cfg,
                                         n_train=4, n_val=16)
  model, _ = pretrained.build_run_model(cfg)
  return SimpleNamespace(model=model, data=data, result=teacher_forced.nll_task(
      model, data, "validation", None, TEACHER_BATCH))


def test_teacher_agreement_is_pooled_over_each_metrics_groups(teacher_nll: SimpleNamespace):
  """Each number is (groups agreeing) / (groups counted) over the whole split, computed here from
  the per-group agreement of the same batches rather than from distill_loss's batch means."""

  model = teacher_nll.model
  k = model.max_group

  @jax.jit
  def agreement(batch):  # [B, G, K]: micro step i's argmax is the teacher's greedy token
    ids, size = batch["input_ids"], batch["input_size"]
    feats, _ = model.base_features(model.smash(ids, size), batch["positions"],
                                   causal_segment_mask(batch["segment_ids"]), merged_bt=size >= 2)
    feats = feats[np.arange(ids.shape[0])[:, None], batch["pred_index"]]
    b, g, f, d = feats.shape
    agree = micro_step_losses(model, feats.reshape(b * g, f, d), batch, DistillConfig(), 1024,
                              batch["target_size"].reshape(-1))[2]
    return agree.reshape(b, g, k)

  source = pipeline.open_split(teacher_nll.data, "validation", k)
  records = [source[i] for i in range(len(source))]
  hits, counts = collections.Counter(), collections.Counter()
  batch_means = collections.defaultdict(list)
  for batch in teacher_forced.split_batches(records, k, TEACHER_BATCH):
    agree = np.asarray(agreement(batch))
    window = batch["window_size"]
    rows = np.arange(window.shape[0])[:, None]
    merged = (batch["input_size"][rows, batch["pred_index"]] >= 2) & (window > 0)
    masks = {"merged": (merged, 0), "unmerged": ((window > 0) & ~merged, 0),
             **{f"s{i + 1}": (window > i, i) for i in range(k)}}
    for name, (mask, step) in masks.items():
      hits[name] += int((agree[..., step] & mask).sum())
      counts[name] += int(mask.sum())
      if mask.any():
        batch_means[name].append((agree[..., step] & mask).sum() / mask.sum())

  result = teacher_nll.result["teacher_agreement"]
  assert list(result) == ["merged", "unmerged", *[f"s{i + 1}" for i in range(k)], "groups"]
  assert result["groups"] == dict(counts)
  assert counts["merged"] > 0 and counts["unmerged"] > 0
  assert counts["merged"] + counts["unmerged"] == counts["s1"]
  for name, n in counts.items():
    assert result[name] == pytest.approx(hits[name] / n, abs=1e-6), name
  # The test can tell the weighting apart: plain means of the batch means differ somewhere.
  assert len(batch_means["s1"]) > 1
  assert any(abs(np.mean(means) - hits[name] / counts[name]) > 1e-3
             for name, means in batch_means.items())


def test_teacher_acceptance_replays_the_decoding_rule(teacher_nll: SimpleNamespace):
  """tokens per step and accepted agreement at each confidence, recomputed in NumPy from the
  stop logits and per-step agreement of the same batches, with the engine's rule written out:
  token i + 1 is emitted while 1 - sigmoid(stop_j) >= c held at every step j <= i (c < 1) and
  the window has it."""
  model = teacher_nll.model
  k = model.max_group

  @jax.jit
  def stop_and_agree(batch):
    ids, size = batch["input_ids"], batch["input_size"]
    feats, _ = model.base_features(model.smash(ids, size), batch["positions"],
                                   causal_segment_mask(batch["segment_ids"]), merged_bt=size >= 2)
    feats = feats[np.arange(ids.shape[0])[:, None], batch["pred_index"]]
    b, g, f, d = feats.shape
    feats = feats.reshape(b * g, f, d)
    agree = micro_step_losses(model, feats, batch, DistillConfig(), 1024,
                              batch["target_size"].reshape(-1))[2]
    h = model.micro_hidden(feats, batch["window_ids"].reshape(-1, k))
    return jax.nn.sigmoid(-model.stop_logits(h)), agree

  source = pipeline.open_split(teacher_nll.data, "validation", k)
  records = [source[i] for i in range(len(source))]
  groups, emitted, accepted, accepted_agree = (collections.Counter() for _ in range(4))
  for batch in teacher_forced.split_batches(records, k, TEACHER_BATCH):
    p_continue, agree = (np.asarray(x) for x in stop_and_agree(batch))
    size = batch["window_size"].reshape(-1)
    for c in TRACKED_CONFIDENCES:
      for n in np.flatnonzero(size > 0):
        groups[c] += 1
        emitted[c] += 1
        for i in range(k - 1):
          if not (c < 1.0 and p_continue[n, i] >= c and i + 1 < size[n]):
            break
          emitted[c] += 1
          accepted[c] += 1
          accepted_agree[c] += int(agree[n, i + 1])
  result = teacher_nll.result["teacher_acceptance"]
  for c in TRACKED_CONFIDENCES:
    tag = f"c{round(100 * c)}"
    assert result[f"tf_tokens_per_step_{tag}"] == pytest.approx(emitted[c] / groups[c], abs=1e-6)
    # nothing accepted: undefined (None), not a made-up 0
    assert result[f"tf_accepted_agree_{tag}"] == (
        pytest.approx(accepted_agree[c] / accepted[c], abs=1e-6) if accepted[c] else None)
  # The random graft continues about half the time: the confidences give different answers.
  lo, hi = TRACKED_CONFIDENCES[0], TRACKED_CONFIDENCES[-1]
  assert emitted[lo] / groups[lo] > emitted[hi] / groups[hi]
  md = report.markdown({"config": {"confidence": [0.5], "batch": TEACHER_BATCH}, "created": "now",
                        "model": {"base": "random", "checkpoint": None},
                        "command": "python -m infer.eval", "tasks": {"nll": teacher_nll.result}})
  assert "| tokens per step | " + " | ".join(
      f"{emitted[c] / groups[c]:.3f}" for c in TRACKED_CONFIDENCES) + " |" in md


def test_teacher_agreement_in_results_md(teacher_nll: SimpleNamespace):
  results = {"config": {"confidence": [0.5], "batch": TEACHER_BATCH}, "created": "now",
             "model": {"base": "random", "checkpoint": None}, "command": "python -m infer.eval",
             "tasks": {"nll": teacher_nll.result}}
  md = report.markdown(results)
  agree = teacher_nll.result["teacher_agreement"]
  assert "| merged | unmerged | s1 | s2 | s3 | s4 |" in md
  assert (f"| {agree['merged']:.3f} ({agree['groups']['merged']}) | "
          f"{agree['unmerged']:.3f} ({agree['groups']['unmerged']}) |") in md


def _draft_agreement(model, data: str, drafting: bool) -> tuple[dict, dict]:
  """Per draft i (micro step i of each window), the share that is the teacher's greedy token,
  pooled over the split in NumPy from the argmax of the drafting decoder's logits on the stored
  base features, and the windows counted."""
  k = model.max_group
  source = pipeline.open_split(data, "validation", k)
  records = [source[i] for i in range(len(source))]
  hits, counts = collections.Counter(), collections.Counter()
  argmax = jax.jit(lambda f, w: model.base.logits(model.micro_hidden(f, w, drafting)).argmax(-1))
  for batch in teacher_forced.split_batches(records, k, TEACHER_BATCH):
    feats = batch["teacher_features"]
    b, g, f, d = feats.shape
    got = np.asarray(argmax(feats.reshape(b * g, f, d), batch["window_ids"].reshape(-1, k)))
    want = batch["teacher_topk_ids"].reshape(b * g, k, -1)[..., 0]
    size = batch["window_size"].reshape(-1)
    for i in range(1, k):
      hits[f"s{i + 1}"] += int(((got[:, i] == want[:, i]) & (size > i)).sum())
      counts[f"s{i + 1}"] += int((size > i).sum())
  return {n: hits[n] / counts[n] for n in counts}, dict(counts)


def test_verify_drafts_are_the_drafting_decoders_argmax_on_plain_features(
    teacher_nll: SimpleNamespace):
  """The nll task reports what verify mode's drafts would be: from the stored exact base
  features, the share of each draft that is the base's greedy token, drafted by the graft's
  drafter where it has one, else its micro decoder; results.md shows it."""
  drafts = teacher_nll.result["verify_drafts"]
  assert drafts["drafter"] == "micro decoder"
  want, counts = _draft_agreement(teacher_nll.model, teacher_nll.data, drafting=False)
  assert drafts["groups"] == counts and min(counts.values()) > 0
  for n, v in want.items():
    assert drafts["agree"][n] == pytest.approx(v, abs=1e-6), n
  md = report.markdown({"config": {"confidence": [0.5], "batch": TEACHER_BATCH},
                        "created": "now", "model": {"base": "random", "checkpoint": None},
                        "command": "python -m infer.eval", "tasks": {"nll": teacher_nll.result}})
  assert "Verify mode's drafts (micro decoder)" in md
  assert f"| {drafts['agree']['s2']:.3f} ({counts['s2']}) |" in md
  # A graft with a drafter drafts with it: other drafts than its micro decoder's.
  cfg = load_run_config(TINY, ["graft.base_lora_rank=4", "graft.drafter_layers=1"])
  model, _ = pretrained.build_run_model(cfg)
  k = model.max_group
  source = pipeline.open_split(teacher_nll.data, "validation", k)
  batches = list(teacher_forced.split_batches([source[i] for i in range(len(source))], k,
                                              TEACHER_BATCH))
  got = teacher_forced.verify_drafts(model, batches)
  assert got["drafter"] == "drafter"
  want, _ = _draft_agreement(model, teacher_nll.data, drafting=True)
  micro, _ = _draft_agreement(model, teacher_nll.data, drafting=False)
  assert want != micro
  for n, v in want.items():
    assert got["agree"][n] == pytest.approx(v, abs=1e-6), n


def test_teacher_signals_of_another_base_are_not_compared(teacher_nll: SimpleNamespace):
  assert teacher_forced.teacher_mismatch(teacher_nll.model, teacher_nll.data) is None
  # another random base
  other, _ = pretrained.build_run_model(load_run_config(TINY, ["train.seed=1"]))
  assert "segmented with another base" in teacher_forced.teacher_mismatch(other, teacher_nll.data)
  # layers 1, 3
  other, _ = pretrained.build_run_model(load_run_config(TINY, ["graft.num_features=2"]))
  assert "stores the teacher's features of layers" in teacher_forced.teacher_mismatch(
      other, teacher_nll.data)


# ----------------------------------------------------------------------------- trainer agreement


def _trainer_validation(cfg, records: list) -> dict[str, float]:
  """Trainer.evaluate of a fresh trainer (its model is build_run_model's: the nll task's) over
  `records` packed in the training shapes (2-row batches: several, for the pooling to matter),
  not the nll task's."""
  from hamburger_jax import training  # pylint: disable=import-outside-toplevel
  tr = training.Trainer(cfg)
  d = cfg.data
  batches = pipeline.packed_dataset(records, batch_rows=tr.local_rows, entries=d.entries,
                                    groups=d.groups, max_group=cfg.graft.max_group, seed=None,
                                    num_epochs=1, prefetch=0)
  return tr.evaluate(iter(batches), max_batches=len(records))


def _assert_same_numbers(val: dict[str, float], nll: dict[str, Any]) -> None:
  ham = nll["hamburger"]
  assert val["val_lm_loss"] == pytest.approx(ham["score"], rel=1e-5)
  names = [n for n in ham if n != "score"]
  assert {"loss", "stop_bce", "stop_acc", "acc_s1", "acc_s4"} <= set(names)
  for n in names:
    assert val[f"val_{n}"] == pytest.approx(ham[n], rel=1e-5, abs=1e-6), n


def test_trainer_validation_reports_the_nll_tasks_numbers(tiny_eval: Path, tiny_data_dir: str):
  """The same model on the same records: the trainer's validation (2-row batches of the run's
  shape) and infer.eval's nll task (4-row batches of its own shape, in results.json) agree on
  every metric they share, whatever the packing."""
  nll = json.loads((tiny_eval / "results.json").read_text())["tasks"]["nll"]
  records = teacher_forced.read_records(tiny_data_dir, "validation", 4, LIMIT)
  cfg = load_run_config(TINY, [f"data.dir={tiny_data_dir}", "data.rows=2"])
  _assert_same_numbers(_trainer_validation(cfg, records), nll)


def test_trainer_validation_reports_the_nll_tasks_teacher_numbers(teacher_nll: SimpleNamespace):
  records = teacher_forced.read_records(teacher_nll.data, "validation", 4)
  cfg = load_run_config(TINY, ["graft.base_lora_rank=4", f"data.dir={teacher_nll.data}",
                               "data.rows=2"])
  val = _trainer_validation(cfg, records)
  _assert_same_numbers(val, teacher_nll.result)
  agree = teacher_nll.result["teacher_agreement"]
  for n in ("merged", "unmerged", "s1", "s2", "s3", "s4"):
    assert val[f"val_agree_{n}"] == pytest.approx(agree[n], rel=1e-5), n
  for n, v in teacher_nll.result["teacher_acceptance"].items():
    assert val[f"val_{n}"] == pytest.approx(0.0 if v is None else v, rel=1e-5), n


# ----------------------------------------------------------------------------- merged-entry ablation

def test_ablation_graft_variant_is_the_nll_tasks_agreement(teacher_nll: SimpleNamespace):
  """infer.experiments.ablate_merged's "graft" row is the nll task's teacher agreement; with the adapters at
  zero (the fixture's fresh graft) "no_adapters" is the same model, and "last_token" is not."""
  from infer.experiments import ablate_merged  # pylint: disable=import-outside-toplevel
  out = ablate_merged.run(teacher_nll.model, teacher_nll.data, "validation", None, TEACHER_BATCH)
  assert teacher_nll.model.merged_entry == "graft"  # the variants are copies
  want = teacher_nll.result["teacher_agreement"]
  for m in ablate_merged.METRICS:
    assert out["graft"][m] == pytest.approx(want[m], abs=1e-6)
    assert out["no_adapters"][m] == pytest.approx(want[m], abs=1e-6)
  assert out["graft"]["nll"] == pytest.approx(teacher_nll.result["hamburger"]["score"])
  assert out["last_token"]["merged"] != pytest.approx(want["merged"], abs=1e-6)


def test_ablation_variants_make_the_merged_entry_they_name():
  """with_merged_entry: "last_token" makes a group's entry its last token's embedding and reads
  it with the exact base; "no_adapters" keeps the embedder's entry and the exact base; the
  model given is unchanged."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from hamburger_jax.config import HamburgerConfig  # pylint: disable=import-outside-toplevel
  from hamburger_jax.model import lora  # pylint: disable=import-outside-toplevel
  from hamburger_jax.model.hamburger import Hamburger, with_merged_entry  # pylint: disable=C0415
  from hamburger_jax.model.llama import causal_segment_mask  # pylint: disable=C0415
  cfg = load_run_config(TINY)
  graft = dataclasses.replace(cfg.graft, base_lora_rank=2)
  model = Hamburger(HamburgerConfig(cfg.model.random, graft), rngs=nnx.Rngs(0))
  for i, lin in enumerate(lora.base_linears(model.base)):
    lin.lora.b.set_value(jax.random.normal(jax.random.key(i), lin.lora.b.shape))
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (3, 4)))
  sizes = jnp.asarray([1, 3, 4])
  e = model.base.embed(ids)
  last = with_merged_entry(model, "last_token")
  np.testing.assert_array_equal(last.smash(ids, sizes), e[jnp.arange(3), sizes - 1])
  plain = with_merged_entry(model, "no_adapters")
  np.testing.assert_array_equal(plain.smash(ids, sizes), model.smash(ids, sizes))
  assert not np.allclose(model.smash(ids, sizes)[1], e[1, 2])  # the embedder merges
  x = model.smash(ids, sizes)[None]
  pos, mask = jnp.arange(3)[None], causal_segment_mask(jnp.ones((1, 3), jnp.int32))
  merged = jnp.ones((1, 3), bool)
  exact = model.base_features(x, pos, mask)[0]
  np.testing.assert_array_equal(plain.base_features(x, pos, mask, merged_bt=merged)[0], exact)
  assert not np.allclose(model.base_features(x, pos, mask, merged_bt=merged)[0], exact)
  assert model.merged_entry == "graft"
  with pytest.raises(ValueError, match="use one of"):
    with_merged_entry(model, "mean")


def test_ablation_needs_teacher_signals(tiny_data_dir: str):
  from infer.experiments import ablate_merged  # pylint: disable=import-outside-toplevel
  cfg = load_run_config(TINY)
  model, _ = pretrained.build_run_model(cfg)
  with pytest.raises(ValueError, match="no usable teacher signals"):
    ablate_merged.run(model, tiny_data_dir, "validation", 4, 2, variants=("graft",))
  proc = subprocess.run([sys.executable, "-m", "infer.experiments.ablate_merged", "--data",
                         "/no/such/dir"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and "--data /no/such/dir does not exist" in proc.stderr


def _write_generations(directory, rows):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "generations.jsonl"), "w") as f:
    for task, i, mode, c, score, ids, steps in rows:
      f.write(json.dumps({"task": task, "id": i, "mode": mode, "confidence": c, "score": score,
                          "token_ids": ids, "macro_steps": steps}) + "\n")


def test_compare_evals_pairs_the_same_examples(tmp_path, capsys):
  from infer import compare_evals  # pylint: disable=import-outside-toplevel
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  _write_generations(a, [("gcd", 0, "base", None, 1.0, [1], 1),
                         ("gcd", 0, "hamburger", 0.5, 1.0, [1, 2, 3, 4], 2),
                         ("gcd", 1, "hamburger", 0.5, 0.0, [5, 6], 2),
                         ("gcd", 2, "hamburger", 0.5, 1.0, [7], 1)])  # not in b: unpaired
  _write_generations(b, [("gcd", 0, "hamburger", 0.5, 0.0, [1, 2, 3, 9], 4),
                         ("gcd", 1, "hamburger", 0.5, 0.0, [5, 6], 1)])
  rows = compare_evals.compare(compare_evals.read_run(a), compare_evals.read_run(b))
  assert len(rows) == 1
  r = rows[0]
  assert (r["task"], r["confidence"], r["n"], r["a"], r["b"]) == ("gcd", 0.5, 2, 0.5, 0.0)
  assert (r["k_a"], r["k_b"], r["identical"]) == (1.5, 1.2, 0.5)
  lo, hi = r["delta_ci95"]
  assert 0.0 <= lo <= 0.5 <= hi <= 1.0
  assert compare_evals.main([a, b]) == 0
  assert "| gcd | 0.5 | 2 | 0.500 | 0.000 | +0.500" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="generations.jsonl does not exist"):
    compare_evals.main([a, str(tmp_path / "missing")])


def test_fidelity_and_verify_through_the_cli(tmp_path: Path):
  """--tasks fidelity on a fidelity set of the tiny base (results.json's `fidelity` entry and
  its results.md table), and --verify: each task's verify run gives the base's tokens."""
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.data.teacher_pass import base_fingerprint  # pylint: disable=C0415
  from hamburger_jax.evaluation import fidelity_set  # pylint: disable=C0415
  from hamburger_jax.run_config import load_run_config  # pylint: disable=C0415
  model, _ = pretrained.build_run_model(load_run_config(TINY))
  rng = np.random.default_rng(4)
  records = []
  for i in range(4):
    groups = tuple(int(g) for g in rng.choice([1, 2, 3, 4], 6))
    records.append(fidelity_set.FidelityRecord(
        "synthetic", f"s{i}", tuple(int(t) for t in rng.integers(1, 250, 5)),
        tuple(int(t) for t in rng.integers(1, 250, sum(groups))), groups))
  path = fidelity_set.save(fidelity_set.FidelitySet(
      tuple(records), {"base_fingerprint": base_fingerprint(model.base)}),
      str(tmp_path / "set.json"))
  out = tmp_path / "out"
  proc = _eval("--config", TINY, "--tasks", "synthetic,fidelity", "--fidelity-set", path,
               "--limit", "4", "--batch", "4", "--confidence", "0.3", "--max-new-tokens", "10",
               "--verify", "0", "--no-plots", "--out", str(out))
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = json.loads((out / "results.json").read_text())
  fid = results["tasks"]["fidelity"]
  assert fid["n"] == 4 and fid["score"] == fid["agree_merged"]
  assert {"agree_single", "agree_one_merge", "agree_s2", "kl_merged", "by_size"} <= set(fid)
  verify = results["tasks"]["synthetic"]["verify"]
  md = (out / "results.md").read_text()
  assert "Fidelity, teacher-forced on the fidelity set" in md and "Verify mode" in md
  rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
  assert {r["mode"] for r in rows} == {"base", "hamburger", "verify"}
  # Tokens a base forward: the verify answers' tokens over their forwards (macro steps), pooled.
  answers = [r for r in rows if r["mode"] == "verify" and r["task"] == "synthetic"]
  assert len(answers) == 4
  assert all(sum(r["groups"]) == len(r["token_ids"]) and len(r["groups"]) == r["macro_steps"]
             for r in answers)
  assert verify["identical"] == 1.0 and verify["tokens_per_forward"] == pytest.approx(
      sum(len(r["token_ids"]) for r in answers) / sum(r["macro_steps"] for r in answers))
  proc = _eval("--config", TINY, "--tasks", "fidelity", "--limit", "2", "--out",
               str(tmp_path / "other"))
  assert proc.returncode == 1 and "another base" in proc.stderr  # the committed set: SmolLM2's
