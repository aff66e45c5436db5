"""The grain training pipeline: records -> sample layouts -> packed static-shape batches.

source -> per-process shard -> shuffle(seed) -> repeat -> layout (docs/SPEC.md 1.2) -> greedy
packing
into `batch_rows` rows of (entries M, groups G) -> thread prefetch. Every batch is a dict of
np.int32 arrays with the fields of `layout.PackedBatch`, shaped identically every step. The
iterator is checkpointable: `get_state()` / `set_state()` resume mid-epoch exactly.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Iterator, Mapping, Sequence

import grain
import numpy as np
import tensorflow_datasets as tfds

from hamburger_jax import files
from hamburger_jax.data.tfds_builder import from_bfloat16_bits
from hamburger_jax.layout import LayoutError, SampleLayout, layout_sample, pack_rows
from hamburger_jax.run_config import DATASET_READER

_READ_THREADS = 2  # the machines this runs on have few cores; the model wants them


def record_layout(record: Mapping[str, Any], max_group: int,
                  position_offset: int = 0) -> SampleLayout:
  """A stored record (tfds_builder features) -> its base-input / target layout (with the
  teacher signals when the record has them)."""
  ids = np.asarray(record["input_ids"], np.int32)
  p = int(record["prompt_len"])
  teacher = None
  if "teacher_features" in record:
    teacher = {"topk_ids": record["teacher_topk_ids"],
               "topk_logp": np.asarray(record["teacher_topk_logp"], np.float32),
               "features": from_bfloat16_bits(record["teacher_features"])}
  return layout_sample(ids[:p], ids[p:], record["groups"], max_group, position_offset, teacher)


class PackBatchIterDataset(grain.IterDataset):
  """Packs sample layouts into batches of `batch_rows` rows of `entries` entries and `groups`
  groups each (first fit over the batch's rows, in arrival order; a sample never spans rows).

  A batch is emitted when the next sample fits in none of its rows; that sample opens the next
  batch. At the end of the input the last batch is padded with empty rows. A sample larger than
  a whole row is an error: the data should have been prepared with a smaller max length.
  """

  def __init__(self, parent: grain.IterDataset, *, batch_rows: int, entries: int, groups: int,
               max_group: int):
    super().__init__(parent)
    if min(batch_rows, entries, groups, max_group) < 1:
      raise ValueError(f"batch_rows={batch_rows}, entries={entries}, groups={groups}, "
                       f"max_group={max_group} must all be positive")
    self._shape = (batch_rows, entries, groups, max_group)

  def __iter__(self) -> "_PackBatchIterator":
    return _PackBatchIterator(self._parent.__iter__(), *self._shape)

  def __str__(self) -> str:
    return "PackBatchIterDataset(batch_rows={}, entries={}, groups={}, max_group={})".format(
        *self._shape)


class _PackBatchIterator(grain.DatasetIterator):
  """State = the parent's state before the first sample not yet emitted (the carried one).

  Restoring it and re-reading from there reproduces the remaining batches exactly, with no
  sample data in the checkpoint.
  """

  def __init__(self, parent: grain.DatasetIterator, batch_rows: int, entries: int, groups: int,
               max_group: int):
    super().__init__(parent)
    self._batch_rows, self._entries, self._groups, self._max_group = (
        batch_rows, entries, groups, max_group)
    self._carry: SampleLayout | None = None  # read, but did not fit the previous batch
    self._carry_state: dict[str, Any] | None = None  # parent state before reading _carry

  def _read(self) -> tuple[SampleLayout | None, dict[str, Any] | None]:
    if self._carry is not None:
      sample, state = self._carry, self._carry_state
      self._carry = self._carry_state = None
      return sample, state
    state = copy.deepcopy(self._parent.get_state())
    try:
      sample = next(self._parent)
    except StopIteration:
      return None, None
    if sample.num_entries > self._entries or sample.num_groups > self._groups:
      raise LayoutError(
          f"a sample has {sample.num_entries} entries and {sample.num_groups} groups but a row "
          f"holds {self._entries} entries and {self._groups} groups: raise entries/groups, or "
          "prepare the data with a smaller --max-len")
    return sample, state

  def __next__(self) -> dict[str, np.ndarray]:
    rows: list[list[SampleLayout]] = [[] for _ in range(self._batch_rows)]
    used = [[0, 0] for _ in range(self._batch_rows)]  # entries, groups per row
    empty = True
    while True:
      sample, state = self._read()
      if sample is None:
        break
      for r in range(self._batch_rows):
        if (used[r][0] + sample.num_entries <= self._entries and
            used[r][1] + sample.num_groups <= self._groups):
          rows[r].append(sample)
          used[r][0] += sample.num_entries
          used[r][1] += sample.num_groups
          empty = False
          break
      else:
        self._carry, self._carry_state = sample, state
        break
    if empty:
      raise StopIteration
    return pack_rows(rows, self._entries, self._groups, self._max_group).as_dict()

  def get_state(self) -> dict[str, Any]:
    if self._carry is not None:
      return copy.deepcopy(self._carry_state)
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state)
    self._carry = self._carry_state = None

  def __str__(self) -> str:
    return "_PackBatchIterator"


def packed_dataset(source: Sequence[Mapping[str, Any]], *, batch_rows: int, entries: int,
                   groups: int, max_group: int, seed: int | None = 0, shard_index: int = 0,
                   shard_count: int = 1, num_epochs: int | None = None, prefetch: int = 2,
                   position_offset: int = 0) -> grain.IterDataset:
  """The pipeline over any random-access `source` of records (a tfds data source or a list).

  seed=None keeps the source order (validation). Each process reads the records
  shard_index::shard_count of the source, disjoint across processes. With a finite num_epochs
  shards may yield different numbers of batches; with num_epochs=None they never end.
  """
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index={shard_index} must be in [0, shard_count={shard_count})")
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f"num_epochs={num_epochs} must be positive, or None to repeat forever")
  ds = grain.MapDataset.source(source)
  if shard_count > 1:
    ds = ds[shard_index::shard_count]
  if len(ds) == 0:
    raise ValueError(f"shard {shard_index} of {shard_count} has no records ({len(source)} in the "
                     "source): use fewer shards or more data")
  if seed is not None:
    ds = ds.shuffle(seed)
  if num_epochs != 1:
    ds = ds.repeat(num_epochs)
  ds = ds.map(lambda r: record_layout(r, max_group, position_offset))
  it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=_READ_THREADS,
                                               prefetch_buffer_size=32))
  it_ds = PackBatchIterDataset(it_ds, batch_rows=batch_rows, entries=entries, groups=groups,
                               max_group=max_group)
  if prefetch:
    it_ds = grain.experimental.ThreadPrefetchIterDataset(it_ds, prefetch_buffer_size=prefetch)
  return it_ds


def _builder(data_dir: str):
  if not data_dir:
    raise FileNotFoundError("no dataset given (data.dir is empty): build one with "
                            "python -m train.prepare_data ... --out DIR and set data.dir to it")
  files.check_local(data_dir, "dataset", DATASET_READER)
  try:
    return tfds.builder_from_directory(data_dir)
  except Exception as e:  # pylint: disable=broad-except
    shards = os.path.abspath(data_dir) + ".shards"  # prepare.SHARDS_SUFFIX (no jax import here)
    if os.path.isdir(shards):
      raise FileNotFoundError(
          f"{data_dir} is not written yet: its shards are in {shards}; let every "
          "train.prepare_data process finish (the last one joins them), or run python -m "
          f"train.prepare_data --join {data_dir}") from None
    raise FileNotFoundError(f"{data_dir} is not a dataset written by train.prepare_data ({e}); "
                            "build one with: python -m train.prepare_data ... --out DIR") from None


def dataset_metadata(data_dir: str) -> dict[str, Any]:
  """What train.prepare_data recorded: strategy, base fingerprint, teacher signals, ..."""
  return dict(_builder(data_dir).info.metadata or {})


def open_split(data_dir: str, split: str, max_group: int | None = None):
  """The tfds data source of `split` in a dataset written by train.prepare_data."""
  builder = _builder(data_dir)
  sources = builder.as_data_source()
  if split not in sources:
    raise ValueError(f"{data_dir} has no split {split!r}; it has: {', '.join(sorted(sources))}")
  data_k = builder.info.metadata.get("max_group") if builder.info.metadata else None
  if max_group is not None and data_k is not None and int(data_k) > max_group:
    raise ValueError(f"{data_dir} was segmented with max_group={data_k} but the model takes "
                     f"max_group={max_group}: re-run train.prepare_data with it")
  return sources[split]


def make_train_iterator(data_dir: str, split: str, batch_rows: int, entries: int, groups: int,
                        max_group: int, seed: int, shard_index: int = 0, shard_count: int = 1,
                        num_epochs: int | None = None,
                        position_offset: int = 0) -> grain.DatasetIterator:
  """Checkpointable iterator of packed training batches (dicts of np.int32, see layout.py).
  `position_offset`: the model's graft.position_offset (merged entries' RoPE positions)."""
  ds = packed_dataset(open_split(data_dir, split, max_group), batch_rows=batch_rows,
                      entries=entries, groups=groups, max_group=max_group, seed=seed,
                      shard_index=shard_index, shard_count=shard_count, num_epochs=num_epochs,
                      position_offset=position_offset)
  return iter(ds)


def validation_batches(data_dir: str, split: str = "validation", *, batch_rows: int,
                       entries: int, groups: int, max_group: int, shard_index: int = 0,
                       shard_count: int = 1,
                       position_offset: int = 0) -> Iterator[dict[str, np.ndarray]]:
  """One deterministic pass over `split` in file order (last batch padded with empty rows)."""
  ds = packed_dataset(open_split(data_dir, split, max_group), batch_rows=batch_rows,
                      entries=entries, groups=groups, max_group=max_group, seed=None,
                      shard_index=shard_index, shard_count=shard_count, num_epochs=1, prefetch=0,
                      position_offset=position_offset)
  return iter(ds)
