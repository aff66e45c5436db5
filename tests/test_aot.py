"""Compiled for a TPU without a TPU (hamburger_jax/aot.py): the tiny config's programs compile for
a v5e slice through libtpu on this CPU, the collectives in the compiled HLO are the ones the
mesh implies, a config that cannot fit fails with one line, and an abstract build allocates
nothing. Skipped where libtpu is not installed (an accelerator host's image)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("libtpu")

from hamburger_jax import aot  # pylint: disable=wrong-import-position
from hamburger_jax.run_config import load_run_config  # pylint: disable=wrong-import-position
from hamburger_jax.training import aot as train_aot  # pylint: disable=wrong-import-position
from hamburger_jax.training import Trainer  # pylint: disable=wrong-import-position
from train import aot as train_aot_cli  # pylint: disable=wrong-import-position

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
MESH = {"data": ["mesh.data=-1", "mesh.fsdp=1"], "fsdp": ["mesh.data=1", "mesh.fsdp=4"]}


@pytest.fixture(scope="module", params=sorted(MESH))
def tiny_check(request):
  return request.param, train_aot.check_train(TINY, "v5e:2x2", overrides=MESH[request.param],
                                              teacher_pass=request.param == "data")


def test_tiny_train_and_eval_steps_compile_for_v5e(tiny_check):
  mesh, check = tiny_check
  assert check.devices == 4 and check.device_kind == "TPU v5 lite"
  assert check.hbm == 16 * aot.GIB
  (stage,) = check.stages
  assert stage.mesh == ({"data": 4, "fsdp": 1, "tensor": 1} if mesh == "data" else
                        {"data": 1, "fsdp": 4, "tensor": 1})
  for report in (stage.step, stage.eval):
    assert report.flops > 0 and report.fusions > 0 and report.total > report.temp
  assert not check.errors()
  lines = train_aot.report_lines(check)
  assert any("train step" in line and "|" in line for line in lines)


def test_collectives_are_the_ones_the_mesh_implies(tiny_check):
  """A pure data mesh replicates the weights: the step only all-reduces (gradients, metrics).
  FSDP splits them: the step all-gathers them before use."""
  mesh, check = tiny_check
  ops = check.stages[0].step.collectives
  if mesh == "data":
    assert set(ops) == {"all-reduce"}, ops
    # The gradients of every trained param cross the mesh once: at least their bytes.
    assert ops["all-reduce"][1] >= check.stages[0].params
  else:
    assert ops.get("all-gather", (0, 0))[0] > 0, ops


def test_teacher_pass_compiles_on_one_host(tiny_check):
  mesh, check = tiny_check
  if mesh != "data":
    assert check.teacher is None
    return
  assert check.teacher is not None and check.teacher.flops > 0
  assert "collective" not in str(check.teacher.collectives)  # replicated base, rows split


def test_a_config_that_cannot_fit_fails_with_one_line(capsys):
  code = train_aot_cli.main(["--config", TINY, "--topology", "v5e:2x2", "--hbm-gib", "0.001",
                             "--no-teacher-pass"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 1
  lines = [line for line in err if line.startswith("error:")]
  assert len(lines) == 2  # the train step and the evaluation step
  assert "train step does not fit" in lines[0] and "GiB over" in lines[0]
  assert "data.rows" in lines[0] or "mesh.fsdp" in lines[0]


def test_a_program_the_compiler_refuses_is_one_line_with_its_knob():
  """Past the chip's own HBM the TPU compiler itself refuses (whatever --hbm-gib reports): the
  error names the program and what to turn, not a traceback."""
  from jax.sharding import SingleDeviceSharding  # pylint: disable=import-outside-toplevel
  dev = aot.tpu_devices("v5e:2x2")[0]
  x = jax.ShapeDtypeStruct((70000,), np.float32, sharding=SingleDeviceSharding(dev))
  lowered = jax.jit(lambda v: jax.numpy.sort(jax.numpy.outer(v, v), axis=0)[0]).lower(x)
  with pytest.raises(aot.AotError, match=r"^outer does not fit: RESOURCE_EXHAUSTED.*HBM.*"
                                         r"; use fewer rows$"):
    aot.compile_all({"outer": lowered}, knob="use fewer rows")


def test_libtpu_takes_the_no_sparse_core_flags():
  """libtpu aborts on a flag it does not know: `train.aot --no-sparse-core`'s flags start it."""
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from hamburger_jax import platforms  # pylint: disable=import-outside-toplevel
  code = ("from hamburger_jax import aot, platforms\n"
          "platforms.use_cpu_backend(); platforms.no_sparse_core(); platforms.no_sparse_core()\n"
          "print(len(aot.tpu_devices('v5p:2x2x1')), os.environ['LIBTPU_INIT_ARGS'])\n")
  env = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"}
  res = subprocess.run([sys.executable, "-c", "import os\n" + code], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=120, check=False)
  assert res.returncode == 0, res.stderr[-2000:]
  chips, *flags = res.stdout.split()
  assert chips == "4" and flags == list(platforms.NO_SPARSE_CORE_FLAGS)  # once, however called


