"""Repository-wide checks: every shipped run config (configs/*.yaml, every stage of a staged one)
loads and builds its model, and the packages import without cycles.

Models are built abstractly (nnx.eval_shape: shapes and dtypes, no weights), so the Llama-3.2-1B
config costs neither its weights nor its memory."""

from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import graphlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

from hamburger_jax import assets, graft_checkpoint, pretrained
from hamburger_jax.config import GraftConfig, HamburgerConfig, LlamaConfig, from_dict, load_yaml
from hamburger_jax.convert import gguf, hf
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import GraftParam
from hamburger_jax.run_config import RunConfig, load_run_config, stage_names
from hamburger_jax.testing import LLAMA_3_2_1B_GRAFT_PARAMS, llama_3_2_1b_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
CASES = [(os.path.basename(c), stage) for c in CONFIGS for stage in stage_names(load_yaml(c))
         or [None]]

# Configs whose base is not in this repository (a path the user fills in): the architecture
# from the model's published config instead of its files.
ABSENT_BASES = {"llama3_2_1b.yaml": llama_3_2_1b_config,
                "llama3_2_1b_h100.yaml": llama_3_2_1b_config,
                "llama3_2_1b_tpu_v5p.yaml": llama_3_2_1b_config}
# Grafted param counts that the paper's setting fixes (checked part by part in
# test_hamburger_model.test_parameter_counts_at_llama_3_2_1b).
GRAFT_PARAMS = {"llama3_2_1b.yaml": LLAMA_3_2_1B_GRAFT_PARAMS,
                "llama3_2_1b_h100.yaml": LLAMA_3_2_1B_GRAFT_PARAMS,
                "llama3_2_1b_tpu_v5p.yaml": LLAMA_3_2_1B_GRAFT_PARAMS}


@functools.lru_cache(maxsize=None)
def _file_config(source: str) -> LlamaConfig:
  kind, path = pretrained.resolve_base(source)
  return gguf.GGUFFile(path).config() if kind == "gguf" else hf.read_config(path)


def base_config(name: str, cfg: RunConfig) -> LlamaConfig:
  """The run's base architecture with the run's dtypes, read without loading weights."""
  m = cfg.model
  dtypes = {"dtype": m.dtype, "param_dtype": m.param_dtype}
  if m.base == "random":
    return dataclasses.replace(m.random, **dtypes)
  if name in ABSENT_BASES:
    return ABSENT_BASES[name](**dtypes)
  try:
    return dataclasses.replace(_file_config(m.base), **dtypes)
  except assets.AssetError as e:
    pytest.skip(str(e))
  except FileNotFoundError as e:
    pytest.fail(f"configs/{name}: {e}; if the base is meant to be supplied by the user, add the "
                "architecture to ABSENT_BASES")


def test_every_config_is_covered():
  assert {n for n, _ in CASES} >= {"tiny.yaml", "smollm2_135m.yaml", "smollm2_135m_paper.yaml",
                                   "llama3_2_1b.yaml"}
  assert ("smollm2_135m.yaml", "micro") in CASES and ("smollm2_135m.yaml", "merger") in CASES


@pytest.mark.parametrize("name,stage", CASES, ids=[f"{n}:{s}" if s else n for n, s in CASES])
def test_config_loads_and_builds(name, stage):
  from hamburger_jax.training import TRAINED  # pylint: disable=import-outside-toplevel
  cfg = load_run_config(os.path.join(REPO, "configs", name), stage=stage)
  assert cfg.stage == (stage or "")
  base = base_config(name, cfg)
  model = nnx.eval_shape(lambda: Hamburger(HamburgerConfig(base, cfg.graft), rngs=nnx.Rngs(0)))
  params = nnx.to_flat_state(nnx.state(model, nnx.Param))
  assert {v.dtype for _, v in params} == {jnp.dtype(cfg.model.param_dtype)}
  if cfg.graft.feature_layers:
    assert model.feature_layers == tuple(cfg.graft.feature_layers)
  assert all(0 <= i < base.num_layers for i in model.feature_layers)
  assert cfg.data.groups <= cfg.data.entries  # each predicted group has its own entry
  # What the run trains exists in this model (a stage selecting nothing would train nothing).
  trained = nnx.to_flat_state(nnx.state(model, TRAINED[cfg.train.trainable]))
  assert len(trained) > 0
  graft = sum(math.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(model, GraftParam)))
  if name in GRAFT_PARAMS:
    assert graft == GRAFT_PARAMS[name]
  export = os.path.normpath(os.path.join(REPO, cfg.checkpoint.export or "-"))
  if export == os.path.normpath(pretrained.DEFAULT_CHECKPOINT):
    # The shipped checkpoint is this config's export: same graft, same base.
    meta = graft_checkpoint.read_meta(pretrained.DEFAULT_CHECKPOINT)
    # (a checkpoint written before a graft option existed reads as its default)
    assert from_dict(GraftConfig, meta["graft"]) == cfg.graft
    assert meta["base_source"] == cfg.model.base


