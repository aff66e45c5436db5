"""Conversations -> token ids -> entropy groups -> the tfds training set (docs/SPEC.md 2.1).

The library half of `train.prepare_data`: tokenise with the chat template (the response keeps its
end-of-turn token), drop samples over the max length, compute the base model's teacher-forced
entropies in batches, segment, and write the dataset atomically.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
from flax import nnx
import tensorflow_datasets as tfds

from hamburger_jax import pretrained, segmentation
from hamburger_jax.config import ConfigError
from hamburger_jax.data.sources import Conversation, SourceError
from hamburger_jax.data.tfds_builder import build_dataset, check_output_dir, work_dir_beside
from hamburger_jax.tokenizer import load_default_tokenizer

# End-of-turn spellings, most specific first; the one the chat template writes is the model's.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>")
_ROW_BUCKET = 64


@dataclasses.dataclass(frozen=True)
class TokenizedSample:
  id: str
  source: str
  prompt_ids: np.ndarray  # [P] int32, chat-templated, ends with the generation prompt
  response_ids: np.ndarray  # [R] int32, ends with the end-of-turn id
  groups: np.ndarray | None = None  # [G] int32 recorded group sizes (strategy "given")

  def __len__(self) -> int:
    return len(self.prompt_ids) + len(self.response_ids)


@dataclasses.dataclass
class PrepareStats:
  conversations: int = 0
  samples: int = 0
  train_samples: int = 0
  validation_samples: int = 0
  dropped_too_long: int = 0
  kept_split: int = 0  # samples whose split came from keep_split
  tokens: int = 0  # prompt + response tokens kept
  response_tokens: int = 0
  groups: int = 0
  group_hist: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  seconds: float = 0.0
  segment_seconds: float = 0.0  # entropy forward passes + strategy

  @property
  def mean_group_size(self) -> float:
    return self.response_tokens / max(self.groups, 1)

  @property
  def segment_tokens_per_s(self) -> float:
    return self.tokens / max(self.segment_seconds, 1e-9)

  def summary(self) -> str:
    hist = "  ".join(f"{k}: {self.group_hist[k]} ({self.group_hist[k] / max(self.groups, 1):.1%})"
                     for k in sorted(self.group_hist))
    return "\n".join([
        f"conversations read   {self.conversations}",
        f"samples written      {self.samples} (train {self.train_samples}, validation "
        f"{self.validation_samples}; {self.kept_split} kept their earlier split)",
        f"dropped (too long)   {self.dropped_too_long}",
        f"tokens               {self.tokens} ({self.response_tokens} response)",
        f"groups               {self.groups}, mean size {self.mean_group_size:.3f}",
        f"group sizes          {hist}",
        f"time                 {self.seconds:.1f} s (segmentation {self.segment_seconds:.1f} s, "
        f"{self.segment_tokens_per_s:.0f} tokens/s)",
    ])


# ----------------------------------------------------------------------------- model, tokenizer


def load_base(model_cfg):
  """(model, tokenizer) for a run config's `model:` section (RunConfig.model); a random base
  (tests) is paired with the default tokenizer, whose vocabulary it must hold."""
  # Imported here: the tokenizer pulls in jinja2 and the GGUF reader, unneeded to read data.
  model, tokenizer = pretrained.load_base_for_run(model_cfg)
  tokenizer = tokenizer or load_default_tokenizer()
  if tokenizer.vocab_size > model.cfg.vocab_size:
    raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                      f"vocab_size is {model.cfg.vocab_size}: raise vocab_size in the config")
  return model, tokenizer


def end_of_turn_id(tokenizer) -> int:
  """The id that closes an assistant turn in this model's chat template (SmolLM2: <|im_end|>)."""
  template = getattr(tokenizer, "chat_template", None) or ""
  for token in _END_OF_TURN:
    i = tokenizer.token_to_id(token) if hasattr(tokenizer, "token_to_id") else None
    if i is not None and token in template:
      return int(i)
  if tokenizer.eos_id is None:
    raise ValueError("the tokenizer names no end-of-turn or eos token; a response needs one")
  return int(tokenizer.eos_id)


