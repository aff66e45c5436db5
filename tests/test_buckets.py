"""Bucket paths (`gs://`) wherever a run reads or writes, against a local Cloud Storage emulator
(tests/conftest.py's `gcs`): files and finished directories, graft exports written and read
there, a training run killed and resumed from a bucket, generation and evaluation reading and
writing there, and a bucket that cannot be reached failing at once in one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from hamburger_jax import files, graft_checkpoint, pretrained, testing
from hamburger_jax.config import GraftConfig, HamburgerConfig, LlamaConfig
from hamburger_jax.convert.mapping import WeightsError
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import GraftParam

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
                  num_kv_heads=2)
SHARD_MB = 1 / 64


def _model(seed: int) -> Hamburger:
  return Hamburger(HamburgerConfig(CFG, GraftConfig(merger_head_dim=16)), rngs=nnx.Rngs(seed))


def _params(model) -> dict:
  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, GraftParam))}


def _upload_dir(local: str, remote: str) -> None:
  files.write_dir_atomic(remote, lambda tmp: shutil.copytree(local, tmp, dirs_exist_ok=True))


@pytest.fixture
def bucket_dir(gcs) -> str:
  """A fresh directory in the emulator's bucket."""
  return f"gs://{gcs.bucket}/{uuid.uuid4().hex[:12]}"


def test_files_read_and_write_a_bucket(bucket_dir: str):
  path = files.join(bucket_dir, "a", "doc.json")
  assert not files.exists(path)
  files.write_json_atomic(path, {"x": 1})
  assert json.loads(files.read_text(path)) == {"x": 1}
  assert files.isfile(path) and files.isdir(files.join(bucket_dir, "a"))
  assert files.listdir(files.join(bucket_dir, "a")) == ["doc.json"]
  assert files.getsize(path) == len('{"x": 1}')
  assert files.absolute(bucket_dir) == bucket_dir  # not ./gs:/...
  with files.open_file(files.join(bucket_dir, "log.jsonl"), "w") as f:
    f.write("one\ntwo\n")
  assert files.read_text(files.join(bucket_dir, "log.jsonl")) == "one\ntwo\n"
  files.remove(path)
  assert not files.exists(path)


def test_a_directory_on_a_bucket_is_finished_by_its_marker_and_replaced_whole(bucket_dir: str):
  out = files.join(bucket_dir, "dir")

  def first(tmp: str) -> None:
    Path(tmp, "old.txt").write_text("old")
    Path(tmp, "sub").mkdir()
    Path(tmp, "sub", "deep.txt").write_text("deep")

  files.write_dir_atomic(out, first)
  assert files.is_complete(out)
  assert files.read_text(files.join(out, "sub", "deep.txt")) == "deep"
  files.write_dir_atomic(out, lambda tmp: Path(tmp, "new.txt").write_text("new"))
  assert files.listdir(out) == sorted(["new.txt", files.COMMIT_MARKER])  # nothing old stays

  def failing(tmp: str) -> None:
    Path(tmp, "half.txt").write_text("half")
    raise OSError("disk full")

  with pytest.raises(OSError, match="disk full"):
    files.write_dir_atomic(out, failing)
  assert files.listdir(out) == sorted(["new.txt", files.COMMIT_MARKER])  # untouched
  files.remove(files.join(out, files.COMMIT_MARKER))
  assert not files.is_complete(out)
  assert files.is_complete(str(Path(__file__).parent))  # a local directory needs no marker


@pytest.mark.parametrize("max_shard_mb", [None, SHARD_MB])
def test_graft_export_round_trip_on_a_bucket(bucket_dir: str, max_shard_mb):
  src, dst = _model(0), _model(1)
  path = files.join(bucket_dir, "export")
  graft_checkpoint.save_graft(src, path, "random", dtype="float32", max_shard_mb=max_shard_mb)
  assert files.is_complete(path)
  pretrained.load_graft(dst, path)
  for p, v in _params(src).items():
    np.testing.assert_array_equal(_params(dst)[p], v, err_msg=str(p))
  if max_shard_mb is None:  # resharding in place, on the bucket, keeps the tensors bit for bit
    graft_checkpoint.reshard_graft(path, max_shard_mb=SHARD_MB)
    assert "graft.safetensors" not in files.listdir(path) and files.is_complete(path)
    pretrained.load_graft(dst := _model(2), path)
    for p, v in _params(src).items():
      np.testing.assert_array_equal(_params(dst)[p], v, err_msg=str(p))


