"""Conversations -> token ids -> entropy groups -> the tfds training set (docs/SPEC.md 2.1).

The library half of `train.prepare_data`: tokenise with the chat template (the response keeps its
end-of-turn token), drop samples over the max length, split by prompt, run the base
teacher-forced over the samples (jitted, rows split over this process's devices), segment, and
write the dataset in shards that one or many processes compute and a join links into one
dataset, atomically (see the notes above `SHARDS_SUFFIX`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
import tensorflow_datasets as tfds

from hamburger_jax import pretrained, segmentation, sharding
from hamburger_jax.config import ConfigError
from hamburger_jax.data.sources import Conversation, SourceError
from hamburger_jax.data.tfds_builder import build_dataset, check_output_dir, join_datasets
from hamburger_jax.files import write_json_atomic
from hamburger_jax.tokenizer import load_default_tokenizer

# End-of-turn spellings, most specific first; the one the chat template writes is the model's.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>")
_ROW_BUCKET = 64
# train.prepare_data's defaults: samples longer than this are dropped; a forward pass holds this
# many tokens per device.
DEFAULT_MAX_LEN = 384
DEFAULT_BATCH_TOKENS = 2048


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
  segment_seconds: float = 0.0  # forward passes + strategy, summed over the shards
  # The same in CPU time of the processes (every thread): comparable on shared cores.
  segment_cpu_seconds: float = 0.0
  # Shards (all of the dataset's once joined, else this process's own).
  num_shards: int = 0
  shards_computed: list[int] = dataclasses.field(default_factory=list)  # by this call
  shards_skipped: list[int] = dataclasses.field(default_factory=list)  # done by an earlier run
  shards_missing: list[int] = dataclasses.field(default_factory=list)  # other processes' to do
  process_id: int = 0
  num_processes: int = 1
  devices: int = 0  # this process's, when it ran a forward pass
  joined: bool = False  # the dataset is written (else only this process's shards are)
  pass_seconds: float = 0.0  # wall time from the first shard's start to the last one's end

  @property
  def mean_group_size(self) -> float:
    return self.response_tokens / max(self.groups, 1)

  @property
  def segment_tokens_per_s(self) -> float:
    return self.tokens / max(self.segment_seconds, 1e-9)

  @property
  def pass_tokens_per_s(self) -> float:
    return self.tokens / max(self.pass_seconds, 1e-9)

  def summary(self) -> str:
    hist = "  ".join(f"{k}: {self.group_hist[k]} ({self.group_hist[k] / max(self.groups, 1):.1%})"
                     for k in sorted(self.group_hist))
    if not self.joined:
      done = self.num_shards - len(self.shards_missing)
      return "\n".join([
          f"process              {self.process_id} of {self.num_processes}: shards "
          f"{_ranges(self.shards_computed) or 'none'} written now, "
          f"{_ranges(self.shards_skipped) or 'none'} done before",
          f"shards done          {done} of {self.num_shards}; waiting for "
          f"{_ranges(self.shards_missing)} (the last process to finish joins them)",
          f"tokens written now   {self.tokens} ({self.response_tokens} response), "
          f"{self.samples} samples",
          f"time                 {self.seconds:.1f} s (segmentation {self.segment_seconds:.1f} s, "
          f"{self.segment_tokens_per_s:.0f} tokens/s)",
      ])
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
        f"teacher pass         {self.num_shards} shards by {self.num_processes} process"
        f"{'es' if self.num_processes > 1 else ''} x {self.devices} device"
        f"{'s' if self.devices > 1 else ''}: {self.pass_seconds:.1f} s from the first shard's "
        f"start to the last one's end, {self.pass_tokens_per_s:.0f} tokens/s; "
        f"{self.segment_cpu_seconds:.1f} CPU s, "
        f"{self.tokens / max(self.segment_cpu_seconds, 1e-9):.0f} tokens per CPU s",
        f"this process         {self.process_id}: wrote shards "
        f"{_ranges(self.shards_computed) or 'none'}, found {_ranges(self.shards_skipped) or 'none'}"
        " done before",
    ])


# ----------------------------------------------------------------------------- model, tokenizer


def load_base(model_cfg):
  """(model, tokenizer) for a run config's `model:` section (RunConfig.model); a random base
  (tests) is paired with the default tokenizer, whose vocabulary it must hold."""
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
            max_group: int, *, batch_tokens: int = DEFAULT_BATCH_TOKENS,
            row_len: int | None = None,
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
  return [_segment_one(s, st, strategy, max_group, teacher) for s, st in zip(samples, stats)]


def _segment_one(sample: TokenizedSample, stats: segmentation.TokenStats,
                 strategy: segmentation.Strategy, max_group: int,
                 teacher: segmentation.TeacherSpec | None
                 ) -> tuple[np.ndarray, dict[str, np.ndarray] | None]:
  rule = strategy.fallback if strategy.reads == "given" and sample.groups is None else strategy
  groups = (sample.groups if rule.reads == "given" else
            np.asarray(rule(getattr(stats, rule.reads), max_group), np.int32))
  return groups, (teacher_signals(stats, groups) if teacher is not None else None)


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


# ----------------------------------------------------------------------------- shards
#
# The kept samples, in source order, are cut into shards of `shard_size` consecutive samples.
# Process I of N computes the shards k with k % N == I (strided: sources are often read one after
# another, long ShareGPT answers then short arithmetic, so contiguous ranges would load one
# process far more than another). Every process reads and tokenises all the sources (cheap next
# to the forward passes) and so knows the whole plan (shards, validation split) without talking
# to the others. A shard is a small tfds dataset `OUT.shards/shard-KKKKK/` plus its done marker
# `shard-KKKKK.json`, written (atomically) only after the dataset is complete; the join links the
# shards' files into OUT. A shard packs its samples into rows on its own, exactly as one process
# did with its chunks of the same size, and every device runs the same per-device batch
# (`batch_tokens` per device), so the records do not depend on how many processes or devices
# made them.

SHARDS_SUFFIX = ".shards"
PLAN_FILE = "plan.json"
_PLAN_FORMAT = 1
_JOIN_LOCK = ".join.lock"


class ShardsError(ValueError):
  """A shards directory that does not fit this run, or is not complete (named, with the fix)."""


def shards_dir_of(out_dir: str) -> str:
  """Where the shards of the dataset `out_dir` are written until they are joined."""
  return os.path.abspath(out_dir) + SHARDS_SUFFIX


def shard_owner(shard: int, num_processes: int) -> int:
  return shard % num_processes


def _shard_name(k: int) -> str:
  return f"shard-{k:05d}"


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


def _canonical(obj: Any) -> Any:
  """`obj` as it reads back from JSON (tuples become lists, keys strings)."""
  return json.loads(json.dumps(obj, sort_keys=True))


def _plan_id(plan: Mapping[str, Any]) -> str:
  return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


def _read_json(path: str) -> Any:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (FileNotFoundError, json.JSONDecodeError):
    return None


def _plan_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
  out = []
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key), new.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      out += [f"{key}.{d}" for d in _plan_differences(a, b)]
    elif a != b:
      out.append("inputs (the kept samples or their split)" if key == "inputs" else
                 f"{key} ({a!r} there, {b!r} here)")
  return out


@contextlib.contextmanager
def _process_lock(shards: str, process_id: int) -> Iterator[None]:
  """Held while process `process_id` works in `shards`: a second copy of it is refused, and a
  run that finds no live holder may discard shards of another plan."""
  fd = os.open(os.path.join(shards, f"process-{process_id:05d}.lock"), os.O_CREAT | os.O_RDWR,
               0o600)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise ShardsError(f"process {process_id} is already running on {shards} (another "
                        "train.prepare_data with the same --out and --process-id)") from None
    yield
  finally:
    os.close(fd)


def _open_plan(shards: str, plan: dict[str, Any], may_discard: bool) -> None:
  """Writes `plan` to `shards`, or checks it against the one there. A different plan is an error
  (a different process count always); a single process (`may_discard`) replaces the other
  plan's shards instead, as a killed run's work is redone."""
  path = os.path.join(shards, PLAN_FILE)
  old = _read_json(path)
  if old is None:
    tmp = f"{path}.tmp-{os.getpid()}"
    write_json_atomic(tmp, plan, sort_keys=True)
    try:
      os.link(tmp, path)  # fails if another process wrote its plan first
    except FileExistsError:
      old = _read_json(path)
    except OSError:  # a filesystem without hard links: the last writer's plan stands
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
    if old is None:
      return
  if old == plan:
    return
  if old.get("num_processes") != plan["num_processes"]:
    raise ShardsError(
        f"{shards} holds the shards of a run of {old.get('num_processes')} processes but this "
        f"run has --num-processes {plan['num_processes']}: the process counts must match (each "
        f"process resumes its own shards). Rerun with --num-processes "
        f"{old.get('num_processes')}, or remove {shards} to start over")
  diff = "; ".join(_plan_differences(old, plan))
  if not may_discard:
    raise ShardsError(f"{shards} holds the shards of a run with other inputs or settings ({diff})"
                      f": rerun with the same sources and flags, or remove {shards} to start over")
  print(f"note: discarding the shards in {shards}, made with other inputs or settings ({diff})",
        file=sys.stderr)
  for entry in os.listdir(shards):
    if entry.startswith(("shard-", ".shard-")) or entry == PLAN_FILE:
      if os.path.isdir(os.path.join(shards, entry)):
        shutil.rmtree(os.path.join(shards, entry))
      else:
        os.remove(os.path.join(shards, entry))
  _open_plan(shards, plan, may_discard=False)


def _shard_marker(shards: str, k: int, plan_id: str) -> dict[str, Any] | None:
  """Shard k's done marker if the shard is complete for this plan, else None."""
  marker = _read_json(os.path.join(shards, _shard_name(k) + ".json"))
  if (not isinstance(marker, dict) or marker.get("plan") != plan_id
      or not os.path.isdir(os.path.join(shards, _shard_name(k)))):
    return None
  return marker


