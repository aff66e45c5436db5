"""The fidelity set: the base's own greedy answers to held-out prompts, segmented into groups,
fixed once and committed, so that every graft's teacher-forced figures (evaluation/fidelity.py)
come from the same tokens.

A record holds its prompt and answer as token ids and the answer's groups (the training data's
segmentation, `STRATEGY`). The prompts are evaluation prompts only: held-out chat (MT-Bench first
turns and held-out ShareGPT ones, both left out of every training source: data/heldout.py) and
the reasoning tasks' evaluation seeds (>= heldout.EVAL_SEED; training draws below it).

  python -m infer.eval --write-fidelity-set hamburger_jax/evaluation/fidelity_set.json
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any, Callable, Sequence

import numpy as np

from hamburger_jax import files

FORMAT = "hamburger-fidelity-set/1"
# The committed set (package data), read by `infer.eval --tasks fidelity` by default.
DEFAULT_PATH = os.path.join(os.path.dirname(__file__), "fidelity_set.json")
# How the answers are grouped: the segmentation the training data uses (docs/results/data.md).
STRATEGY = "confident:0.6"
# (source, records, new-token budget): chat and chains of thought, where most merging happens,
# and the short number tasks the judge scores. 96 records, ~10k answer tokens.
SOURCES = (("mt_bench", 24, 160), ("sharegpt_heldout", 40, 160), ("gsm_symbolic", 16, 160),
           ("letter_counting", 4, 24), ("gcd", 4, 24), ("lcm", 4, 24),
           ("basic_arithmetic", 4, 16))


class FidelitySetError(ValueError):
  """A fidelity set that cannot be read or does not fit the model; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class FidelityRecord:
  source: str
  id: str
  prompt: tuple[int, ...]
  response: tuple[int, ...]
  groups: tuple[int, ...]  # sizes, summing to len(response)

  def to_json(self) -> dict[str, Any]:
    return {"source": self.source, "id": self.id, "prompt": list(self.prompt),
            "response": list(self.response), "groups": list(self.groups)}


@dataclasses.dataclass(frozen=True)
class FidelitySet:
  records: tuple[FidelityRecord, ...]
  meta: dict[str, Any]


def _prompts(engine, sources) -> list[tuple[str, str, list[int], int]]:
  """(source, example id, templated prompt ids, budget) of every source's first examples."""
  from hamburger_jax.data import heldout  # pylint: disable=import-outside-toplevel
  from hamburger_jax.evaluation import tasks as eval_tasks  # pylint: disable=C0415
  count = lambda text: len(engine.tokenizer.encode(text))
  out = []
  for name, n, budget in sources:
    task = eval_tasks.get_task(name)
    if isinstance(task, eval_tasks.ReasoningGymTask):
      exs = task.examples(n, seed=heldout.EVAL_SEED)
    elif name == "sharegpt_heldout":
      exs = task.examples(n, count_tokens=count)
    else:
      exs = task.examples(n)
    out += [(name, ex.id, engine.encode_prompt(ex.messages), budget) for ex in exs]
  return out


