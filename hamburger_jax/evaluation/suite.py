"""The free-generation suite: prompts as token ids with their checkers, written once on any
machine and carried to the ones that judge a graft (a training window on an accelerator).

A suite holds, per item: the task, its chat-templated prompt as token ids, the new-token budget,
the checker and its reference, and the base's greedy answer when the suite was written. The
checkers need no dataset package where they run:
  number  exact numeric match of the answer's last number (tasks.extract_answer /
          numbers_equal) with the reference; the four reasoning tasks, seeds >= EVAL_SEED
  rouge   ROUGE-L F1 against the base's greedy answer decoded in the same run (the judge's own
          base, in its dtype); held-out chat prompts (MT-Bench first turns, held-out ShareGPT)
  tokens  the share of the reference continuation's ids generated exactly (synthetic prompts,
          for a model without a tokenizer: a CPU rehearsal)
Texts are decoded with the model's tokenizer; without one, `rouge` compares token ids.

`python -m infer.eval --write-suite DIR` writes DIR/suite.json; `suite_judge.judge` decodes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import time
from typing import Any, Callable, Sequence

from hamburger_jax import files
from hamburger_jax.data import heldout
from hamburger_jax.decode import serving
from hamburger_jax.decode.requests import GenerationError, Request
from hamburger_jax.evaluation import tasks as eval_tasks
from hamburger_jax.evaluation.rouge import lcs_length, rouge_l

FORMAT = "hamburger-suite/1"
SUITE_FILE = "suite.json"
# Tasks where the 135M base scores well above zero, so a graft's losses show at n = 200.
NUMBER_TASKS = ("letter_counting", "gcd", "lcm", "basic_arithmetic")
TASK_EXAMPLES = 200
# 128 held-out chat prompts: all 80 MT-Bench first turns, then held-out ShareGPT ones.
CHAT_SOURCES = (("mt_bench", 80), ("sharegpt_heldout", 48))
CHAT_TOKENS = 128
CHECKERS = ("number", "rouge", "tokens")


class SuiteError(ValueError):
  """A suite that cannot be read or does not fit the model; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class SuiteItem:
  task: str
  id: str
  prompt: tuple[int, ...]
  max_new: int
  checker: str  # one of CHECKERS
  reference: Any  # number: the answer's text; tokens: the expected ids; rouge: None
  base: tuple[int, ...] = ()  # the base's greedy answer when the suite was written

  def to_json(self) -> dict[str, Any]:
    return {"task": self.task, "id": self.id, "prompt": list(self.prompt),
            "max_new": self.max_new, "checker": self.checker,
            "reference": list(self.reference) if self.checker == "tokens" else self.reference,
            "base": list(self.base)}


@dataclasses.dataclass(frozen=True)
class Suite:
  items: tuple[SuiteItem, ...]
  meta: dict[str, Any]

  @property
  def tasks(self) -> list[str]:
    return list(dict.fromkeys(it.task for it in self.items))

  def of_checker(self, checker: str) -> list[int]:
    return [i for i, it in enumerate(self.items) if it.checker == checker]


def score(item: SuiteItem, ids: Sequence[int], base_ids: Sequence[int],
          decode: Callable[[Sequence[int]], str] | None) -> float:
  """One generation's score by its item's checker; `base_ids` the judge's base answer."""
  if item.checker == "number":
    if decode is None:
      raise SuiteError(f"{item.id} is checked on text: the model needs a tokenizer")
    return float(eval_tasks.numbers_equal(eval_tasks.extract_answer(decode(ids)),
                                          str(item.reference)))
  if item.checker == "rouge":
    if decode is not None:
      return rouge_l(decode(ids), decode(base_ids))
    return _rouge_ids(list(ids), list(base_ids))
  expected = list(item.reference)[:item.max_new]
  return sum(a == b for a, b in zip(ids, expected)) / max(len(expected), 1)


def _rouge_ids(a: list[int], b: list[int]) -> float:
  if not a or not b:
    return float(not a and not b)
  lcs = lcs_length(a, b)
  return 0.0 if lcs == 0 else 2 * lcs / (len(a) + len(b))


