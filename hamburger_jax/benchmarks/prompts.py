"""What the decode benches decode: the bench prompts (chat questions of several kinds) and a
stream of real serving requests."""

from __future__ import annotations

import numpy as np

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that checks whether a number is prime.",
    "Explain in simple terms why the sky is blue.",
    "Give me three tips for learning a new language.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What are the main differences between a list and a tuple in Python?",
    "Write a short poem about the autumn rain.",
]


def chat_ids(tok, prompts: list[str]) -> list[list[int]]:
  return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True)
          for p in prompts]

def serve_workload(tok, n: int, new_range: tuple[int, int], seed: int = 0,
                   max_prompt_tokens: int = 192) -> list[tuple[list[int], int]]:
  """A stream of real requests: held-out ShareGPT first turns (up to max_prompt_tokens) and
  gsm_symbolic evaluation questions, alternating, each with max_new_tokens drawn uniformly
  from new_range."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from hamburger_jax.evaluation import tasks  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  count = lambda s: len(tok.encode(s))
  chat = dataclasses.replace(tasks.SHAREGPT_HELDOUT, max_prompt_tokens=max_prompt_tokens)
  sharegpt = chat.examples(n - n // 2, count_tokens=count)
  gsm = tasks.GSM_SYMBOLIC.examples(n // 2)
  mixed = [ex for pair in zip(sharegpt, gsm) for ex in pair] + sharegpt[len(gsm):]
  return [(tok.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=True),
           int(rng.integers(new_range[0], new_range[1] + 1))) for ex in mixed[:n]]


# Held-out prompts of the verify bench, taken in turn: chat (MT-Bench first turns, held-out
# ShareGPT) and the reasoning tasks at their evaluation seeds (data/heldout.py).
HELDOUT_SOURCES = ("mt_bench", "sharegpt_heldout", "gsm_symbolic", "letter_counting", "gcd",
                   "basic_arithmetic")


def heldout_prompts(tok, n: int, max_prompt_tokens: int = 192) -> list[tuple[str, list[int]]]:
  """(source, templated prompt ids) of `n` held-out prompts, the sources taken in turn: what no
  graft nor drafter trained on, as a user sends them."""
  # pylint: disable=import-outside-toplevel
  import dataclasses
  from hamburger_jax.data import heldout
  from hamburger_jax.evaluation import tasks
  per = -(-n // len(HELDOUT_SOURCES))
  count = lambda s: len(tok.encode(s))
  by_source = []
  for name in HELDOUT_SOURCES:
    task = tasks.get_task(name)
    if isinstance(task, tasks.ReasoningGymTask):
      exs = task.examples(per, seed=heldout.EVAL_SEED)
    elif name == "sharegpt_heldout":
      exs = dataclasses.replace(task, max_prompt_tokens=max_prompt_tokens).examples(
          per, count_tokens=count)
    else:
      exs = task.examples(per)
    by_source.append([(name, tok.apply_chat_template(ex.messages, add_generation_prompt=True,
                                                     tokenize=True)) for ex in exs])
  mixed = [p for row in zip(*by_source) for p in row]
  return mixed[:n]