def test_unfinished_export_on_a_bucket_is_refused(bucket_dir: str):
  path = files.join(bucket_dir, "export")
  graft_checkpoint.save_graft(_model(0), path, "random", dtype="float32")
  files.remove(files.join(path, files.COMMIT_MARKER))  # as a writer killed before its end
  with pytest.raises(WeightsError, match=f"{path} is an unfinished export"):
    pretrained.load_graft(_model(1), path)
  with pytest.raises(WeightsError, match="is not a HAMburger checkpoint .no hamburger.json"):
    pretrained.load_graft(_model(1), files.join(bucket_dir, "nothing-here"))
  with pytest.raises(WeightsError, match=re.escape(
      "gs://no-such-bucket-here/export is not a HAMburger checkpoint (no bucket "
      "gs://no-such-bucket-here (or this account cannot list it))")):
    pretrained.load_graft(_model(1), "gs://no-such-bucket-here/export")


def test_a_stage_starts_from_an_export_on_a_bucket_once_it_is_finished(bucket_dir: str,
                                                                        tiny_data_dir: str):
  """train.init_from on a bucket: a finished export is loaded into the run's model; an
  unfinished one, or one on a bucket that does not exist, is refused before the model loads."""
  from hamburger_jax.config import ConfigError  # pylint: disable=import-outside-toplevel
  from hamburger_jax.run_config import load_run_config  # pylint: disable=import-outside-toplevel
  export = files.join(bucket_dir, "micro", "export")
  cfg = lambda path, seed=0: load_run_config(TINY, [f"data.dir={tiny_data_dir}",
                                                    f"train.init_from={path or repr('')}",
                                                    f"train.seed={seed}"])
  source, _ = pretrained.build_run_model(cfg("", seed=1))  # not the graft a seed-0 run starts at
  graft_checkpoint.save_graft(source, export, "random", dtype="float32")
  files.remove(files.join(export, files.COMMIT_MARKER))
  with pytest.raises(ConfigError, match=f"train.init_from={export} is an unfinished export"):
    pretrained.check_init_from(cfg(export))
  files.mark_complete(export)
  started, _ = pretrained.build_run_model(cfg(export))
  assert any(not np.array_equal(v, _params(pretrained.build_run_model(cfg(""))[0])[p])
             for p, v in _params(source).items())
  for p, v in _params(source).items():
    np.testing.assert_array_equal(_params(started)[p], v, err_msg=str(p))
  with pytest.raises(ConfigError, match="is not a graft export .no bucket gs://no-such-bucket-"):
    pretrained.check_init_from(cfg("gs://no-such-bucket-here/export"))


def test_missing_object_of_a_finished_export_is_named(bucket_dir: str):
  path = files.join(bucket_dir, "export")
  graft_checkpoint.save_graft(_model(0), path, "random", dtype="float32", max_shard_mb=SHARD_MB)
  victim = files.join(path, graft_checkpoint.shard_file("graft", 2, len(
      [n for n in files.listdir(path) if n.startswith("graft-")])))
  files.remove(victim)
  with pytest.raises(WeightsError, match=re.escape(f"{victim} is missing")):
    pretrained.load_graft(_model(1), path)


def test_a_bucket_that_does_not_exist_fails_in_one_line_and_nothing_is_written(gcs):
  where = "gs://no-such-bucket-here/run"
  with pytest.raises(files.StorageError) as e:
    files.check_writable(where, "checkpoint.dir")
  message = str(e.value)
  assert "\n" not in message
  assert message.startswith(f"checkpoint.dir {where} cannot be written: no such bucket")
  with pytest.raises(files.StorageError, match="no such bucket"):
    graft_checkpoint.save_graft(_model(0), files.join(where, "export"), "random")
  assert not files.exists(where)
  files.check_writable(f"gs://{gcs.bucket}/run", "checkpoint.dir")  # the probe leaves nothing
  assert not files.exists(f"gs://{gcs.bucket}/run")


