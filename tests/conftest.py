"""Session-scoped fixtures shared by the test modules."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import time

import pytest

from hamburger_jax import precision

# The suite an accelerator host runs (`pytest -m portable`, infer.accelerator_check): modules
# whose every test holds on any backend (no fake CPU devices, no CPU-only timing).
PORTABLE = ("test_engine", "test_decode_layout", "test_llama", "test_hamburger_model",
            "test_verify")

# The tests compare greedy tokens exactly, against references computed in float32: on every
# backend they decode in float32 with full-precision matmuls (hamburger_jax/precision.py).
precision.pin(decode_dtype="float32", matmuls="highest")


def pytest_collection_modifyitems(config, items):
  """Marks the PORTABLE modules' tests `portable`."""
  del config
  for item in items:
    if item.module.__name__.rsplit(".", 1)[-1] in PORTABLE:
      item.add_marker(pytest.mark.portable)


@pytest.fixture(scope="module", autouse=True)
def _release_programs():
  """Drops every compiled program and trace when a module's tests end. A pytest-xdist process
  runs some fifty modules; keeping every program it compiled grew it to 8 GB, and beside the
  servers and subprocesses of the server tests the 24 GiB machine ran out of memory. A program
  a later module needs again is read back from the persistent compilation cache."""
  yield
  import jax  # pylint: disable=import-outside-toplevel
  jax.clear_caches()
  gc.collect()
  try:  # hand the freed pages back to the system: glibc keeps them for this process otherwise
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):  # not glibc
    pass


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
  """The synthetic dataset of configs/tiny.yaml (vocab 256, max_group 4), built once per test run."""
  from hamburger_jax.data.synthetic import build_synthetic_dataset  # pylint: disable=C0415
  return build_synthetic_dataset(str(tmp_path_factory.mktemp("tiny-data") / "data"), vocab=256,
                                 max_group=4)


@pytest.fixture(scope="session")
def gcs():
  """A Cloud Storage emulator with one bucket, `gs://<gcs.bucket>` (tests/gcs_emulator.py):
  the `gs://` paths of gcsfs, etils.epath, tensorstore and orbax go to it while it runs.
  `gcs.env` is what a subprocess needs to reach it too."""
  import os  # pylint: disable=import-outside-toplevel
  import gcs_emulator  # pylint: disable=import-outside-toplevel
  emulator = gcs_emulator.start()
  before = {k: os.environ.get(k) for k in emulator.env}
  os.environ.update(emulator.env)
  try:
    yield emulator
  finally:
    emulator.server.stop()
    for k, v in before.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


# ----------------------------------------------------------------------------- where time goes

# With HAMBURGER_TEST_TIMINGS=DIR, each test process writes one line per test to DIR/<worker>.jsonl:
# its wall seconds (setup, call and teardown) and the seconds this process spent tracing,
# lowering and compiling programs with XLA meanwhile (jax.monitoring's durations; programs that a
# test's subprocesses compile are not seen). tests/suite_timings.py tables them.
TIMINGS_ENV = "HAMBURGER_TEST_TIMINGS"
_JAX_DURATIONS = {"/jax/core/compile/backend_compile_duration": "compile_s",
                  "/jax/core/compile/jaxpr_trace_duration": "trace_s",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration": "trace_s"}
_spent = {"compile_s": 0.0, "trace_s": 0.0}


def _on_duration(event: str, seconds: float, **_) -> None:
  if event in _JAX_DURATIONS:
    _spent[_JAX_DURATIONS[event]] += seconds


def pytest_configure(config):
  # The test processes (both pytest-xdist workers) and the entry points the tests run as
  # subprocesses share JAX's persistent compilation cache, as users' runs do: a program one test
  # compiled (the tiny models' engines recur across files) is read back by the next.
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  cache.enable_compilation_cache()
  if os.environ.get(TIMINGS_ENV):
    import jax  # pylint: disable=import-outside-toplevel
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    config.stash[_TIMINGS_KEY] = {}


_TIMINGS_KEY = pytest.StashKey[dict]()
_OUTCOMES_KEY = pytest.StashKey[dict]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """Each phase's outcome (setup, call, teardown), for the timings' lines."""
  outcome = yield
  report = outcome.get_result()
  item.stash.setdefault(_OUTCOMES_KEY, {})[report.when] = report.outcome


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  timings = item.config.stash.get(_TIMINGS_KEY, None)
  if timings is None:
    yield
    return
  before, t0 = dict(_spent), time.perf_counter()
  yield
  reports = item.stash.get(_OUTCOMES_KEY, {})
  failed = [when for when, outcome in reports.items() if outcome == "failed"]
  line = {"test": item.nodeid, "file": item.nodeid.split("::", 1)[0],
          "wall_s": round(time.perf_counter() - t0, 3),
          "outcome": "failed" if failed else reports.get("call", "skipped"),
          **{k: round(_spent[k] - before[k], 3) for k in _spent}}
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  os.makedirs(os.environ[TIMINGS_ENV], exist_ok=True)
  with open(os.path.join(os.environ[TIMINGS_ENV], f"{worker}.jsonl"), "a",
            encoding="utf-8") as f:
    f.write(json.dumps(line) + "\n")