def row_length(max_len: int) -> int:
  """The teacher pass's row: max_len rounded up to whole buckets (one program for the whole
  dataset)."""
  return -(-max_len // _ROW_BUCKET) * _ROW_BUCKET


def rows_per_device(batch_tokens: int, row_len: int) -> int:
  return max(1, batch_tokens // row_len)


def lower_teacher_pass(model: nnx.Module, mesh, *, max_len: int = DEFAULT_MAX_LEN,
                       batch_tokens: int = DEFAULT_BATCH_TOKENS,
                       teacher: segmentation.TeacherSpec | None = None):
  """One forward pass of the teacher pass, lowered for `mesh` (a data axis over one process's
  devices, the base replicated) as `prepare_dataset` runs it; `model` may be abstract
  (nnx.eval_shape). `.compile()` it to see its cost on the mesh's devices."""
  graphdef, state = nnx.split(model)
  rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(sharding.BATCH_AXES))
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state)
  row_len = row_length(max_len)
  n = rows_per_device(batch_tokens, row_len) * sharding.batch_divisor(mesh)
  ids = jax.ShapeDtypeStruct((n, row_len), jnp.int32, sharding=rows)
  return segmentation.token_stats_program.lower(graphdef, state, ids, ids, teacher)


@dataclasses.dataclass
class _Forward:
  """The base split for jit, its weights replicated over a data-parallel mesh of this process's
  devices; a pass of `rows_per_device` rows per device."""
  graphdef: Any
  state: Any
  rows_sharding: Any
  rows_per_device: int
  devices: int

  @classmethod
  def build(cls, model: nnx.Module, rows_per_device: int, mesh=None) -> "_Forward":
    mesh = mesh if mesh is not None else sharding.make_mesh(data=-1,
                                                            devices=jax.local_devices())
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, NamedSharding(mesh, P()))
    return cls(graphdef, state, NamedSharding(mesh, P(sharding.BATCH_AXES)), rows_per_device,
               sharding.batch_divisor(mesh))

  @property
  def rows_per_pass(self) -> int:
    return self.rows_per_device * self.devices

  def run(self, ids: np.ndarray, seg: np.ndarray,
          teacher: segmentation.TeacherSpec | None) -> tuple[jax.Array, ...]:
    """segmentation's jitted forward (the one every statistic of this project comes from) on
    rows that arrive split over the mesh: each device runs its rows_per_device rows."""
    return segmentation.token_stats_program(
        self.graphdef, self.state, jax.device_put(ids, self.rows_sharding),
        jax.device_put(seg, self.rows_sharding), teacher)

  def __call__(self, ids: np.ndarray, seg: np.ndarray,
               teacher: segmentation.TeacherSpec | None) -> list[np.ndarray]:
    return [np.asarray(a) for a in self.run(ids, seg, teacher)]