@pytest.mark.parametrize("code,words", [
    (401, "no credentials (on a Cloud VM, give the VM's service account the storage scope"),
    (403, "permission denied (grant this account access to the bucket)")])
def test_no_credentials_or_permission_is_said_in_words(bucket_dir: str, monkeypatch, code,
                                                       words):
  """What Cloud Storage answers a caller without credentials (401) or access (403), which the
  emulator never does: gcsfs's error, raised where an object is opened to be written or read."""
  from etils import epath  # pylint: disable=import-outside-toplevel
  from gcsfs.retry import HttpError  # pylint: disable=import-outside-toplevel
  export = files.join(bucket_dir, "export")
  graft_checkpoint.save_graft(_model(0), export, "random", dtype="float32")

  def refuse(*_, **__):
    raise HttpError({"code": code, "message": "caller does not have storage.objects.get"})

  monkeypatch.setattr(type(epath.Path(bucket_dir)), "open", refuse)
  with pytest.raises(files.StorageError) as e:
    files.check_writable(bucket_dir, "--out")
  assert str(e.value).startswith(f"--out {bucket_dir} cannot be written: {words}")
  with pytest.raises(files.StorageError) as e:
    pretrained.load_graft(_model(1), export)
  assert str(e.value).startswith(f"cannot read {export}/hamburger.json: {words}")
  assert "\n" not in str(e.value)


def test_readers_of_local_files_refuse_a_bucket_and_say_to_mount_it(capsys):
  """Datasets are read through array_record, which opens local files: a bucket URL there is
  refused at once, by every way in."""
  from hamburger_jax.config import ConfigError  # pylint: disable=import-outside-toplevel
  from hamburger_jax.data import pipeline  # pylint: disable=import-outside-toplevel
  from hamburger_jax.run_config import (  # pylint: disable=import-outside-toplevel
      check_training_inputs, load_run_config)
  from infer import eval as eval_cli  # pylint: disable=import-outside-toplevel
  from train import prepare_data  # pylint: disable=import-outside-toplevel
  mount = "mount the bucket (gcsfuse) at the same path on every host and give the mounted path"
  data = "gs://my-bucket/data/x"
  with pytest.raises(ConfigError, match=re.escape(f"data.dir {data} is on a bucket, but the "
                                                  "dataset reader (array_record) opens local "
                                                  f"files only: {mount}")):
    check_training_inputs(load_run_config(TINY, [f"data.dir={data}"]))
  with pytest.raises(files.StorageError, match=re.escape(f"dataset {data} is on a bucket")):
    pipeline.dataset_metadata(data)
  assert prepare_data.main(["--config", TINY, "--source", "synthetic", "--out", data]) == 2
  assert f"dataset output {data} is on a bucket" in capsys.readouterr().err
  assert prepare_data.main(["--join", data]) == 2
  assert f"--join {data} is on a bucket" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    eval_cli.parse_args(["--config", TINY, "--tasks", "nll", "--data", data])
  assert f"--data {data} is on a bucket" in capsys.readouterr().err