def tokenize(conversation: Conversation, tokenizer, eot_id: int) -> TokenizedSample:
  """Prompt = chat template with the generation prompt; response = its ids + end-of-turn.

  A conversation that carries its exact ids (self-distilled) keeps them as they are.
  """
  if conversation.response_ids is not None:
    groups = conversation.groups
    return TokenizedSample(conversation.id, conversation.source,
                           np.asarray(conversation.prompt_ids, np.int32),
                           np.asarray(conversation.response_ids, np.int32),
                           None if groups is None else np.asarray(groups, np.int32))
  # Ids straight from the template (as the engine does at inference), and the response as plain
  # text: a "<|im_end|>" typed in a message is text, never the control token.
  prompt = tokenizer.apply_chat_template(conversation.prompt_messages,
                                         add_generation_prompt=True, tokenize=True)
  response = list(tokenizer.encode(conversation.response, parse_special=False)) + [eot_id]
  return TokenizedSample(conversation.id, conversation.source, np.asarray(prompt, np.int32),
                         np.asarray(response, np.int32))


def check_given_groups(sample: TokenizedSample, strategy: segmentation.Strategy,
                       max_group: int) -> None:
  """Strategy "given" trains on each sample's recorded groups: they must fit K, and be there
  unless the strategy has a fallback for samples without them."""
  if sample.groups is None:
    if strategy.fallback is not None:
      return
    raise SourceError(f"record {sample.id}: strategy 'given' needs the groups the response was "
                      "emitted in; write the file with `python -m train.self_distill "
                      "--checkpoint ...`, or choose given:STRATEGY (e.g. given:confident:0.6) to "
                      "segment records without groups by STRATEGY")
  if sample.groups.max() > max_group:
    raise SourceError(f"record {sample.id}: a group of {sample.groups.max()} tokens exceeds "
                      f"graft.max_group={max_group}; was it generated by a graft with another K?")


def check_ids_in_vocab(record: Conversation | TokenizedSample, vocab_size: int) -> None:
  """Refuses ids outside [0, vocab_size) (JAX would clamp them silently), naming the record (for
  JSONL sources: file:line)."""
  for name in ("prompt_ids", "response_ids"):
    ids = getattr(record, name)
    if ids is None:
      continue
    if isinstance(ids, np.ndarray):
      out = ids[(ids < 0) | (ids >= vocab_size)]
      bad = int(out[0]) if out.size else None
    else:
      bad = next((int(i) for i in ids if not 0 <= int(i) < vocab_size), None)
    if bad is not None:
      raise SourceError(f"record {record.id} ({record.source}): {name} holds token id {bad}, "
                        f"outside the model's vocabulary [0, {vocab_size}); fix or remove the "
                        "record")


# ----------------------------------------------------------------------------- segmentation


def segment(model: nnx.Module, samples: list[TokenizedSample], strategy: segmentation.Strategy,
            max_group: int, *, batch_tokens: int = 2048, row_len: int | None = None,
            teacher: segmentation.TeacherSpec | None = None,
            progress: Callable[[int], None] | None = None
            ) -> list[tuple[np.ndarray, dict[str, np.ndarray] | None]]:
  """Group sizes of each sample's response, from the model's teacher-forced token statistics
  (strategy "given": the sample's recorded groups, or its fallback's where it has none), and
  (with `teacher`) the sample's teacher signals: top-k per response token and the features at
  each group's predicting position (the token before the group's first)."""
  stats = segmentation.response_token_stats(
      model, [(s.prompt_ids, s.response_ids) for s in samples], batch_tokens=batch_tokens,
      row_len=row_len, teacher=teacher, progress=progress)
  out = []
  for s, st in zip(samples, stats):
    rule = strategy.fallback if strategy.reads == "given" and s.groups is None else strategy
    groups = (s.groups if rule.reads == "given" else
              np.asarray(rule(getattr(st, rule.reads), max_group), np.int32))
    out.append((groups, teacher_signals(st, groups) if teacher is not None else None))
  return out


def teacher_signals(stats: segmentation.TokenStats, groups) -> dict[str, np.ndarray]:
  """What a sample stores for distillation: the top-k of every response token, and the features
  at each group's predicting position (the token before the group's first)."""
  groups = np.asarray(groups)
  starts = np.cumsum(groups) - groups  # row j of stats.features predicts response token j
  return {"teacher_topk_ids": stats.topk_ids, "teacher_topk_logp": stats.topk_logp,
          "teacher_features": stats.features[starts]}


