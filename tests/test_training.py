"""Training: the sharded step equals the single-device step, two processes equal one, kill -9 then
resume equals an uninterrupted run, frozen base and learning-rate groups, gradient accumulation,
and clear errors for bad configs.

Runs that need fake devices, several processes or a kill happen in subprocesses (jax fixes its
device count when its backend starts). This file is also their helper script:
`python tests/test_training.py sharded OUT_DIR DATA_DIR` (the 8-fake-device checks).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import jax
import numpy as np
import pytest
from flax import nnx

from hamburger_jax import assets, graft_checkpoint, sharding, testing
from hamburger_jax.config import ConfigError
from hamburger_jax.data import pipeline
from hamburger_jax.model.llama import GraftParam
from hamburger_jax.run_config import RunConfig, load_run_config
from hamburger_jax import training

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
MESHES = {"single": (1, 1, 1), "fsdp4_tensor2": (1, 4, 2), "data2_fsdp2_tensor2": (2, 2, 2)}
# Floats are written as YAML reads them: "1e-6" without a dot would be a string.
# Adam's first update is lr * g / (|g| + eps). With the default eps=1e-8 a gradient element of
# ~1e-8 moves its param by a fraction of lr that a different summation order (sharding, processes,
# accumulation) changes by percents; runs compared across layouts use eps=1e-6, where a gradient
# rounding difference of 1e-10 moves a param by at most lr * 1e-4.
STABLE = {"train.eps": "1.0e-6"}
# trainable: all with weight decay off: the first update of each param is exactly the above.
ALL = {**STABLE, "train.trainable": "all", "train.steps": 3, "train.lr_final": "1.0e-5",
       "train.weight_decay": 0.0}
KILL_STEPS = 16


# ----------------------------------------------------------------------------- helpers


def _overrides(data_dir: str, run_dir: str | Path, extra: dict[str, Any] | None = None) -> list[str]:
  """`--set` overrides of configs/tiny.yaml for a run on the synthetic data in `run_dir`."""
  values = {"data.dir": data_dir, "checkpoint.dir": str(run_dir), "train.eval_every": 0,
            **(extra or {})}
  return [f"{k}={v}" for k, v in values.items()]


def _cli(overrides: list[str], *flags: str) -> list[str]:
  sets = [a for o in overrides for a in ("--set", o)]
  return [sys.executable, "-m", "train.main", "--config", TINY, "--no-progress", *flags, *sets]


def _run(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
  """Runs `args` in its own process group, all of which is killed if it overruns `timeout`
  (train/launch_local.sh starts the training processes as its children)."""
  with subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True, start_new_session=True) as proc:
    try:
      out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      out, err = proc.communicate()
      raise AssertionError(f"{' '.join(args)} ran over {timeout} s:\n{out[-3000:]}{err[-3000:]}")
  return subprocess.CompletedProcess(args, proc.returncode, out, err)


class _Background:
  """A subprocess whose output goes to files (so it never blocks on a full pipe)."""

  def __init__(self, args: list[str], env: dict[str, str], log_dir: Path):
    log_dir.mkdir(parents=True, exist_ok=True)
    self.out, self.err = log_dir / "stdout", log_dir / "stderr"
    with open(self.out, "w") as out, open(self.err, "w") as err:
      self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=err, text=True)

  def result(self, timeout: float) -> subprocess.CompletedProcess:
    self.proc.wait(timeout=timeout)
    return subprocess.CompletedProcess(self.proc.args, self.proc.returncode,
                                       self.out.read_text(), self.err.read_text())

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()


def _key(path: tuple) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _flat(tree: Any) -> dict[str, np.ndarray]:
  """{'graft/micro/...': host copy} of a pytree of arrays."""
  return {_key(p): np.array(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _spec(spec: jax.sharding.PartitionSpec | jax.sharding.Sharding) -> list:
  """A PartitionSpec (or a sharding's) as JSON, trailing replicated dims dropped: P(None) == P().
  A single-device sharding has no spec: it is replicated."""
  if isinstance(spec, jax.sharding.Sharding):
    spec = getattr(spec, "spec", jax.sharding.PartitionSpec())
  out = [list(a) if isinstance(a, tuple) else a for a in spec]
  while out and out[-1] is None:
    out.pop()
  return out


def _batches(cfg: RunConfig, rows: int, n: int, shard_index: int = 0,
             shard_count: int = 1) -> list[dict[str, np.ndarray]]:
  """The first `n` batches of `rows` rows that the training pipeline gives one process."""
  d = cfg.data
  it = pipeline.make_train_iterator(d.dir, "train", batch_rows=rows, entries=d.entries,
                                    groups=d.groups, max_group=cfg.graft.max_group, seed=d.seed,
                                    shard_index=shard_index, shard_count=shard_count)
  out = [next(it) for _ in range(n)]
  it.close()
  return out


def _concat(*batches: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def _load_export(path: str | Path) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  return load_file(os.path.join(path, graft_checkpoint.GRAFT_FILE))


def _metrics(run_dir: Path) -> list[dict[str, float]]:
  return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _checkpoint_steps(directory: Path) -> list[int]:
  return [int(n) for n in os.listdir(directory) if n.isdigit()] if directory.exists() else []


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _no_gguf() -> str:
  raise assets.AssetError("tests: the random tiny base needs no tokenizer")


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def sub_env() -> dict[str, str]:
  """Environment of the subprocesses (testing.subprocess_env), this Python's scripts first on
  the PATH."""
  return testing.subprocess_env(
      PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


@pytest.fixture(scope="module")
def no_gguf_tokenizer():
  """Skips parsing the SmolLM2 GGUF for a tokenizer the 256-token random base cannot use."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(assets, "smollm2_gguf", _no_gguf)
    yield


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory, tiny_data_dir: str,
            sub_env: dict[str, str]) -> dict[str, Any]:
  """One step of each mesh in MESHES on 8 fake CPU devices (see _sharded_main)."""
  out = tmp_path_factory.mktemp("sharded")
  proc = _run([sys.executable, __file__, "sharded", str(out), tiny_data_dir], sub_env, 400)
  assert proc.returncode == 0, proc.stderr[-5000:]
  results = json.loads((out / "results.json").read_text())
  results["params"] = {name: dict(np.load(out / f"{name}.npz")) for name in MESHES}
  return results


