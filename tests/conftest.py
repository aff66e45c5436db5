"""Session-scoped fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from hamburger_jax import precision

# The suite an accelerator host runs (`pytest -m portable`, infer.accelerator_check): modules
# whose every test holds on any backend (no fake CPU devices, no CPU-only timing).
PORTABLE = ("test_engine", "test_decode_layout", "test_llama", "test_hamburger_model")

# The tests compare greedy tokens exactly, against references computed in float32: on every
# backend they decode in float32 with full-precision matmuls (hamburger_jax/precision.py).
precision.pin(decode_dtype="float32", matmuls="highest")


def pytest_collection_modifyitems(config, items):
  """Marks the PORTABLE modules' tests `portable`."""
  del config
  for item in items:
    if item.module.__name__.rsplit(".", 1)[-1] in PORTABLE:
      item.add_marker(pytest.mark.portable)


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