def test_a_base_on_a_bucket_is_read_from_a_local_copy(bucket_dir: str, tmp_path: Path,
                                                      monkeypatch):
  """A GGUF, or an HF directory, on a bucket loads as from the disk: each host keeps a copy in
  its cache, fetched once (a file already there with the object's size and time is kept)."""
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  from hamburger_jax.convert import hf  # pylint: disable=import-outside-toplevel
  from hamburger_jax.run_config import ModelConfig  # pylint: disable=import-outside-toplevel
  from hamburger_jax.testing import write_tiny_llama_gguf  # pylint: disable=C0415
  monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
  monkeypatch.setenv(cache.NO_WEIGHT_CACHE_ENV, "1")
  local = str(tmp_path / "tiny.gguf")
  write_tiny_llama_gguf(local)
  remote = files.join(bucket_dir, "models", "tiny.gguf")
  files.upload(local, remote)
  (got, _), (want, _) = pretrained.load_llama(remote), pretrained.load_llama(local)
  want_params = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(want))}
  for p, v in nnx.to_flat_state(nnx.state(got)):
    np.testing.assert_array_equal(np.asarray(v[...]), want_params[p], err_msg=str(p))
  copy = files.mirror(remote, os.path.join(cache.cache_root(), "buckets"))
  assert copy.startswith(str(tmp_path / "cache")) and Path(copy).read_bytes() == Path(
      local).read_bytes()
  before = os.stat(copy).st_ino
  assert files.mirror(remote, os.path.join(cache.cache_root(), "buckets")) == copy
  assert os.stat(copy).st_ino == before  # kept, not fetched again
  hf_dir = str(tmp_path / "hf")
  hf.save(want, want.cfg, hf_dir)
  _upload_dir(hf_dir, files.join(bucket_dir, "models", "hf"))
  arch = pretrained.architecture(ModelConfig(base=files.join(bucket_dir, "models", "hf")))
  assert arch.hidden_size == want.cfg.hidden_size and arch.num_layers == want.cfg.num_layers
  with pytest.raises(FileNotFoundError, match="absent.gguf: no such object"):
    pretrained.load_llama(files.join(bucket_dir, "models", "absent.gguf"))
  with pytest.raises(FileNotFoundError, match="no bucket gs://no-such-bucket-here "):
    pretrained.load_llama("gs://no-such-bucket-here/m.gguf")


# ----------------------------------------------------------------------------- training

STEPS = 8


@pytest.fixture(scope="module")
def sub_env(gcs) -> dict[str, str]:
  """A subprocess's environment (testing.subprocess_env) with the emulator's address."""
  return testing.subprocess_env(**gcs.env)


def _train_args(data_dir: str, run_dir: str, every: int) -> list[str]:
  values = {"data.dir": data_dir, "checkpoint.dir": run_dir, "train.eval_every": 0,
            "train.steps": STEPS, "checkpoint.every": every}
  return [sys.executable, "-m", "train.main", "--config", TINY, "--no-progress",
          *[a for k, v in values.items() for a in ("--set", f"{k}={v}")]]


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
  proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  return proc


def _finished_steps(ckpt_dir: str) -> list[int]:
  """Steps orbax finished in a bucket directory (its commit marker written)."""
  if not files.isdir(ckpt_dir):
    return []
  return [int(n) for n in files.listdir(ckpt_dir)
          if n.isdigit() and files.isfile(files.join(ckpt_dir, n, files.COMMIT_MARKER))]


def _export(path: str) -> dict[str, np.ndarray]:
  meta = graft_checkpoint.read_meta(path)
  return graft_checkpoint.read_tensors(path, "graft", meta)


def _metrics(run_dir: str) -> dict[int, dict]:
  from hamburger_jax import training  # pylint: disable=import-outside-toplevel
  return {m["step"]: m for m in training.read_metrics(run_dir)}


@pytest.fixture(scope="module")
def local_run(tiny_data_dir: str, tmp_path_factory: pytest.TempPathFactory,
              sub_env: dict[str, str]) -> str:
  """An uninterrupted run on local disk (it also fills the jit cache the bucket runs hit)."""
  run_dir = str(tmp_path_factory.mktemp("local-run") / "run")
  _run(_train_args(tiny_data_dir, run_dir, STEPS), sub_env)
  return run_dir