def _module_imports(packages: tuple[str, ...]) -> dict[str, set[str]]:
  """Module -> the modules of `packages` it imports, anywhere in the file (function-level imports
  included: a lazy import hides a cycle from the interpreter, not from the design)."""
  files = {}
  for pkg in packages:
    for f in glob.glob(os.path.join(REPO, pkg, "**", "*.py"), recursive=True):
      parts = os.path.relpath(f, REPO)[:-3].split(os.sep)
      files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
  graph = {}
  for name, f in files.items():
    with open(f) as fh:
      tree = ast.parse(fh.read())
    deps = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        deps |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    graph[name] = {d for d in deps if d in files and d != name and not name.startswith(d + ".")}
  return graph


def test_no_import_cycles():
  graph = _module_imports(("hamburger_jax", "infer", "train"))
  assert "hamburger_jax.model.hamburger" in graph["hamburger_jax.convert.release"]  # sanity
  try:
    list(graphlib.TopologicalSorter(graph).static_order())
  except graphlib.CycleError as e:
    pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


PRODUCT = ("hamburger_jax", "infer", "train")


def test_one_model_loader_name():
  """Loading a model for a command has one name (hamburger_jax/cli.py's load_model): a second
  function of that name is a second way to build the same model."""
  where = []
  for pkg in PRODUCT:
    for f in glob.glob(os.path.join(REPO, pkg, "**", "*.py"), recursive=True):
      tree = ast.parse(Path(f).read_text(encoding="utf-8"))
      where += [f"{os.path.relpath(f, REPO)}:{n.lineno}" for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef) and n.name == "load_model"]
  assert [w.split(":")[0] for w in where] == ["hamburger_jax/cli.py"], where


def _entry_points() -> set[str]:
  """Modules run as `python -m ...`: those with a __main__ guard."""
  out = set()
  for pkg in PRODUCT:
    for f in glob.glob(os.path.join(REPO, pkg, "**", "*.py"), recursive=True):
      body = ast.parse(Path(f).read_text(encoding="utf-8")).body
      if any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in body):
        out.add(os.path.relpath(f, REPO)[:-3].replace(os.sep, "."))
  return out


def test_imports_point_one_way():
  """The library never imports an entry point or the test fixtures; train/ never imports
  infer/; no entry point imports another (what two share belongs in the library)."""
  graph, entries = _module_imports(PRODUCT), _entry_points()
  assert {"infer.generate", "train.main", "train.pipeline"} <= entries  # sanity
  wrong = []
  for name, deps in graph.items():
    for d in deps:
      top = d.split(".")[0]
      if d == "hamburger_jax.testing" and name != d:
        wrong.append(f"{name} imports the test fixtures {d}")
      elif name.startswith("hamburger_jax") and top in ("infer", "train"):
        wrong.append(f"library module {name} imports {d}")
      elif name.startswith("train") and top == "infer":
        wrong.append(f"{name} imports {d}")
      elif name in entries and d in entries:
        wrong.append(f"entry point {name} imports entry point {d}")
  assert not wrong, "\n".join(sorted(wrong))


def test_data_never_imports_the_evaluation():
  """The evaluation reads data (its held-out examples, pipelines, corpora); data never reads the
  evaluation: what both need (seeds, held-out prompts) is data's (hamburger_jax/data/heldout.py)."""
  graph = _module_imports(PRODUCT)
  wrong = sorted(f"{name} imports {d}" for name, deps in graph.items()
                 if name.startswith("hamburger_jax.data.") for d in deps
                 if d.startswith("hamburger_jax.evaluation"))
  assert not wrong, "\n".join(wrong)


# namedtuple's public methods, spelled with an underscore so as not to clash with field names
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
# os._exit: the standard library's documented exit without cleanup (the sandbox's init, PID 1 of
# its namespaces, leaves that way)
PUBLIC_UNDERSCORE_API = NAMEDTUPLE_API | {"_exit"}