@pytest.fixture(scope="module")
def graft_run(tmp_path_factory: pytest.TempPathFactory, tiny_data_dir: str,
              no_gguf_tokenizer) -> SimpleNamespace:
  """3 single-process steps of configs/tiny.yaml (trainable: graft) over the global batches that
  a 2-process run sees: each step joins the next 4-row batch of data shard 0 and of shard 1."""
  tmp = tmp_path_factory.mktemp("graft-run")
  cfg = load_run_config(TINY, _overrides(tiny_data_dir, tmp, {**STABLE, "train.steps": 3}))
  tr = training.Trainer(cfg)
  shards = [_batches(cfg, cfg.data.rows // 2, 3, i, 2) for i in range(2)]
  state_keys = set(tr.state.params)
  base0, graft0 = _flat(tr.frozen), _flat(tr.state.params)
  metrics = [tr.step([_concat(a, b)]) for a, b in zip(*shards)]
  model = tr.current_model()
  graft_checkpoint.save_graft(model, str(tmp / "export"), "random", dtype="float32")
  _, graft, base = nnx.split(model, GraftParam, nnx.Param)
  return SimpleNamespace(state_keys=state_keys, base0=base0, graft0=graft0, metrics=metrics,
                         base1=_flat(tr.frozen), graft1=_flat(tr.state.params),
                         model_base=_flat({"base": nnx.to_pure_dict(base)}),
                         model_graft=_flat({"graft": nnx.to_pure_dict(graft)}),
                         export=tmp / "export")


@pytest.fixture(scope="module")
def all_run(tmp_path_factory: pytest.TempPathFactory, tiny_data_dir: str,
            no_gguf_tokenizer) -> SimpleNamespace:
  """3 steps of trainable: all; step i trains on 4-row micro-batches 2i and 2i+1 joined."""
  tmp = tmp_path_factory.mktemp("all-run")
  cfg = load_run_config(TINY, _overrides(tiny_data_dir, tmp, ALL))
  tr = training.Trainer(cfg)
  micro = _batches(cfg, cfg.data.rows // 2, 2 * cfg.train.steps)
  p0 = _flat(tr.state.params)
  metrics = [tr.step([_concat(micro[0], micro[1])])]
  p1, opt1 = _flat(tr.state.params), _flat(tr.state.opt_state)
  metrics += [tr.step([_concat(micro[2 * i], micro[2 * i + 1])]) for i in range(1, cfg.train.steps)]
  return SimpleNamespace(cfg=cfg, micro=micro, p0=p0, p1=p1, opt1=opt1, metrics=metrics,
                         schedules=tr.schedules)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory, tiny_data_dir: str,
             sub_env: dict[str, str]) -> Path:
  """The run dir of an uninterrupted CLI run of KILL_STEPS steps (it also fills the jit cache
  that the kill test's runs then hit)."""
  run_dir = tmp_path_factory.mktemp("full-run") / "run"
  proc = _run(_cli(_overrides(tiny_data_dir, run_dir, {
      "train.steps": KILL_STEPS, "checkpoint.every": KILL_STEPS})), sub_env, 400)
  assert proc.returncode == 0, proc.stderr[-5000:]
  return run_dir


# ----------------------------------------------------------------------------- sharding


def _expected_spec(axes: list, shape: list[int], mesh: dict[str, int]) -> list:
  """TRAIN_RULES spelled out: a dim takes its rule's mesh axis when the axis divides it and no
  earlier dim of the param took it; else it stays replicated."""
  spec, used = [], set()
  for name, dim in zip(axes, shape):
    axis = sharding.TRAIN_RULES.get(name) if name else None
    if axis is not None and axis not in used and dim % mesh[axis] == 0:
      spec.append(axis)
      used.add(axis)
    else:
      spec.append(None)
  return _spec(jax.sharding.PartitionSpec(*spec))


@pytest.mark.slow  # the `sharded` subprocess: ~50 s
def test_sharded_step_matches_single_device(sharded):
  assert sharded["devices"] == 8
  want = sharded["params"]["single"]
  for name in ("fsdp4_tensor2", "data2_fsdp2_tensor2"):
    d, f, t = MESHES[name]
    assert sharded[name]["mesh"] == {"data": d, "fsdp": f, "tensor": t}
    for m in ("loss", "lm_loss", "stop_bce", "grad_norm"):
      assert sharded[name]["metrics"][m] == pytest.approx(sharded["single"]["metrics"][m],
                                                          abs=1e-5), (name, m)
    assert sharded[name]["metrics"]["tokens"] == sharded["single"]["metrics"]["tokens"]
    got = sharded["params"][name]
    assert got.keys() == want.keys() and any(k.startswith("base/") for k in got)
    for k in want:
      np.testing.assert_allclose(got[k], want[k], atol=1e-5, rtol=0, err_msg=f"{name} {k}")


@pytest.mark.slow  # the `sharded` subprocess: ~50 s
def test_train_partition_specs(sharded):
  fsdp_tensor = sharded["fsdp4_tensor2"]["placed"]
  q = "graft/micro/decoder/layers/0/self_attn/q_proj/kernel"
  assert fsdp_tensor[q] == ["fsdp", "tensor"]  # ('embed', 'heads')
  assert fsdp_tensor["graft/micro/decoder/layers/1/mlp/down_proj/kernel"] == ["tensor", "fsdp"]
  assert fsdp_tensor["base/base/decoder/layers/0/self_attn/k_proj/kernel"] == ["fsdp", "tensor"]
  assert fsdp_tensor["graft/embedder/k_proj/bias"] == ["tensor"]  # ('heads',)
  assert fsdp_tensor["graft/micro/stop_head/out/kernel"] == ["fsdp"]  # ('embed', None)
  for norm in ("graft/micro/decoder/layers/0/input_layernorm/weight", "base/base/norm/weight"):
    assert fsdp_tensor[norm] == []  # replicated
  # vocab_size 257 is not divisible by tensor=2: that dim stays whole, embed still splits.
  assert fsdp_tensor["base/base/embed_tokens"] == [None, "fsdp"]
  for name in ("fsdp4_tensor2", "data2_fsdp2_tensor2"):
    r = sharded[name]
    assert r["placed"] == r["intended"], name  # the arrays live where the rules put them
    for k, (axes, shape) in r["axes"].items():
      assert r["placed"][k] == _expected_spec(axes, shape, r["mesh"]), (name, k, axes, shape)
    assert r["mu"] == r["placed"], name  # Adam's moments are sharded like their params
    assert not any("data" in str(s) for s in r["placed"].values())  # params never split on data


@pytest.mark.slow  # the `sharded` subprocess: ~50 s
def test_mesh_and_rows_errors(sharded):
  errors = sharded["errors"]
  assert errors["mesh_3_1_1"]["type"] == "ConfigError"
  assert "does not divide the 8 devices" in errors["mesh_3_1_1"]["message"]
  assert errors["mesh_-1_3_1"]["type"] == "ConfigError"
  assert "'fsdp': 3" in errors["mesh_-1_3_1"]["message"]
  assert errors["mesh_1_2_2"]["type"] == "ConfigError"
  assert "uses 4 devices but 8 are present" in errors["mesh_1_2_2"]["message"]
  assert errors["rows"]["type"] == "ConfigError"
  assert "data.rows=6" in errors["rows"]["message"]
  assert "data-parallel size 4" in errors["rows"]["message"]


def _sharded_main(out: str, data_dir: str) -> None:
  """On 8 fake CPU devices: one step of each mesh of MESHES on the same batch ('single' on one
  device), saving params (npz), metrics and PartitionSpecs (results.json); plus mesh/rows errors."""
  jax.config.update("jax_num_cpu_devices", 8)
  assets.smollm2_gguf = _no_gguf
  make_mesh = sharding.make_mesh
  results: dict[str, Any] = {"devices": jax.device_count()}
  extra = {**STABLE, "train.trainable": "all", "model.random.vocab_size": 257}
  batch = None
  for name, (d, f, t) in MESHES.items():
    devices = jax.devices()[:1] if name == "single" else None
    sharding.make_mesh = lambda *a, devices=devices: make_mesh(*a, devices=devices)
    cfg = load_run_config(TINY, _overrides(data_dir, os.path.join(out, name), {
        **extra, "mesh.data": d, "mesh.fsdp": f, "mesh.tensor": t}))
    tr = training.Trainer(cfg)
    if batch is None:
      batch = _batches(cfg, cfg.data.rows, 1)[0]
    _, graft, base = nnx.split(tr.model, GraftParam, nnx.Param)
    axes = {f"{group}/{'/'.join(map(str, path))}": (list(v.get_metadata()["logical_axes"]),
                                                     list(v.shape))
            for group, state in (("graft", graft), ("base", base))
            for path, v in nnx.to_flat_state(state)}
    metrics = tr.step([batch])
    params = tr.state.params
    np.savez(os.path.join(out, f"{name}.npz"), **_flat(params))
    results[name] = {
        "metrics": metrics, "mesh": dict(tr.mesh.shape), "axes": axes,
        "intended": {_key(p): _spec(s.spec)
                     for p, s in jax.tree_util.tree_flatten_with_path(tr.param_shardings)[0]},
        "placed": {_key(p): _spec(x.sharding)
                   for p, x in jax.tree_util.tree_flatten_with_path(params)[0]},
        "mu": {_key(p).split("/mu/")[1]: _spec(x.sharding)
               for p, x in jax.tree_util.tree_flatten_with_path(tr.state.opt_state)[0]
               if "/mu/" in _key(p)}}
  sharding.make_mesh = make_mesh

  def rows_error() -> None:
    training.Trainer(load_run_config(TINY, _overrides(data_dir, os.path.join(out, "rows"), {
        "mesh.fsdp": 4, "mesh.tensor": 2, "data.rows": 6})))

  checks: dict[str, Callable[[], Any]] = {
      "mesh_3_1_1": lambda: sharding.make_mesh(3, 1, 1),
      "mesh_-1_3_1": lambda: sharding.make_mesh(-1, 3, 1),
      "mesh_1_2_2": lambda: sharding.make_mesh(1, 2, 2), "rows": rows_error}
  results["errors"] = {}
  for name, check in checks.items():
    try:
      check()
      results["errors"][name] = {"type": None, "message": ""}
    except Exception as e:  # pylint: disable=broad-except
      results["errors"][name] = {"type": type(e).__name__, "message": str(e)}
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f)


# ----------------------------------------------------------------------------- processes


@pytest.mark.slow
def test_two_processes_match_single_process(graft_run, tiny_data_dir: str, tmp_path: Path,
                                            sub_env: dict[str, str]):
  """Each process reads its own shard of the records (shard_index::shard_count), so a global
  batch of the 2-process run is [4 rows of shard 0, 4 rows of shard 1], not what 1 process packs
  from all records; graft_run trains on exactly those global batches in one process."""
  run_dir = tmp_path / "run"
  env = {**sub_env, "PORT": str(_free_port())}
  sets = [a for o in _overrides(tiny_data_dir, run_dir, {**STABLE, "train.steps": 3})
          for a in ("--set", o)]
  proc = _run(["bash", "train/launch_local.sh", "2", "--config", TINY, "--cpu-devices", "1",
               *sets], env, 400)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  got, want = _load_export(run_dir / "export"), _load_export(graft_run.export)
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_allclose(got[k], want[k], atol=1e-5, rtol=0, err_msg=k)
  logged = _metrics(run_dir)  # process 0 only
  assert [m["step"] for m in logged] == [1, 2, 3]
  for m, ref in zip(logged, graft_run.metrics):
    assert math.isfinite(m["loss"])
    assert m["tokens"] == ref["tokens"]  # global counts: both shards are in every step
    assert m["loss"] == pytest.approx(ref["loss"], abs=1e-5)
  assert any(not np.array_equal(graft_run.graft1[k], v) for k, v in graft_run.graft0.items())


@pytest.mark.slow
def test_kill_and_resume_is_exact(full_run, tiny_data_dir: str, tmp_path: Path,
                                  sub_env: dict[str, str]):
  run_dir = tmp_path / "run"
  args = _cli(_overrides(tiny_data_dir, run_dir, {"train.steps": KILL_STEPS,
                                                  "checkpoint.every": 1}))
  victim = _Background(args, sub_env, tmp_path / "killed")
  try:
    deadline = time.monotonic() + 300
    while not [s for s in _checkpoint_steps(run_dir / "checkpoints") if s >= 3]:
      assert victim.proc.poll() is None, f"the run ended early: {victim.err.read_text()[-3000:]}"
      assert time.monotonic() < deadline, "no checkpoint at step >= 3 in time"
      time.sleep(0.02)
    os.kill(victim.proc.pid, signal.SIGKILL)
    assert victim.result(60).returncode == -signal.SIGKILL
  finally:
    victim.stop()
  assert not (run_dir / "export").exists(), "the run finished before the kill"

  resumed = _run(args, sub_env, 400)
  assert resumed.returncode == 0, resumed.stderr[-5000:]
  start = int(re.search(r"resumed from step (\d+)", resumed.stdout).group(1))
  assert 3 <= start < KILL_STEPS

  got, want = _load_export(run_dir / "export"), _load_export(full_run / "export")
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0, err_msg=k)
  # Same batches in the same order: every logged step (before the kill, and again after the
  # resume) saw the tokens, groups and loss of the uninterrupted run's step.
  ref = {m["step"]: m for m in _metrics(full_run)}
  logged = _metrics(run_dir)
  assert set(range(start + 1, KILL_STEPS + 1)) <= {m["step"] for m in logged}
  for m in logged:
    r = ref[m["step"]]
    assert (m["tokens"], m["groups"]) == (r["tokens"], r["groups"]), m["step"]
    assert m["loss"] == pytest.approx(r["loss"], abs=1e-6), m["step"]