def teacher_metadata(model: nnx.Module, teacher: segmentation.TeacherSpec | None
                     ) -> tuple[dict[str, Any], dict[str, int] | None]:
  """(dataset metadata naming the base and the teacher signals, the builder's teacher shapes)."""
  meta: dict[str, Any] = {"base_fingerprint": base_fingerprint(model)}
  if teacher is None:
    return meta, None
  shapes = {"top_k": teacher.top_k, "num_features": len(teacher.feature_layers),
            "hidden": model.cfg.hidden_size}
  meta["teacher"] = {**shapes, "feature_layers": list(teacher.feature_layers)}
  return meta, shapes


def _chunks(it: Iterable[Any], size: int) -> Iterator[list[Any]]:
  chunk = []
  for x in it:
    chunk.append(x)
    if len(chunk) == size:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


def prepare_dataset(conversations: Iterable[Conversation], model: nnx.Module, tokenizer,
                    out_dir: str, *, strategy: str = "decreasing_v2", max_group: int = 4,
                    max_len: int = 384, val_fraction: float = 0.05, seed: int = 0,
                    overwrite: bool = False, chunk_size: int = 256, batch_tokens: int = 2048,
                    metadata: Mapping[str, Any] | None = None,
                    teacher: segmentation.TeacherSpec | None = None,
                    keep_split: Mapping[bytes, str] | None = None,
                    progress: Callable[[int], None] | None = None) -> PrepareStats:
  """Tokenises, segments and writes `conversations` to `out_dir` (train + validation splits).

  Streams: conversations are read `chunk_size` at a time and segmented samples go to a temp
  JSONL beside `out_dir` (teacher arrays to .npy files there), so memory does not grow with the
  source. `teacher` stores the distillation recipe's teacher signals with every sample (see
  `segment`). `keep_split` (`split_of_samples` of a dataset this one grows, e.g. a
  self-distillation file rebuilt with more answers, or on-policy answers to the same prompts):
  a sample whose prompt is found there keeps that prompt's split, so a model trained on the old
  training split meets none of its prompts in the new validation split; only new prompts are
  split at `val_fraction`. Splits go by prompt: all answers to one prompt share a split. `progress(n)` is called as conversations are
  segmented or dropped.
  """
  start = time.perf_counter()
  strategy_fn = segmentation.get_strategy(strategy)
  if not 0.0 <= val_fraction < 1.0:
    raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
  if max_len < 2:
    raise ValueError(f"max_len={max_len} must be at least 2 (a prompt and a response token)")
  out = os.path.abspath(out_dir)
  check_output_dir(out, overwrite)  # before hours of work, not after
  known = keep_split or {}
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  eot = end_of_turn_id(tokenizer)
  # One row length for every entropy pass: a single compilation for the whole dataset.
  row_len = -(-max_len // _ROW_BUCKET) * _ROW_BUCKET
  stats = PrepareStats()
  keys: list[bytes] = []  # each written sample's prompt_key: the split goes by prompt

  vocab = int(model.cfg.vocab_size)

  def kept() -> Iterator[TokenizedSample]:
    for conv in conversations:
      stats.conversations += 1
      check_ids_in_vocab(conv, vocab)  # ids given by the source, before any conversion
      sample = tokenize(conv, tokenizer, eot)
      check_ids_in_vocab(sample, vocab)
      if strategy_fn.reads == "given":
        check_given_groups(sample, strategy_fn, max_group)
      if len(sample) > max_len:
        stats.dropped_too_long += 1
        if progress is not None:
          progress(1)
        continue
      yield sample

  with work_dir_beside(out, "samples") as tmp:
    samples_path = os.path.join(tmp, "samples.jsonl")
    with open(samples_path, "w", encoding="utf-8") as f:
      for chunk in _chunks(kept(), chunk_size):
        t0 = time.perf_counter()
        segmented = segment(model, chunk, strategy_fn, max_group, batch_tokens=batch_tokens,
                            row_len=row_len, teacher=teacher, progress=progress)
        stats.segment_seconds += time.perf_counter() - t0
        for s, (g, signals) in zip(chunk, segmented):
          if signals is not None:
            for name, value in signals.items():
              np.save(os.path.join(tmp, f"{stats.samples}.{name}.npy"), value)
          ids = np.concatenate([s.prompt_ids, s.response_ids])
          f.write(json.dumps({
              "input_ids": ids.tolist(),
              "prompt_len": len(s.prompt_ids), "groups": g.tolist(), "source": s.source,
              "id": s.id}) + "\n")
          keys.append(prompt_key(s.prompt_ids))
          stats.samples += 1
          stats.tokens += len(s)
          stats.response_tokens += len(s.response_ids)
          stats.groups += len(g)
          stats.group_hist.update(g.tolist())
    if stats.samples == 0:
      raise ValueError(f"no samples to write: {stats.conversations} conversations read, "
                       f"{stats.dropped_too_long} longer than max_len={max_len}")
    new = list(dict.fromkeys(k for k in keys if k not in known))  # new prompts, in order
    val_keys = {new[j] for j in validation_indices(len(new), val_fraction, seed)}
    val = {i for i, k in enumerate(keys) if k in val_keys or known.get(k) == "validation"}
    stats.kept_split = sum(k in known for k in keys)
    stats.validation_samples = len(val)
    stats.train_samples = stats.samples - len(val)

    def read(split: str) -> Callable[[], Iterator[dict[str, Any]]]:
      def gen():
        with open(samples_path, encoding="utf-8") as f:
          for i, line in enumerate(f):
            if (i in val) == (split == "validation"):
              sample = json.loads(line)
              for name in (TEACHER_FIELDS if teacher else ()):
                sample[name] = np.load(os.path.join(tmp, f"{i}.{name}.npy"))
              yield sample
      return gen

    splits = {"train": read("train")}
    if val:
      splits["validation"] = read("validation")
    base_meta, shapes = teacher_metadata(model, teacher)
    meta = {"strategy": strategy, "max_len": max_len, "val_fraction": val_fraction, "seed": seed,
            "end_of_turn_id": eot, **base_meta, **dict(metadata or {})}
    build_dataset(out, splits, max_group=max_group, metadata=meta, overwrite=overwrite,
                  teacher=shapes)
  stats.seconds = time.perf_counter() - start
  return stats


TEACHER_FIELDS = ("teacher_topk_ids", "teacher_topk_logp", "teacher_features")


def base_fingerprint(model: nnx.Module) -> str:
  """Identifies the base whose forward made a dataset's groups and teacher signals: its
  architecture and a hash of some of its weights (the same architecture with other weights
  would segment and teach differently)."""
  h = hashlib.sha256(json.dumps(dataclasses.asdict(model.cfg), sort_keys=True).encode())
  h.update(np.asarray(model.embed_tokens[...][:64], np.float32).tobytes())
  h.update(np.asarray(model.decoder.layers[-1].mlp.down_proj.kernel[...][:64],
                      np.float32).tobytes())
  return h.hexdigest()[:16]


def prompt_key(prompt_ids) -> bytes:
  """Identifies a sample's prompt by its tokens: the same prompt tokenised the same way has the
  same key in any dataset, whatever the response."""
  return hashlib.sha256(np.asarray(prompt_ids, np.int32).tobytes()).digest()


def split_of_samples(dataset_dir: str) -> dict[bytes, str]:
  """{prompt_key: split} of every sample in a prepared dataset (a prompt found in both splits,
  possible in data split by sample before, counts as validation: it stays held out)."""
  try:
    source = tfds.builder_from_directory(dataset_dir).as_data_source()
  except Exception as e:  # tfds raises several types for "not a dataset"
    raise ValueError(f"{dataset_dir!r} is not a prepared dataset ({e}); pass the "
                     f"directory train.prepare_data wrote") from None
  out: dict[bytes, str] = {}
  for split in source:
    for rec in source[split]:
      key = prompt_key(rec["input_ids"][:int(rec["prompt_len"])])
      if out.get(key) != "validation":
        out[key] = split
  return out


def validation_indices(n: int, fraction: float, seed: int) -> set[int]:
  """A seeded random `fraction` of 0..n-1 (at least one when fraction > 0 and n >= 2)."""
  if fraction <= 0 or n < 2:
    return set()
  k = min(n - 1, max(1, round(n * fraction)))
  return set(np.random.default_rng(seed).permutation(n)[:k].tolist())
