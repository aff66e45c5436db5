"""Sharded train.prepare_data: the dataset that 2 processes, or one process on 8 devices, write
equals the single-process one record for record (every feature array, bit for bit); a run killed
midway resumes to the same dataset; mismatched runs and missing shards are named.

The data: token-id records (hamburger_jax.testing's synthetic samples, a few too long to keep)
through a tiny random base with the default tokenizer's vocabulary, teacher signals on, shards of
6 samples, 2 rows of 64 tokens per device and forward pass; half the records carry the groups
they train on, the rest are segmented by the base's entropies. Multi-process and multi-device runs
happen in subprocesses (jax fixes its devices at start), as tests/test_training.py does.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow_datasets as tfds

from hamburger_jax import testing
from hamburger_jax.data import pipeline, prepare, teacher_pass, tfds_builder
from hamburger_jax.data import shards as shardlib
from train import prepare_data

REPO = Path(__file__).resolve().parents[1]
# The default tokenizer's 49152 ids (prepare_data pairs a random base with it), configs/tiny.yaml's
# depth (4 layers: the graft's 4 feature layers), narrower.
CONFIG = """model:
  base: random
  random: {vocab_size: 49152, hidden_size: 32, intermediate_size: 64, num_layers: 4,
           num_heads: 4, num_kv_heads: 2, max_position_embeddings: 256}