def test_bad_topologies_are_one_line_errors():
  for bad, says in (("v9x:2x2", "generation"), ("v5e:4", "AxB"), ("v5e:1x1", "2x2")):
    with pytest.raises(aot.AotError, match=says):
      aot.tpu_devices(bad)


def test_the_abstract_1b_build_allocates_nothing():
  """The 1B config's whole training state as shapes: every leaf is a ShapeDtypeStruct with its
  sharding, so compiling it for a pod fits on this machine."""
  devices = aot.tpu_devices("v5p:2x2x4")
  cfg = load_run_config(str(REPO / "configs" / "llama3_2_1b_tpu_v5p.yaml"))
  from hamburger_jax import sharding  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
  trainer = Trainer(cfg, mesh=mesh, abstract=True)
  leaves = jax.tree.leaves((trainer.state, trainer.frozen, trainer.abstract_batch()))
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.state.params))
  assert params > 1.2e9  # base + graft, trained together
  # FSDP over 16 chips: each holds a sixteenth of the fp32 params (and of each moment).
  assert aot.sharded_bytes(trainer.state.params) < 4 * params / 16 * 1.01
  with pytest.raises(RuntimeError, match="abstract"):
    trainer.step([])


def test_hlo_collective_parsing():
  text = "\n".join([
      "  %ag = f32[16,64]{1,0} all-gather(f32[4,64]{1,0} %p), dimensions={0}",
      "  %ars = (f32[8]{0}, f32[8]{0}) all-reduce-start(f32[8]{0} %x), to_apply=%add",
      "  %ard = f32[8]{0} all-reduce-done((f32[8]{0}, f32[8]{0}) %ars)",
      "  ROOT %rs = bf16[2,8]{1,0} reduce-scatter(bf16[8,8]{1,0} %y), dimensions={0}",
      "  %f = f32[8]{0} fusion(f32[8]{0} %x), kind=kLoop, calls=%fused",
  ])
  assert aot.collectives(text) == {"all-gather": (1, 16 * 64 * 4), "all-reduce": (1, 32),
                                   "reduce-scatter": (1, 32)}
  assert aot.count_fusions(text) == 1


# ----------------------------------------------------------------------------- the engine


def _engine_rows(capsys, *argv: str) -> tuple[int, str, list[dict[str, str]]]:
  from hamburger_jax import testing  # pylint: disable=import-outside-toplevel
  from infer import aot as infer_aot_cli  # pylint: disable=import-outside-toplevel
  code = infer_aot_cli.main(["--topology", "v5e:2x2", "--config", TINY, "--prompt-len", "64",
                             "--max-new", "32", *argv])
  captured = capsys.readouterr()
  tables = testing.markdown_tables(captured.out)
  return code, captured.out + captured.err, tables[0] if tables else []