def _teacher_pass(forward: _Forward, samples: Sequence[TokenizedSample], row_len: int,
                  teacher: segmentation.TeacherSpec | None,
                  progress: Callable[[int], None] | None
                  ) -> Iterator[tuple[int, segmentation.TokenStats]]:
  """(index in `samples`, its TokenStats) of every sample, a forward pass at a time."""
  return segmentation.packed_token_stats(
      forward, [(s.prompt_ids, s.response_ids) for s in samples], row_len,
      forward.rows_per_pass, teacher, progress)


def _write_shard(shards: str, k: int, plan: Mapping[str, Any], plan_id: str,
                 samples: Sequence[TokenizedSample], first: int, val: set[int],
                 forward: _Forward, strategy: segmentation.Strategy,
                 teacher: segmentation.TeacherSpec | None, process: tuple[int, int],
                 progress: Callable[[int], None] | None) -> dict[str, Any]:
  """Computes shard k (samples[first:]) and writes its dataset, then its done marker."""
  started = time.time()
  t0, cpu0 = time.perf_counter(), time.process_time()
  max_group = plan["max_group"]
  records: list[dict[str, Any] | None] = [None] * len(samples)
  hist: collections.Counter = collections.Counter()
  for j, st in _teacher_pass(forward, samples, plan["settings"]["row_len"], teacher, progress):
    s = samples[j]
    groups, signals = _segment_one(s, st, strategy, max_group, teacher)
    records[j] = {"input_ids": np.concatenate([s.prompt_ids, s.response_ids]),
                  "prompt_len": len(s.prompt_ids), "groups": np.asarray(groups, np.int32),
                  "source": s.source, **(signals or {})}
    hist.update(np.asarray(groups).tolist())
  seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
  split = {"train": [], "validation": []}
  for j, rec in enumerate(records):
    split["validation" if first + j in val else "train"].append(rec)
  build_dataset(os.path.join(shards, _shard_name(k)),
                {name: (lambda recs=recs: iter(recs)) for name, recs in split.items() if recs},
                max_group=max_group, metadata=plan["metadata"], overwrite=True,
                teacher=plan["teacher_shapes"])
  marker = {
      "plan": plan_id, "shard": k, "samples": len(samples), "train": len(split["train"]),
      "validation": len(split["validation"]), "tokens": sum(len(s) for s in samples),
      "response_tokens": sum(len(s.response_ids) for s in samples),
      "groups": sum(hist.values()), "group_hist": {str(g): n for g, n in sorted(hist.items())},
      "seconds": seconds, "cpu_seconds": cpu_seconds, "started": started,
      "finished": time.time(),
      "process_id": process[0], "num_processes": process[1], "devices": forward.devices}
  write_json_atomic(os.path.join(shards, _shard_name(k) + ".json"), marker, sort_keys=True)
  return marker