@pytest.mark.slow
def test_killed_run_resumes_from_the_bucket_exactly(local_run: str, tiny_data_dir: str,
                                                    bucket_dir: str, sub_env: dict[str, str],
                                                    tmp_path: Path):
  run_dir = files.join(bucket_dir, "run")
  args = _train_args(tiny_data_dir, run_dir, 1)
  with open(tmp_path / "stderr", "w") as err:
    victim = subprocess.Popen(args, cwd=REPO, env=sub_env, stdout=subprocess.DEVNULL, stderr=err)
  try:
    deadline = time.monotonic() + 200
    while not [s for s in _finished_steps(files.join(run_dir, "checkpoints")) if s >= 3]:
      assert victim.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
      assert time.monotonic() < deadline, "no checkpoint at step >= 3 in time"
      time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(60) == -signal.SIGKILL
  finally:
    if victim.poll() is None:
      victim.kill()
      victim.wait()
  assert not files.exists(files.join(run_dir, "export")), "the run finished before the kill"

  resumed = _run(args, sub_env)
  start = int(re.search(r"resumed from step (\d+)", resumed.stdout).group(1))
  assert 3 <= start < STEPS
  assert f"export in {run_dir}/export" in resumed.stdout
  got, want = _export(files.join(run_dir, "export")), _export(os.path.join(local_run, "export"))
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0, err_msg=k)
  ref, logged = _metrics(local_run), _metrics(run_dir)
  assert set(range(start + 1, STEPS + 1)) <= set(logged)
  for step, m in logged.items():
    assert m["loss"] == pytest.approx(ref[step]["loss"], abs=1e-6), step
  assert any(n.startswith("events.out.tfevents") for n in files.listdir(files.join(run_dir, "tb")))
  # The tools that read a run read it from the bucket.
  from hamburger_jax.training import pick  # pylint: disable=import-outside-toplevel
  from train import curves  # pylint: disable=import-outside-toplevel
  assert STEPS in pick.saved_steps(run_dir)
  assert curves.main([run_dir]) == 0
  assert files.read_bytes(files.join(run_dir, "curves.png"))[:8] == b"\x89PNG\r\n\x1a\n"
  earlier = files.join(run_dir, "export-7")  # an earlier saved step, exported from the bucket
  from hamburger_jax import training  # pylint: disable=import-outside-toplevel
  from hamburger_jax.run_config import load_run_config  # pylint: disable=import-outside-toplevel
  sets = [a for a in args[args.index("--set"):] if a != "--set"]
  assert training.export_step(load_run_config(TINY, [*sets, f"checkpoint.export={earlier}"]), 7,
                              log=lambda _: None) == earlier
  assert graft_checkpoint.read_meta(earlier)["trained_steps"] == 7
  assert any(not np.array_equal(v, got[k]) for k, v in _export(earlier).items())


@pytest.mark.usefixtures("gcs")
def test_training_to_a_missing_bucket_fails_before_any_work(tiny_data_dir: str):
  from train import main as train_main  # pylint: disable=import-outside-toplevel
  where = "gs://no-such-bucket-here/run"
  with pytest.raises(SystemExit) as e:
    train_main.main(["--config", TINY, "--set", f"data.dir={tiny_data_dir}",
                     "--set", f"checkpoint.dir={where}"])
  assert str(e.value).startswith(f"error: checkpoint.dir {where} cannot be written: no such "
                                 "bucket")
  assert "\n" not in str(e.value)
  assert not files.exists(where)


# ----------------------------------------------------------------------------- inference


def test_eval_reads_its_checkpoint_from_and_writes_its_results_to_a_bucket(
    local_run: str, bucket_dir: str, sub_env: dict[str, str]):
  checkpoint, out = files.join(bucket_dir, "export"), files.join(bucket_dir, "eval")
  _upload_dir(os.path.join(local_run, "export"), checkpoint)
  _run([sys.executable, "-m", "infer.eval", "--config", TINY, "--checkpoint", checkpoint,
        "--tasks", "synthetic", "--confidence", "0.5", "--limit", "2", "--batch", "2",
        "--max-new-tokens", "4", "--out", out], sub_env)
  results = json.loads(files.read_text(files.join(out, "results.json")))
  assert results["model"]["checkpoint"] == checkpoint
  assert results["tasks"]["synthetic"]["n"] == 2
  assert "| synthetic" in files.read_text(files.join(out, "results.md"))
  assert len(files.read_text(files.join(out, "generations.jsonl")).splitlines()) >= 2
  from hamburger_jax.evaluation import plots  # pylint: disable=import-outside-toplevel
  for name in plots.FILES:
    assert files.read_bytes(files.join(out, name))[:8] == b"\x89PNG\r\n\x1a\n", name
  # Redrawn from the bucket's results.json, into the bucket; compared from the bucket.
  from infer import compare_evals  # pylint: disable=import-outside-toplevel
  from infer import eval as eval_cli  # pylint: disable=import-outside-toplevel
  files.remove(files.join(out, plots.FILES[0]))
  assert eval_cli.main(["--replot", files.join(out, "results.json")]) == 0
  assert files.read_bytes(files.join(out, plots.FILES[0]))[:8] == b"\x89PNG\r\n\x1a\n"
  assert len(compare_evals.read_run(out)) == len(
      files.read_text(files.join(out, "generations.jsonl")).splitlines())


