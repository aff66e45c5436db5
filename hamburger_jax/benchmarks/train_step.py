"""The train-step bench (`python -m train.bench`): a HAMburger step against a plain SFT step of
the base on the same packed rows, each step's FLOPs (ours and XLA's) and MFU, and the input
pipeline's rate beside them."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Any, Callable

import numpy as np

from hamburger_jax import cli


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
  from hamburger_jax.data import pipeline  # pylint: disable=import-outside-toplevel
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
  from hamburger_jax.data import synthetic  # pylint: disable=import-outside-toplevel
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  from hamburger_jax.data.tfds_builder import build_dataset  # pylint: disable=C0415
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
  from hamburger_jax.data import pipeline  # pylint: disable=import-outside-toplevel
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
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from hamburger_jax.losses import sft_loss  # pylint: disable=import-outside-toplevel

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
  evenly); None where XLA does not count matmuls (a GPU: roofline.xla_counts_matmuls)."""
  from hamburger_jax import roofline  # pylint: disable=import-outside-toplevel
  if not roofline.xla_counts_matmuls():
    return None
  return roofline.xla_flops(compiled) * devices


@dataclasses.dataclass(frozen=True)
class TrainBench:
  """What `python -m train.bench` measures, besides its run config."""
  config: str  # the config's path, for the report's first line
  steps: int = 3  # timed steps, after one warm-up
  data: str | None = None  # a tfds dataset dir (None: synthetic samples)
  random_weights: bool = False  # the report says so
  sft: bool = True  # the SFT baseline (a second optimiser state of the whole base)
  input_batches: int = 20  # batches the input pipeline's rate is timed over


