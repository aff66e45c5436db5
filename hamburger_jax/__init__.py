"""HAMburger in JAX: multi-token macro steps that write one KV entry each.

  import hamburger_jax as hj
  model, tok = hj.load_hamburger()  # the shipped checkpoint on SmolLM2-135M-Instruct
  engine = hj.Engine(model, tok)
  engine.generate(["Hi"], max_new_tokens=8)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hamburger_jax import platforms

platforms.cpu_unless_tpu()

if TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
  from hamburger_jax.decode.engine import Engine
  from hamburger_jax.decode.requests import Generation, GenerationError, Request
  from hamburger_jax.decode.sampling import SamplingParams
  from hamburger_jax.pretrained import load, load_hamburger, load_llama

# Each name resolves on first use: importing the package, or a light submodule such as
# hamburger_jax.config (which the CLIs read before parsing arguments), loads no JAX, and the
# submodules, which import each other, never meet a half-initialised package.
_EXPORTS = {
    "Engine": "hamburger_jax.decode.engine",
    "Request": "hamburger_jax.decode.requests",
    "Generation": "hamburger_jax.decode.requests",
    "GenerationError": "hamburger_jax.decode.requests",
    "SamplingParams": "hamburger_jax.decode.sampling",
    "load": "hamburger_jax.pretrained",
    "load_hamburger": "hamburger_jax.pretrained",
    "load_llama": "hamburger_jax.pretrained",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *__all__})
