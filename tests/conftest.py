"""Session-scoped fixtures shared by the test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
  """The synthetic dataset of configs/tiny.yaml (vocab 256, max_group 4), built once per test run."""
  from hamburger_jax.testing import build_synthetic_dataset  # pylint: disable=import-outside-toplevel
  return build_synthetic_dataset(str(tmp_path_factory.mktemp("tiny-data") / "data"), vocab=256,
                                 max_group=4)