@pytest.mark.usefixtures("gcs")
def test_eval_to_a_missing_bucket_fails_before_the_model_loads(capsys):
  from infer import eval as eval_cli  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit):
    eval_cli.parse_args(["--config", TINY, "--tasks", "synthetic",
                         "--out", "gs://no-such-bucket-here/eval"])
  err = capsys.readouterr().err
  assert "--out gs://no-such-bucket-here/eval cannot be written: no such bucket" in err
  with pytest.raises(SystemExit):
    eval_cli.parse_args(["--config", TINY, "--tasks", "synthetic",
                         "--checkpoint", "gs://no-such-bucket-here/export"])
  assert ("checkpoint gs://no-such-bucket-here/export is not there, no bucket "
          "gs://no-such-bucket-here") in capsys.readouterr().err


@pytest.mark.slow
def test_generate_reads_a_checkpoint_from_a_bucket(bucket_dir: str, sub_env: dict[str, str]):
  """The shipped checkpoint, copied to the bucket, reads the same tensors as from the disk, and
  infer.generate decodes with it."""
  from hamburger_jax import assets  # pylint: disable=import-outside-toplevel
  try:
    assets.smollm2_gguf()
  except assets.AssetError as e:
    pytest.skip(str(e))
  checkpoint = files.join(bucket_dir, "shipped")
  _upload_dir(pretrained.DEFAULT_CHECKPOINT, checkpoint)
  got, want = _export(checkpoint), _export(pretrained.DEFAULT_CHECKPOINT)
  assert got.keys() == want.keys()
  for k, v in want.items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)
  out = _run([sys.executable, "-m", "infer.generate", "--checkpoint", checkpoint, "--mode",
              "hamburger", "--prompt", "What is 2 + 2?", "--max-new-tokens", "4", "--json"],
             sub_env).stdout
  row = json.loads(out.strip().splitlines()[-1])
  assert row["mode"] == "hamburger" and len(row["token_ids"]) == 4


@pytest.mark.slow
def test_two_processes_save_into_one_bucket_directory(tiny_data_dir: str, bucket_dir: str,
                                                       sub_env: dict[str, str]):
  """Both processes of a 2-process run write their parts of each save (orbax's state, each one's
  data position) into the same gs:// directory; process 0 alone writes the metrics and the
  export."""
  import socket  # pylint: disable=import-outside-toplevel
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  run_dir = files.join(bucket_dir, "run")
  sets = [a for o in (f"data.dir={tiny_data_dir}", f"checkpoint.dir={run_dir}",
                      "train.eval_every=0", "train.steps=2", "checkpoint.every=2")
          for a in ("--set", o)]
  _run(["bash", "train/launch_local.sh", "2", "--config", TINY, "--cpu-devices", "1", *sets],
       {**sub_env, "PORT": str(port)})
  step = files.join(run_dir, "checkpoints", "2")
  assert files.isfile(files.join(step, files.COMMIT_MARKER))
  assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(files.listdir(files.join(step, "state")))
  assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(
      files.listdir(files.join(step, "data")))
  lines = files.read_text(files.join(run_dir, "metrics.jsonl")).splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2]  # one writer
  assert len(files.listdir(files.join(run_dir, "tb"))) == 1
  assert files.is_complete(files.join(run_dir, "export")) and _export(files.join(run_dir, "export"))
