"""The entry points a user runs, one line each (`python -m infer`).

Each line is the first line of the module's docstring, read from its source: no module is
imported, so the list answers at once, without loading JAX.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# Beside the modules directly in infer/ (the user's menu), the subpackages listed after them.
SUBPACKAGES = ("experiments",)


def summary(path: str) -> str:
  """The first line of a module's docstring (its one-line summary), capitalised, without a
  leading "CLI: "; ValueError where the module has none."""
  with open(path, encoding="utf-8") as f:
    doc = ast.get_docstring(ast.parse(f.read(), path))
  if not doc:
    raise ValueError(f"{path} has no docstring: its first line is the module's line in "
                     "`python -m infer`")
  line = doc.splitlines()[0].removeprefix("CLI: ")
  return line[:1].upper() + line[1:]


def entry_points(package: str = "") -> list[str]:
  """The modules of infer/ (or of its subpackage `package`) that a user runs, by name: every
  module there but __init__ and __main__ (helpers belong to the library, hamburger_jax/)."""
  folder = os.path.join(HERE, package)
  return sorted(name[:-3] for name in os.listdir(folder)
                if name.endswith(".py") and name not in ("__init__.py", "__main__.py"))


def menu() -> list[str]:
  """The lines `python -m infer` prints."""
  width = max(len(n) for pkg in ("", *SUBPACKAGES) for n in entry_points(pkg)) + 2
  lines = ["python -m infer.NAME (each with --help: its flags and examples):", ""]
  lines += [f"  {n:<{width}}{summary(os.path.join(HERE, n + '.py'))}" for n in entry_points()]
  for pkg in SUBPACKAGES:  # the package's docstring heads its list
    lines += ["", summary(os.path.join(HERE, pkg, "__init__.py")), ""]
    lines += [f"  {n:<{width}}{summary(os.path.join(HERE, pkg, n + '.py'))}"
              for n in entry_points(pkg)]
  return lines


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m infer", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.parse_args(argv)
  try:
    print("\n".join(menu()))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
