"""Scoring a generation task's runs: per-example scores of the base and of HAMburger at each
confidence, and the entry results.json keeps for the task (score, bootstrap intervals, KV
compression, speed ratio, agreement with the base's tokens)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from hamburger_jax.decode.requests import pooled_tokens_per_step
from hamburger_jax.evaluation.agreement import first_divergence, token_agreement
from hamburger_jax.evaluation.generation import ModeRun, run_modes
from hamburger_jax.evaluation.statistics import paired_bootstrap_ci
from hamburger_jax.data import heldout
from hamburger_jax.data.synthetic import synthetic_samples

# Synthetic prompts come from this seed; build_synthetic_dataset's seeds (0, 1) stay below.
SYNTHETIC_SEED = heldout.EVAL_SEED
# The tasks scored by ROUGE-L against the base's own answers (score_vs_base).
VS_BASE_TASKS = ("mt_bench", "sharegpt_heldout")


def ckey(c: float) -> str:
  """A confidence as a results.json key: 0.6 -> "0.6"."""
  return f"{c:g}"


@dataclasses.dataclass
class Scored:
  """A generation task's runs and per-example scores."""
  metric: str
  examples: list  # heldout.Example
  base: ModeRun
  ham: dict[float, ModeRun]
  base_scores: list[float]
  ham_scores: dict[float, list[float]]
  verify: ModeRun | None = None  # verify mode's run (the base's tokens, drafted), if asked
  verify_scores: list[float] | None = None

  def result(self, max_new: int) -> dict[str, Any]:
    """results.json's entry; speed ratio = HAMburger decode tokens/s over the base's; delta =
    HAMburger's score minus the base's, with its paired interval; token agreement with the base."""
    result = {"metric": self.metric, "n": len(self.examples), "max_new_tokens": max_new,
              "base": self.base.summary(self.base_scores), "hamburger": {}}
    base_ids = [g.token_ids for g in self.base.gens]
    for c, run in self.ham.items():
      summary = run.summary(self.ham_scores[c])
      summary["speed_ratio"] = summary["tokens_per_s"] / result["base"]["tokens_per_s"]
      summary["delta"] = summary["score"] - result["base"]["score"]
      summary["delta_ci95"] = list(paired_bootstrap_ci(self.ham_scores[c], self.base_scores))
      summary.update(token_agreement(base_ids, [g.token_ids for g in run.gens]))
      summary.update(first_divergence(base_ids, [g.token_ids for g in run.gens],
                                      [g.groups for g in run.gens]))
      result["hamburger"][ckey(c)] = summary
    if self.verify is not None:
      summary = self.verify.summary(self.verify_scores)
      summary.pop("kv_compression")  # one entry per token, as the base
      summary["tokens_per_forward"] = pooled_tokens_per_step(self.verify.gens)
      summary["speed_ratio"] = summary["tokens_per_s"] / result["base"]["tokens_per_s"]
      summary.update(token_agreement(base_ids, [g.token_ids for g in self.verify.gens]))
      result["verify"] = summary
    return result

  def records(self, task: str) -> Iterator[dict[str, Any]]:
    """generations.jsonl lines: one per example and mode."""
    runs = [("base", None, self.base, self.base_scores)] + [
        ("hamburger", c, run, self.ham_scores[c]) for c, run in self.ham.items()]
    if self.verify is not None:
      runs.append(("verify", None, self.verify, self.verify_scores))
    for mode, c, run, scores in runs:
      for ex, g, s in zip(self.examples, run.gens, scores):
        yield {"task": task, "id": ex.id, "mode": mode, "confidence": c, "score": s,
               "text": g.text, "token_ids": g.token_ids, "groups": g.groups,
               "macro_steps": g.macro_steps, "prompt_tokens": g.prompt_tokens}


def _scored(metric, examples, base, ham, verify, score) -> Scored:
  return Scored(metric, examples, base, ham, score(base), {c: score(run) for c, run in ham.items()},
                verify, None if verify is None else score(verify))


def score_by_task(engine, task, examples, confidences, max_new, batch, max_group=None,
                  verify_draft_confidence=None) -> Scored:
  """reasoning-gym exact match and HumanEval pass@1: task.score(text, example) per generation."""
  runs = run_modes(engine, examples, confidences, max_new, batch, task.name, max_group,
                   verify_draft_confidence)
  score = lambda run: [task.score(g.text, ex) for g, ex in zip(run.gens, examples)]
  return _scored("pass@1" if task.name == "humaneval" else "exact_match", examples, *runs, score)


def score_vs_base(engine, task, examples, confidences, max_new, batch, max_group=None,
                  verify_draft_confidence=None) -> Scored:
  """ROUGE-L of HAMburger's answers against the base's own answers (attached as references):
  mt_bench and sharegpt_heldout (tasks.VsReferenceTask), which have no judge offline."""
  base, ham, checked = run_modes(engine, examples, confidences, max_new, batch, task.name,
                                 max_group, verify_draft_confidence)
  examples = [task.with_reference(ex, g.text) for ex, g in zip(examples, base.gens)]
  scored = _scored("rouge_l_vs_base", examples, base, ham, checked,
                   lambda run: [task.score(g.text, ex) for g, ex in zip(run.gens, examples)])
  scored.base_scores = [1.0] * len(examples)  # the base against itself, by definition
  return scored


class SyntheticTask:
  """Prompts of hamburger_jax.data.synthetic.synthetic_samples (token ids, for tokenizer-less models);
  score = fraction of the expected continuation's first max_new tokens generated exactly."""

  name = "synthetic"

  def __init__(self, vocab: int, max_group: int):
    self.vocab, self.max_group = vocab, max_group

  def examples(self, n: int) -> list[heldout.Example]:
    samples = synthetic_samples(n, self.vocab, self.max_group, seed=SYNTHETIC_SEED)
    # `messages` holds token ids here: the engine takes a list of ints as a raw prompt.
    return [heldout.Example(f"synthetic/{SYNTHETIC_SEED}/{i}",
                            s["input_ids"][:s["prompt_len"]].tolist(),
                            s["input_ids"][s["prompt_len"]:].tolist())
            for i, s in enumerate(samples)]

  @staticmethod
  def score(token_ids: list[int], example, max_new: int) -> float:
    expected = example.reference[:max_new]
    return sum(a == b for a, b in zip(token_ids, expected)) / max(len(expected), 1)


def score_synthetic(engine, task: SyntheticTask, examples, confidences, max_new, batch,
                    max_group=None, verify_draft_confidence=None) -> Scored:
  """Token match of the synthetic task (scored on ids: the model may have no tokenizer)."""
  runs = run_modes(engine, examples, confidences, max_new, batch, task.name, max_group,
                   verify_draft_confidence)
  score = lambda run: [task.score(g.token_ids, ex, max_new) for g, ex in zip(run.gens, examples)]
  return _scored("token_match", examples, *runs, score)


def run_task(engine, task, examples, confidences, max_new, batch, max_group=None,
             verify_draft_confidence=None) -> Scored:
  """Generates and scores one task by its family's rule (the three functions above)."""
  family = (score_vs_base if task.name in VS_BASE_TASKS else
            score_synthetic if task.name == "synthetic" else score_by_task)
  return family(engine, task, examples, confidences, max_new, batch, max_group,
                verify_draft_confidence)