# ----------------------------------------------------------------------------- freezing, lr


def test_trainable_graft_keeps_base_bit_identical(graft_run):
  assert graft_run.state_keys == {"graft"}  # the base is neither trained nor checkpointed
  assert graft_run.base1.keys() == graft_run.base0.keys() == graft_run.model_base.keys()
  for k, v in graft_run.base0.items():
    assert graft_run.base1[k].tobytes() == v.tobytes(), k
    assert graft_run.model_base[k].tobytes() == v.tobytes(), k  # what current_model() uses
  for k, v in graft_run.graft0.items():
    assert not np.array_equal(graft_run.graft1[k], v), k
    np.testing.assert_array_equal(graft_run.model_graft[k], graft_run.graft1[k])


def test_trainable_all_changes_base(all_run):
  base = [k for k in all_run.p0 if k.startswith("base/")]
  assert len(base) > 30
  for k in base:
    assert not np.array_equal(all_run.p1[k], all_run.p0[k]), k


def test_learning_rate_groups_and_cosine_decay(all_run):
  t = all_run.cfg.train
  assert t.lr_graft != t.lr_base and t.lr_final < t.lr_base
  for group, peak in (("graft", t.lr_graft), ("base", t.lr_base)):
    got = [m[f"lr_{group}"] for m in all_run.metrics]
    assert got[0] == pytest.approx(peak, rel=1e-6)
    want = [t.lr_final + (peak - t.lr_final) * 0.5 * (1 + math.cos(math.pi * i / t.steps))
            for i in range(t.steps)]
    assert got == pytest.approx(want, rel=1e-5)
    assert float(all_run.schedules[group](t.steps)) == pytest.approx(t.lr_final, rel=1e-5)


def test_first_adam_step_moves_each_group_by_its_lr(all_run):
  """Adam's first update is -lr * g / (|g| + eps) ~ -lr * sign(g), with g = mu / (1 - b1) (weight
  decay is off): exactly that with the lr of the param's group, and about lr in size."""
  t = all_run.cfg.train
  medians = {}
  for group, lr in (("graft", t.lr_graft), ("base", t.lr_base)):
    mu = {k.split("/mu/")[1]: v for k, v in all_run.opt1.items()
          if "/mu/" in k and k.split("/mu/")[1].startswith(group + "/")}
    assert len(mu) > 30
    for k, m in mu.items():
      g = m / (1 - t.b1)
      np.testing.assert_allclose(all_run.p1[k] - all_run.p0[k], -lr * g / (np.abs(g) + t.eps),
                                 rtol=0, atol=1e-3 * lr + 1e-7, err_msg=k)
    delta = np.concatenate([np.abs(all_run.p1[k] - all_run.p0[k]).ravel() for k in mu])
    assert delta.max() <= lr * 1.001, group
    medians[group] = np.median(delta)
    assert medians[group] == pytest.approx(lr, rel=0.05), group
  assert medians["graft"] / medians["base"] == pytest.approx(t.lr_graft / t.lr_base, rel=0.05)


