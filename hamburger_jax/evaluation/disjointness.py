"""Comparable keys of evaluation and training prompts, so that an evaluation can check that no
prompt it asks was trained on (data.heldout.assert_disjoint compares them)."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from hamburger_jax.data import pipeline, sources
from hamburger_jax.data.tokens import corpus as corpuslib


def prompt_key(ids: Sequence[int], tokenizer) -> str:
  """A comparable form of a templated prompt: its text when there is a tokenizer (so the same
  prompt tokenised two ways still matches), else its ids."""
  return tokenizer.decode(list(ids)) if tokenizer is not None else " ".join(map(str, ids))


def training_prompt_keys(path: str, tokenizer) -> list[str]:
  """Prompt keys of a training set: a token corpus (train.token_corpus), a tfds directory (split
  "train") or a JSONL file; ValueError for text prompts that a model without tokenizer cannot
  compare."""
  if os.path.isfile(os.path.join(path, corpuslib.META_FILE)):
    return corpus_prompt_keys(corpuslib.TokenCorpus.load(path), tokenizer)
  if os.path.isdir(path):
    split = pipeline.open_split(path, "train")
    return [prompt_key(np.asarray(r["input_ids"])[:int(r["prompt_len"])], tokenizer)
            for r in (split[i] for i in range(len(split)))]
  keys = []
  for conv in sources.jsonl_conversations(path):
    if conv.prompt_ids is not None:
      keys.append(prompt_key(conv.prompt_ids, tokenizer))
    elif tokenizer is None:
      raise ValueError(f"{path} holds text prompts but the model has no tokenizer to compare them")
    else:
      keys.append(prompt_key(tokenizer.encode(tokenizer.apply_chat_template(
          conv.prompt_messages, add_generation_prompt=True, tokenize=False)), tokenizer))
  return keys


def corpus_prompt_keys(corpus: "corpuslib.TokenCorpus", tokenizer) -> list[str]:
  """Keys of a token corpus's training prompts that a single-turn evaluation prompt can equal:
  the tokens before each training sample's first response (a sample opens with the system line
  and a user turn; the prompts of its later responses hold earlier turns too)."""
  first = {}
  for s, a, _ in corpus.responses:
    first.setdefault(int(s), int(a))
  keys = []
  for i in corpus.sample_ids("train"):
    if int(i) in first:
      start = int(corpus.samples[i, 0])
      keys.append(prompt_key(np.asarray(corpus.tokens[start:first[int(i)]]).tolist(), tokenizer))
  return keys


def eval_prompt_keys(engine, examples) -> list[str]:
  """Each example's templated prompt, and for reasoning-gym items also the bare question (the
  form of the gsm_symbolic training source)."""
  keys = []
  for ex in examples:
    keys.append(prompt_key(engine.encode_prompt(ex.messages), engine.tokenizer))
    if isinstance(ex.reference, dict) and "question" in ex.reference:
      keys.append(prompt_key(engine.encode_prompt(ex.reference["question"]), engine.tokenizer))
  return keys
