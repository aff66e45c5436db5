"""A window's explicit state: what its command asked (Settings), what every part reads and never
changes (Run), and the records the parts pass on (Data, Progress). Each part of the window is a
function that takes the records it needs and returns the ones it made (window/run.py)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np

from hamburger_jax.files import write_text_atomic
from hamburger_jax.window.stream import Samples

EXPORT_SHARD_MB = 16  # files come back from a GPU machine at 16 MiB at most


@dataclasses.dataclass(frozen=True)
class Arm:
  """A named recipe trained from the same init on the same data: config overrides."""
  name: str
  overrides: tuple[str, ...] = ()


@dataclasses.dataclass
class Settings:
  budget_minutes: float
  started: float  # time.monotonic() when the command started: the budget counts from there
  threshold: float = 0.6  # confident:p, the boundaries' rule
  decode_eval: bool = False  # decode speed against the base: only when asked
  decode_tokens: int = 64
  seed: int = 0
  # The base's own answers: their share of the response tokens trained on (0: the corpus's
  # alone), rows answered at once, and the longest prompt and answer.
  answers_share: float = 0.8
  answer_rows: int = 512
  answer_prompt_tokens: int = 256
  answer_tokens: int = 256
  answers_in: tuple[str, ...] = ()  # earlier windows' answers/ directories, trained on too
  suite: str | None = None  # a suite directory (evaluation/suite.py): judges by free generation
  judge_batch: int = 64
  arms: tuple[Arm, ...] = ()  # recipes sharing the training minutes (empty: the config alone)

  @property
  def deadline(self) -> float:
    return self.started + 60 * self.budget_minutes


class Report:
  """report.md: a heading per part, rewritten whole after each."""

  def __init__(self, path: str, title: str, log: Callable[[str], None]):
    self.path, self.log = path, log
    self.lines = [f"# {title}", ""]

  def part(self, name: str, lines: list[str]) -> None:
    self.lines += [f"## {name}", "", *lines, ""]
    for line in lines:
      self.log(f"[{name}] {line}")
    write_text_atomic(self.path, "\n".join(self.lines))


@dataclasses.dataclass
class Run:
  """What every part reads: config, settings, directories, the trainer and its costs."""
  cfg: Any  # RunConfig
  s: Settings
  out: str
  work: str
  report: Report
  summary: dict[str, Any]
  trainer: Any  # training.trainer.Trainer
  prior_tokens: int  # response tokens the init's lineage trained on
  peak: Any  # peaks.Peak
  flops: float  # one train step's model FLOPs
  log: Callable[[str], None] = print

  def elapsed(self) -> float:
    return time.monotonic() - self.s.started


@dataclasses.dataclass(frozen=True)
class Data:
  """The samples a window trains on and the order it reads them in."""
  samples: Samples
  corpus_samples: int  # corpus samples come first; answers are numbered after them
  train_ids: np.ndarray  # training order (answers mixed in once made)
  val_ids: np.ndarray
  corpus_meta: dict[str, Any]
  answered: frozenset = frozenset()  # corpus samples whose prompts have answers already
  carried_answers: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
  corpus_fingerprint: str = ""  # answer_files.corpus_fingerprint: what answer files name


@dataclasses.dataclass(frozen=True)
class Progress:
  """Steps and response tokens trained so far, and the rates measured."""
  steps: int = 0
  tokens: int = 0
  rates: Any = None  # window.plan.Rates