def test_gradient_accumulation_matches_larger_batch(all_run, tiny_data_dir: str, tmp_path: Path):
  """accum=2 x 4 rows == accum=1 x 8 rows on the same rows: same loss, gradient (Adam moments)
  and update; all_run's first step is the 8-row reference."""
  cfg = load_run_config(TINY, _overrides(tiny_data_dir, tmp_path, {
      **ALL, "data.rows": all_run.cfg.data.rows // 2, "data.accum": 2}))
  tr = training.Trainer(cfg)
  p0 = _flat(tr.state.params)
  assert all(np.array_equal(p0[k], v) for k, v in all_run.p0.items())
  m = tr.step(all_run.micro[:2])
  ref = all_run.metrics[0]
  assert m["tokens"] == ref["tokens"] and m["groups"] == ref["groups"]
  for name in ("loss", "lm_loss", "stop_bce", "acc_s1", "grad_norm"):
    assert m[name] == pytest.approx(ref[name], rel=1e-5, abs=1e-6), name
  p1, opt1 = _flat(tr.state.params), _flat(tr.state.opt_state)
  for k, v in all_run.p1.items():
    np.testing.assert_allclose(p1[k], v, atol=1e-5, rtol=0, err_msg=k)
  # mu = (1 - b1) g and nu = (1 - b2) g^2: the accumulated gradient itself. Some gradients are
  # zero up to rounding (a key bias shifts all of a query's logits alike), so the tolerance is
  # relative to the largest moment of each kind.
  for kind in ("mu", "nu"):
    leaves = {k: v for k, v in all_run.opt1.items() if f"/{kind}/" in k}
    scale = max(float(np.abs(v).max()) for v in leaves.values())
    for k, v in leaves.items():
      np.testing.assert_allclose(opt1[k], v, rtol=1e-4, atol=1e-5 * scale, err_msg=k)


# ----------------------------------------------------------------------------- bad input


def test_config_errors(full_run, tiny_data_dir: str, tmp_path: Path, no_gguf_tokenizer):
  with pytest.raises(ConfigError,
                     match=r"unknown config key .train\.stepz.; valid keys of train are: .*\bsteps\b"):
    load_run_config(TINY, ["train.stepz=3"])
  with pytest.raises(ConfigError, match=r"'trian'.*\btrain\b"):
    load_run_config(TINY, ["trian.steps=3"])
  shutil.copytree(full_run / "checkpoints", tmp_path / "checkpoints")
  cfg = load_run_config(TINY, _overrides(tiny_data_dir, tmp_path, {"graft.micro_layers": 1}))
  with pytest.raises(ConfigError, match=r"another model config: graft\.micro_layers is 2 there "
                                        r"but 1 now"):
    training.run(cfg, progress=False, log=lambda _: None)


def test_cli_config_errors(full_run, tiny_data_dir: str, tmp_path: Path,
                           sub_env: dict[str, str]):
  """Each bad input exits non-zero with one `error: ...` line on stderr and no traceback."""
  shutil.copytree(full_run / "checkpoints", tmp_path / "resume" / "checkpoints")
  run = lambda name, extra: _overrides(tiny_data_dir, tmp_path / name, extra)
  cases = {
      "unknown_key": (_cli(run("k", {"train.stepz": 3})), ["'train.stepz'", "steps", "lr_graft"]),
      "mesh": (_cli(run("m", {"mesh.fsdp": 3}), "--cpu-devices", "8"),
               ["'fsdp': 3", "does not divide the 8 devices"]),
      "rows": (_cli(run("r", {"mesh.data": 4, "data.rows": 6}), "--cpu-devices", "4"),
               ["data.rows=6", "data-parallel size 4"]),
      "resume": (_cli(run("resume", {"graft.micro_layers": 1})),
                 ["another model config", "graft.micro_layers is 2 there but 1 now"]),
  }
  procs = {name: _Background(args, sub_env, tmp_path / "logs" / name)
           for name, (args, _) in cases.items()}
  try:
    for name, (_, words) in cases.items():
      res = procs[name].result(300)
      assert res.returncode not in (0, None), name
      lines = res.stderr.strip().splitlines()
      assert len(lines) == 1 and lines[0].startswith("error: "), (name, res.stderr[-3000:])
      for w in words:
        assert w in lines[0], (name, w, lines[0])
  finally:
    for p in procs.values():
      p.stop()
  assert not (tmp_path / "resume" / "export").exists()


if __name__ == "__main__":
  if sys.argv[1:2] == ["sharded"]:
    _sharded_main(*sys.argv[2:4])
  else:
    raise SystemExit("usage: python tests/test_training.py sharded OUT_DIR DATA_DIR")


def test_curves_plot(full_run, tmp_path: Path, capsys):
  from train import curves  # pylint: disable=import-outside-toplevel
  out = tmp_path / "curves.png"
  assert curves.main([str(full_run), "--out", str(out)]) == 0
  steps = [m for m in _metrics(full_run) if "step_s" in m]  # the paper recipe: data groups
  assert steps and all(1 <= m["mean_group_size"] <= 4 for m in steps)
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # A resumed run re-logs steps after its last checkpoint: the later record of a step wins.
  run = tmp_path / "resumed"
  run.mkdir()
  (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
      {"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 2, "loss": 3.0})) + "\n")
  assert [r["loss"] for r in training.read_metrics(str(run))] == [5.0, 3.0]
  capsys.readouterr()
  assert curves.main([str(tmp_path / "nowhere")]) == 2
  assert "metrics.jsonl does not exist" in capsys.readouterr().err


def _gen(step, tokens, agreement, identical=0.5):
  return {"step": step, "gen_tokens_per_step": tokens, "gen_prefix_agreement": agreement,
          "gen_identical": identical}


def test_pick_rule(tmp_path: Path, capsys):
  """The shipping rule: most tokens per step among saved steps at >= the start's agreement;
  else the best agreement, flagged."""
  from hamburger_jax.training import pick  # pylint: disable=import-outside-toplevel
  from train import pick as pick_cli  # pylint: disable=import-outside-toplevel
  rows = [_gen(0, 1.10, 0.70), {"step": 5, "loss": 2.0}, _gen(20, 1.02, 0.90),
          _gen(40, 1.30, 0.71), _gen(60, 1.50, 0.69), _gen(80, 1.30, 0.80)]
  assert pick.pick_step(rows) == pick.Pick(80, False, 0.70)  # tie on tokens: higher agreement
  assert pick.pick_step(rows, saved={20, 40, 60}).step == 40  # 80 has no checkpoint
  fallback = pick.pick_step([_gen(0, 1.0, 0.9), _gen(20, 1.2, 0.8), _gen(40, 1.5, 0.85)])
  assert fallback == pick.Pick(40, True, 0.9)
  with pytest.raises(ValueError, match="step 0"):
    pick.pick_step(rows[1:])
  with pytest.raises(ValueError, match="no saved step"):
    pick.pick_step(rows, saved={5})

  run = tmp_path / "joint"
  (run / "checkpoints").mkdir(parents=True)
  for step in (20, 40, 60):
    (run / "checkpoints" / str(step)).mkdir()
  (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  capsys.readouterr()
  assert pick_cli.main([str(run)]) == 0
  out = capsys.readouterr().out
  assert "| 40 | yes | 1.300 | 0.710 | 0.500 | **pick** |" in out
  assert "| 80 | no |" in out and "--export-step 40" in out
  assert pick_cli.main([str(tmp_path / "nowhere")]) == 2
  assert "metrics.jsonl does not exist" in capsys.readouterr().err


# ----------------------------------------------------------------------------- distill stages


STAGE_STEPS = 8


def _staged_config(path: Path, data_dir: str, run_dir: Path) -> str:
  """configs/tiny.yaml trained as the distill recipe's stages 1 (micro) and 2 (merger), then the
  stop head alone on the "harm" target."""
  import yaml  # pylint: disable=import-outside-toplevel
  raw = yaml.safe_load(Path(TINY).read_text())
  raw["graft"]["base_lora_rank"] = 4
  raw["data"]["dir"] = data_dir
  raw["train"].update(recipe="distill", eval_every=0, eps=1.0e-6)
  raw["checkpoint"].update(dir=str(run_dir), every=2)
  raw["stages"] = [{"name": "micro", "train": {"trainable": "micro", "steps": STAGE_STEPS}},
                   {"name": "merger", "train": {"trainable": "merger", "steps": STAGE_STEPS}},
                   {"name": "stop", "train": {"trainable": "stop", "steps": STAGE_STEPS},
                    "distill": {"stop_target": "harm"}}]
  path.write_text(yaml.safe_dump(raw))
  return str(path)


@pytest.fixture(scope="module")
def teacher_data_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
  from hamburger_jax.testing import build_synthetic_teacher_dataset  # pylint: disable=import-outside-toplevel
  cfg = load_run_config(TINY, ["graft.base_lora_rank=4"])
  return build_synthetic_teacher_dataset(str(tmp_path_factory.mktemp("teacher") / "data"), cfg)


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory, teacher_data_dir: str,
           no_gguf_tokenizer) -> SimpleNamespace:
  """Stage 1 then stage 2 of the staged tiny config, in process, counting base forwards."""
  from hamburger_jax.model.llama import Llama  # pylint: disable=import-outside-toplevel
  tmp = tmp_path_factory.mktemp("staged")
  config = _staged_config(tmp / "staged.yaml", teacher_data_dir, tmp / "run")
  calls = {"n": 0}
  forward = Llama.forward

  def counted(self, *args, **kwargs):
    calls["n"] += 1
    return forward(self, *args, **kwargs)

  results = {}
  for stage in ("micro", "merger", "stop"):
    calls["n"] = 0
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(Llama, "forward", counted)
      cfg = load_run_config(config, stage=stage)
      results[stage] = training.run(cfg, progress=False, log=lambda *_: None)
    results[f"{stage}_base_forwards"] = calls["n"]
  return SimpleNamespace(config=config, run=tmp / "run", **results)


def test_stage_1_never_runs_the_base_forward_and_learns(staged):
  assert staged.micro_base_forwards == 0
  losses = [m["loss"] for m in _metrics(staged.run / "micro")]
  assert len(losses) == STAGE_STEPS
  assert np.mean(losses[-2:]) < np.mean(losses[:2]), losses
  assert (staged.run / "micro" / "export" / graft_checkpoint.META_FILE).exists()


def test_stage_2_starts_from_stage_1_trains_the_merger_only_and_learns(staged):
  assert staged.merger_base_forwards > 0
  losses = [m["loss"] for m in _metrics(staged.run / "merger")]
  assert np.mean(losses[-2:]) < np.mean(losses[:2]), losses
  one, two = (_load_export(staged.run / s / "export") for s in ("micro", "merger"))
  micro = [k for k in one if ".micro." in f".{k}." or k.startswith("micro")]
  merger = [k for k in one if k not in micro]
  assert micro and merger
  for k in micro:  # stage 2 started from stage 1's micro decoder and kept it frozen
    np.testing.assert_array_equal(two[k], one[k], err_msg=k)
  assert any(not np.array_equal(two[k], one[k]) for k in merger)  # and trained the merger
  last = _metrics(staged.run / "merger")[-1]
  assert "feature_loss" in last
  # distill steps count teacher windows (up to K tokens each), which are not the data's groups
  assert 1 <= last["mean_window_size"] <= 4 and "mean_group_size" not in last


def test_stop_stage_trains_the_stop_head_only_and_learns(staged):
  assert staged.stop_base_forwards > 0  # the harm target reads the merged forward
  bce = [m["stop_bce"] for m in _metrics(staged.run / "stop")]
  assert np.mean(bce[-2:]) < np.mean(bce[:2]), bce
  two, three = (_load_export(staged.run / s / "export") for s in ("merger", "stop"))
  stop = [k for k in two if "stop_head" in k]
  assert stop
  for k in two:
    if k not in stop:
      np.testing.assert_array_equal(three[k], two[k], err_msg=k)
  assert any(not np.array_equal(three[k], two[k]) for k in stop)


@pytest.mark.parametrize("confidence", [1.0, 0.0])
def test_generation_check_measures_agreement_with_the_base(staged, tmp_path: Path, confidence,
                                                            no_gguf_tokenizer):
  """train.generate_every generates freely on held-out prompts (before the first step too) and
  compares with the frozen base's greedy answers: at confidence 1.0 HAMburger is the base
  (agreement 1); a graft forced to continue every step (confidence 0) merges and leaves the
  base's path."""
  cfg = load_run_config(staged.config, [
      f"checkpoint.dir={tmp_path / 'gen'}", "train.steps=2", "train.generate_every=2",
      "train.generate_prompts=4", "train.generate_tokens=12",
      f"train.generate_confidence={confidence}"], stage="micro")
  training.run(cfg, progress=False, log=lambda *_: None)
  rows = _metrics(tmp_path / "gen" / "micro")
  assert rows[0]["step"] == 0 and "loss" not in rows[0]  # the initial graft, before training
  last = rows[-1]
  if confidence == 1.0:
    assert last["gen_tokens_per_step"] == 1.0
    assert last["gen_identical"] == last["gen_prefix_agreement"] == 1.0
  else:
    assert last["gen_tokens_per_step"] > 1.0
    assert last["gen_identical"] < 1.0 and last["gen_prefix_agreement"] < 1.0


def test_export_step_exports_an_earlier_checkpoint(staged, tmp_path: Path, no_gguf_tokenizer):
  """--export-step exports a checkpoint that later ones followed: the same params as the run's
  own export when it stood at that step (train.steps lowered to it), not the latest."""
  quiet = lambda *_: None
  sets = [f"checkpoint.dir={tmp_path / 'run'}", "train.steps=4", "checkpoint.every=2",
          "checkpoint.keep=3"]
  training.run(load_run_config(staged.config, sets, stage="micro"), max_steps=2, progress=False,
              log=quiet)
  stood = load_run_config(staged.config, [*sets[:1], "train.steps=2",
                                          f"checkpoint.export={tmp_path / 'stood'}"], stage="micro")
  assert training.run(stood, progress=False, log=quiet).export_dir == str(tmp_path / "stood")
  cfg = load_run_config(staged.config, sets, stage="micro")
  training.run(cfg, progress=False, log=quiet)  # on to step 4, exported to the run's export
  picked = load_run_config(staged.config, [*sets, f"checkpoint.export={tmp_path / 'picked'}"],
                           stage="micro")
  assert training.export_step(picked, 2, log=quiet) == str(tmp_path / "picked")
  at2, stood2 = _load_export(tmp_path / "picked"), _load_export(tmp_path / "stood")
  at4 = _load_export(tmp_path / "run" / "micro" / "export")
  assert at2.keys() == stood2.keys() == at4.keys()
  for k in at2:
    np.testing.assert_array_equal(at2[k], stood2[k], err_msg=k)
  assert any(not np.array_equal(at2[k], at4[k]) for k in at2)
  meta = json.loads((tmp_path / "picked" / graft_checkpoint.META_FILE).read_text())
  assert meta["trained_steps"] == 2
  with pytest.raises(ConfigError, match=r"no checkpoint at step 3 .* saved steps are \[2, 4\]"):
    training.export_step(picked, 3, log=quiet)


def test_accumulated_acceptance_counts_are_sums(staged, tmp_path: Path, no_gguf_tokenizer):
  """accum=2 x R/2 rows logs the same acceptance counts (n_tf_*) and ratios (tf_*) as accum=1 x
  R rows on the same rows: counts add up across micro-batches, ratios are taken of the sums."""
  one = load_run_config(staged.config, [f"checkpoint.dir={tmp_path / 'one'}"], stage="micro")
  rows = one.data.rows
  two = load_run_config(staged.config, [f"checkpoint.dir={tmp_path / 'two'}",
                                        f"data.rows={rows // 2}", "data.accum=2"], stage="micro")
  halves = _batches(one, rows // 2, 2)
  m1 = training.Trainer(one).step([_concat(*halves)])
  m2 = training.Trainer(two).step(halves)
  keys = [k for k in m1 if k.startswith(("n_tf_", "tf_"))]
  assert any(k.startswith("n_tf_groups_") for k in keys) and m1["n_tf_groups_c80"] > 0
  for k in keys:
    assert m2[k] == pytest.approx(m1[k], rel=1e-6), k


def test_stage_and_distill_data_errors(staged, teacher_data_dir: str, tiny_data_dir: str,
                                       tmp_path: Path, no_gguf_tokenizer):
  fresh = _staged_config(tmp_path / "fresh.yaml", teacher_data_dir, tmp_path / "fresh")
  with pytest.raises(ConfigError, match="run the previous stage to its end first"):
    training.run(load_run_config(fresh, stage="merger"), progress=False)
  with pytest.raises(ConfigError, match=r"trained in stages \(micro, merger, stop\)"):
    load_run_config(fresh)
  assert load_run_config(fresh, shared_only=True).graft.base_lora_rank == 4  # data tools
  with pytest.raises(ConfigError, match="unknown stage 'polish'"):
    load_run_config(fresh, stage="polish")
  no_teacher = load_run_config(fresh, [f"data.dir={tiny_data_dir}"], stage="micro")
  with pytest.raises(ConfigError, match="needs teacher signals"):
    training.run(no_teacher, progress=False)
  other_base = load_run_config(fresh, ["train.seed=1"], stage="micro")  # another random base
  with pytest.raises(ConfigError, match="segmented with another base"):
    training.run(other_base, progress=False)
  with pytest.raises(ConfigError, match="needs train.recipe=distill"):
    load_run_config(fresh, ["train.recipe=paper"], stage="micro")
  # --set moves the stages' root and wins over a stage's own values.
  moved = load_run_config(fresh, [f"checkpoint.dir={tmp_path / 'x'}", "train.steps=3"],
                          stage="merger")
  assert (moved.checkpoint.dir, moved.train.init_from, moved.train.steps) == (
      str(tmp_path / "x" / "merger"), str(tmp_path / "x" / "micro" / "export"), 3)
  assert not (tmp_path / "fresh").exists()  # nothing written by the refused runs


@pytest.mark.slow
def test_killed_stage_resumes_exactly(staged, tmp_path: Path, sub_env: dict[str, str]):
  """Stage 2 (frozen micro decoder from stage 1's export, trained merger) killed mid-run and
  resumed ends where the uninterrupted stage 2 ended."""
  run = tmp_path / "run"
  shutil.copytree(staged.run / "micro", run / "micro")  # stage 1 done, as in the fixture
  config = _staged_config(tmp_path / "staged.yaml", str(load_run_config(
      staged.config, stage="micro").data.dir), run)
  args = [sys.executable, "-m", "train.main", "--config", config, "--stage", "merger",
          "--no-progress", "--set", "checkpoint.every=1"]
  victim = _Background(args, sub_env, tmp_path / "killed")
  try:
    deadline = time.monotonic() + 300
    while not [s for s in _checkpoint_steps(run / "merger" / "checkpoints") if s >= 2]:
      assert victim.proc.poll() is None, f"the run ended early: {victim.err.read_text()[-3000:]}"
      assert time.monotonic() < deadline, "no checkpoint at step >= 2 in time"
      time.sleep(0.02)
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.result(60)
  finally:
    victim.stop()
  assert not (run / "merger" / "export").exists(), "the stage finished before the kill"
  resumed = _run(args, sub_env, 400)
  assert resumed.returncode == 0, resumed.stderr[-5000:]
  assert re.search(r"resumed from step (\d+)", resumed.stdout)
  got, want = _load_export(run / "merger" / "export"), _load_export(staged.run / "merger" / "export")
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0, err_msg=k)


def test_max_minutes_saves_and_stops_after_a_step(staged, tmp_path: Path, no_gguf_tokenizer):
  config = _staged_config(tmp_path / "boxed.yaml", str(load_run_config(
      staged.config, stage="micro").data.dir), tmp_path / "boxed")
  cfg = load_run_config(config, ["train.eval_every=100"], stage="micro")
  out = training.run(cfg, max_minutes=0, progress=False, log=lambda *_: None)
  assert (out.steps_done, out.final_step, out.export_dir) == (1, 1, None)
  assert _checkpoint_steps(tmp_path / "boxed" / "micro" / "checkpoints") == [1]
  # The initial graft is validated (where the curves start), and the stop evaluated and logged.
  logged = _metrics(tmp_path / "boxed" / "micro")
  assert [m["step"] for m in logged] == [0, 1]
  assert "val_loss" in logged[0] and "loss" not in logged[0] and "val_loss" in logged[1]
  assert logged[0]["val_loss"] != logged[1]["val_loss"]  # a step trained between them
  # Acceptance ratios of the validation are ratios of its summed counts.
  v = logged[1]
  assert v["val_tf_tokens_per_step_c50"] == pytest.approx(
      v["val_n_tf_emitted_c50"] / v["val_n_tf_groups_c50"])
  assert 1.0 <= v["val_tf_tokens_per_step_c30"] and v["val_n_tf_groups_c30"] > 0
  with pytest.raises(ConfigError, match="max_steps=-3 must be >= 1"):
    training.run(cfg, max_steps=-3, progress=False)


def test_max_cpu_minutes_counts_the_steps_cpu_time(staged, tmp_path: Path, no_gguf_tokenizer):
  config = _staged_config(tmp_path / "cpu.yaml", str(load_run_config(
      staged.config, stage="micro").data.dir), tmp_path / "cpu")
  # The stop falls on a checkpoint step (every=1): saved once, not refused as a duplicate.
  cfg = load_run_config(config, ["train.eval_every=0", "train.log_every=1", "checkpoint.every=1"],
                        stage="micro")
  said = []
  out = training.run(cfg, max_cpu_minutes=0, progress=False, log=said.append)
  assert (out.steps_done, out.final_step, out.export_dir) == (1, 1, None)
  assert any("CPU min of training: saving step 1" in s for s in said), said
  logged = _metrics(tmp_path / "cpu" / "micro")
  assert logged[0]["step_cpu_s"] > 0
  # A budget no step reaches trains to the end.
  assert training.run(cfg, max_cpu_minutes=1e6, progress=False, log=said.append).final_step == (
      cfg.train.steps)
  with pytest.raises(ConfigError, match="max_cpu_minutes=-1 must be >= 0"):
    training.run(cfg, max_cpu_minutes=-1, progress=False)


def test_recipe_comparison_plot(staged, tmp_path: Path, capsys):
  from hamburger_jax.training import curves as plots  # pylint: disable=C0415
  from train import curves  # pylint: disable=import-outside-toplevel
  # Stages chain on one minutes axis: stage 2's steps come after stage 1's minutes.
  one = [{"step": s, "step_s": 60.0, "val_agree_s2": 0.1 * s} for s in (1, 2)]
  two = [{"step": s, "step_s": 30.0, "val_agree_merged": 0.2} for s in (1, 2, 3, 4)]
  assert [m for m, _ in plots.minutes_axis([one, two])] == [1.0, 2.0, 2.5, 3.0, 3.5, 4.0]
  # CPU seconds are the axis when every run logged them (comparable on a shared machine).
  assert plots.time_key([[one, two]]) == "step_s"
  cpu = [dict(r, step_cpu_s=2 * r["step_s"]) for r in one]
  assert plots.time_key([[cpu]]) == "step_cpu_s"
  assert [m for m, _ in plots.minutes_axis([cpu], "step_cpu_s")] == [2.0, 4.0]
  out = tmp_path / "cmp.png"
  stages = f"{staged.run / 'micro'},{staged.run / 'merger'}"
  assert curves.main(["--compare", f"distill={stages}", f"again={stages}", "--out",
                      str(out)]) == 0
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # The stop head's trade-off, from the last validation of each run.
  rows = [{"step": 1, "val_tf_tokens_per_step_c80": 9.0, "val_tf_accepted_agree_c80": 0.0},
          {"step": 2, "val_tf_tokens_per_step_c80": 1.2, "val_tf_accepted_agree_c80": 0.9,
           "val_tf_tokens_per_step_c50": 1.6, "val_tf_accepted_agree_c50": 0.7}]
  assert plots.tradeoff_points(rows) == [(0.5, 1.6, 0.7), (0.8, 1.2, 0.9)]
  # Nothing accepted (1.0 token per step): the share is undefined, not 0.
  idle = [dict(rows[1], val_tf_tokens_per_step_c80=1.0, val_tf_accepted_agree_c80=0.0)]
  assert plots.tradeoff_points(idle) == [(0.5, 1.6, 0.7), (0.8, 1.0, None)]
  # The logged count decides where there is one (a ratio may round to 1.0).
  counted = [dict(rows[1], val_tf_tokens_per_step_c80=1.0, val_n_tf_accepted_c80=1.0)]
  assert plots.tradeoff_points(counted)[1] == (0.8, 1.0, 0.9)
  with pytest.raises(ValueError, match="no val_tf_"):
    plots.tradeoff_points([{"step": 1}])
  run = tmp_path / "tf"
  run.mkdir()
  (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert curves.main(["--tradeoff", f"a={run}", f"b={run}", "--out", str(out)]) == 0
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(SystemExit):  # --compare without --out
    curves.main(["--compare", f"distill={stages}"])
  assert curves.main(["--compare", "distill", "--out", str(out)]) == 2
  assert "use NAME=DIR" in capsys.readouterr().err
  # The acceptance panels follow --confidence; an untracked one is refused.
  assert plots.compared_panels(0.5)[-2][0] == "val_tf_tokens_per_step_c50"
  assert curves.main(["--compare", f"distill={stages}", "--confidence", "0.5", "--out",
                      str(out)]) == 0
  assert curves.main(["--compare", f"distill={stages}", "--confidence", "0.55", "--out",
                      str(out)]) == 2
  assert "validation tracks only 0.3, 0.5" in capsys.readouterr().err


def _two_steps(tiny_data_dir: str, run_dir: Path, scan: bool, remat: str) -> tuple[list, dict]:
  """(metrics, updated params) of 2 steps of the tiny model with adapters on merged entries and
  the base trained too, its layers unrolled or scanned (train.scan_layers, train.remat)."""
  cfg = load_run_config(TINY, _overrides(tiny_data_dir, run_dir, {
      **ALL, "graft.base_lora_rank": 4, "train.scan_layers": scan, "train.remat": remat}))
  tr = training.Trainer(cfg)
  metrics = [tr.step([b]) for b in _batches(cfg, cfg.data.rows, 2)]
  return metrics, _flat(tr.state.params)


@pytest.fixture(scope="module")
def unrolled_steps(tiny_data_dir: str, tmp_path_factory: pytest.TempPathFactory,
                   no_gguf_tokenizer) -> tuple[list, dict]:
  """The unrolled layers' 2 steps, the reference of every scanned variant."""
  return _two_steps(tiny_data_dir, tmp_path_factory.mktemp("unrolled"), False, "none")


@pytest.mark.parametrize("remat", ["none", "layers"])
def test_scanned_layers_train_like_unrolled_ones(unrolled_steps, tiny_data_dir: str,
                                                 tmp_path: Path, remat: str, no_gguf_tokenizer):
  """train.scan_layers (one loop over stacked layer weights) and train.remat=layers compute the
  same step as the unrolled layers: losses, metrics and updated params agree to float32
  rounding, with adapters on merged entries and the base trained too."""
  m0, p0 = unrolled_steps
  m1, p1 = _two_steps(tiny_data_dir, tmp_path / "scanned", True, remat)
  for a, b in zip(m0, m1):
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
  assert p0.keys() == p1.keys()
  for k in p0:
    np.testing.assert_allclose(p1[k], p0[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_remat_needs_scanned_layers():
  with pytest.raises(ConfigError, match="scan_layers"):
    load_run_config(TINY, ["train.remat=layers"])
  with pytest.raises(ConfigError, match="train.remat"):
    load_run_config(TINY, ["train.scan_layers=true", "train.remat=everything"])


# ----------------------------------------------------------------------------- fidelity curves


def _tiny_fidelity_set(model, path: Path, n: int = 6) -> str:
  """A fidelity set for the tiny random base: synthetic token ids, random groups."""
  from hamburger_jax.data.teacher_pass import base_fingerprint  # pylint: disable=C0415
  from hamburger_jax.evaluation import fidelity_set  # pylint: disable=C0415
  rng = np.random.default_rng(3)
  records = []
  for i in range(n):
    groups = tuple(int(g) for g in rng.choice([1, 2, 3, 4], 8))
    records.append(fidelity_set.FidelityRecord(
        "synthetic", f"s{i}", tuple(int(t) for t in rng.integers(1, 250, 6)),
        tuple(int(t) for t in rng.integers(1, 250, sum(groups))), groups))
  fset = fidelity_set.FidelitySet(tuple(records),
                                  {"base_fingerprint": base_fingerprint(model.base)})
  return fidelity_set.save(fset, str(path))


def test_fidelity_check_logs_the_learning_curve(staged, tmp_path: Path, no_gguf_tokenizer):
  """train.fidelity_every measures the fidelity set at the start, every N steps and at the end
  (fid_* metrics); a set from another base is refused before training."""
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  start = f"train.init_from={staged.run / 'micro' / 'export'}"
  cfg = load_run_config(staged.config, [f"checkpoint.dir={tmp_path / 'fid'}", start],
                        stage="merger")
  fset = _tiny_fidelity_set(pretrained.build_run_model(cfg)[0], tmp_path / "set.json")
  cfg = load_run_config(staged.config, [
      f"checkpoint.dir={tmp_path / 'fid'}", "train.steps=4", "train.fidelity_every=2",
      f"train.fidelity_set={fset}", start], stage="merger")
  training.run(cfg, progress=False, log=lambda *_: None)
  rows = [r for r in _metrics(tmp_path / "fid" / "merger") if "fid_agree_merged" in r]
  assert [r["step"] for r in rows] == [0, 2, 4]
  for r in rows:
    assert 0 <= r["fid_agree_merged"] <= 1 and r["fid_kl_merged"] >= 0
    assert {"fid_agree_single", "fid_agree_one_merge", "fid_agree_s2"} <= set(r)
  assert rows[0]["fid_kl_merged"] != rows[-1]["fid_kl_merged"]  # the graft trained between
  other = load_run_config(staged.config, [
      f"checkpoint.dir={tmp_path / 'fid2'}", "train.steps=2", "train.fidelity_every=2",
      f"train.fidelity_set={fset}", "train.seed=5", start], stage="merger")
  with pytest.raises(ConfigError, match="another base"):
    training.run(other, progress=False, log=lambda *_: None)


def test_a_drafter_run_logs_its_drafts_curve(staged, tmp_path: Path, no_gguf_tokenizer):
  """train.fidelity_every in a drafter's run: what its drafts are worth on the set's answers read
  as single tokens (fid_d1.., fid_chained, fid_walk) at the start, every N steps and at the
  end, the drafter learning between; train.curves --fidelity draws its panels."""
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from train import curves as curves_cli  # pylint: disable=import-outside-toplevel
  start = f"train.init_from={staged.run / 'micro' / 'export'}"
  sets = [f"checkpoint.dir={tmp_path / 'd'}", start, "graft.drafter_layers=1",
          "train.trainable=drafter", "distill.greedy_weight=0.5"]
  cfg = load_run_config(staged.config, sets, stage="merger")
  model = pretrained.build_run_model(cfg)[0]
  fset = _tiny_fidelity_set(model, tmp_path / "set.json")
  cfg = load_run_config(staged.config, sets + [
      "train.steps=4", "train.fidelity_every=2", f"train.fidelity_set={fset}"], stage="merger")
  training.run(cfg, progress=False, log=lambda *_: None)
  rows = [r for r in _metrics(tmp_path / "d" / "merger") if "fid_chained" in r]
  assert [r["step"] for r in rows] == [0, 2, 4]
  for r in rows:
    assert 0 <= r["fid_d1"] <= 1 and 1 <= r["fid_chained"] <= 4 and 1 <= r["fid_walk"] <= 4
    assert "fid_agree_merged" not in r
  assert any(r["greedy_ce"] > 0 for r in _metrics(tmp_path / "d" / "merger") if "greedy_ce" in r)
  out = tmp_path / "drafts.png"
  assert curves_cli.main(["--fidelity", f"d={tmp_path / 'd' / 'merger'}", "--out",
                          str(out)]) == 0
  # The drafter config's way: a reduced head (train.micro_vocab, the init's list) and the
  # training-time test (distill.draft_unroll); the vocabulary's rows stay frozen, as the base.
  from hamburger_jax import micro_vocab  # pylint: disable=import-outside-toplevel
  init = tmp_path / "init"
  shutil.copytree(staged.run / "micro" / "export", init)
  vocab = model.cfg.base.vocab_size
  micro_vocab.save(str(init), np.arange(vocab, 0, -1), 32, ["test"])
  reduced = load_run_config(staged.config, [
      f"checkpoint.dir={tmp_path / 'r'}", f"train.init_from={init}", "graft.drafter_layers=1",
      "train.trainable=drafter", "train.micro_vocab=32", "distill.draft_unroll=true",
      "distill.greedy_weight=0.5", "train.steps=2", "train.fidelity_every=2",
      f"train.fidelity_set={fset}"], stage="merger")
  training.run(reduced, progress=False, log=lambda *_: None)
  rows = [r for r in _metrics(tmp_path / "r" / "merger") if "fid_chained" in r]
  assert [r["step"] for r in rows] == [0, 2] and all(np.isfinite(r["loss"]) for r in
                                                     _metrics(tmp_path / "r" / "merger")
                                                     if "loss" in r)


def test_a_run_grows_the_graft_it_starts_from(staged, teacher_data_dir: str, tmp_path: Path,
                                              no_gguf_tokenizer):
  """train.init_from a graft without the options this run adds (a contextual entry, a larger
  adapter rank): the grown graft computes what the old one did; its export loads with its own
  options. A change that is not growth is refused."""
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.evaluation import teacher_forced  # pylint: disable=import-outside-toplevel
  from hamburger_jax.objectives.distillation import distill_loss  # pylint: disable=C0415
  from hamburger_jax.run_config import DistillConfig  # pylint: disable=C0415
  export = str(staged.run / "merger" / "export")
  base_cfg = load_run_config(staged.config, [f"train.init_from={export}"], stage="stop")
  grown_cfg = load_run_config(staged.config, [
      f"train.init_from={export}", "graft.contextual_entry=true", "graft.base_lora_rank=8",
      "graft.base_lora_alpha=4.0"], stage="stop")
  old, _ = pretrained.build_run_model(base_cfg)
  grown, _ = pretrained.build_run_model(grown_cfg)
  records = teacher_forced.read_records(teacher_data_dir, "validation", 4, 4)
  batch = next(iter(teacher_forced.split_batches(records, 4, 2)))
  batch = {k: jax.numpy.asarray(v) for k, v in batch.items()}
  a = distill_loss(old, batch, DistillConfig())[1]
  b = distill_loss(grown, batch, DistillConfig())[1]
  for name in ("loss", "kl", "feature_loss", "agree_merged"):
    assert float(a[name]) == pytest.approx(float(b[name]), rel=1e-5, abs=1e-6), name
  out = tmp_path / "grown"
  graft_checkpoint.save_graft(grown, str(out), "random", dtype="float32")
  again = pretrained.build_run_model(load_run_config(staged.config, [
      "graft.contextual_entry=true", "graft.base_lora_rank=8", "graft.base_lora_alpha=4.0"],
      stage="stop"))[0]
  pretrained.load_graft(again, str(out))
  for (path, x), (_, y) in zip(nnx.to_flat_state(nnx.state(grown, GraftParam)),
                               nnx.to_flat_state(nnx.state(again, GraftParam))):
    np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(path))
  shrunk = load_run_config(staged.config, [f"train.init_from={export}",
                                           "graft.base_lora_rank=2"], stage="stop")
  with pytest.raises(Exception, match="a run may only add to the graft"):
    pretrained.build_run_model(shrunk)


def test_a_drafter_grows_from_the_micro_decoder_and_trains_alone(staged, tmp_path: Path,
                                                                no_gguf_tokenizer):
  """train.trainable=drafter from a graft without a drafter: it starts as a copy of the micro
  decoder (verify drafts as before; here both have the tiny graft's 2 layers), then only it
  moves; the export loads with it, and verify mode drafts from it while still emitting the
  base's tokens."""
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  export = str(staged.run / "merger" / "export")
  cfg = load_run_config(staged.config, [
      f"train.init_from={export}", "graft.drafter_layers=2", "train.trainable=drafter",
      f"checkpoint.dir={tmp_path / 'drafter'}", "train.steps=4", "train.eval_every=4"],
      stage="micro")
  grown, _ = pretrained.build_run_model(cfg)
  for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(grown.drafter)),
                            nnx.to_flat_state(nnx.state(grown.micro))):
    np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(p))
  before = _load_export(export)
  training.run(cfg, progress=False, log=lambda *_: None)
  after = _load_export(tmp_path / "drafter" / "micro" / "export")
  # Its validation reports the drafter's own agreement, not the merged forward's micro decoder.
  val = [r for r in _metrics(tmp_path / "drafter" / "micro") if "val_kl" in r][-1]
  assert "val_agree_s2" in val and "val_agree_merged" not in val
  for k, v in before.items():
    np.testing.assert_array_equal(after[k], v, err_msg=k)  # nothing but the drafter moved
  drafter = [k for k in after if k.startswith("drafter.")]
  assert drafter and any(not np.array_equal(after[k], after["micro." + k[8:]]) for k in drafter)
  model, _ = pretrained.build_run_model(load_run_config(staged.config, [
      "graft.drafter_layers=2", f"train.init_from={tmp_path / 'drafter' / 'micro' / 'export'}"],
      stage="stop"))
  engine = Engine(model, None, stop_ids=())
  prompts = [[5, 6, 7, 8], [9, 10]]
  base = engine.generate(prompts, max_new_tokens=10, mode="base")
  verify = engine.generate(prompts, max_new_tokens=10, mode="verify")
  assert [g.token_ids for g in verify] == [g.token_ids for g in base]
  with pytest.raises(ConfigError, match="set graft.drafter_layers"):
    load_run_config(staged.config, ["train.trainable=drafter"], stage="micro")


def test_fidelity_curves_plot(tmp_path: Path, capsys):
  """train.curves --fidelity: the arms' fid_* metrics, one line a run; runs without them are
  an error."""
  from train import curves as curves_cli  # pylint: disable=import-outside-toplevel
  for name, slope in (("a", 0.0), ("b", 0.001)):
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(
        {"step": s, "fid_agree_merged": 0.53 + slope * s, "fid_agree_single": 0.63,
         "fid_agree_one_merge": 0.64, "fid_kl_merged": 1.2}) for s in (0, 25, 50)) + "\n")
  out = tmp_path / "fid.png"
  assert curves_cli.main(["--fidelity", f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}", "--out",
                          str(out)]) == 0
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  (tmp_path / "c").mkdir()
  (tmp_path / "c" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
  assert curves_cli.main(["--fidelity", f"c={tmp_path / 'c'}", "--out", str(out)]) == 2
  assert "no fid_* metrics" in capsys.readouterr().err