def save(suite: Suite, directory: str) -> str:
  files.makedirs(directory)
  path = files.join(directory, SUITE_FILE)
  files.write_json_atomic(path, {"format": FORMAT, **suite.meta,
                                 "items": [it.to_json() for it in suite.items]})
  return path


def load(directory: str, vocab_size: int | None = None,
         tokenizer_fingerprint: str | None = None) -> Suite:
  """Reads DIR/suite.json (or the file itself), checked against the model's vocabulary and
  tokenizer when given."""
  path = directory if directory.endswith(".json") else os.path.join(directory, SUITE_FILE)
  try:
    with open(path, encoding="utf-8") as f:
      raw = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise SuiteError(f"cannot read the suite {path} ({e}): write one with python -m infer.eval "
                     "--write-suite DIR") from None
  if raw.get("format") != FORMAT:
    raise SuiteError(f"{path} is not a suite of format {FORMAT} (format {raw.get('format')!r}): "
                     "write it again with python -m infer.eval --write-suite DIR")
  items = tuple(SuiteItem(it["task"], it["id"], tuple(it["prompt"]), int(it["max_new"]),
                          it["checker"], tuple(it["reference"]) if it["checker"] == "tokens"
                          else it["reference"], tuple(it["base"])) for it in raw["items"])
  meta = {k: v for k, v in raw.items() if k not in ("format", "items")}
  bad = sorted({it.checker for it in items} - set(CHECKERS))
  if bad or not items:
    raise SuiteError(f"{path}: {'unknown checker ' + bad[0] if bad else 'no items'}")
  if vocab_size is not None and meta.get("vocab_size") != vocab_size:
    raise SuiteError(f"{path} was written for a vocabulary of {meta.get('vocab_size')} ids, the "
                     f"model has {vocab_size}: write the suite with this model")
  if tokenizer_fingerprint is not None and meta.get("tokenizer") not in (None,
                                                                         tokenizer_fingerprint):
    raise SuiteError(f"{path} was tokenised by another tokenizer ({meta.get('tokenizer')}): "
                     "write the suite with this model's tokenizer")
  return Suite(items, meta)


def decode_items(engine, items: Sequence[SuiteItem], *, mode: str, confidence: float,
                 batch: int, progress: Callable[[int, int], None] | None = None) -> list:
  """Greedy generations of `items` in order, in one serving run of `batch` slots (a slot
  refilled as soon as its answer ends, each item at its own budget): one layout, so a suite
  compiles one set of programs a mode, while the decode programs' views (shapes.views) keep
  short rows from reading the long ones' entries. `progress(done, total)` after each `batch`
  answers."""
  out: list = [None] * len(items)
  run = engine.serve(_requests(items, confidence), slots=min(batch, len(items)), mode=mode)
  with contextlib.closing(run):  # an error ends the run at once
    for done, g in enumerate(run, 1):
      if g.error:
        raise GenerationError(f"suite item {items[g.id].task}/{items[g.id].id}: {g.error}")
      out[g.id] = g
      if progress is not None and (done % batch == 0 or done == len(items)):
        progress(done, len(items))
  return out


def _requests(items: Sequence[SuiteItem], confidence: float) -> list[Request]:
  return [Request(list(it.prompt), max_new_tokens=it.max_new, confidence=confidence, id=i)
          for i, it in enumerate(items)]


def compile_items(engine, items: Sequence[SuiteItem], modes: Sequence[str], batch: int) -> float:
  """Compiles what decode_items runs for `items` in each of `modes`, all the modes' programs
  together (on a GPU host, at once); returns the seconds spent."""
  return serving.precompile(engine, [(_requests(items, 1.0), min(batch, len(items)), mode)
                                     for mode in modes])


PROGRESS_EVERY_S = 30.0  # a suite's decode says how far it is at most this often


def progress_log(log: Callable[[str], None], what: str) -> Callable[[int, int], None]:
  """decode_items' progress as a line at most every PROGRESS_EVERY_S seconds, and at the end: a
  suite's decode takes minutes where programs compile slowly or the device is a CPU."""
  start = last = time.monotonic()

  def progress(done: int, total: int) -> None:
    nonlocal last
    now = time.monotonic()
    if done == total or now - last >= PROGRESS_EVERY_S:
      last = now
      log(f"{what}: {done}/{total} answered ({now - start:.0f} s)")
  return progress


