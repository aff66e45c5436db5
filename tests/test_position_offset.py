"""graft.position_offset end to end (docs/method.md section 2): with offset 1 every response
entry sits one RoPE position further (the release's generate convention) in the training
pipeline, in validation, in the NLL evaluation, in the export and at decode."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hamburger_jax import assets, layout, pretrained, testing
from hamburger_jax.data import pipeline
from hamburger_jax.decode.engine import Engine
from hamburger_jax.evaluation.teacher_forced import split_batches
from hamburger_jax.run_config import load_run_config
from hamburger_jax import training

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def _records(data_dir: str, n: int) -> list[dict]:
  split = pipeline.open_split(data_dir, "validation", 4)
  return [split[i] for i in range(n)]


def _segments(batch) -> list[tuple[int, ...]]:
  """Positions of each packed sample of a batch (rows hold several, by segment id)."""
  out = []
  for pos, seg in zip(batch["positions"], batch["segment_ids"]):
    out += [tuple(pos[seg == s].tolist()) for s in np.unique(seg[seg > 0])]
  return sorted(out)


def test_split_batches_follow_the_layout_rules(tiny_data_dir):
  records = _records(tiny_data_dir, 6)
  for offset in (0, 1):
    batch = next(iter(split_batches(records, 4, 8, offset)))
    want = sorted(tuple(layout.merged_positions(int(r["prompt_len"]), np.asarray(r["groups"]),
                                                offset).tolist()) for r in records)
    assert _segments(batch) == want
  r = records[0]  # with offset 1 the last group's entry sits at P - 1 + (response length) + 1
  last = layout.merged_positions(int(r["prompt_len"]), np.asarray(r["groups"]), 1)[-1]
  assert last == int(r["prompt_len"]) + sum(r["groups"])


def test_training_and_decoding_at_offset_one(tiny_data_dir, tmp_path, monkeypatch):
  monkeypatch.setattr(assets, "smollm2_gguf", lambda: (_ for _ in ()).throw(
      assets.AssetError("no tokenizer for the random tiny base")))
  seen = []
  real = pipeline.make_train_iterator

  def spy(*args, **kwargs):
    seen.append(kwargs.get("position_offset"))
    return real(*args, **kwargs)

  monkeypatch.setattr(pipeline, "make_train_iterator", spy)
  sets = {"data.dir": tiny_data_dir, "checkpoint.dir": str(tmp_path / "run"),
          "train.eval_every": 0, "train.generate_every": 0, "train.steps": 2,
          "graft.position_offset": 1}
  cfg = load_run_config(TINY, [f"{k}={v}" for k, v in sets.items()])
  result = training.run(cfg, progress=False, log=lambda _: None)
  assert seen == [1] and result.steps_done == 2
  # The export carries the offset, and the engine decodes with it.
  model, _ = pretrained.build_run_model(load_run_config(TINY, [f"{k}={v}" for k, v in {
      **sets, "train.init_from": result.export_dir}.items()]))
  assert model.cfg.graft.position_offset == 1
  prompts = [list(r["input_ids"][:r["prompt_len"]]) for r in _records(tiny_data_dir, 3)]
  engine = Engine(model, None, stop_ids=())
  shifted = engine.generate(prompts, max_new_tokens=10, mode="hamburger", confidence=0.0)
  assert all(max(g.groups) >= 2 for g in shifted)  # merged entries are read
  for r, g in zip(prompts, shifted):  # the reference loop places entries by the layout rules
    assert (g.token_ids, g.groups) == testing.reference_hamburger(model, r, 10, 0.0, stop=-1)