def _private_uses(source: str) -> list[str]:
  """`obj._name` where `obj` is not self/cls and no class of this source defines `_name`: a
  private attribute reached from outside the module that owns it."""
  tree, own = ast.parse(source), set()
  for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
    for node in ast.walk(cls):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        own.add(node.name)
      elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        own.add(node.attr)
      elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        own.add(node.id)
  return [f"line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree)
          if isinstance(n, ast.Attribute) and n.attr.startswith("_")
          and not n.attr.startswith("__") and n.attr not in PUBLIC_UNDERSCORE_API | own
          and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]


def test_no_private_attribute_across_modules():
  assert _private_uses("class A:\n  def _f(self): pass\ndef g(a):\n  return a._f()") == []
  assert _private_uses("def g(trainer):\n  return trainer._step_fn") == [
      "line 2: trainer._step_fn"]
  found = {os.path.relpath(f, REPO): uses for pkg in PRODUCT
           for f in glob.glob(os.path.join(REPO, pkg, "**", "*.py"), recursive=True)
           if (uses := _private_uses(Path(f).read_text(encoding="utf-8")))}
  assert not found, found


def test_files_are_replaced_through_one_writer():
  """Renaming into place is hamburger_jax/files.py's (a file, a directory), besides the tfds
  datasets' own build directories (with their recovery of a killed build) and the sharded
  teacher pass's plan (a hard link: the first process's plan wins)."""
  own = {"hamburger_jax/files.py", "hamburger_jax/data/tfds_builder.py",
         "hamburger_jax/data/shards.py"}
  renames = {os.path.relpath(f, REPO) for pkg in PRODUCT
             for f in glob.glob(os.path.join(REPO, pkg, "**", "*.py"), recursive=True)
             if re.search(r"\bos\.(replace|rename)\(", Path(f).read_text(encoding="utf-8"))}
  assert renames <= own, sorted(renames - own)


# Imported here only because they are installed here (optional imports of the image's
# packages), or this machine's compiler for TPUs: not needed on an accelerator host.
OPTIONAL_HERE = {"libtpu", "ipython", "traitlets", "hamburger-jax"}
# gcsfs's dependencies (gs:// paths), installed here: they share the `google` namespace with
# protobuf, so the probe below names them whenever protobuf is imported, though no part imports
# them.
GOOGLE_NAMESPACE_HERE = {"google-api-core", "google-auth", "google-cloud-core",
                         "google-cloud-storage", "google-cloud-storage-control",
                         "google-resumable-media", "grpc-google-iam-v1"}


def test_runbook_wheels_cover_what_the_accelerator_check_imports():
  """docs/accelerators.md's wheel list and the image packages it names cover every
  distribution the accelerator check's parts import (grain needs portpicker: a missing one is
  a failed import on the device host, found there too late)."""
  doc = (Path(REPO) / "docs" / "accelerators.md").read_text(encoding="utf-8")
  norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
  wheels = {norm(m) for m in re.findall(r"([A-Za-z0-9_.-]+)==[0-9]", doc)}
  image = re.search(r"<!-- image-packages -->(.*?)<!-- /image-packages -->", doc, re.S)
  assert image, "docs/accelerators.md lost its image-packages list"
  listed = wheels | {norm(n.strip()) for n in image.group(1).split(",")}
  probe = ("import importlib, json, sys, importlib.metadata as md\n"
           "import infer.accelerator_check as a\n"
           "[importlib.import_module(m) for m in a.PART_MODULES]\n"
           "pd = md.packages_distributions()\n"
           "tops = {n.split('.')[0] for n in sys.modules} - set(sys.stdlib_module_names)\n"
           "print(json.dumps(sorted({d for t in tops for d in pd.get(t, [])})))\n")
  res = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                       timeout=300, check=True)
  imported = {norm(d) for d in json.loads(res.stdout.strip().splitlines()[-1])}
  assert imported - listed - OPTIONAL_HERE - GOOGLE_NAMESPACE_HERE == set()


def test_every_entry_point_answers_help(capsys):
  """`python -m X --help` for every entry point: it imports, its flags parse, and its usage
  names the command a user types."""
  import importlib  # pylint: disable=import-outside-toplevel
  entries = sorted(_entry_points())
  assert len(entries) >= 15  # sanity: infer/ and train/ were found
  for name in entries:
    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as e:
      module.main(["--help"])
    out = capsys.readouterr().out
    command = name.removesuffix(".__main__")  # `python -m PACKAGE` runs PACKAGE/__main__.py
    assert e.value.code == 0 and f"python -m {command}" in out, (name, out[:300])
