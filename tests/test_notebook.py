"""notebooks/hamburger_colab.ipynb runs headless, top to bottom, in SMOKE mode (the tiny random
model only: no SmolLM2), as CI runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "hamburger_colab.ipynb"


def _with_parameters(nb, **params) -> None:
  """Rewrites the cell tagged "parameters" (papermill's convention) in memory."""
  cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(cells) == 1, "the notebook needs exactly one cell tagged 'parameters'"
  names = {line.split("=")[0].strip() for line in cells[0].source.splitlines() if "=" in line}
  assert set(params) <= names, f"{sorted(set(params) - names)} are not notebook parameters"
  cells[0].source = "\n".join(f"{k} = {v!r}" for k, v in params.items())


@pytest.mark.slow
def test_notebook_runs_in_smoke_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
  nbformat = pytest.importorskip("nbformat")
  # The kernel keeps its programs in the compilation cache of the test processes (the per-user
  # one, tests/conftest.py), as the entry points the notebook runs do.
  import jax  # pylint: disable=import-outside-toplevel
  if jax.config.jax_compilation_cache_dir:
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  _with_parameters(nb, SMOKE=True)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(REPO)}})
  client.execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.output_type == "error"]
  html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
  assert "HAMburger (c = 0.3)" in html and "background:#ffd7af" in html  # the coloured groups
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 4  # sweep, loss curve, the eval's two PNGs
  text = "".join(o.get("text", "") for o in outputs)
  assert "trained 4 steps" in text
  nbformat.write(nb, tmp_path / "executed.ipynb")  # kept for a look when the test fails
