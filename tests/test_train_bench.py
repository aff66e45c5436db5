"""The train bench's report (hamburger_jax/benchmarks/train_step.py): each step's MFU over the
devices it ran on, and its error for data that fill too few batches (figures given, never
timed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hamburger_jax import testing
from hamburger_jax.costs import peaks
from hamburger_jax.benchmarks import train_step

PEAK = peaks.Peak("fake device", 100e12, 1e12, "given")  # one device's


def _row(model_flops: float, seconds: float, devices: int) -> train_step.StepRow:
  flops = SimpleNamespace(model=model_flops, executed=model_flops)
  return train_step.StepRow(seconds, 1.0, flops, None, flops, devices)


def test_each_step_is_divided_by_the_peak_of_the_devices_it_ran_on():
  """On a host of 4 devices: the SFT baseline runs on one (50 TFLOP in 1 s of one 100 TFLOP/s
  device: 50%, where the peak of all 4 read 12.5%), the HAMburger step on all 4."""
  sft, ham = _row(50e12, 1.0, 1), _row(100e12, 0.5, 4)
  assert sft.mfu(PEAK) == pytest.approx(0.5)
  assert ham.mfu(PEAK) == pytest.approx(0.5)
  cfg = SimpleNamespace(data=SimpleNamespace(rows=4, entries=256, groups=128),
                        train=SimpleNamespace(trainable="all", recipe="paper"),
                        model=SimpleNamespace(param_dtype="float32", dtype="float32"))
  lines = train_step.report_lines(
      train_step.TrainBench("cfg.yaml"), cfg, train_step.Batches([[], []], 320, 1000),
      {"plain SFT of the base": sft, "HAMburger": ham}, (10.0, 5000.0), PEAK)
  rows = {r["step"]: r for r in testing.markdown_tables("\n".join(lines))[0]}
  assert {name: (r["devices"], r["MFU"]) for name, r in rows.items()} == {
      "plain SFT of the base": ("1", "50.0%"), "HAMburger": ("4", "50.0%"),
      "input pipeline (grain, alone)": ("-", "-")}


def test_too_little_data_is_one_error_line(monkeypatch, capsys):
  from train import bench  # pylint: disable=import-outside-toplevel

  def too_few(*_):
    raise train_step.BenchError("DIR fills 1 batch(es) of 2 rows; the bench needs 2")

  monkeypatch.setattr(train_step, "run", too_few)
  assert bench.main(["--config", "configs/tiny.yaml", "--random-weights", "--rows", "2"]) == 1
  assert capsys.readouterr().err == "error: DIR fills 1 batch(es) of 2 rows; the bench needs 2\n"