def _task_items(engine, n: int) -> list[SuiteItem]:
  out = []
  for name in NUMBER_TASKS:
    task = eval_tasks.get_task(name)
    for ex in task.examples(n, seed=heldout.EVAL_SEED):
      out.append(SuiteItem(name, ex.id, tuple(engine.encode_prompt(ex.messages)),
                           _max_new(name), "number", str(ex.reference["answer"])))
  return out


def _max_new(task: str) -> int:
  from hamburger_jax.evaluation.run import MAX_NEW_TOKENS  # pylint: disable=C0415  # a cycle
  return MAX_NEW_TOKENS[task]


def _chat_items(engine, counts: Sequence[tuple[str, int]]) -> list[SuiteItem]:
  count = lambda text: len(engine.tokenizer.encode(text))
  out = []
  for name, n in counts:
    task = eval_tasks.get_task(name)
    exs = task.examples(n, count_tokens=count) if name == "sharegpt_heldout" else \
        task.examples(n)
    out += [SuiteItem(name, ex.id, tuple(engine.encode_prompt(ex.messages)), CHAT_TOKENS,
                      "rouge", None) for ex in exs]
  return out


def chat_sources(n: int | None) -> tuple[tuple[str, int], ...]:
  """n held-out chat prompts: MT-Bench's first turns first, then held-out ShareGPT ones (None:
  CHAT_SOURCES)."""
  if n is None:
    return CHAT_SOURCES
  mt = min(n, dict(CHAT_SOURCES)["mt_bench"])
  return tuple((name, k) for name, k in (("mt_bench", mt), ("sharegpt_heldout", n - mt)) if k)


def _synthetic_items(engine, n: int) -> list[SuiteItem]:
  from hamburger_jax.evaluation.scoring import SyntheticTask  # pylint: disable=C0415
  task = SyntheticTask(engine.base_cfg.vocab_size, engine.max_group or 1)
  exs = task.examples(n)
  half = len(exs) // 2
  # Half are checked against their expected continuation, half against the base's answer: the
  # two kinds of checker a text suite has, on a model without a tokenizer.
  return ([SuiteItem("synthetic", ex.id, tuple(ex.messages), _max_new("synthetic"), "tokens",
                     tuple(ex.reference)) for ex in exs[:half]] +
          [SuiteItem("synthetic_vs_base", ex.id, tuple(ex.messages), _max_new("synthetic"),
                     "rouge", None) for ex in exs[half:]])


def build(engine, *, task_examples: int = TASK_EXAMPLES,
          chat: Sequence[tuple[str, int]] = CHAT_SOURCES, batch: int = 32,
          command: str = "", log: Callable[[str], None] = lambda line: None) -> Suite:
  """The suite for `engine`'s model: the number tasks and chat prompts with a tokenizer, else
  synthetic prompts (2 * task_examples); each with the base's greedy answer."""
  from hamburger_jax.data.tokens.corpus import tokenizer_fingerprint  # pylint: disable=C0415
  tok = engine.tokenizer
  if tok is None:
    items = _synthetic_items(engine, 2 * task_examples)
  else:
    items = _task_items(engine, task_examples) + _chat_items(engine, chat)
  log(f"suite: {len(items)} items; the base's greedy answers ...")
  base = decode_items(engine, items, mode="base", confidence=1.0, batch=batch,
                      progress=progress_log(log, "suite: the base"))
  items = [dataclasses.replace(it, base=tuple(g.token_ids)) for it, g in zip(items, base)]
  meta = {"vocab_size": engine.base_cfg.vocab_size,
          "tokenizer": tokenizer_fingerprint(tok) if tok is not None else None,
          "created": datetime.datetime.now().isoformat(timespec="seconds"),
          "command": command, "tasks": list(dict.fromkeys(it.task for it in items))}
  return Suite(tuple(items), meta)