graft: {max_group: 4}
"""
FLAGS = ["--max-len", "64", "--teacher-top-k", "4", "--batch-tokens", "128", "--shard-size", "6",
         "--val-fraction", "0.2", "--strategy", "given:decreasing_v2"]
NUM_SHARDS = 6  # 34 samples kept of 40 (6 too long), 6 per shard
tfds.disable_progress_bar()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
  from hamburger_jax.data.synthetic import synthetic_samples  # pylint: disable=C0415
  d = tmp_path_factory.mktemp("inputs")
  (d / "tiny.yaml").write_text(CONFIG)
  lines = []
  for i, s in enumerate(synthetic_samples(40, 49152, 4, seed=0, response_len=(6, 40))):
    ids, p = s["input_ids"].tolist(), s["prompt_len"]
    if i % 7 == 3:
      ids += list(range(100, 140))  # over --max-len: dropped
    if i % 9 == 5:
      p = lines[-1]["prompt_ids"]  # another answer to the previous prompt: the same split
      ids = p + ids[s["prompt_len"]:]
      p = len(p)
    line = {"prompt": f"q{i}", "response": "a", "prompt_ids": ids[:p], "response_ids": ids[p:]}
    if i % 2 == 0 and len(ids) - p == sum(s["groups"]):
      # Recorded groups of several tokens (a random base's own would all be single tokens):
      # each group's teacher features are read at its predicting position.
      line["groups"] = s["groups"]
    lines.append(line)
  (d / "d.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  return SimpleNamespace(dir=d, config=str(d / "tiny.yaml"), source=f"jsonl:{d / 'd.jsonl'}")


@pytest.fixture(scope="module")
def cached_tokenizer():
  """One load of the default tokenizer for the in-process runs (its GGUF takes seconds)."""
  from hamburger_jax.tokenizer import load_default_tokenizer  # pylint: disable=C0415
  tok = load_default_tokenizer()
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(prepare, "load_default_tokenizer", lambda **_: tok)
    yield


def _args(inputs: SimpleNamespace, out: Path | str, *extra: str) -> list[str]:
  return ["--config", inputs.config, "--source", inputs.source, *FLAGS, "--out", str(out),
          *extra]


def _main(argv: list[str]) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = prepare_data.main(argv)
  return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def reference(inputs: SimpleNamespace, cached_tokenizer, tmp_path_factory) -> Path:
  """One process, one device, uninterrupted."""
  out = tmp_path_factory.mktemp("reference") / "ds"
  rc, stdout, stderr = _main(_args(inputs, out))
  assert rc == 0, stderr[-3000:]
  assert f"{NUM_SHARDS} shards by 1 process x 1 device" in stdout
  assert "samples written      34 (train" in stdout and "dropped (too long)   6" in stdout
  assert "4: " in stdout.split("group sizes")[1]  # groups of up to 4 tokens
  assert not Path(shardlib.shards_dir_of(out)).exists()  # removed once joined
  # Each split holds its samples in source order, and together they are every kept sample.
  lines = [json.loads(x) for x in (inputs.dir / "d.jsonl").read_text().splitlines()]
  kept = [tuple(x["prompt_ids"] + x["response_ids"]) for x in lines
          if len(x["prompt_ids"]) + len(x["response_ids"]) <= 64]
  index = {ids: i for i, ids in enumerate(kept)}
  assert len(index) == len(kept) == 34
  order = {split: [index[tuple(r["input_ids"].tolist())] for r in records]
           for split, records in _dataset(out)[1].items()}
  assert all(o == sorted(o) for o in order.values()) and len(order["validation"]) >= 5
  assert sorted(order["train"] + order["validation"]) == list(range(34))
  return out


def _dataset(path: Path | str) -> tuple[dict, dict[str, list[dict]]]:
  builder = tfds.builder_from_directory(str(path))
  source = builder.as_data_source()
  return (dict(builder.info.metadata),
          {split: [source[split][i] for i in range(len(source[split]))] for split in source})


def assert_same_dataset(got: Path | str, want: Path | str) -> None:
  got_meta, got_splits = _dataset(got)
  want_meta, want_splits = _dataset(want)
  assert got_meta == want_meta
  assert {s: len(r) for s, r in got_splits.items()} == {s: len(r) for s, r in want_splits.items()}
  assert set(want_splits) == {"train", "validation"}
  for split, records in want_splits.items():
    for i, (a, b) in enumerate(zip(got_splits[split], records)):
      assert a.keys() == b.keys() and "teacher_features" in b, (split, i)
      for key in b:
        x, y = np.asarray(a[key]), np.asarray(b[key])
        assert x.dtype == y.dtype and np.array_equal(x, y), (split, i, key)


def _entries(directory: Path) -> list[str]:
  return sorted(os.listdir(directory))


# ----------------------------------------------------------------------------- in one process


def test_a_killed_run_resumes_to_the_same_dataset(inputs, reference, cached_tokenizer,
                                                  tmp_path: Path, monkeypatch):
  """Killed after shard 2's dataset is written but before its done marker, then killed in a
  forward pass of shard 3, then finished: the finished shards are skipped, the half-written one
  redone, and the dataset equals the uninterrupted run's."""
  out = tmp_path / "ds"
  shards = Path(shardlib.shards_dir_of(out))
  write_json = teacher_pass.write_json_atomic

  def killed_before_marker(path, obj, **kwargs):
    if os.path.basename(path) == "shard-00002.json":
      raise KeyboardInterrupt
    write_json(path, obj, **kwargs)

  monkeypatch.setattr(teacher_pass, "write_json_atomic", killed_before_marker)
  with pytest.raises(KeyboardInterrupt):
    _main(_args(inputs, out))
  monkeypatch.setattr(teacher_pass, "write_json_atomic", write_json)
  assert not out.exists()
  assert {"shard-00000.json", "shard-00001.json", "shard-00002"} <= set(_entries(shards))
  assert "shard-00002.json" not in _entries(shards)
  # What a kill leaves besides: a tfds build's work directory (its lock no longer held) and a
  # marker cut off before its rename.
  (shards / ".shard-00003.tmp-killed").mkdir()
  (shards / ".shard-00003.tmp-killed" / tfds_builder._LOCK_FILE).touch()  # pylint: disable=W0212
  (shards / "shard-00003.json.tmp-999").write_text('{"plan": ')

  shard, passes = [], []
  write_shard, forward = teacher_pass.write_shard, teacher_pass.Forward.__call__

  def noting_the_shard(shards_dir, k, *a, **kw):
    shard.append(k)
    return write_shard(shards_dir, k, *a, **kw)

  def killed_in_shard_3(self, ids, seg, teacher):
    passes.append(shard[-1])
    if passes.count(3) == 2:  # its second forward pass
      raise KeyboardInterrupt
    return forward(self, ids, seg, teacher)

  monkeypatch.setattr(prepare, "write_shard", noting_the_shard)  # where prepare_dataset looks
  monkeypatch.setattr(teacher_pass.Forward, "__call__", killed_in_shard_3)
  with pytest.raises(KeyboardInterrupt):
    _main(_args(inputs, out))
  monkeypatch.setattr(teacher_pass.Forward, "__call__", forward)
  assert shard == [2, 3]  # 0 and 1 were skipped
  assert "shard-00002.json" in _entries(shards) and "shard-00003.json" not in _entries(shards)

  rc, stdout, stderr = _main(_args(inputs, out))
  assert rc == 0, stderr[-3000:]
  assert "wrote shards 3-5, found 0-2 done before" in stdout
  assert_same_dataset(out, reference)
  assert _entries(tmp_path) == ["ds"]  # no shards, no work directory left