def run(bench: TrainBench, cfg, tmp: str, device_peak: Callable[[], Any]) -> list[str]:
  """Measures the HAMburger step against a plain SFT step of the base on
  the same packed rows, with FLOPs, MFU and the input pipeline's rate; `device_peak()` gives the
  device's peaks.Peak (measured before and after the steps), `tmp` holds synthetic data.
  Returns the report's lines (markdown)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from hamburger_jax import layout, peaks, roofline  # pylint: disable=import-outside-toplevel
  from hamburger_jax.data import pipeline  # pylint: disable=import-outside-toplevel
  from hamburger_jax.training import Trainer  # pylint: disable=import-outside-toplevel

  d, k = cfg.data, cfg.graft.max_group
  first_peak = device_peak()
  trainer = cli.phase("building the model" + (" (random weights)" if bench.random_weights else ""),
                      lambda: Trainer(cfg))
  hcfg = trainer.model.cfg
  data_dir = bench.data or cli.phase("writing synthetic samples", lambda: synthetic_dataset(
      f"{tmp}/data", hcfg.base.vocab_size, k, d.entries, 64 * d.rows, d.seed))
  source = pipeline.open_split(data_dir, "train", k)
  records = [source[i] for i in range(min(len(source), 64 * d.rows))]
  batches = pack_first_fit(records, k, d.entries, d.groups, d.rows, bench.steps + 1)
  if len(batches) < 2:
    raise SystemExit(f"error: {data_dir} fills {len(batches)} batch(es) of {d.rows} rows; the "
                     "bench needs 2 (a warm-up and a timed step): use more data or fewer --rows")
  width = max(sum(len(r["input_ids"]) for r, _ in row) for b in batches for row in b)
  width = -(-width // 64) * 64
  tokens = [sum(len(r["input_ids"]) - int(r["prompt_len"]) for row in b for r, _ in row)
            for b in batches]
  n = int(np.mean(tokens[1:]))

  # Each step compiled once, ahead of time: the timed steps run that executable, and XLA's FLOP
  # count is read off it (no second program compiled only to be counted).
  globals_ = [trainer.global_batch([layout.pack_rows([[lay for _, lay in row] for row in b],
                                                     d.entries, d.groups, k).as_dict()])
              for b in batches]
  ham_step, compile_s = compile_timed("compiling the HAMburger step",
                                      lambda: trainer.lower_step(globals_[0]))
  ham_times = []
  for i, batch in enumerate(globals_):
    t = time.perf_counter()
    trainer.state, metrics = ham_step(trainer.state, trainer.frozen, batch)
    jax.block_until_ready(metrics)
    if i:
      ham_times.append(time.perf_counter() - t)
  ham = roofline.train_step_flops(hcfg, d.rows, d.entries, d.groups, cfg.train.trainable,
                                  cfg.train.ce_chunk)
  # What XLA counts of that program: the chunked loss's loop body once.
  ham_check = roofline.train_step_flops(hcfg, d.rows, d.entries, d.groups, cfg.train.trainable,
                                        cfg.train.ce_chunk, loop_once=True)
  ham_xla = xla_view(ham_step, trainer.mesh.size)
  rows = {"HAMburger": (min(ham_times), compile_s, ham, ham_xla, ham_check)}

  if bench.sft:
    base = trainer.current_model().base  # the step donated the original buffers
    # Committed to one device, as the step's outputs are: arguments placed otherwise (the
    # trainer's mesh, an eager init's uncommitted zeros) would not match the compiled step.
    device = jax.devices()[0]
    params = jax.device_put(nnx.state(base, nnx.Param), device)
    graphdef = nnx.graphdef(base)
    del trainer, ham_step, globals_  # the optimiser state; the base's arrays live on in `params`
    tx = optax.adamw(cfg.train.lr_base, weight_decay=cfg.train.weight_decay)
    opt_state = jax.device_put(tx.init(params), device)
    sft_batches = [jax.device_put({key: jnp.asarray(v) for key, v in sft_rows(
        [[r for r, _ in row] for row in b], width).items()}, device) for b in batches]
    sft_step, compile_s = compile_timed("compiling the SFT step", lambda: make_sft_step(
        graphdef, tx, cfg.train.ce_chunk).lower(params, opt_state, sft_batches[0]))
    sft_times = []
    for i, batch in enumerate(sft_batches):
      t = time.perf_counter()
      params, opt_state, _ = jax.block_until_ready(sft_step(params, opt_state, batch))
      if i:
        sft_times.append(time.perf_counter() - t)
    sft = roofline.sft_step_flops(hcfg.base, d.rows, width, cfg.train.ce_chunk)
    sft_check = roofline.sft_step_flops(hcfg.base, d.rows, width, cfg.train.ce_chunk,
                                        loop_once=True)
    rows = {"plain SFT of the base": (min(sft_times), compile_s, sft, xla_view(sft_step, 1),
                                      sft_check), **rows}

  rate, token_rate = cli.phase("timing the input pipeline",
                               lambda: input_rate(data_dir, cfg, bench.input_batches))
  peak = first_peak.best(device_peak())  # measured again, after the steps

  lines = []
  say = lambda *parts: lines.extend("".join(parts).split("\n"))
  say(f"{bench.config}{' (random weights)' if bench.random_weights else ''}: {d.rows} rows/step,"
        f" HAMburger rows of {d.entries} entries / {d.groups} groups, SFT rows of {width} tokens;"
        f" ~{n} response tokens per step; trainable {cfg.train.trainable}, recipe "
        f"{cfg.train.recipe}; {cfg.model.param_dtype} weights, {cfg.model.dtype} compute; best of "
        f"{len(ham_times)} steps after warm-up")
  say(f"device: {peak.name} x {jax.device_count()}; peak {peak.flops / 1e12:.3g} TFLOP/s per "
        f"device ({peak.source})")
  say("FLOPs per response token; model = forward + backward (MFU's numerator), executed adds "
        "the LM head's rematerialised forward; XLA: cost analysis of the timed program, "
        "elementwise work included and its chunked-loss loop counted once (XLA / ours compares "
        "it with ours counted the same way; left out on a GPU, where XLA does not count the "
        "matmuls cuBLAS runs)")
  say("\n| step | seconds | response tokens/s | model FLOPs/token | executed FLOPs/token (ours) "
        "| FLOPs/token (XLA) | XLA / ours | MFU | compile s |")
  say("|---|---|---|---|---|---|---|---|---|")
  peak_all = dataclasses.replace(peak, flops=peak.flops * jax.device_count())
  for name, (s, c, ours, xla, check) in rows.items():
    xla_cols = ("- | -" if xla is None else
                f"{xla / n / 1e6:.1f}M | {xla / check.executed:.3f}")
    say(f"| {name} | {s:.3f} | {n / s:.0f} | {ours.model / n / 1e6:.1f}M | "
          f"{ours.executed / n / 1e6:.1f}M | {xla_cols} | "
          f"{peaks.mfu(ours.model, s, peak_all):.1%} | {c:.0f} |")
  h = rows["HAMburger"][0]
  say(f"| input pipeline (grain, alone) | {1 / rate:.3f} | {token_rate:.0f} | - | - | - | - | "
        "- | - |")
  if "plain SFT of the base" in rows:
    say(f"\nHAMburger / SFT step cost: {h / rows['plain SFT of the base'][0]:.2f}x")
  say(f"input: {rate:.1f} batches/s against {1 / h:.2f} HAMburger steps/s: "
        + (f"compute-bound (the pipeline could feed {rate * h:.1f}x the step rate)"
           if rate * h >= 1 else f"input-bound (the step could take {1 / (rate * h):.1f}x the "
           "batches the pipeline makes)"))
  return lines
