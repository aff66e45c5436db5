"""infer/ is a user's menu: a few entry points, each listed with its one-line summary by
`python -m infer`, which answers at once (it imports no JAX); the experiment probes sit apart,
in infer/experiments/."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INFER = os.path.join(REPO, "infer")
# More than this many commands directly in infer/ and a user no longer sees which to run: a
# probe goes to infer/experiments/, what only one command runs to the library, a variant of a
# command becomes its flag or mode.
MAX_ENTRY_POINTS = 10


def _modules(folder: str) -> list[str]:
  return sorted(f[:-3] for f in os.listdir(folder)
                if f.endswith(".py") and f not in ("__init__.py", "__main__.py"))


def _first_line(path: str) -> str:
  """The first line of the module's docstring ("" where it has none)."""
  with open(path, encoding="utf-8") as f:
    doc = ast.get_docstring(ast.parse(f.read())) or ""
  return doc.splitlines()[0] if doc else ""


def test_infer_holds_at_most_ten_entry_points():
  names = _modules(INFER)
  assert {"generate", "serve", "server", "eval", "bench"} <= set(names)  # sanity
  assert len(names) <= MAX_ENTRY_POINTS, (
      f"infer/ holds {len(names)} modules a user runs ({', '.join(names)}): at most "
      f"{MAX_ENTRY_POINTS}; move probes to infer/experiments/ and helpers to hamburger_jax/")


def test_each_entry_point_opens_with_a_one_line_summary():
  """`python -m infer` prints each module's first docstring line: a sentence of its own, not
  the start of a wrapped paragraph."""
  paths = [os.path.join(INFER, n + ".py") for n in _modules(INFER)]
  paths += [os.path.join(INFER, "experiments", n + ".py")
            for n in _modules(os.path.join(INFER, "experiments"))]
  paths.append(os.path.join(INFER, "experiments", "__init__.py"))
  lines = {os.path.relpath(p, REPO): _first_line(p) for p in paths}
  # 97: the line and its opening quotes within the 100 columns of the source
  bad = [f"{p}: {line!r}" for p, line in lines.items() if not line.endswith(".") or len(line) > 97]
  assert not bad, "first docstring lines that are no one-line summary:\n" + "\n".join(bad)


def test_python_m_infer_lists_every_entry_point_at_once():
  start = time.monotonic()
  res = subprocess.run([sys.executable, "-X", "importtime", "-m", "infer"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, check=False)
  took = time.monotonic() - start
  assert res.returncode == 0, res.stderr[-2000:]
  listed = {m.group(1): m.group(2) for m in re.finditer(r"^  (\w+) +(\S.*)$", res.stdout, re.M)}
  for folder in (INFER, os.path.join(INFER, "experiments")):
    for name in _modules(folder):
      assert name in listed, f"python -m infer does not list {name}:\n{res.stdout}"
      summary = _first_line(os.path.join(folder, name + ".py")).removeprefix("CLI: ")
      assert listed[name].lower() == summary.lower()
  assert "python -m infer.experiments.NAME" in res.stdout
  # -X importtime writes one line per module imported: its name is the last column.
  imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines()}
  assert not {m for m in imported if m.split(".")[0] in ("jax", "jaxlib", "hamburger_jax")}
  assert took < 20, f"python -m infer took {took:.1f} s"