def test_a_single_process_replaces_the_shards_of_other_settings(inputs, reference,
                                                                cached_tokenizer, tmp_path: Path,
                                                                monkeypatch):
  """A killed run with other settings leaves shards of another plan; a single process redoes
  them (as a killed run's work was always redone), saying why."""
  out = tmp_path / "ds"
  forward = teacher_pass.Forward.__call__

  def killed(self, ids, seg, teacher):
    raise KeyboardInterrupt

  monkeypatch.setattr(teacher_pass.Forward, "__call__", killed)
  with pytest.raises(KeyboardInterrupt):
    _main(_args(inputs, out, "--seed", "3"))
  monkeypatch.setattr(teacher_pass.Forward, "__call__", forward)
  assert (Path(shardlib.shards_dir_of(out)) / shardlib.PLAN_FILE).exists()
  rc, _, stderr = _main(_args(inputs, out))
  assert rc == 0, stderr[-3000:]
  assert "discarding the shards" in stderr and "settings.seed (3 there, 0 here)" in stderr
  assert_same_dataset(out, reference)


def test_a_missing_process_is_named_and_process_counts_must_match(inputs, reference,
                                                                   cached_tokenizer,
                                                                   tmp_path: Path):
  out = tmp_path / "ds"
  rc, stdout, stderr = _main(_args(inputs, out, "--num-processes", "2", "--process-id", "0"))
  assert rc == 0, stderr[-3000:]
  assert "shards 0, 2, 4 written now" in stdout and "waiting for 1, 3, 5" in stdout
  assert not out.exists()

  rc, _, stderr = _main(["--join", str(out)])
  assert rc == 2 and "3 of the 6 shards" in stderr and "1, 3, 5 (process 1 of 2)" in stderr
  with pytest.raises(FileNotFoundError, match="--join"):
    pipeline.open_split(str(out), "train")
  rc, _, stderr = _main(_args(inputs, out, "--num-processes", "3", "--process-id", "1"))
  assert rc == 2 and "process counts must match" in stderr and "--num-processes 2" in stderr
  rc, _, stderr = _main(_args(inputs, out, "--num-processes", "2", "--process-id", "1",
                              "--max-len", "60"))
  assert rc == 2 and "other inputs or settings" in stderr and "settings.max_len" in stderr
  rc, stdout, _ = _main(_args(inputs, out, "--num-processes", "2", "--process-id", "0"))
  assert rc == 0 and "shards none written now, 0, 2, 4 done before" in stdout

  rc, stdout, stderr = _main(_args(inputs, out, "--num-processes", "2", "--process-id", "1"))
  assert rc == 0, stderr[-3000:]
  assert f"wrote {out}" in stdout and "teacher pass         6 shards by 2 processes" in stdout
  assert_same_dataset(out, reference)
  assert _entries(tmp_path) == ["ds"]
  rc, _, stderr = _main(["--join", str(out)])
  assert rc == 2 and "already joined" in stderr


def test_a_second_copy_of_a_process_is_refused(inputs, cached_tokenizer, tmp_path: Path):
  out = tmp_path / "ds"
  shards = Path(shardlib.shards_dir_of(out))
  shards.mkdir()
  fd = os.open(shards / "process-00000.lock", os.O_CREAT | os.O_RDWR)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)  # as the live process 0 holds it
    rc, _, stderr = _main(_args(inputs, out))
  finally:
    os.close(fd)
  assert rc == 2 and "process 0 is already running" in stderr