def test_the_engine_compiles_for_v5e_at_each_slot_count(capsys):
  """`python -m infer.aot`: every program the engine runs (prefill, the decode and serving loops
  in both modes, one macro step alone), per slot count, compiled by the TPU compiler, with its
  memory and fusions per chip; HAMburger's loop holds the micro steps: more fusions."""
  code, out, rows = _engine_rows(capsys, "--batches", "1,2")
  assert code == 0, out
  assert "v5e:2x2, 1 chip (TPU v5 lite, 16.00 GiB HBM per chip)" in out
  kinds = lambda b: sorted(r["program"].split(",")[0].split(" of ")[0] for r in rows
                           if r["slots"] == b)
  expected = sorted(["decode loop"] * 2 + ["serving loop"] * 2 + ["prefill"]
                    + ["one macro step"] * 2)
  assert kinds("1") == kinds("2") == expected
  fusions = {(r["slots"], r["program"]): int(r["fusions"]) for r in rows}
  assert all(f > 0 for f in fusions.values())
  for b in ("1", "2"):
    assert fusions[(b, "decode loop, hamburger")] > fusions[(b, "decode loop, base")]
    assert (fusions[(b, "one macro step, hamburger, forced K")]
            > fusions[(b, "one macro step, base")])
  assert all(float(r["total GiB"]) < 1 and r["of HBM"] == "0%" for r in rows)


def test_a_graft_that_merges_at_a_layer_compiles_for_v5e(capsys, tmp_path):
  """A graft merging at layer 2 of 4 (model/layer_merge.py): its decode and serving loops and
  its forced macro step (the K-wide lower layers and the one-wide upper ones) compile for a
  TPU, with more fusions than the same graft merging at the input (the K-wide lower span)."""
  import yaml  # pylint: disable=import-outside-toplevel
  raw = yaml.safe_load(open(TINY, encoding="utf-8"))
  raw["graft"]["merge_layer"] = 2
  raw["data"]["tokens"] = 256
  config = tmp_path / "tiny_l2.yaml"
  config.write_text(yaml.safe_dump(raw))
  code, out, rows = _engine_rows(capsys, "--batches", "1", "--config", str(config))
  assert code == 0, out
  at_layer = {r["program"]: int(r["fusions"]) for r in rows}
  code, out, rows = _engine_rows(capsys, "--batches", "1")
  at_input = {r["program"]: int(r["fusions"]) for r in rows}
  step = "one macro step, hamburger, forced K"
  assert at_layer[step] > at_input[step]
  assert at_layer["decode loop, hamburger"] > at_layer["decode loop, base"]


def test_the_engine_compiles_sharded_over_the_tensor_axis(capsys):
  code, out, rows = _engine_rows(capsys, "--batches", "1", "--tensor", "2")
  assert code == 0, out
  assert "v5e:2x2, 2 chips (tensor)" in out and len(rows) == 7


@pytest.mark.parametrize("argv,message", [
    (["--tensor", "3"], "are not a rectangular block, which a TPU mesh needs; use one of 1, 2, 4"),
    (["--tensor", "8"], "--tensor 8: v5e:2x2 has 4 chips"),
    (["--batches", "0"], "each must be >= 1"),
])
def test_engine_check_bad_input_is_one_line(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    _engine_rows(capsys, *argv)
  said = str(e.value.code) + capsys.readouterr().err
  assert message in said and "Traceback" not in said


# ----------------------------------------------------------------------------- the configs


def _documented_check(path: Path) -> list[str] | None:
  """The `python -m train.aot ...` command a config's header comment gives for its figures."""
  import re  # pylint: disable=import-outside-toplevel
  header = " ".join(line.lstrip("#").strip() for line in path.read_text().splitlines()
                    if line.startswith("#"))
  m = re.search(r"python -m train\.aot (--config [^)]*)\)", header)
  return m.group(1).split() if m else None


ACCELERATOR_CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml")
                             if _documented_check(p))


def test_the_accelerator_configs_document_their_check():
  assert ACCELERATOR_CONFIGS == ["llama3_2_1b_h100.yaml", "llama3_2_1b_tpu_v5p.yaml",
                                 "smollm2_135m_h100.yaml", "smollm2_135m_tpu_v5e.yaml"]


