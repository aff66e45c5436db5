"""Train-step cost: a HAMburger step vs a plain SFT step of the base on the same samples, each
step's FLOPs (ours and XLA's) and MFU, and the input pipeline's rate beside them.

  python -m train.bench --config configs/smollm2_135m_paper.yaml [--data DIR] [--steps 3]
  python -m train.bench --config configs/smollm2_135m.yaml --stage micro --data DIR  # stage 1
  python -m train.bench --config configs/llama3_2_1b.yaml --random-weights --rows 1 \
      --entries 128 --trainable graft --no-sft                 # the 1B model, no weights needed

Both steps see the same packed rows of samples: HAMburger as merged entries + groups, SFT as
the plain token sequence with the loss on response tokens. Both use AdamW. The SFT step always
trains the whole base (the run a user would do instead); --trainable picks HAMburger's set (all:
the same base weights plus the graft; graft: graft and adapters only). Times are the best of
--steps after a compiled warm-up; the HAMburger / SFT ratio is the graft's training overhead.

Without --data the samples are synthetic, at lengths scaled to the config's rows, written as a
dataset so that the real grain pipeline (shuffle, layout, packing, prefetch) reads them: its
rate, measured alone, says whether input or compute bounds training. --random-weights builds
the config's model with random weights (its base architecture from the GGUF metadata, an HF
config.json, or config.KNOWN_ARCHITECTURES for a base that is not on this machine). Steps run
data-parallel over the local devices (mesh data=-1; --set mesh.fsdp=N shards).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import tempfile
import time

import numpy as np

from hamburger_jax.run_config import RECIPES, TRAINABLE
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


def check_flags(p: argparse.ArgumentParser, args) -> None:
  for flag in ("steps", "rows", "entries", "groups", "input_batches"):
    v = getattr(args, flag)
    if v is not None and v < 1:
      p.error(f"--{flag.replace('_', '-')} {v} must be >= 1")
  if args.entries and args.groups and args.groups > args.entries:
    p.error(f"--groups {args.groups} > --entries {args.entries}: each predicted group needs its "
            "own entry; lower --groups")
  cli.check_peak_flags(p, args)


def shape_overrides(args, raw_data: dict) -> list[str]:
  """--rows / --entries / --groups as config overrides; --entries alone keeps the config's
  groups-per-entry ratio."""
  out = [f"data.rows={args.rows}"] if args.rows else []
  if args.entries:
    out.append(f"data.entries={args.entries}")
    if not args.groups:
      entries, groups = int(raw_data.get("entries", 256)), int(raw_data.get("groups", 128))
      out.append(f"data.groups={max(1, min(args.entries, args.entries * groups // entries))}")
  if args.groups:
    out.append(f"data.groups={args.groups}")
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m train.bench", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True)
  p.add_argument("--stage", default=None, help="a stage of a staged config (its trainable set)")
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--data", default=None, help="tfds dataset dir (default: synthetic samples)")
  p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
  p.add_argument("--trainable", default=None, choices=TRAINABLE,
                 help="HAMburger's trained set: all, graft, or a distill stage's (micro: stage "
                 "1, on stored teacher features; merger: stage 2)")
  p.add_argument("--recipe", default=None, choices=RECIPES,
                 help="default: the config's (micro needs distill and a teacher dataset)")
  p.add_argument("--random-weights", action="store_true",
                 help="the config's model with random weights (no weight files)")
  p.add_argument("--rows", type=int, default=None, help="packed rows per step (data.rows)")
  p.add_argument("--entries", type=int, default=None,
                 help="base-input entries per row, the sequence length (data.entries)")
  p.add_argument("--groups", type=int, default=None,
                 help="predicted groups per row (data.groups; default with --entries: the "
                 "config's ratio)")
  p.add_argument("--no-sft", action="store_true",
                 help="skip the SFT baseline (a second optimiser state of the whole base)")
  p.add_argument("--input-batches", type=int, default=20,
                 help="batches the input pipeline's rate is timed over")
  cli.add_peak_flags(p)
  cli.add_precision_flag(p)
  args = p.parse_args(argv)
  check_flags(p, args)

  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.config import ConfigError, load_yaml  # pylint: disable=C0415
  from hamburger_jax.run_config import load_run_config  # pylint: disable=C0415

  recipe = [f"train.recipe={args.recipe}"] if args.recipe else []
  trainable = [] if args.stage and args.trainable is None else [
      f"train.trainable={args.trainable or 'all'}"]
  mesh = ["mesh.data=-1", "mesh.fsdp=1", "mesh.tensor=1"]  # before --set: the user's win
  try:
    shapes = shape_overrides(args, load_yaml(args.config).get("data") or {})
    cfg = load_run_config(args.config, mesh + args.set + shapes + recipe + trainable + [
        "data.accum=1", "train.init_from=''", f"train.precision={args.precision}"],
                          stage=args.stage)
    if args.random_weights:
      cfg = pretrained.random_run_config(cfg)
  except (ConfigError, RuntimeError) as e:  # RuntimeError: an asset (the GGUF) not installed
    raise SystemExit(f"error: {e}") from None
  if cfg.train.recipe == "distill" and not args.data:
    raise SystemExit("error: recipe distill trains on the teacher's stored signals, which "
                     "synthetic samples lack: pass --data DIR (train.prepare_data "
                     "--teacher-top-k) or --recipe paper")
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  cache.enable_compilation_cache()
  with tempfile.TemporaryDirectory(prefix="train-bench-") as tmp:
    run(args, cfg, tmp)
  return 0


def run(args, cfg, tmp: str) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from hamburger_jax import layout, peaks, roofline  # pylint: disable=import-outside-toplevel
  from hamburger_jax.data import pipeline  # pylint: disable=import-outside-toplevel
  from hamburger_jax.training import Trainer  # pylint: disable=import-outside-toplevel

  d, k = cfg.data, cfg.graft.max_group
  first_peak = cli.device_peak(args, cfg.model.dtype)
  trainer = cli.phase("building the model" + (" (random weights)" if args.random_weights else ""),
                      lambda: Trainer(cfg))
  hcfg = trainer.model.cfg
  data_dir = args.data or cli.phase("writing synthetic samples", lambda: synthetic_dataset(
      f"{tmp}/data", hcfg.base.vocab_size, k, d.entries, 64 * d.rows, d.seed))
  source = pipeline.open_split(data_dir, "train", k)
  records = [source[i] for i in range(min(len(source), 64 * d.rows))]
  batches = pack_first_fit(records, k, d.entries, d.groups, d.rows, args.steps + 1)
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

  if not args.no_sft:
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
                               lambda: input_rate(data_dir, cfg, args.input_batches))
  peak = first_peak.best(cli.device_peak(args, cfg.model.dtype))  # measured again, after the steps

  print(f"{args.config}{' (random weights)' if args.random_weights else ''}: {d.rows} rows/step,"
        f" HAMburger rows of {d.entries} entries / {d.groups} groups, SFT rows of {width} tokens;"
        f" ~{n} response tokens per step; trainable {cfg.train.trainable}, recipe "
        f"{cfg.train.recipe}; {cfg.model.param_dtype} weights, {cfg.model.dtype} compute; best of "
        f"{len(ham_times)} steps after warm-up")
  print(f"device: {peak.name} x {jax.device_count()}; peak {peak.flops / 1e12:.3g} TFLOP/s per "
        f"device ({peak.source})")
  print("FLOPs per response token; model = forward + backward (MFU's numerator), executed adds "
        "the LM head's rematerialised forward; XLA: cost analysis of the timed program, "
        "elementwise work included and its chunked-loss loop counted once (XLA / ours compares "
        "it with ours counted the same way; left out on a GPU, where XLA does not count the "
        "matmuls cuBLAS runs)")
  print("\n| step | seconds | response tokens/s | model FLOPs/token | executed FLOPs/token (ours) "
        "| FLOPs/token (XLA) | XLA / ours | MFU | compile s |")
  print("|---|---|---|---|---|---|---|---|---|")
  peak_all = dataclasses.replace(peak, flops=peak.flops * jax.device_count())
  for name, (s, c, ours, xla, check) in rows.items():
    xla_cols = ("- | -" if xla is None else
                f"{xla / n / 1e6:.1f}M | {xla / check.executed:.3f}")
    print(f"| {name} | {s:.3f} | {n / s:.0f} | {ours.model / n / 1e6:.1f}M | "
          f"{ours.executed / n / 1e6:.1f}M | {xla_cols} | "
          f"{peaks.mfu(ours.model, s, peak_all):.1%} | {c:.0f} |")
  h = rows["HAMburger"][0]
  print(f"| input pipeline (grain, alone) | {1 / rate:.3f} | {token_rate:.0f} | - | - | - | - | "
        "- | - |")
  if "plain SFT of the base" in rows:
    print(f"\nHAMburger / SFT step cost: {h / rows['plain SFT of the base'][0]:.2f}x")
  print(f"input: {rate:.1f} batches/s against {1 / h:.2f} HAMburger steps/s: "
        + (f"compute-bound (the pipeline could feed {rate * h:.1f}x the step rate)"
           if rate * h >= 1 else f"input-bound (the step could take {1 / (rate * h):.1f}x the "
           "batches the pipeline makes)"))


if __name__ == "__main__":
  sys.exit(main())