def _add_markers(stats: PrepareStats, markers: Iterable[Mapping[str, Any]]) -> None:
  first, last = math.inf, -math.inf
  for m in markers:
    stats.samples += m["samples"]
    stats.train_samples += m["train"]
    stats.validation_samples += m["validation"]
    stats.tokens += m["tokens"]
    stats.response_tokens += m["response_tokens"]
    stats.groups += m["groups"]
    stats.group_hist.update({int(g): n for g, n in m["group_hist"].items()})
    stats.segment_seconds += m["seconds"]
    stats.segment_cpu_seconds += m["cpu_seconds"]
    first, last = min(first, m["started"]), max(last, m["finished"])
    stats.devices = max(stats.devices, m["devices"])
  stats.pass_seconds = max(last - first, 0.0)


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
  `shards_dir_of(out_dir)` and joined into `out_dir` at the end (see the notes above
  `SHARDS_SUFFIX`). Resumable: a rerun skips the shards a killed run finished.
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
  if not 0.0 <= val_fraction < 1.0:
    raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
  if max_len < 2:
    raise ValueError(f"max_len={max_len} must be at least 2 (a prompt and a response token)")
  if chunk_size < 1:
    raise ValueError(f"chunk_size={chunk_size} (samples per shard) must be positive")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
  out = os.path.abspath(out_dir)
  check_output_dir(out, overwrite)  # before hours of work, not after
  stats = PrepareStats(process_id=process_id, num_processes=num_processes)
  samples = read_samples(conversations, tokenizer, vocab=int(model.cfg.vocab_size),
                         strategy=strategy_fn, max_group=max_group, max_len=max_len, stats=stats,
                         progress=progress)
  if not samples:
    raise ValueError(f"no samples to write: {stats.conversations} conversations read, "
                     f"{stats.dropped_too_long} longer than max_len={max_len}")
  known = keep_split or {}
  keys = [prompt_key(s.prompt_ids) for s in samples]  # the split goes by prompt
  new = list(dict.fromkeys(k for k in keys if k not in known))  # new prompts, in order
  val_keys = {new[j] for j in validation_indices(len(new), val_fraction, seed)}
  val = {i for i, k in enumerate(keys) if k in val_keys or known.get(k) == "validation"}
  stats.kept_split = sum(k in known for k in keys)

  # One row length for every forward pass: a single compilation for the whole dataset.
  row_len = row_length(max_len)
  base_meta, shapes = teacher_metadata(model, teacher)
  eot = end_of_turn_id(tokenizer)
  meta = {"strategy": strategy, "max_len": max_len, "val_fraction": val_fraction, "seed": seed,
          "end_of_turn_id": eot, **base_meta, **dict(metadata or {})}
  num_shards = -(-len(samples) // chunk_size)
  plan = _canonical({
      "format": _PLAN_FORMAT, "num_processes": num_processes, "shard_size": chunk_size,
      "num_shards": num_shards, "samples": len(samples), "validation_samples": len(val),
      "conversations": stats.conversations, "dropped_too_long": stats.dropped_too_long,
      "kept_split": stats.kept_split, "inputs": _inputs_hash(samples, val),
      "settings": {"strategy": strategy, "max_len": max_len, "row_len": row_len,
                   "batch_tokens": batch_tokens, "val_fraction": val_fraction, "seed": seed,
                   "keep_split": _keep_split_hash(keep_split),
                   "teacher": dataclasses.asdict(teacher) if teacher else None},
      "max_group": max_group, "metadata": meta, "teacher_shapes": shapes})
  plan_id = _plan_id(plan)
  shards = shards_dir_of(out)
  os.makedirs(shards, exist_ok=True)
  stats.num_shards = num_shards
  with _process_lock(shards, process_id):
    _open_plan(shards, plan, may_discard=num_processes == 1)
    forward = None
    for k in range(process_id, num_shards, num_processes):
      first = k * chunk_size
      chunk = samples[first:first + chunk_size]
      if _shard_marker(shards, k, plan_id) is not None:
        stats.shards_skipped.append(k)
        if progress is not None:
          progress(len(chunk))
        continue
      if forward is None:  # a run with every shard done loads nothing onto the devices
        forward = _Forward.build(model, rows_per_device(batch_tokens, row_len), mesh)
        stats.devices = forward.devices
      _write_shard(shards, k, plan, plan_id, chunk, first, val, forward, strategy_fn, teacher,
                   (process_id, num_processes), progress)
      stats.shards_computed.append(k)
  missing = [k for k in range(num_shards) if _shard_marker(shards, k, plan_id) is None]
  if missing:
    stats.shards_missing = missing
    _add_markers(stats, filter(None, (_shard_marker(shards, k, plan_id)
                                      for k in stats.shards_computed)))
  else:
    joined = _join_once(out, overwrite)
    if joined is not None:
      joined.process_id, joined.num_processes = process_id, num_processes
      joined.shards_computed, joined.shards_skipped = stats.shards_computed, stats.shards_skipped
      stats = joined
  stats.seconds = time.perf_counter() - start
  return stats


def _join_once(out: str, overwrite: bool) -> PrepareStats | None:
  """join_shards, by whichever process gets there first; None if another one joined them."""
  shards = shards_dir_of(out)
  try:
    fd = os.open(os.path.join(shards, _JOIN_LOCK), os.O_CREAT | os.O_RDWR, 0o600)
  except FileNotFoundError:
    return None  # joined, and the shards removed, by another process
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    if not os.path.exists(os.path.join(shards, PLAN_FILE)):
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
  shards = shards_dir_of(out)
  plan = _read_json(os.path.join(shards, PLAN_FILE))
  if plan is None:
    if os.path.exists(out) and not os.path.exists(shards):
      raise ShardsError(f"{out} is already joined (no {shards}): nothing to do")
    raise ShardsError(f"{shards} holds no plan.json: nothing to join; write the shards with "
                      f"python -m train.prepare_data ... --out {out_dir}")
  if plan.get("format") != _PLAN_FORMAT:
    raise ShardsError(f"{shards} was written by another version of train.prepare_data "
                      f"(format {plan.get('format')}, this one reads {_PLAN_FORMAT}): remove it "
                      "and rerun")
  check_output_dir(out, overwrite)
  plan_id, n, procs = _plan_id(plan), plan["num_shards"], plan["num_processes"]
  markers = [_shard_marker(shards, k, plan_id) for k in range(n)]
  missing = [k for k, m in enumerate(markers) if m is None]
  if missing:
    owners = sorted({shard_owner(k, procs) for k in missing})
    raise ShardsError(
        f"{len(missing)} of the {n} shards of {out} are not done: {_ranges(missing)} (process"
        f"{'es' if len(owners) > 1 else ''} {', '.join(map(str, owners))} of {procs}); rerun "
        f"{'them' if len(owners) > 1 else 'it'} with the same flags (finished shards are "
        "skipped), then join")
  stats = PrepareStats(conversations=plan["conversations"],
                       dropped_too_long=plan["dropped_too_long"], kept_split=plan["kept_split"],
                       num_shards=n, num_processes=procs, joined=True)
  _add_markers(stats, markers)
  join_datasets(out, [os.path.join(shards, _shard_name(k)) for k in range(n)],
                max_group=plan["max_group"], metadata=plan["metadata"], overwrite=overwrite,
                teacher=plan["teacher_shapes"])
  shutil.rmtree(shards, ignore_errors=True)
  stats.seconds = time.perf_counter() - start
  return stats


def _ranges(ks: Sequence[int]) -> str:
  """[1, 2, 3, 7] -> "1-3, 7"."""
  out, i = [], 0
  while i < len(ks):
    j = i
    while j + 1 < len(ks) and ks[j + 1] == ks[j] + 1:
      j += 1
    out.append(str(ks[i]) if i == j else f"{ks[i]}-{ks[j]}")
    i = j + 1
  return ", ".join(out)


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