def build(engine, *, sources=SOURCES, batch: int = 16, command: str = "",
          log: Callable[[str], None] = lambda line: None) -> FidelitySet:
  """The set for `engine`'s model (a tokenizer needed): the base's greedy answers, served in
  `batch` slots, and their groups from the base's teacher-forced probabilities."""
  # pylint: disable=import-outside-toplevel
  from hamburger_jax import segmentation
  from hamburger_jax.data.teacher_pass import TokenizedSample, base_fingerprint, segment
  from hamburger_jax.data.tokens.corpus import tokenizer_fingerprint
  from hamburger_jax.decode.requests import GenerationError, Request
  if engine.tokenizer is None:
    raise FidelitySetError("the fidelity set is made of text prompts: the model needs a "
                           "tokenizer")
  prompts = _prompts(engine, sources)
  log(f"fidelity set: {len(prompts)} prompts; the base's greedy answers ...")
  reqs = [Request(ids, max_new_tokens=budget, id=i)
          for i, (_, _, ids, budget) in enumerate(prompts)]
  answers: list[list[int] | None] = [None] * len(prompts)
  for g in engine.serve(reqs, slots=batch, mode="base"):
    if g.error:
      raise GenerationError(f"fidelity set item {prompts[g.id][1]}: {g.error}")
    answers[g.id] = list(g.token_ids)
  model = engine.model
  base = getattr(model, "base", model)
  max_group = engine.max_group or 1
  samples = [TokenizedSample(eid, name, np.asarray(ids, np.int32), np.asarray(ans, np.int32))
             for (name, eid, ids, _), ans in zip(prompts, answers)]
  log("fidelity set: segmenting ...")
  grouped = segment(base, samples, segmentation.get_strategy(STRATEGY), max_group)
  records = tuple(FidelityRecord(s.source, s.id, tuple(int(t) for t in s.prompt_ids),
                                 tuple(int(t) for t in s.response_ids),
                                 tuple(int(k) for k in groups))
                  for s, (groups, _) in zip(samples, grouped))
  meta = {"base_fingerprint": base_fingerprint(base),
          "tokenizer": tokenizer_fingerprint(engine.tokenizer), "strategy": STRATEGY,
          "max_group": max_group, "created": datetime.datetime.now().isoformat(timespec="seconds"),
          "command": command, "sources": [list(s) for s in sources]}
  return FidelitySet(records, meta)


def save(fset: FidelitySet, path: str) -> str:
  files.write_text_atomic(path, json.dumps(
      {"format": FORMAT, **fset.meta, "records": [r.to_json() for r in fset.records]},
      separators=(",", ":")) + "\n")
  return path


def load(path: str | None = None) -> FidelitySet:
  """Reads a fidelity set (default: the committed one)."""
  path = path or DEFAULT_PATH
  try:
    with open(path, encoding="utf-8") as f:
      raw = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise FidelitySetError(f"cannot read the fidelity set {path} ({e}): write one with python "
                           "-m infer.eval --write-fidelity-set PATH") from None
  if raw.get("format") != FORMAT:
    raise FidelitySetError(f"{path} is not a fidelity set of format {FORMAT} (format "
                           f"{raw.get('format')!r}): write it again with python -m infer.eval "
                           "--write-fidelity-set PATH")
  records = []
  for r in raw["records"]:
    rec = FidelityRecord(r["source"], r["id"], tuple(r["prompt"]), tuple(r["response"]),
                         tuple(r["groups"]))
    if sum(rec.groups) != len(rec.response) or not rec.prompt or not rec.response:
      raise FidelitySetError(f"{path}: record {rec.id} has groups {list(rec.groups)} for "
                             f"{len(rec.response)} answer tokens: write the set again")
    records.append(rec)
  return FidelitySet(tuple(records), {k: v for k, v in raw.items()
                                      if k not in ("format", "records")})


def check_fits(fset: FidelitySet, base, max_group: int, where: str = "the fidelity set") -> None:
  """FidelitySetError unless the set was made by `base` (its greedy answers are this base's
  own) with groups a graft of `max_group` can read."""
  # pylint: disable=import-outside-toplevel
  from hamburger_jax.data.teacher_pass import base_fingerprint
  stored = fset.meta.get("base_fingerprint")
  if stored != base_fingerprint(base):
    raise FidelitySetError(f"{where} holds the greedy answers of another base (fingerprint "
                           f"{stored}), so they are not this base's own: write a set with this "
                           "base (python -m infer.eval --write-fidelity-set PATH)")
  largest = max(max(r.groups) for r in fset.records)
  if largest > max_group:
    raise FidelitySetError(f"{where} has groups of {largest} tokens; the graft reads at most "
                           f"{max_group}: write a set with this graft")


def prompt_ids(fset: FidelitySet) -> list[Sequence[int]]:
  return [r.prompt for r in fset.records]
