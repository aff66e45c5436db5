"""The train-step bench (`python -m train.bench`): a HAMburger step against a plain SFT step of
the base on the same packed rows, each step's FLOPs (ours and XLA's) and MFU, and the input
pipeline's rate beside them."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tensorflow_datasets as tfds
from flax import nnx

from hamburger_jax import cli, layout
from hamburger_jax.costs import analytic, peaks, program_flops
from hamburger_jax.data import pipeline, synthetic
from hamburger_jax.data.tfds_builder import build_dataset
from hamburger_jax.objectives.losses import sft_loss
from hamburger_jax.training import Trainer


def sft_rows(rows, width: int) -> dict[str, np.ndarray]:
  """The same rows of samples as plain token sequences [B, T] (loss where t+1 is a response)."""
  b = len(rows)
  out = {k: np.zeros((b, width), np.int32) for k in ("tokens", "segment_ids", "positions")}
  out["loss_mask"] = np.zeros((b, width), np.float32)
  for r, samples in enumerate(rows):
    t = 0
    for seg, s in enumerate(samples, start=1):
      ids = np.asarray(s["input_ids"])
      n, p = len(ids), int(s["prompt_len"])
      out["tokens"][r, t:t + n] = ids
      out["segment_ids"][r, t:t + n] = seg
      out["positions"][r, t:t + n] = np.arange(n)
      out["loss_mask"][r, t + p - 1:t + n - 1] = 1.0
      t += n
  return out


def pack_first_fit(records, k: int, entries: int, groups: int, rows: int, batches: int):
  """`batches` batches of `rows` rows, the records packed first-fit under both limits (the
  HAMburger packer's rule), each row a list of (record, layout)."""
  out, cur, m, g = [], [], 0, 0
  for rec in records:
    lay = pipeline.record_layout(rec, k)
    if lay.num_entries > entries or lay.num_groups > groups:
      continue  # larger than a whole row: prepare_data's --max-len keeps these out
    if m + lay.num_entries > entries or g + lay.num_groups > groups:
      out.append(cur)
      cur, m, g = [], 0, 0
    cur.append((rec, lay))
    m, g = m + lay.num_entries, g + lay.num_groups
  return [out[i:i + rows] for i in range(0, len(out) - rows + 1, rows)][:batches]


def synthetic_dataset(out_dir: str, vocab: int, k: int, entries: int, n: int, seed: int) -> str:
  """`n` synthetic samples at lengths scaled to a row of `entries` entries (SmolLM2 config:
  prompts ~32-51, responses ~85-128 tokens), written as train.prepare_data writes a dataset."""
  lengths = {"prompt_len": (max(1, entries // 8), max(2, entries // 5)),
             "response_len": (max(1, entries // 3), max(2, entries // 2))}
  train = synthetic.synthetic_samples(n, vocab, k, seed, **lengths)
  val = synthetic.synthetic_samples(8, vocab, k, seed + 1, **lengths)
  tfds.disable_progress_bar()
  with contextlib.redirect_stdout(sys.stderr):  # tfds' progress lines are not the bench's output
    return build_dataset(out_dir, {"train": lambda: train, "validation": lambda: val},
                         max_group=k, metadata={"source": "synthetic"})


def input_rate(data_dir: str, cfg, batches: int) -> tuple[float, float]:
  """(batches/s, response tokens/s) of the training input pipeline (grain: read, shuffle,
  layout, pack, prefetch) at the run's shapes, alone on the machine: one batch to start its
  threads, then `batches` timed."""
  d = cfg.data
  it = pipeline.make_train_iterator(data_dir, "train", batch_rows=d.rows, entries=d.entries,
                                    groups=d.groups, max_group=cfg.graft.max_group, seed=d.seed,
                                    position_offset=cfg.graft.position_offset)
  try:
    next(it)
    t, tokens = time.perf_counter(), 0
    for _ in range(batches):
      tokens += int(np.sum(next(it)["target_size"]))
    dt = time.perf_counter() - t
  finally:
    if hasattr(it, "close"):
      it.close()
  return batches / dt, tokens / dt


def make_sft_step(graphdef, tx, ce_chunk: int):
  """The baseline's jitted step: AdamW on the whole base, token-mean CE on response tokens."""

  @jax.jit
  def sft_step(params, opt_state, batch):
    loss_fn = lambda p: sft_loss(nnx.merge(graphdef, p), batch, ce_chunk)[0]
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return sft_step


def compile_timed(what: str, lower):
  """(compiled program, seconds) of `lower()`'s program, with a progress line."""
  t = time.perf_counter()
  compiled = cli.phase(what, lambda: lower().compile())
  return compiled, time.perf_counter() - t


def xla_view(compiled, devices: int) -> float | None:
  """XLA's FLOPs of a compiled step on every device (a data-parallel step splits its rows
  evenly); None where XLA does not count matmuls (a GPU: program_flops.xla_counts_matmuls)."""
  if not program_flops.xla_counts_matmuls():
    return None
  return program_flops.xla_flops(compiled) * devices


class BenchError(ValueError):
  """The bench cannot run as asked; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class TrainBench:
  """What `python -m train.bench` measures, besides its run config."""
  config: str  # the config's path, for the report's first line
  steps: int = 3  # timed steps, after one warm-up
  data: str | None = None  # a tfds dataset dir (None: synthetic samples)
  random_weights: bool = False  # the report says so
  sft: bool = True  # the SFT baseline (a second optimiser state of the whole base)
  input_batches: int = 20  # batches the input pipeline's rate is timed over


@dataclasses.dataclass(frozen=True)
class Batches:
  """The packed rows both steps see: `rows[i]` is batch i, a list of rows of (record, layout);
  batch 0 warms up, the others are timed."""
  rows: list
  width: int  # tokens of an SFT row (the longest row, rounded up to 64)
  tokens: int  # response tokens of a timed step (their mean)


@dataclasses.dataclass(frozen=True)
class StepRow:
  """One step's figures: the best of its timed runs, and its FLOPs (roofline's counts)."""
  seconds: float
  compile_s: float
  flops: Any  # model (MFU's numerator) and executed FLOPs of one step
  xla: float | None  # XLA's count of the program (None: not counted, on a GPU)
  xla_check: Any  # ours, counted as XLA counts (the chunked loss's loop body once)
  devices: int  # the devices the step ran on: its MFU is over their peak, together

  def mfu(self, peak: peaks.Peak) -> float:
    """Model FLOPs utilisation of the devices this step ran on (`peak`: one device's)."""
    return peaks.mfu(self.flops.model, self.seconds,
                     dataclasses.replace(peak, flops=peak.flops * self.devices))


def pack_batches(data_dir: str, cfg, steps: int) -> Batches:
  """`steps` + 1 batches of the dataset's records, packed at the config's shapes."""
  d, k = cfg.data, cfg.graft.max_group
  source = pipeline.open_split(data_dir, "train", k)
  records = [source[i] for i in range(min(len(source), 64 * d.rows))]
  batches = pack_first_fit(records, k, d.entries, d.groups, d.rows, steps + 1)
  if len(batches) < 2:
    raise BenchError(f"{data_dir} fills {len(batches)} batch(es) of {d.rows} rows; the bench "
                     "needs 2 (a warm-up and a timed step): use more data or fewer --rows")
  width = max(sum(len(r["input_ids"]) for r, _ in row) for b in batches for row in b)
  tokens = [sum(len(r["input_ids"]) - int(r["prompt_len"]) for row in b for r, _ in row)
            for b in batches]
  return Batches(batches, -(-width // 64) * 64, int(np.mean(tokens[1:])))


def measure_hamburger(trainer: Trainer, cfg, batches: Batches) -> StepRow:
  """The trainer's step on every batch (the first a warm-up), on the trainer's mesh. Compiled
  once, ahead of time: the timed steps run that executable, and XLA's FLOP count is read off
  it (no second program compiled only to be counted)."""
  d, k = cfg.data, cfg.graft.max_group
  globals_ = [trainer.global_batch([layout.pack_rows([[lay for _, lay in row] for row in b],
                                                     d.entries, d.groups, k).as_dict()])
              for b in batches.rows]
  step, compile_s = compile_timed("compiling the HAMburger step",
                                  lambda: trainer.lower_step(globals_[0]))
  times = []
  for i, batch in enumerate(globals_):
    t = time.perf_counter()
    trainer.state, metrics = step(trainer.state, trainer.frozen, batch)
    jax.block_until_ready(metrics)
    if i:
      times.append(time.perf_counter() - t)
  count = lambda **kw: analytic.train_step_flops(trainer.model.cfg, d.rows, d.entries, d.groups,
                                                 cfg.train.trainable, cfg.train.ce_chunk, **kw)
  return StepRow(min(times), compile_s, count(), xla_view(step, trainer.mesh.size),
                 count(loop_once=True), trainer.mesh.size)


def measure_sft(base, cfg, batches: Batches) -> StepRow:
  """A plain SFT step of `base` (AdamW on all of it, token-mean CE on response tokens) on the
  same rows as plain token sequences, on one device."""
  # Committed to one device, as the step's outputs are: arguments placed otherwise (the
  # trainer's mesh, an eager init's uncommitted zeros) would not match the compiled step.
  device = jax.devices()[0]
  params = jax.device_put(nnx.state(base, nnx.Param), device)
  tx = optax.adamw(cfg.train.lr_base, weight_decay=cfg.train.weight_decay)
  opt_state = jax.device_put(tx.init(params), device)
  sft_batches = [jax.device_put({key: jnp.asarray(v) for key, v in sft_rows(
      [[r for r, _ in row] for row in b], batches.width).items()}, device) for b in batches.rows]
  step, compile_s = compile_timed("compiling the SFT step", lambda: make_sft_step(
      nnx.graphdef(base), tx, cfg.train.ce_chunk).lower(params, opt_state, sft_batches[0]))
  times = []
  for i, batch in enumerate(sft_batches):
    t = time.perf_counter()
    params, opt_state, _ = jax.block_until_ready(step(params, opt_state, batch))
    if i:
      times.append(time.perf_counter() - t)
  count = lambda **kw: analytic.sft_step_flops(base.cfg, cfg.data.rows, batches.width,
                                               cfg.train.ce_chunk, **kw)
  return StepRow(min(times), compile_s, count(), xla_view(step, 1), count(loop_once=True), 1)


def run(bench: TrainBench, cfg, tmp: str, device_peak: Callable[[], peaks.Peak]) -> list[str]:
  """Measures the HAMburger step against a plain SFT step of the base on the same packed rows,
  with FLOPs, MFU and the input pipeline's rate; `device_peak()` gives one device's peaks.Peak
  (measured before and after the steps), `tmp` holds synthetic data. Returns the report's lines
  (markdown); BenchError when the data fill too few batches."""
  d = cfg.data
  first_peak = device_peak()
  trainer = cli.phase("building the model" + (" (random weights)" if bench.random_weights else ""),
                      lambda: Trainer(cfg))
  vocab = trainer.model.cfg.base.vocab_size
  data_dir = bench.data or cli.phase("writing synthetic samples", lambda: synthetic_dataset(
      f"{tmp}/data", vocab, cfg.graft.max_group, d.entries, 64 * d.rows, d.seed))
  batches = pack_batches(data_dir, cfg, bench.steps)
  rows = {"HAMburger": measure_hamburger(trainer, cfg, batches)}
  if bench.sft:
    base = trainer.current_model().base  # the step donated the original buffers
    del trainer  # its optimiser state: the base's arrays live on in `base`
    rows = {"plain SFT of the base": measure_sft(base, cfg, batches), **rows}
  rate, token_rate = cli.phase("timing the input pipeline",
                               lambda: input_rate(data_dir, cfg, bench.input_batches))
  peak = first_peak.best(device_peak())  # measured again, after the steps
  return report_lines(bench, cfg, batches, rows, (rate, token_rate), peak)


def report_lines(bench: TrainBench, cfg, batches: Batches, rows: dict[str, StepRow],
                 input_rates: tuple[float, float], peak: peaks.Peak) -> list[str]:
  """The report: the steps' table (each step's MFU over the devices it ran on), the input
  pipeline's rate and what bounds training. `peak`: one device's."""
  d, n = cfg.data, batches.tokens
  rate, token_rate = input_rates
  lines = []
  say = lambda *parts: lines.extend("".join(parts).split("\n"))
  say(f"{bench.config}{' (random weights)' if bench.random_weights else ''}: {d.rows} rows/step,"
      f" HAMburger rows of {d.entries} entries / {d.groups} groups, SFT rows of {batches.width} "
      f"tokens; ~{n} response tokens per step; trainable {cfg.train.trainable}, recipe "
      f"{cfg.train.recipe}; {cfg.model.param_dtype} weights, {cfg.model.dtype} compute; best of "
      f"{len(batches.rows) - 1} steps after warm-up")
  say(f"device: {peak.name}; peak {peak.flops / 1e12:.3g} TFLOP/s per device ({peak.source}); "
      "MFU over the devices a step ran on (devices column), their peaks added")
  say("FLOPs per response token; model = forward + backward (MFU's numerator), executed adds "
      "the LM head's rematerialised forward; XLA: cost analysis of the timed program, "
      "elementwise work included and its chunked-loss loop counted once (XLA / ours compares "
      "it with ours counted the same way; left out on a GPU, where XLA does not count the "
      "matmuls cuBLAS runs)")
  say("\n| step | devices | seconds | response tokens/s | model FLOPs/token | executed "
      "FLOPs/token (ours) | FLOPs/token (XLA) | XLA / ours | MFU | compile s |")
  say("|---|---|---|---|---|---|---|---|---|---|")
  for name, r in rows.items():
    xla_cols = ("- | -" if r.xla is None else
                f"{r.xla / n / 1e6:.1f}M | {r.xla / r.xla_check.executed:.3f}")
    say(f"| {name} | {r.devices} | {r.seconds:.3f} | {n / r.seconds:.0f} | "
        f"{r.flops.model / n / 1e6:.1f}M | {r.flops.executed / n / 1e6:.1f}M | {xla_cols} | "
        f"{r.mfu(peak):.1%} | {r.compile_s:.0f} |")
  h = rows["HAMburger"].seconds
  say(f"| input pipeline (grain, alone) | - | {1 / rate:.3f} | {token_rate:.0f} | - | - | - | - "
      "| - | - |")
  if "plain SFT of the base" in rows:
    say(f"\nHAMburger / SFT step cost: {h / rows['plain SFT of the base'].seconds:.2f}x")
  say(f"input: {rate:.1f} batches/s against {1 / h:.2f} HAMburger steps/s: "
      + (f"compute-bound (the pipeline could feed {rate * h:.1f}x the step rate)"
         if rate * h >= 1 else f"input-bound (the step could take {1 / (rate * h):.1f}x the "
         "batches the pipeline makes)"))
  return lines
