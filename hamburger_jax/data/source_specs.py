"""The specs that name training sources, and the reasoning-gym training sources they name: the
one owner of the three spec grammars and their names.

- The tfds pipeline's (train.prepare_data, train.pipeline): "sharegpt", "gsm_symbolic",
  "jsonl:PATH", each optionally "SPEC@N" (`mixed_sources`, PIPELINE_SOURCES).
- Self-distillation's: "NAME:COUNT,..." prompts of each (`parse_mix`, MIX_SOURCES).
- The token corpus's (train.token_corpus --mix): "sharegpt" read whole, "NAME:N" reasoning-gym
  problems (`parse_sources`, CORPUS_SOURCES); build_corpus leaves out `heldout.heldout_sets`.

The grammars differ in what they accept (a count after "@" or ":", ShareGPT counted or whole,
JSONL files or not); what they share is the reasoning-gym names (REASONING_SOURCES). Training
problems come from seeds below heldout.EVAL_SEED, minus the evaluation's questions.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from typing import Iterator, Sequence

from hamburger_jax.data import sources as sourcelib
from hamburger_jax.data.heldout import (EVAL_SEED, GSM_SYMBOLIC, REASONING, evaluation_questions,
                                        user_message)
from hamburger_jax.data.sources import Conversation, SourceError
from hamburger_jax.data.tokens.corpus import CorpusError

# The reasoning-gym tasks every grammar can name as a training source.
REASONING_SOURCES = tuple(REASONING)
# The tfds pipeline's sources (make_source, mixed_sources).
PIPELINE_SOURCES = ("sharegpt", "gsm_symbolic", "jsonl:PATH")
# Self-distillation's sources (parse_mix): NAME:COUNT prompts of each.
MIX_SOURCES = ("sharegpt", *REASONING_SOURCES, "synthetic")
# Source specs build_corpus takes (train.token_corpus --mix). ShareGPT is read whole, every
# conversation multi-turn, minus the held-out evaluation records and prompts; NAME:N are N
# problems of a reasoning-gym task that the evaluation uses, drawn from training seeds [0, N)
# (evaluation seeds start at EVAL_SEED) minus any evaluation question.
# gsm_symbolic answers with its chain of thought ("... #### N", gsm_symbolic_conversations),
# the others in their evaluation prompt format with the bare answer.
CORPUS_SOURCES = ("sharegpt", *(f"{name}:N" for name in REASONING_SOURCES))


# ----------------------------------------------------------------------------- reasoning-gym


def check_training_seed(seed: int) -> None:
  if not 0 <= seed < EVAL_SEED:
    raise SourceError(
        f"gsm_symbolic training seed {seed} is outside [0, {EVAL_SEED}): seeds >= "
        f"{EVAL_SEED} are reserved for evaluation; pick a smaller --seed")


def gsm_symbolic_conversations(size: int, seed: int,
                               exclude: Iterable[str] = ()) -> Iterator[Conversation]:
  """GSM-style questions from seeds [seed, seed + size), minus the questions in `exclude`
  (pass the evaluation questions, `evaluation_questions("gsm_symbolic")`:
  the templates repeat questions across seeds, and 2 of the first 6,000 training seeds give
  one of the 200 evaluation questions); the response is the chain of thought ending "#### N"."""
  check_training_seed(seed)
  if size < 1:
    raise SourceError(f"gsm_symbolic needs a positive number of samples, got {size}")
  excluded = {sourcelib.normalize_question(q) for q in exclude}
  for i, example in enumerate(GSM_SYMBOLIC.items(size, seed)):
    if sourcelib.normalize_question(example["question"]) not in excluded:
      yield Conversation(user_message(example["question"]), example["metadata"]["answer_cot"],
                         "gsm_symbolic", f"gsm_symbolic:{seed}:{i}")


def reasoning_prompts(name: str, n: int, seed: int = 0) -> Iterator[Conversation]:
  """Training questions in the evaluation prompt format, minus any evaluation question."""
  task = REASONING[name]
  for i, item in enumerate(task.train_items(n, seed, exclude=evaluation_questions(name))):
    yield Conversation(task.messages(item["question"]), task.target(item), name,
                       f"{name}/{seed + i}")


# ----------------------------------------------------------------------------- pipeline specs


def make_source(spec: str, limit: int | None = None, seed: int = 0,
                exclude: Iterable[str] = ()) -> Iterator[Conversation]:
  """Conversations of `spec` (sharegpt, gsm_symbolic, jsonl:PATH), at most `limit` of them.

  `seed` selects the gsm_symbolic problems and `exclude` drops those questions from them;
  ShareGPT and JSONL keep their file order.
  """
  if limit is not None and limit < 1:
    raise SourceError(f"limit={limit} must be positive (or None for the whole source)")
  if spec == "sharegpt":
    it = sourcelib.sharegpt_conversations(sourcelib.sharegpt_path())
  elif spec == "gsm_symbolic":
    if limit is None:
      raise SourceError("gsm_symbolic generates problems without end: pass a limit (--limit N)")
    check_training_seed(seed)  # here too: the generator below would only check when first read
    it = gsm_symbolic_conversations(limit, seed, exclude)
  elif spec.startswith("jsonl:") and len(spec) > len("jsonl:"):
    path = spec[len("jsonl:"):]
    if not os.path.exists(path):
      raise SourceError(f"JSONL file {path} does not exist")
    it = sourcelib.jsonl_conversations(path)
  else:
    raise SourceError(
        f"unknown data source {spec!r}; valid sources are: {', '.join(PIPELINE_SOURCES)}")
  return _take(it, limit)


def mixed_sources(specs: list[str], limit: int | None = None, seed: int = 0,
                  exclude: Iterable[str] = ()) -> Iterator[Conversation]:
  """Several sources read one after the other; "SPEC@N" takes at most N of SPEC (else `limit`).
  Every spec is checked before any is read."""
  parts = []
  for spec in specs:
    name, at, n = spec.rpartition("@") if "@" in spec else (spec, "", "")
    own = limit
    if at:
      if not n.isdigit() or int(n) < 1:
        raise SourceError(f"source {spec!r}: the count after @ must be a positive integer")
      own = int(n)
    parts.append(make_source(name, own, seed, exclude))
  return itertools.chain.from_iterable(parts)


def _take(it: Iterator[Conversation], limit: int | None) -> Iterator[Conversation]:
  for i, conv in enumerate(it):
    if limit is not None and i >= limit:
      return
    yield conv



# ----------------------------------------------------------------------------- distill specs


def parse_mix(spec: str) -> list[tuple[str, int]]:
  out = []
  for part in spec.split(","):
    name, _, n = part.partition(":")
    if name not in MIX_SOURCES or not n.isdigit():
      raise SourceError(f"--mix item {part!r}: use NAME:COUNT with NAME in {MIX_SOURCES}")
    out.append((name, int(n)))
  return out



# ----------------------------------------------------------------------------- token corpus specs


def parse_sources(specs: Sequence[str]) -> list[tuple[str, int | None]]:
  """[(name, count or None)] of specs like ("sharegpt", "gsm_symbolic:5000"); CorpusError names a
  bad one."""
  if not specs:
    raise CorpusError(f"no sources given; name at least one of: {', '.join(CORPUS_SOURCES)}")
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
      limit = EVAL_SEED
      if count > limit:
        raise CorpusError(
            f"source {spec!r}: {name} draws training problems from seeds [0, {count}), which "
            f"reaches the evaluation seeds (>= {limit}); use at most {name}:{limit}")
      out.append((name, count))
    else:
      raise CorpusError(
          f"unknown source {spec!r}; valid sources are: {', '.join(CORPUS_SOURCES)}")
  names = [name for name, _ in out]
  repeated = sorted({name for name in names if names.count(name) > 1})
  if repeated:
    raise CorpusError(f"source {repeated[0]!r} is named twice; name each source once")
  return out


def reasoning_conversations(name: str, n: int) -> Iterator[tuple[str, list[dict[str, str]]]]:
  """(id, messages) of `name`'s training problems [0, n), minus its evaluation questions: the
  token corpus's reasoning sources (gsm_symbolic_conversations, else reasoning_prompts)."""
  gsm = name == "gsm_symbolic"
  convs = (gsm_symbolic_conversations(n, 0, exclude=evaluation_questions(name)) if gsm
           else reasoning_prompts(name, n))
  for i, conv in enumerate(convs):
    yield (conv.id if gsm else f"{name}:{i}"), conv.prompt_messages + [
        {"role": "assistant", "content": conv.response}]
