"""Conversations -> token ids -> entropy groups -> the tfds training set (docs/SPEC.md 2.1).

The library half of `train.prepare_data`: tokenise with the chat template (the response keeps its
end-of-turn token), drop samples over the max length, split by prompt, run the base
teacher-forced over the samples (hamburger_jax/data/teacher_pass.py: jitted, rows split over
this process's devices), segment, and write the dataset in shards that one or many processes
compute and a join links into one dataset, atomically (hamburger_jax/data/shards.py).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
from flax import nnx
import tensorflow_datasets as tfds

from hamburger_jax import pretrained, segmentation
from hamburger_jax.config import ConfigError
from hamburger_jax.data import shards as shardlib
from hamburger_jax.data.sources import Conversation, SourceError
from hamburger_jax.data.teacher_pass import (DEFAULT_BATCH_TOKENS, DEFAULT_MAX_LEN, Forward,
                                             PrepareStats, TokenizedSample, add_markers,
                                             row_length, rows_per_device, teacher_metadata,
                                             tokenizer_fingerprint, write_shard)
from hamburger_jax.data.tfds_builder import check_output_dir, join_datasets
from hamburger_jax.tokenizer import load_default_tokenizer

# End-of-turn spellings, most specific first; the one the chat template writes is the model's.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>")


# ----------------------------------------------------------------------------- model, tokenizer


class IdsTokenizer:
  """What preparation asks of a tokenizer, for a base without one whose records all carry
  their token ids (nothing is tokenised): the vocabulary size, and an end-of-turn id that only
  text answers would read."""
  chat_template = None
  eos_id = 0

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size


def load_base(model_cfg, token_ids: bool = False):
  """(model, tokenizer) for a run config's `model:` section (RunConfig.model). A random base
  (tests) is paired with the default tokenizer, whose vocabulary it must hold, or with
  `token_ids` an IdsTokenizer: its records carry token ids (a self-distilled base without a
  tokenizer)."""
  model, tokenizer = pretrained.load_base_for_run(model_cfg)
  if tokenizer is None and token_ids:
    return model, IdsTokenizer(model.cfg.vocab_size)
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


# ----------------------------------------------------------------------------- the dataset


def read_samples(conversations: Iterable[Conversation], tokenizer, *, vocab: int,
                 strategy: segmentation.Strategy, max_group: int, max_len: int,
                 stats: PrepareStats,
                 progress: Callable[[int], None] | None = None) -> list[TokenizedSample]:
  """Tokenises every conversation and keeps those of at most `max_len` tokens, in order; checks
  ids and recorded groups on the way, so bad data fails before any forward pass."""
  eot = end_of_turn_id(tokenizer)
  kept = []
  for conv in conversations:
    stats.conversations += 1
    check_ids_in_vocab(conv, vocab)  # ids given by the source, before any conversion
    sample = tokenize(conv, tokenizer, eot)
    check_ids_in_vocab(sample, vocab)
    if strategy.reads == "given":
      check_given_groups(sample, strategy, max_group)
    if len(sample) > max_len:
      stats.dropped_too_long += 1
      if progress is not None:
        progress(1)
      continue
    kept.append(sample)
  return kept


def _inputs_hash(samples: Sequence[TokenizedSample], val: set[int]) -> str:
  h = hashlib.sha256()
  for i, s in enumerate(samples):
    for ids in (s.prompt_ids, s.response_ids, s.groups):
      if ids is None:
        h.update(b"-")
        continue
      ids = np.asarray(ids, np.int32)
      h.update(np.int64(len(ids)).tobytes() + ids.tobytes())
    h.update(json.dumps([s.source, s.id, i in val]).encode())
  return h.hexdigest()


def _keep_split_hash(keep_split: Mapping[bytes, str] | None) -> str | None:
  if not keep_split:
    return None
  h = hashlib.sha256()
  for key in sorted(keep_split):
    h.update(key + keep_split[key].encode())
  return h.hexdigest()


def prepare_dataset(conversations: Iterable[Conversation], model: nnx.Module, tokenizer,
                    out_dir: str, *, strategy: str = "decreasing_v2", max_group: int = 4,
                    max_len: int = DEFAULT_MAX_LEN, val_fraction: float = 0.05, seed: int = 0,
                    overwrite: bool = False, chunk_size: int = 256,
                    batch_tokens: int = DEFAULT_BATCH_TOKENS,
                    metadata: Mapping[str, Any] | None = None,
                    teacher: segmentation.TeacherSpec | None = None,
                    keep_split: Mapping[bytes, str] | None = None,
                    progress: Callable[[int], None] | None = None,
                    process_id: int = 0, num_processes: int = 1, mesh=None) -> PrepareStats:
  """Tokenises, segments and writes `conversations` to `out_dir` (train + validation splits).

  The samples are cut into shards of `chunk_size` consecutive samples, written under
  `shards.shards_dir_of(out_dir)` and joined into `out_dir` at the end
  (hamburger_jax/data/shards.py). Resumable: a rerun skips the shards a killed run finished.
  `num_processes` > 1: this process (`process_id`) computes its own shards only, and the process
  that finds them all done joins them (`stats.joined`; `join_shards` joins later). Each forward
  pass holds `batch_tokens` tokens per device of `mesh` (default: all of this process's devices,
  on a data axis). `teacher` stores the distillation recipe's teacher signals with every sample
  (see `segment`). `keep_split` (`split_of_samples` of a dataset this one grows, e.g. a
  self-distillation file rebuilt with more answers, or on-policy answers to the same prompts):
  a sample whose prompt is found there keeps that prompt's split, so a model trained on the old
  training split meets none of its prompts in the new validation split; only new prompts are
  split at `val_fraction`. Splits go by prompt: all answers to one prompt share a split.
  `progress(n)` is called as conversations are segmented (or found done) or dropped.
  """
  start = time.perf_counter()
  strategy_fn = segmentation.get_strategy(strategy)
  _check_settings(val_fraction=val_fraction, max_len=max_len, chunk_size=chunk_size,
                  process_id=process_id, num_processes=num_processes)
  out = os.path.abspath(out_dir)
  check_output_dir(out, overwrite)  # before hours of work, not after
  stats = PrepareStats(process_id=process_id, num_processes=num_processes)
  samples = read_samples(conversations, tokenizer, vocab=int(model.cfg.vocab_size),
                         strategy=strategy_fn, max_group=max_group, max_len=max_len, stats=stats,
                         progress=progress)
  if not samples:
    raise ValueError(f"no samples to write: {stats.conversations} conversations read, "
                     f"{stats.dropped_too_long} longer than max_len={max_len}")
  val = _validation_samples(samples, keep_split, val_fraction, seed, stats)
  # One row length for every forward pass: a single compilation for the whole dataset.
  row_len = row_length(max_len)
  plan = _plan(samples, val, stats, model=model, tokenizer=tokenizer, strategy=strategy,
               max_group=max_group, max_len=max_len, row_len=row_len, val_fraction=val_fraction,
               seed=seed, chunk_size=chunk_size, batch_tokens=batch_tokens, metadata=metadata,
               teacher=teacher, keep_split=keep_split)
  plan_id = shardlib.plan_id(plan)
  shards = shardlib.shards_dir_of(out)
  os.makedirs(shards, exist_ok=True)
  stats.num_shards = plan["num_shards"]
  with shardlib.process_lock(shards, process_id):
    shardlib.open_plan(shards, plan, may_discard=num_processes == 1)
    _compute_own_shards(
        shards, plan, plan_id, samples, val, stats,
        build_forward=lambda: Forward.build(model, rows_per_device(batch_tokens, row_len), mesh),
        strategy=strategy_fn, teacher=teacher, progress=progress)
  stats = _join_if_complete(out, overwrite, shards, plan_id, stats)
  stats.seconds = time.perf_counter() - start
  return stats


def _check_settings(*, val_fraction: float, max_len: int, chunk_size: int, process_id: int,
                    num_processes: int) -> None:
  if not 0.0 <= val_fraction < 1.0:
    raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
  if max_len < 2:
    raise ValueError(f"max_len={max_len} must be at least 2 (a prompt and a response token)")
  if chunk_size < 1:
    raise ValueError(f"chunk_size={chunk_size} (samples per shard) must be positive")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")


def _validation_samples(samples: Sequence[TokenizedSample],
                        keep_split: Mapping[bytes, str] | None, val_fraction: float, seed: int,
                        stats: PrepareStats) -> set[int]:
  """Indices of the samples in the validation split, chosen by prompt: a prompt in `keep_split`
  keeps its split there, a new one is drawn at `val_fraction`. Counts the kept ones in `stats`."""
  known = keep_split or {}
  keys = [prompt_key(s.prompt_ids) for s in samples]  # the split goes by prompt
  new = list(dict.fromkeys(k for k in keys if k not in known))  # new prompts, in order
  val_keys = {new[j] for j in validation_indices(len(new), val_fraction, seed)}
  stats.kept_split = sum(k in known for k in keys)
  return {i for i, k in enumerate(keys) if k in val_keys or known.get(k) == "validation"}


def _plan(samples: Sequence[TokenizedSample], val: set[int], stats: PrepareStats, *,
          model: nnx.Module, tokenizer, strategy: str, max_group: int, max_len: int,
          row_len: int, val_fraction: float, seed: int, chunk_size: int, batch_tokens: int,
          metadata: Mapping[str, Any] | None, teacher: segmentation.TeacherSpec | None,
          keep_split: Mapping[bytes, str] | None) -> dict[str, Any]:
  """What every process writing the shards must agree on (shards.open_plan), as it reads back
  from plan.json: the inputs, the settings, and the dataset's metadata."""
  base_meta, shapes = teacher_metadata(model, teacher)
  eot = end_of_turn_id(tokenizer)
  meta = {"strategy": strategy, "max_len": max_len, "val_fraction": val_fraction, "seed": seed,
          "end_of_turn_id": eot, **base_meta, **dict(metadata or {})}
  if hasattr(tokenizer, "encode"):  # an IdsTokenizer (records carrying their ids) has none
    meta["tokenizer_fingerprint"] = tokenizer_fingerprint(tokenizer)
  return shardlib.canonical({
      "format": shardlib.PLAN_FORMAT, "num_processes": stats.num_processes,
      "shard_size": chunk_size, "num_shards": -(-len(samples) // chunk_size),
      "samples": len(samples), "validation_samples": len(val),
      "conversations": stats.conversations, "dropped_too_long": stats.dropped_too_long,
      "kept_split": stats.kept_split, "inputs": _inputs_hash(samples, val),
      "settings": {"strategy": strategy, "max_len": max_len, "row_len": row_len,
                   "batch_tokens": batch_tokens, "val_fraction": val_fraction, "seed": seed,
                   "keep_split": _keep_split_hash(keep_split),
                   "teacher": dataclasses.asdict(teacher) if teacher else None},
      "max_group": max_group, "metadata": meta, "teacher_shapes": shapes})


def _compute_own_shards(shards: str, plan: Mapping[str, Any], plan_id: str,
                        samples: Sequence[TokenizedSample], val: set[int], stats: PrepareStats, *,
                        build_forward: Callable[[], Forward], strategy: segmentation.Strategy,
                        teacher: segmentation.TeacherSpec | None,
                        progress: Callable[[int], None] | None) -> None:
  """Computes the shards of this process (stats.process_id), skipping those already done."""
  chunk_size, process = plan["shard_size"], (stats.process_id, stats.num_processes)
  forward = None
  for k in range(stats.process_id, plan["num_shards"], stats.num_processes):
    first = k * chunk_size
    chunk = samples[first:first + chunk_size]
    if shardlib.shard_marker(shards, k, plan_id) is not None:
      stats.shards_skipped.append(k)
      if progress is not None:
        progress(len(chunk))
      continue
    if forward is None:  # a run with every shard done loads nothing onto the devices
      forward = build_forward()
      stats.devices = forward.devices
    write_shard(shards, k, plan, plan_id, chunk, first, val, forward, strategy, teacher, process,
                progress)
    stats.shards_computed.append(k)


def _join_if_complete(out: str, overwrite: bool, shards: str, plan_id: str,
                      stats: PrepareStats) -> PrepareStats:
  """The joined dataset's stats once every shard is done (this process's own counts kept), else
  `stats` naming the missing shards."""
  missing = [k for k in range(stats.num_shards)
             if shardlib.shard_marker(shards, k, plan_id) is None]
  if missing:
    stats.shards_missing = missing
    add_markers(stats, filter(None, (shardlib.shard_marker(shards, k, plan_id)
                                      for k in stats.shards_computed)))
    return stats
  joined = _join_once(out, overwrite)
  if joined is None:
    return stats
  joined.process_id, joined.num_processes = stats.process_id, stats.num_processes
  joined.shards_computed, joined.shards_skipped = stats.shards_computed, stats.shards_skipped
  return joined


def _join_once(out: str, overwrite: bool) -> PrepareStats | None:
  """join_shards, by whichever process gets there first; None if another one joined them."""
  shards = shardlib.shards_dir_of(out)
  try:
    fd = os.open(os.path.join(shards, shardlib.JOIN_LOCK), os.O_CREAT | os.O_RDWR, 0o600)
  except FileNotFoundError:
    return None  # joined, and the shards removed, by another process
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    if not os.path.exists(os.path.join(shards, shardlib.PLAN_FILE)):
      return None
    return join_shards(out, overwrite=overwrite)
  finally:
    os.close(fd)


def join_shards(out_dir: str, *, overwrite: bool = False) -> PrepareStats:
  """Joins the shards of `out_dir` (all of them done) into the dataset `out_dir`, records in the
  order one process would have written them, and removes the shards. Names the missing shards,
  and the processes that own them, when some are not done."""
  start = time.perf_counter()
  out = os.path.abspath(out_dir)
  shards = shardlib.shards_dir_of(out)
  plan = shardlib.read_json(os.path.join(shards, shardlib.PLAN_FILE))
  if plan is None:
    if os.path.exists(out) and not os.path.exists(shards):
      raise shardlib.ShardsError(f"{out} is already joined (no {shards}): nothing to do")
    raise shardlib.ShardsError(f"{shards} holds no plan.json: nothing to join; write the shards "
                               f"with python -m train.prepare_data ... --out {out_dir}")
  if plan.get("format") != shardlib.PLAN_FORMAT:
    raise shardlib.ShardsError(
        f"{shards} was written by another version of train.prepare_data (format "
        f"{plan.get('format')}, this one reads {shardlib.PLAN_FORMAT}): remove it and rerun")
  check_output_dir(out, overwrite)
  plan_id, n, procs = shardlib.plan_id(plan), plan["num_shards"], plan["num_processes"]
  markers = [shardlib.shard_marker(shards, k, plan_id) for k in range(n)]
  missing = [k for k, m in enumerate(markers) if m is None]
  if missing:
    owners = sorted({shardlib.shard_owner(k, procs) for k in missing})
    raise shardlib.ShardsError(
        f"{len(missing)} of the {n} shards of {out} are not done: {shardlib.ranges(missing)} "
        f"(process"
        f"{'es' if len(owners) > 1 else ''} {', '.join(map(str, owners))} of {procs}); rerun "
        f"{'them' if len(owners) > 1 else 'it'} with the same flags (finished shards are "
        "skipped), then join")
  stats = PrepareStats(conversations=plan["conversations"],
                       dropped_too_long=plan["dropped_too_long"], kept_split=plan["kept_split"],
                       num_shards=n, num_processes=procs, joined=True)
  add_markers(stats, markers)
  join_datasets(out, [os.path.join(shards, shardlib.shard_name(k)) for k in range(n)],
                max_group=plan["max_group"], metadata=plan["metadata"], overwrite=overwrite,
                teacher=plan["teacher_shapes"])
  shutil.rmtree(shards, ignore_errors=True)
  stats.seconds = time.perf_counter() - start
  return stats


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