def test_sharding_flags_are_checked_before_any_work(capsys):
  for argv, match in (
      (["--join", "d", "--config", "c.yaml"], "--join takes the dataset directory alone"),
      (["--config", "c.yaml", "--source", "gsm_symbolic", "--out", "o", "--num-processes", "2",
        "--process-id", "2"], r"--process-id 2 must be in \[0, --num-processes 2\)"),
      (["--config", "c.yaml", "--source", "gsm_symbolic", "--out", "o", "--shard-size", "0"],
       "--shard-size=0 must be positive"),
      (["--config", "c.yaml", "--source", "gsm_symbolic", "--out", "o", "--num-processes", "2",
        "--process-id", "0", "--self-distill"], "--self-distill runs in one process"),
      (["--source", "gsm_symbolic"], "required: --config, --out"),
  ):
    with pytest.raises(SystemExit):
      prepare_data.parse_args(argv)
    assert re.search(match, capsys.readouterr().err), match
  assert prepare_data.main(["--join", "/nonexistent/ds"]) == 2
  assert "nothing to join" in capsys.readouterr().err


# ----------------------------------------------------------------------------- subprocesses


@pytest.fixture(scope="module")
def sub_env() -> dict[str, str]:
  """CPU only, one device unless asked (testing.subprocess_env)."""
  return testing.subprocess_env()


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
  with open(log, "w") as f:
    return subprocess.Popen([sys.executable, "-m", "train.prepare_data", *args], cwd=REPO,
                            env=env, stdout=f, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> list[str]:
  try:
    for proc in procs:
      proc.wait(timeout=timeout)
  finally:
    for proc in procs:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
  texts = [log.read_text() for log in logs]
  for proc, text in zip(procs, texts):
    assert proc.returncode == 0, text[-4000:]
  return texts


@pytest.mark.slow  # two subprocesses: ~30 s on 2 cores
def test_two_processes_write_the_single_process_dataset(inputs, reference, sub_env,
                                                         tmp_path: Path):
  out = tmp_path / "ds"
  logs = [tmp_path / f"process-{i}.log" for i in range(2)]
  procs = [_start(_args(inputs, out, "--num-processes", "2", "--process-id", str(i)), sub_env,
                  log) for i, log in enumerate(logs)]
  texts = _finish(procs, logs, 300)
  assert sum(f"wrote {out}" in t for t in texts) == 1  # the last to finish joined
  for text, mine in zip(texts, ("0, 2, 4", "1, 3, 5")):  # each process its every other shard
    assert f"shards {mine} written now" in text or f"wrote shards {mine}, found none" in text
  assert_same_dataset(out, reference)
  assert _entries(tmp_path) == ["ds", "process-0.log", "process-1.log"]


@pytest.mark.slow  # a subprocess on 8 devices: ~30 s on 2 cores
def test_eight_devices_write_the_single_process_dataset(inputs, reference, sub_env,
                                                        tmp_path: Path):
  """The rows of each forward pass split over 8 fake CPU devices, 2 rows each."""
  out = tmp_path / "ds"
  env = {**sub_env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  log = tmp_path / "log"
  with open(log, "w") as f:
    proc = subprocess.Popen([sys.executable, __file__, "passes", str(tmp_path / "passes.json"),
                             *_args(inputs, out)], cwd=REPO, env=env, stdout=f,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
  (text,) = _finish([proc], [log], 300)
  assert "6 shards by 1 process x 8 devices" in text
  passes = json.loads((tmp_path / "passes.json").read_text())
  assert passes and all(p == {"rows": 16, "devices": 8, "rows_per_device": [2] * 8}
                        for p in passes), passes
  assert_same_dataset(out, reference)


def _passes_main(record: str, argv: list[str]) -> int:
  """train.prepare_data, noting how every forward pass's output rows lie over the devices."""
  passes = []
  run = teacher_pass.Forward.run

  def noting(self, ids, seg, teacher):
    arrays = run(self, ids, seg, teacher)
    shards = arrays[0].addressable_shards
    passes.append({"rows": arrays[0].shape[0], "devices": len({s.device for s in shards}),
                   "rows_per_device": [s.data.shape[0] for s in shards]})
    return arrays

  teacher_pass.Forward.run = noting
  rc = prepare_data.main(argv)
  with open(record, "w", encoding="utf-8") as f:
    json.dump(passes, f)
  return rc


if __name__ == "__main__":
  assert sys.argv[1] == "passes", sys.argv
  sys.exit(_passes_main(sys.argv[2], sys.argv[3:]))
