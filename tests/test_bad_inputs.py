"""Bad inputs outside the decode engine: each is refused with one clear line that names
the problem (and the file, where there is one) and what to do, before anything heavy runs, and
nothing is written. Run config values, train.main flags, YAML files, JSONL sources (non-UTF-8,
unknown roles, out-of-vocabulary ids), graft checkpoints (truncated or corrupted safetensors,
broken hamburger.json), and the work directories a killed train.prepare_data leaves behind."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from hamburger_jax import graft_checkpoint, pretrained
from hamburger_jax.config import ConfigError, GraftConfig, HamburgerConfig, LlamaConfig
from hamburger_jax.convert.mapping import WeightsError
from hamburger_jax.data import prepare, sources, tfds_builder
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.run_config import check_training_inputs, load_run_config

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


# ----------------------------------------------------------------------------- run config


@pytest.mark.parametrize("override, message", [
    ("train.steps=0", "train.steps=0 must be >= 1 (an untrained run has nothing to export)"),
    ("train.steps=-4", "train.steps=-4 must be >= 1"),
    ("checkpoint.keep=0", "checkpoint.keep=0 must be >= 1 (checkpoints kept; resuming needs"),
    ("checkpoint.every=0", "checkpoint.every=0 must be >= 1"),
    ("train.log_every=0", "train.log_every=0 must be >= 1"),
    ("train.eval_every=-1", "train.eval_every=-1 must be >= 0 (0 turns it off)"),
    ("data.rows=0", "data.rows=0 must be >= 1"),
    ("data.accum=0", "data.accum=0 must be >= 1"),
    ("data.entries=-1", "data.entries=-1 must be >= 1"),
    ("mesh.fsdp=0", "mesh.fsdp=0 must be >= 1"),
    ("mesh.data=0", "mesh.data=0 must be -1 (the devices left) or >= 1"),
    ("train.warmup_steps=21", "train.warmup_steps=21 exceeds train.steps=20"),
    ("train.lr_graft=-1", "train.lr_graft=-1.0 must be >= 0"),
    ("train.b2=1", "train.b2=1.0 must be in [0, 1)"),
    ("checkpoint.export_dtype=int8", "checkpoint.export_dtype='int8': use one of bfloat16"),
    ("checkpoint.dir=''", "checkpoint.dir is empty"),
])
def test_run_config_values_are_checked_when_parsed(override: str, message: str) -> None:
  with pytest.raises(ConfigError) as info:
    load_run_config(TINY, [override])
  assert message in str(info.value)


def test_training_inputs(tmp_path: Path) -> None:
  with pytest.raises(ConfigError, match="data.dir is empty: build a dataset"):
    check_training_inputs(load_run_config(TINY, ["data.dir=''"]))
  with pytest.raises(ConfigError, match=f"data.dir {tmp_path}/none does not exist: build it"):
    check_training_inputs(load_run_config(TINY, [f"data.dir={tmp_path}/none"]))
  with pytest.raises(ConfigError, match="is not a dataset written by train.prepare_data"):
    check_training_inputs(load_run_config(TINY, [f"data.dir={tmp_path}"]))


def test_broken_yaml_names_the_file(tmp_path: Path) -> None:
  bad = tmp_path / "bad.yaml"
  bad.write_text("train: {steps: 3\nmodel: [\n")
  with pytest.raises(ConfigError, match=rf"config file {bad} is not valid YAML at line 2"):
    load_run_config(str(bad))
  latin = tmp_path / "latin.yaml"
  latin.write_bytes("train: {steps: 3}  # caf\xe9\n".encode("latin-1"))
  with pytest.raises(ConfigError, match=rf"config file {latin} is not UTF-8 text \(byte 0xe9"):
    load_run_config(str(latin))
  with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory"):
    load_run_config(str(tmp_path))
  with pytest.raises(ConfigError, match=r"--set 'train.steps=\[1': the value is not valid YAML"):
    load_run_config(TINY, ["train.steps=[1"])


def _train_main(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "train.main", "--no-progress", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_train_main_refuses_before_loading_anything(tmp_path: Path) -> None:
  """Each bad input: a non-zero exit, one error line naming the problem, no traceback, nothing
  written (the run directory is not created)."""
  run_dir = tmp_path / "run"
  bad_yaml = tmp_path / "bad.yaml"
  bad_yaml.write_text("train: [\n")
  data = tmp_path / "data"
  data.mkdir()
  base = ["--config", TINY, "--set", f"checkpoint.dir={run_dir}", "--set", f"data.dir={data}"]
  cases = {
      "steps": (base + ["--set", "train.steps=0"], "train.steps=0 must be >= 1"),
      "max_steps": (base + ["--max-steps", "-3"], "--max-steps=-3 must be a positive number"),
      "max_minutes": (base + ["--max-minutes", "-1"], "--max-minutes=-1.0 must be >= 0"),
      "max_cpu_minutes": (base + ["--max-cpu-minutes", "-2"],
                          "--max-cpu-minutes=-2.0 must be >= 0"),
      "keep": (base + ["--set", "checkpoint.keep=0"], "checkpoint.keep=0 must be >= 1"),
      "every": (base + ["--set", "checkpoint.every=0"], "checkpoint.every=0 must be >= 1"),
      "log_every": (base + ["--set", "train.log_every=0"], "train.log_every=0 must be >= 1"),
      "rows": (base + ["--set", "data.rows=0"], "data.rows=0 must be >= 1"),
      "no_data": (base + ["--set", f"data.dir={tmp_path}/missing"],
                  f"data.dir {tmp_path}/missing does not exist"),
      "not_data": (base, f"data.dir {data} is not a dataset written by train.prepare_data"),
      "yaml": (["--config", str(bad_yaml)], f"config file {bad_yaml} is not valid YAML"),
      "export_step": (base + ["--export-step", "0"], "--export-step=0 must be a saved step"),
      "export_no_run": (base + ["--export-step", "5"],
                        f"{run_dir}/checkpoints does not exist: no run saved checkpoints"),
  }
  for name, (args, message) in cases.items():
    res = _train_main(*args)
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0, name
    assert "Traceback" not in res.stderr and "error: " in lines[-1], (name, res.stderr[-2000:])
    assert message in lines[-1], (name, lines[-1])
    assert not run_dir.exists(), name


# ----------------------------------------------------------------------------- JSONL sources


def _jsonl(path: Path, records: list) -> str:
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def test_jsonl_not_utf8_names_file_and_line(tmp_path: Path) -> None:
  path = tmp_path / "d.jsonl"
  path.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "b"}\n')
  with pytest.raises(sources.SourceError,
                     match=rf"{path}:2: not UTF-8 text \(byte 0xe9 at column 16\); re-save"):
    list(sources.jsonl_conversations(str(path)))


def test_jsonl_unknown_role(tmp_path: Path) -> None:
  path = _jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "narrator", "content": "x"},
                                                     {"role": "assistant", "content": "y"}]}])
  with pytest.raises(sources.SourceError, match=r"d.jsonl:1: unknown role 'narrator'"):
    list(sources.jsonl_conversations(path))


def _tiny_random_config(tmp_path: Path) -> str:
  cfg = tmp_path / "tiny.yaml"
  cfg.write_text(
      "model:\n  base: random\n  random: {vocab_size: 49152, hidden_size: 16, "
      "intermediate_size: 32,\n           num_layers: 1, num_heads: 2, num_kv_heads: 1}\n"
      "graft: {max_group: 4}\ntrain: {steps: 3}\n")
  return str(cfg)


@pytest.mark.parametrize("ids, where", [
    ({"prompt_ids": [1, 2], "response_ids": [99999999]}, "response_ids holds token id 99999999"),
    ({"prompt_ids": [1, 2**40], "response_ids": [5]}, f"prompt_ids holds token id {2**40}"),
])
def test_prepare_data_refuses_out_of_vocabulary_ids(tmp_path: Path, capsys, ids, where) -> None:
  from train import prepare_data  # pylint: disable=import-outside-toplevel
  good = {"prompt": "hi", "response": "yo"}
  path = _jsonl(tmp_path / "d.jsonl", [good, {**good, **ids}])
  out = tmp_path / "ds"
  assert prepare_data.main(["--config", _tiny_random_config(tmp_path), "--source",
                            f"jsonl:{path}", "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: record d.jsonl:2 (jsonl:d.jsonl): "), err[-1]
  assert where in err[-1] and "outside the model's vocabulary [0, 49152)" in err[-1]
  # Nothing written: no dataset and no work directory beside it.
  assert sorted(os.listdir(tmp_path)) == ["d.jsonl", "tiny.yaml"]


# ----------------------------------------------------------------------------- work directories


def _leftover(parent: Path, name: str, *, locked: bool = False, lock_file: bool = True,
              age_s: float = 0.0) -> tuple[Path, int | None]:
  """A work directory as a run leaves it: with its lock file, held (a live run) or not (killed)."""
  path = parent / name
  path.mkdir()
  (path / "samples.jsonl").write_text("{}\n")
  fd = None
  if lock_file:
    fd = os.open(path / tfds_builder._LOCK_FILE, os.O_CREAT | os.O_RDWR)  # pylint: disable=protected-access
    if locked:
      fcntl.flock(fd, fcntl.LOCK_EX)
    else:
      os.close(fd)
      fd = None
  if age_s:
    old = os.path.getmtime(path) - age_s
    os.utime(path, (old, old))
  return path, fd


def test_killed_prepare_leftovers_are_cleaned_on_the_next_run(tmp_path: Path) -> None:
  out = tmp_path / "ds"
  out.mkdir()
  (out / "dataset_info.json").write_text("{}")  # a complete dataset: never touched
  killed_samples, _ = _leftover(tmp_path, ".ds.samples-abc123")
  killed_tmp, _ = _leftover(tmp_path, ".ds.tmp-def456")
  old_unlocked, _ = _leftover(tmp_path, ".ds.tmp-old000", lock_file=False, age_s=3600)
  fresh_unlocked, _ = _leftover(tmp_path, ".ds.tmp-new000", lock_file=False)
  live, fd = _leftover(tmp_path, ".ds.samples-live00", locked=True)
  other, _ = _leftover(tmp_path, ".other.tmp-xyz789")
  try:
    with pytest.raises(tfds_builder.DatasetExistsError):
      tfds_builder.check_output_dir(str(out), overwrite=False)
    assert not killed_samples.exists() and not killed_tmp.exists()
    assert not old_unlocked.exists()
    assert fresh_unlocked.exists(), "an unlocked directory this young may be a run starting"
    assert live.exists(), "a live run's work directory was removed"
    assert other.exists(), "another output's work directory was removed"
    assert sorted(os.listdir(out)) == ["dataset_info.json"]
  finally:
    os.close(fd)
  tfds_builder.check_output_dir(str(out), overwrite=True)
  assert not live.exists()  # its run is gone now


def test_a_dataset_moved_aside_by_a_killed_overwrite_is_put_back(tmp_path: Path) -> None:
  out = tmp_path / "ds"
  aside, _ = _leftover(tmp_path, ".ds.tmp-kill01")
  (aside / "replaced").mkdir()
  (aside / "replaced" / "dataset_info.json").write_text('{"old": true}')
  with pytest.raises(tfds_builder.DatasetExistsError):
    tfds_builder.check_output_dir(str(out), overwrite=False)
  assert (out / "dataset_info.json").read_text() == '{"old": true}'
  assert not aside.exists()


def test_work_dir_is_locked_and_removed() -> None:
  out = REPO / ".pytest_cache" / "work-dir-test" / "ds"
  with tfds_builder.work_dir_beside(str(out), "samples") as path:
    assert os.path.basename(path).startswith(".ds.samples-")
    assert tfds_builder.clean_stale_work_dirs(str(out)) == []  # held: not stale
  assert not os.path.exists(path)


# ----------------------------------------------------------------------------- graft checkpoints


@pytest.fixture(scope="module")
def graft_dir(tmp_path_factory) -> Path:
  cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                    num_heads=4, num_kv_heads=2)
  model = Hamburger(HamburgerConfig(cfg, GraftConfig(merger_head_dim=16)), rngs=nnx.Rngs(0))
  path = tmp_path_factory.mktemp("graft") / "ckpt"
  graft_checkpoint.save_graft(model, str(path), "random", dtype="float32")
  return path


def _copy(src: Path, dst: Path) -> Path:
  dst.mkdir()
  for f in src.iterdir():
    (dst / f.name).write_bytes(f.read_bytes())
  return dst


def _tiny_hamburger() -> Hamburger:
  cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                    num_heads=4, num_kv_heads=2)
  return Hamburger(HamburgerConfig(cfg, GraftConfig(merger_head_dim=16)), rngs=nnx.Rngs(1))


@pytest.mark.parametrize("damage, message", [
    ("truncate", "cannot be read"),
    ("garbage_header", "cannot be read"),
    ("empty", "cannot be read"),
    ("missing", "is missing: the checkpoint is incomplete"),
])
def test_damaged_graft_safetensors_names_the_file(graft_dir: Path, tmp_path: Path, damage: str,
                                                  message: str) -> None:
  ckpt = _copy(graft_dir, tmp_path / "ckpt")
  weights = ckpt / graft_checkpoint.GRAFT_FILE
  data = weights.read_bytes()
  if damage == "truncate":
    weights.write_bytes(data[:len(data) // 2])
  elif damage == "garbage_header":
    weights.write_bytes(np.uint64(len(data)).tobytes() + b"{not json" + data[17:])
  elif damage == "empty":
    weights.write_bytes(b"")
  else:
    weights.unlink()
  with pytest.raises(WeightsError) as info:
    pretrained.load_graft(_tiny_hamburger(), str(ckpt))
  assert str(weights) in str(info.value) and message in str(info.value)


@pytest.mark.parametrize("content, message", [
    ('{"format": "hamburger-jax/graft-v1", "base_so', "is not valid JSON"),
    (b"\xff\xfe{}", "is not valid JSON"),
    ("[1, 2]", "lacks base_source, base_config, graft"),
    ('{"base_source": "random", "graft": {}}', "lacks base_config"),
])
def test_broken_hamburger_json_names_the_file(graft_dir: Path, tmp_path: Path, content,
                                              message: str) -> None:
  ckpt = _copy(graft_dir, tmp_path / "ckpt")
  meta = ckpt / graft_checkpoint.META_FILE
  if isinstance(content, bytes):
    meta.write_bytes(content)
  else:
    meta.write_text(content)
  with pytest.raises(WeightsError) as info:
    pretrained.load_graft(_tiny_hamburger(), str(ckpt))
  assert str(meta) in str(info.value) and message in str(info.value)
  with pytest.raises(WeightsError) as info:
    pretrained.load_hamburger(str(ckpt))  # fails on the metadata, before any base loads
  assert str(meta) in str(info.value)


def test_bad_config_in_hamburger_json_fails_before_the_base_loads(graft_dir: Path,
                                                                  tmp_path: Path) -> None:
  ckpt = _copy(graft_dir, tmp_path / "ckpt")
  meta_path = ckpt / graft_checkpoint.META_FILE
  meta = json.loads(meta_path.read_text())
  meta["graft"]["max_group"] = 0
  meta["base_source"] = str(tmp_path / "no-such-base.gguf")  # loading it would fail differently
  meta_path.write_text(json.dumps(meta))
  with pytest.raises(WeightsError, match=rf"{meta_path}: .*max_group=0"):
    pretrained.load_hamburger(str(ckpt))


# ----------------------------------------------------------------------------- chat templates


def test_prepared_samples_keep_special_token_strings_as_text() -> None:
  from hamburger_jax import assets  # pylint: disable=import-outside-toplevel
  from hamburger_jax.tokenizer import load_default_tokenizer  # pylint: disable=import-outside-toplevel
  try:
    tok = load_default_tokenizer()
  except assets.AssetError as e:
    pytest.skip(str(e))
  im_end = tok.token_to_id("<|im_end|>")
  conv = sources.Conversation(
      [{"role": "user", "content": "Say <|im_end|> please"}], "Here: <|im_end|><|im_start|>user",
      "test", "1")
  clean = sources.Conversation([{"role": "user", "content": "Say  please"}], "Here: ", "test", "2")
  sample = prepare.tokenize(conv, tok, im_end)
  plain = prepare.tokenize(clean, tok, im_end)
  # The control tokens are the template's and the final end of turn, nothing from the text.
  assert sample.prompt_ids.tolist().count(im_end) == plain.prompt_ids.tolist().count(im_end)
  assert sample.response_ids.tolist().count(im_end) == 1 and sample.response_ids[-1] == im_end
  assert tok.token_to_id("<|im_start|>") not in sample.response_ids.tolist()
  assert tok.decode(sample.response_ids) == "Here: <|im_end|><|im_start|>user<|im_end|>"
