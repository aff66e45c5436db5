"""The on-disk training set: a tfds array_record dataset of tokenised, segmented samples.

Works without tensorflow. Read it with `tfds.builder_from_directory(DIR).as_data_source()`.
Per sample: input_ids (prompt + response), prompt_len, groups (sizes summing to the response
length, docs/SPEC.md 2.1), source. The builder writes whatever samples the caller hands it; building
is atomic (`build_dataset`): a temp directory next to the output, renamed at the end.

`join_datasets` makes one dataset of several (the shards of a sharded `train.prepare_data`) by
linking their files, records in order, without rewriting them.

Work directories beside the output (`.NAME.samples-*`, `.NAME.tmp-*` of build_dataset and
join_datasets) are held under a lock while their run lives; one that a killed run left behind is
removed by the next run for the same output (`check_output_dir`), never a live run's and never a
complete dataset (a dataset a killed --overwrite had moved aside is put back).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.core import naming as tfds_naming
from tensorflow_datasets.core import shuffle as tfds_shuffle
from tensorflow_datasets.core import splits as tfds_splits

from hamburger_jax import files
from hamburger_jax.layout import LayoutError, check_groups
from hamburger_jax.run_config import DATASET_READER

SPLITS = ("train", "validation")
Sample = Mapping[str, Any]  # {"input_ids", "prompt_len", "groups", "source"}


class DatasetExistsError(FileExistsError):
  """The output directory exists and overwriting was not asked for."""


class HamburgerSft(tfds.core.GeneratorBasedBuilder):
  """Tokenised SFT samples with their entropy groups, for HAMburger training."""

  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {
      "1.0.0": "input_ids (prompt + response incl. end-of-turn), prompt_len, groups, source.",
      "1.1.0": "optional teacher signals for distillation: teacher_topk_ids / teacher_topk_logp "
               "[R, k] per response token, teacher_features [G, F, D] (bfloat16 bits) per group.",
  }

  def __init__(self, *, splits: Mapping[str, Callable[[], Iterable[Sample]]] | None = None,
               max_group: int = 4, metadata: Mapping[str, Any] | None = None,
               teacher: Mapping[str, int] | None = None, **kwargs):
    """`splits` maps a split name to a function returning its samples (read once, lazily);
    `teacher` ({top_k, num_features, hidden}) adds the teacher-signal features."""
    self._splits = dict(splits or {})
    self._max_group = max_group
    self._metadata = dict(metadata or {})
    self._teacher = dict(teacher) if teacher else None
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    features = {
        "input_ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
        "prompt_len": tfds.features.Scalar(dtype=np.int32),
        "groups": tfds.features.Tensor(shape=(None,), dtype=np.int32),
        "source": tfds.features.Text(),
    }
    if self._teacher:
      k, f, d = (self._teacher[n] for n in ("top_k", "num_features", "hidden"))
      features.update(
          teacher_topk_ids=tfds.features.Tensor(shape=(None, k), dtype=np.int32),
          teacher_topk_logp=tfds.features.Tensor(shape=(None, k), dtype=np.float16),
          # bfloat16 bit patterns: residual streams hold values far beyond float16's range.
          teacher_features=tfds.features.Tensor(shape=(None, f, d), dtype=np.uint16))
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict(features),
        metadata=tfds.core.MetadataDict(max_group=self._max_group, **self._metadata),
        # Records keep the generator's order; the training pipeline shuffles.
        disable_shuffling=True)

  # tfds prints "Downloading and preparing dataset ... to <temp dir>" around every build: nothing
  # is downloaded, the directory is a temporary one, and a sharded build makes one per shard.
  def _log_download_bytes(self) -> None:
    pass

  def _log_download_done(self) -> None:
    pass

  def _split_generators(self, dl_manager):
    del dl_manager
    unknown = sorted(set(self._splits) - set(SPLITS))
    if unknown:
      raise ValueError(f"unknown split {unknown[0]!r}; valid splits are: {', '.join(SPLITS)}")
    return {name: self._generate_examples(name, fn) for name, fn in self._splits.items()}

  def _generate_examples(self, split: str, samples_fn: Callable[[], Iterable[Sample]]):
    for i, sample in enumerate(samples_fn()):
      yield i, encode_sample(sample, self._max_group, f"{split} sample {i}", self._teacher)


def encode_sample(sample: Sample, max_group: int, where: str = "sample",
                  teacher: Mapping[str, int] | None = None) -> dict[str, Any]:
  """Validates one sample and converts it to the feature dtypes; raises LayoutError if bad."""
  ids = np.asarray(sample["input_ids"], np.int32)
  prompt_len = int(sample["prompt_len"])
  if ids.ndim != 1 or not 1 <= prompt_len < len(ids):
    raise LayoutError(f"{where}: prompt_len={prompt_len} must be in [1, {len(ids)}) for "
                      f"{len(ids)} input ids (both prompt and response must be non-empty)")
  try:
    groups = check_groups(sample["groups"], len(ids) - prompt_len, max_group)
  except LayoutError as e:
    raise LayoutError(f"{where} ({sample.get('source', '?')}): {e}") from None
  out = {"input_ids": ids, "prompt_len": np.int32(prompt_len),
         "groups": groups.astype(np.int32), "source": str(sample.get("source", ""))}
  if teacher:
    r, g = len(ids) - prompt_len, len(groups)
    want = {"teacher_topk_ids": (r, teacher["top_k"]), "teacher_topk_logp": (r, teacher["top_k"]),
            "teacher_features": (g, teacher["num_features"], teacher["hidden"])}
    for name, shape in want.items():
      value = np.asarray(sample[name])
      if value.shape != shape:
        raise LayoutError(f"{where}: {name} has shape {value.shape}, expected {shape}")
    out["teacher_topk_ids"] = np.asarray(sample["teacher_topk_ids"], np.int32)
    out["teacher_topk_logp"] = np.asarray(sample["teacher_topk_logp"], np.float16)
    out["teacher_features"] = bfloat16_bits(sample["teacher_features"])
  return out


def bfloat16_bits(x) -> np.ndarray:
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def from_bfloat16_bits(bits) -> np.ndarray:
  return np.asarray(bits, np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)


def build_dataset(out_dir: str, splits: Mapping[str, Callable[[], Iterable[Sample]]], *,
                  max_group: int, metadata: Mapping[str, Any] | None = None,
                  overwrite: bool = False, teacher: Mapping[str, int] | None = None) -> str:
  """Writes the dataset so that `tfds.builder_from_directory(out_dir)` reads it; returns out_dir.

  Built in a temp directory next to `out_dir` and renamed into place at the end, so an
  interrupted build never leaves anything at `out_dir` (a kill may leave a `.NAME.tmp-*`
  directory beside it, which the next run for the same output removes).
  """
  check_output_dir(out_dir, overwrite)
  out = os.path.abspath(out_dir)
  with work_dir_beside(out, "tmp") as tmp:
    _build(out, tmp, splits, max_group=max_group, metadata=metadata, teacher=teacher)
  return out


def _build(out: str, tmp: str, splits: Mapping[str, Callable[[], Iterable[Sample]]], *,
           max_group: int, metadata: Mapping[str, Any] | None,
           teacher: Mapping[str, int] | None) -> None:
  # tfds buffers a split in memory and spills it to disk past MAX_MEM_BUFFER_SIZE (1 GB) through
  # tf.io.gfile, i.e. TensorFlow, which we do not depend on: a dataset with teacher features
  # passes 1 GB at a few thousand samples. Records keep their order (disable_shuffling), so the
  # buffer only has to hold the split: keep it in memory.
  spill_limit = tfds_shuffle.MAX_MEM_BUFFER_SIZE
  tfds_shuffle.MAX_MEM_BUFFER_SIZE = max(spill_limit, 1 << 40)
  try:
    builder = HamburgerSft(splits=splits, max_group=max_group, metadata=metadata,
                           teacher=teacher, data_dir=tmp, file_format="array_record")
    builder.download_and_prepare()
    _install(out, os.fspath(builder.data_dir), tmp)  # built in tmp/hamburger_sft/1.1.0
  finally:
    tfds_shuffle.MAX_MEM_BUFFER_SIZE = spill_limit


def _install(out: str, built: str, tmp: str) -> None:
  """Renames `built` (inside the work directory `tmp`) to `out`; an existing `out` (overwrite) is
  moved into `tmp` first and goes with it (a kill in between: clean_stale_work_dirs puts it
  back)."""
  if os.path.exists(out):
    os.rename(out, os.path.join(tmp, "replaced"))
  os.rename(built, out)


def join_datasets(out_dir: str, parts: Sequence[str], *, max_group: int,
                  metadata: Mapping[str, Any] | None = None, overwrite: bool = False,
                  teacher: Mapping[str, int] | None = None) -> str:
  """Writes at `out_dir` the dataset whose every split is the parts' splits one after another
  (records in order), from datasets that build_dataset wrote with the same features; returns
  out_dir. A part may lack a split.

  The parts' array_record files are hard-linked (copied where the filesystem refuses links), not
  rewritten, so joining costs no pass over the data and leaves the parts intact. Atomic like
  build_dataset: nothing appears at `out_dir` until the whole dataset is there.
  """
  check_output_dir(out_dir, overwrite)
  out = os.path.abspath(out_dir)
  infos = [tfds.builder_from_directory(os.fspath(p)).info for p in parts]
  with work_dir_beside(out, "tmp") as tmp:
    built = os.path.join(tmp, "joined")
    os.makedirs(built)
    builder = HamburgerSft(max_group=max_group, metadata=metadata, teacher=teacher,
                           data_dir=os.path.join(tmp, "unused"), file_format="array_record")
    split_infos = []
    for split in SPLITS:
      files, lengths, num_bytes = [], [], 0
      for info in infos:
        if split in info.splits:
          part = info.splits[split]
          files += [os.fspath(f) for f in part.filepaths]
          lengths += [int(n) for n in part.shard_lengths]
          num_bytes += int(part.num_bytes)
      if not files:
        continue
      template = tfds_naming.ShardedFileTemplate(
          data_dir=built, template=tfds_naming.DEFAULT_FILENAME_TEMPLATE,
          dataset_name=builder.name, split=split, filetype_suffix="array_record")
      for src, dst in zip(files, template.sharded_filepaths(len(files))):
        _link_or_copy(src, os.fspath(dst))
      split_infos.append(tfds_splits.SplitInfo(name=split, shard_lengths=lengths,
                                               num_bytes=num_bytes, filename_template=template))
    if not split_infos:
      raise ValueError(f"nothing to join: the {len(parts)} parts hold no records")
    info = builder.info
    info.set_splits(tfds_splits.SplitDict(split_infos))
    info.write_to_directory(built)
    _install(out, built, tmp)
  return out


def _link_or_copy(src: str, dst: str) -> None:
  try:
    os.link(src, dst)
  except OSError:  # a filesystem without hard links, or another device
    shutil.copyfile(src, dst)


WORK_KINDS = ("samples", "tmp")
_LOCK_FILE = ".owner.lock"
# A work directory without a lock file (written before locks, or a run killed between creating
# it and locking it) counts as abandoned once it is this old.
_UNLOCKED_GRACE_S = 60.0


@contextlib.contextmanager
def work_dir_beside(out: str, kind: str) -> Iterator[str]:
  """A fresh `.NAME.<kind>-*` directory beside `out`, locked by this process while it exists and
  removed at the end; a killed run leaves it unlocked for clean_stale_work_dirs."""
  out = os.path.abspath(out)
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  path = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.{kind}-", dir=parent)
  fd = os.open(os.path.join(path, _LOCK_FILE), os.O_CREAT | os.O_RDWR, 0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield path
  finally:
    shutil.rmtree(path, ignore_errors=True)
    os.close(fd)


def clean_stale_work_dirs(out_dir: str) -> list[str]:
  """Removes the work directories beside `out_dir` that killed runs left (unlocked); returns
  them. A previous dataset that a killed --overwrite had moved into one (`replaced`) goes back to
  `out_dir` when that is missing."""
  out = os.path.abspath(out_dir)
  parent, name = os.path.split(out)
  try:
    entries = sorted(os.listdir(parent))
  except (FileNotFoundError, NotADirectoryError):
    return []
  removed = []
  for entry in entries:
    path = os.path.join(parent, entry)
    if (not any(entry.startswith(f".{name}.{kind}-") for kind in WORK_KINDS)
        or os.path.islink(path) or not os.path.isdir(path)):
      continue
    lock = os.path.join(path, _LOCK_FILE)
    try:
      fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
      if time.time() - os.path.getmtime(path) > _UNLOCKED_GRACE_S:
        _remove_work_dir(path, out)
        removed.append(path)
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      continue  # a live run's
    else:
      _remove_work_dir(path, out)
      removed.append(path)
    finally:
      os.close(fd)
  return removed


def _remove_work_dir(path: str, out: str) -> None:
  replaced = os.path.join(path, "replaced")
  if os.path.isdir(replaced) and not os.path.exists(out):
    os.rename(replaced, out)
    print(f"note: restored {out}, which an interrupted --overwrite had moved aside",
          file=sys.stderr)
  shutil.rmtree(path, ignore_errors=True)


def check_output_dir(out_dir: str, overwrite: bool) -> None:
  """Refuses an existing `out_dir` unless `overwrite`; first removes what killed runs for the same
  output left beside it (clean_stale_work_dirs). A bucket URL is refused (files.StorageError):
  the dataset is built in a local directory renamed into place, and read through array_record."""
  files.check_local(out_dir, "dataset output", DATASET_READER)
  clean_stale_work_dirs(out_dir)
  if os.path.exists(out_dir) and not overwrite:
    raise DatasetExistsError(
        f"{out_dir} already exists; pass --overwrite (overwrite=True) to replace it, or choose "
        "another output directory")