@pytest.mark.parametrize("name", ACCELERATOR_CONFIGS)
def test_every_accelerator_config_lowers_on_its_topology(name, capsys):
  """Each accelerator config's documented `train.aot` command, lowered (`--lower-only`: its
  mesh, shapes and shardings on the topology, every stage and the teacher pass; the compile,
  minutes a config, is the command itself): on every commit, a config change that breaks a
  pod run fails here."""
  from hamburger_jax.config import load_yaml  # pylint: disable=import-outside-toplevel
  from hamburger_jax.run_config import stage_names  # pylint: disable=import-outside-toplevel
  argv = [a for a in _documented_check(REPO / "configs" / name) if a != "--no-sparse-core"]
  argv[argv.index("--config") + 1] = str(REPO / argv[argv.index("--config") + 1])
  assert train_aot_cli.main([*argv, "--lower-only"]) == 0
  from hamburger_jax import testing  # pylint: disable=import-outside-toplevel
  out = capsys.readouterr().out
  assert "teacher pass" in out.splitlines()[0]
  rows = testing.markdown_tables(out)[0]
  stages = stage_names(load_yaml(str(REPO / "configs" / name))) or ["train"]
  assert [r["stage"] for r in rows] == stages
  assert all(float(r["state GiB"]) > 0 and int(r["of HBM"].rstrip("%")) < 100 for r in rows)


def _documented_engine_commands() -> list[str]:
  import re  # pylint: disable=import-outside-toplevel
  text = (REPO / "docs" / "accelerators.md").read_text()
  return sorted(set(re.findall(r"`python -m infer\.aot ([^`]*)`", text)))


@pytest.mark.parametrize("command", _documented_engine_commands())
def test_every_documented_engine_command_lowers(command, capsys):
  """The engine commands docs/accelerators.md gives figures for (the shipped graft on a v5e,
  the 1B config on a v5p), lowered at their real width on every commit (`--lower-only`)."""
  from infer import aot as infer_aot_cli  # pylint: disable=import-outside-toplevel
  assert len(_documented_engine_commands()) == 2
  argv = command.split()
  if "--config" in argv:
    argv[argv.index("--config") + 1] = str(REPO / argv[argv.index("--config") + 1])
  assert infer_aot_cli.main([*argv, "--lower-only"]) == 0
  out = capsys.readouterr().out
  slots = argv[argv.index("--batches") + 1].split(",")
  lines = [l for l in out.splitlines() if l.startswith("- ")]
  assert [l.split(" slots: ")[0][2:] for l in lines] == slots
  assert all(len(l.split(": ", 1)[1].split("; ")) == 7 for l in lines)


OTHER_CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml")
                       if p.name not in ACCELERATOR_CONFIGS)


@pytest.mark.parametrize("name", OTHER_CONFIGS)
def test_every_other_config_lowers_for_a_tpu(name, capsys):
  """The configs made for a CPU or a GPU machine lower for TPU chips too (`--lower-only`), on as
  many v5p chips as their mesh fixes (llama3_2_1b.yaml: fsdp 8)."""
  assert OTHER_CONFIGS == ["llama3_2_1b.yaml", "smollm2_135m.yaml", "smollm2_135m_drafter.yaml",
                           "smollm2_135m_fidelity.yaml", "smollm2_135m_layer_merge.yaml",
                           "smollm2_135m_paper.yaml", "smollm2_135m_window.yaml", "tiny.yaml"]
  path = str(REPO / "configs" / name)
  mesh = load_run_config(path, shared_only=True).mesh
  chips = max(mesh.data, 1) * mesh.fsdp * mesh.tensor
  assert train_aot_cli.main(["--config", path, "--topology", "v5p:2x2x2", "--chips", str(chips),
                             "--lower-only"]) == 0
  from hamburger_jax import testing  # pylint: disable=import-outside-toplevel
  rows = testing.markdown_tables(capsys.readouterr().out)[0]
  assert rows and all(int(r["of HBM"].rstrip("%")) < 100 for r in rows)
