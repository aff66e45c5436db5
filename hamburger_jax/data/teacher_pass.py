"""The teacher pass of data preparation (hamburger_jax/data/prepare.py): the base run
teacher-forced over the tokenised samples, jitted, its weights replicated and the rows of each
forward pass split over this process's devices; each sample's groups and teacher signals from its
token statistics; a shard of samples computed and written with its done marker
(hamburger_jax/data/shards.py), and the markers summed into PrepareStats.

Every forward pass has one row length, so a whole dataset compiles a single program;
`lower_teacher_pass` lowers that program for a mesh without any weights (train.aot).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from hamburger_jax import segmentation, sharding
from hamburger_jax.data import shards as shardlib
from hamburger_jax.data.tfds_builder import build_dataset
from hamburger_jax.files import write_json_atomic

_ROW_BUCKET = 64
# train.prepare_data's defaults: samples longer than this are dropped; a forward pass holds this
# many tokens per device.
DEFAULT_MAX_LEN = 384
DEFAULT_BATCH_TOKENS = 2048
TEACHER_FIELDS = ("teacher_topk_ids", "teacher_topk_logp", "teacher_features")


@dataclasses.dataclass(frozen=True)
class TokenizedSample:
  """One sample as the teacher pass reads it (prepare.tokenize makes it)."""
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
          f"{shardlib.ranges(self.shards_computed) or 'none'} written now, "
          f"{shardlib.ranges(self.shards_skipped) or 'none'} done before",
          f"shards done          {done} of {self.num_shards}; waiting for "
          f"{shardlib.ranges(self.shards_missing)} (the last process to finish joins them)",
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
        f"{shardlib.ranges(self.shards_computed) or 'none'}, found "
        f"{shardlib.ranges(self.shards_skipped) or 'none'}"
        " done before",
    ])


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


def teacher_spec(model: nnx.Module, graft_cfg, top_k: int) -> segmentation.TeacherSpec | None:
  """The teacher signals the distillation recipe stores with each sample: the base's top-`top_k`
  log-probabilities per response token and its features at the graft's feature layers
  (`graft_cfg`: RunConfig.graft); None for top_k 0 (the paper recipe stores none)."""
  if top_k < 0:
    raise ValueError(f"--teacher-top-k={top_k} must be >= 0")
  if top_k == 0:
    return None
  if top_k > model.cfg.vocab_size:
    raise ValueError(f"--teacher-top-k={top_k} exceeds the vocabulary ({model.cfg.vocab_size})")
  return segmentation.TeacherSpec(top_k, graft_cfg.resolved_feature_layers(model.cfg.num_layers))


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


# What a tokenizer fingerprint encodes: words, digits, code, accents, other scripts and the chat
# markers, so that another vocabulary or another split of any of them shows.
_PROBE = ("The quick brown fox, 1234567890 and 3.14; def f(x): return x ** 2 # café naïve "
          "Москва 東京 🙂 <|im_start|>user\n<|im_end|>")


def tokenizer_fingerprint(tokenizer) -> str:
  """Identifies the tokenizer whose ids a dataset holds: its vocabulary size and its ids for a
  probe text (another tokenizer reads the stored ids as other text)."""
  h = hashlib.sha256(str(tokenizer.vocab_size).encode())
  h.update(np.asarray(tokenizer.encode(_PROBE), np.int64).tobytes())
  return h.hexdigest()[:16]


def base_fingerprint(model: nnx.Module) -> str:
  """Identifies the base whose forward made a dataset's groups and teacher signals: its
  architecture and a hash of some of its weights (the same architecture with other weights
  would segment and teach differently)."""
  h = hashlib.sha256(json.dumps(dataclasses.asdict(model.cfg), sort_keys=True).encode())
  h.update(np.asarray(model.embed_tokens[...][:64], np.float32).tobytes())
  h.update(np.asarray(model.decoder.layers[-1].mlp.down_proj.kernel[...][:64],
                      np.float32).tobytes())
  return h.hexdigest()[:16]


# ----------------------------------------------------------------------------- forward passes


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
class Forward:
  """The base split for jit, its weights replicated over a data-parallel mesh of this process's
  devices; a pass of `rows_per_device` rows per device."""
  graphdef: Any
  state: Any
  rows_sharding: Any
  rows_per_device: int
  devices: int

  @classmethod
  def build(cls, model: nnx.Module, rows_per_device: int, mesh=None) -> "Forward":
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


def _teacher_pass(forward: Forward, samples: Sequence[TokenizedSample], row_len: int,
                  teacher: segmentation.TeacherSpec | None,
                  progress: Callable[[int], None] | None
                  ) -> Iterator[tuple[int, segmentation.TokenStats]]:
  """(index in `samples`, its TokenStats) of every sample, a forward pass at a time."""
  return segmentation.packed_token_stats(
      forward, [(s.prompt_ids, s.response_ids) for s in samples], row_len,
      forward.rows_per_pass, teacher, progress)


# ----------------------------------------------------------------------------- shards


def write_shard(shards: str, k: int, plan: Mapping[str, Any], plan_id: str,
                samples: Sequence[TokenizedSample], first: int, val: set[int],
                forward: Forward, strategy: segmentation.Strategy,
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
  build_dataset(os.path.join(shards, shardlib.shard_name(k)),
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
  write_json_atomic(os.path.join(shards, shardlib.shard_name(k) + ".json"), marker,
                    sort_keys=True)
  return marker


def add_markers(stats: PrepareStats, markers: Iterable[Mapping[str, Any]]) -> None:
  """Adds the shards' done markers (what write_shard records) to `stats`."""
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
