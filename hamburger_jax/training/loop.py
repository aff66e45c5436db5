"""A training run around the train step: data, orbax checkpoints with exact resume, metrics
(metrics.jsonl, TensorBoard), the checks it logs (training/checks.py), time budgets, the
params-only export.

State that is saved: the trainable params (graft only, or graft + base), the optimiser state and
the step, together with the grain iterator state and the run config. A frozen base is not saved:
it is reloaded from its source, which the saved config names.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from typing import Any, Callable

import grain
import jax
import orbax.checkpoint as ocp

from hamburger_jax import files, graft_checkpoint, micro_vocab, pretrained
from hamburger_jax.config import ConfigError
from hamburger_jax.data import pipeline
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.run_config import RunConfig, checkpoints_dir
from hamburger_jax.training.checks import RunChecks
from hamburger_jax.training.metrics_log import MetricsLog, read_metrics  # noqa: F401  (loop's API)
from hamburger_jax.training.trainer import Trainer

# Config sections that must match to resume from a checkpoint (the rest may change between runs).
RESUME_KEYS = ("model", "graft", "train.trainable", "train.recipe", "train.init_from")


class IteratorSnapshot(grain.DatasetIterator):
  """The data iterator's state frozen at save time (orbax may write it after training moved on)."""

  def __init__(self, state: dict[str, Any]):
    super().__init__()
    self._state = state

  def __next__(self):
    raise StopIteration

  def get_state(self) -> dict[str, Any]:
    return self._state

  def set_state(self, state: dict[str, Any]) -> None:
    self._state = state


def check_data(cfg: RunConfig, meta: dict[str, Any], model: Hamburger | None = None,
               tokenizer=None) -> None:
  """The dataset (its `meta`data) fits the recipe and was made by this run's base (its groups and
  teacher signals come from the base's forward) and tokenizer (its ids). Without `model`: the
  checks that need no model, run before loading one."""
  teacher = meta.get("teacher")
  if cfg.train.recipe == "distill" and not teacher:
    raise ConfigError(
        f"train.recipe=distill needs teacher signals but {cfg.data.dir} has none: prepare it "
        "with python -m train.prepare_data ... --teacher-top-k 16")
  if model is None:
    return
  if cfg.train.recipe == "distill":
    if list(teacher["feature_layers"]) != list(model.feature_layers):
      raise ConfigError(
          f"{cfg.data.dir} stores the teacher's features of layers {teacher['feature_layers']} "
          f"but the graft reads layers {list(model.feature_layers)}: prepare the data with this "
          "run's config")
  # pylint: disable=import-outside-toplevel
  from hamburger_jax.data.teacher_pass import base_fingerprint, tokenizer_fingerprint
  stored = meta.get("base_fingerprint")
  if stored and stored != base_fingerprint(model.base):
    raise ConfigError(
        f"{cfg.data.dir} was segmented with another base model ({meta.get('base', '?')}, "
        f"fingerprint {stored}) than this run's {cfg.model.base!r}: prepare the data with this "
        "run's base")
  stored = meta.get("tokenizer_fingerprint")
  if stored and tokenizer is not None and stored != tokenizer_fingerprint(tokenizer):
    raise ConfigError(
        f"{cfg.data.dir} holds the ids of another tokenizer (fingerprint {stored}) than this "
        f"run's {cfg.model.base!r}: prepare the data with this run's base")


def checkpoint_manager(directory: str, cfg: RunConfig) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      save_interval_steps=1, max_to_keep=cfg.checkpoint.keep, enable_async_checkpointing=True,
      create=True)
  return ocp.CheckpointManager(files.absolute(directory), options=options,
                               item_names=("state", "data", "config"))


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def check_resumable(saved: dict, cfg: RunConfig, where: str) -> None:
  now, then = _flatten(cfg.to_dict()), _flatten(saved)
  for key in RESUME_KEYS:
    diff = sorted(k for k in set(now) | set(then)
                  if (k == key or k.startswith(key + ".")) and now.get(k) != then.get(k))
    if diff:
      k = diff[0]
      raise ConfigError(
          f"checkpoint in {where} is from another model config: {k} is {then.get(k)!r} there "
          f"but {now.get(k)!r} now; use a new checkpoint.dir or the original config")


@dataclasses.dataclass
class RunResult:
  steps_done: int
  final_step: int
  metrics: dict[str, float]
  export_dir: str | None
  interrupted: bool = False  # stopped by SIGTERM (saved where it stood)


def _close(iterator) -> None:
  if hasattr(iterator, "close"):
    iterator.close()


def restore_step(trainer: Trainer, mngr: ocp.CheckpointManager, step: int, cfg: RunConfig,
                 ckpt_dir: str, iterator=None) -> None:
  """Restores the train state saved at `step` (and the data position, given the iterator)."""
  saved_cfg = mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
  check_resumable(saved_cfg["config"], cfg, ckpt_dir)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          trainer.state, trainer.state_shardings)
  items = {"state": ocp.args.StandardRestore(abstract)}
  if iterator is not None:
    items["data"] = grain.checkpoint.CheckpointRestore(iterator)
  trainer.state = mngr.restore(step, args=ocp.args.Composite(**items))["state"]


def resume_latest(trainer: Trainer, mngr: ocp.CheckpointManager, iterator, cfg: RunConfig,
                  ckpt_dir: str, log: Callable[[str], None]) -> None:
  """Restores state and data position from the latest checkpoint, if there is one."""
  latest = mngr.latest_step()
  if latest is None:
    return
  restore_step(trainer, mngr, latest, cfg, ckpt_dir, iterator)
  log(f"resumed from step {latest} in {ckpt_dir}")


def export_path(cfg: RunConfig) -> str:
  """Where a run's params-only export goes."""
  return cfg.checkpoint.export or files.join(cfg.checkpoint.dir, "export")


def check_outputs(cfg: RunConfig) -> None:
  """A bucket that the run's checkpoints or export cannot be written to fails now, in one line
  (files.StorageError), not after the model loaded or a first save."""
  files.check_writable(cfg.checkpoint.dir, "checkpoint.dir")
  if cfg.checkpoint.export:
    files.check_writable(cfg.checkpoint.export, "checkpoint.export")


def export_graft(trainer: Trainer, cfg: RunConfig, step: int,
                 log: Callable[[str], None]) -> str:
  """Writes the params-only export that `infer.generate --checkpoint` (and the next stage) reads,
  with train.init_from's micro-step vocabulary where it stores one (graft_checkpoint.save_graft)."""
  export_dir = export_path(cfg)
  model = trainer.current_model()
  if trainer.process_index == 0:
    graft_checkpoint.save_graft(model, export_dir, cfg.model.base,
                                dtype=cfg.checkpoint.export_dtype,
                                include_base=trainer.trains_base,
                                extra={"trained_steps": step, "run_dir": cfg.checkpoint.dir},
                                micro_vocab_from=cfg.train.init_from or None)
    carried = micro_vocab.carried(cfg.train.init_from, model.cfg.base.vocab_size)
    log(f"exported params to {export_dir}" +
        (f" with {cfg.train.init_from}'s micro vocabulary ({micro_vocab.FILE})" if carried
         else ""))
  return export_dir


def export_step(cfg: RunConfig, step: int, log: Callable[[str], None] = print) -> str:
  """Exports the checkpoint saved at `step` (e.g. the one the generation check liked best, before
  the run's end) without training; returns the export directory."""
  check_outputs(cfg)
  ckpt_dir = checkpoints_dir(cfg.checkpoint.dir)
  if not files.isdir(ckpt_dir):
    raise FileNotFoundError(f"{ckpt_dir} does not exist: no run saved checkpoints in "
                            f"checkpoint.dir={cfg.checkpoint.dir}")
  mngr = checkpoint_manager(ckpt_dir, cfg)
  try:
    steps = sorted(mngr.all_steps())
    if step not in steps:
      raise ConfigError(f"no checkpoint at step {step} in {ckpt_dir}: saved steps are {steps} "
                        "(checkpoint.every sets how often a run saves, checkpoint.keep how many "
                        "it keeps)")
    pretrained.check_init_from(cfg)
    trainer = Trainer(cfg)
    restore_step(trainer, mngr, step, cfg, ckpt_dir)
    return export_graft(trainer, cfg, step, log)
  finally:
    mngr.close()


def _check_limits(max_steps: int | None, max_minutes: float | None,
                  max_cpu_minutes: float | None) -> None:
  if max_steps is not None and max_steps < 1:
    raise ConfigError(f"max_steps={max_steps} must be >= 1")
  for name, value in (("max_minutes", max_minutes), ("max_cpu_minutes", max_cpu_minutes)):
    if value is not None and not value >= 0:
      raise ConfigError(f"{name}={value} must be >= 0")


class _Budget:
  """One invocation's wall-time and CPU-time limits (run's docstring)."""

  def __init__(self, max_minutes: float | None, max_cpu_minutes: float | None):
    self.max_minutes, self.max_cpu_minutes = max_minutes, max_cpu_minutes
    self.deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    self.cpu_used = 0.0

  def cpu_spent(self) -> bool:
    return self.max_cpu_minutes is not None and self.cpu_used >= 60 * self.max_cpu_minutes

  def spent(self) -> bool:
    return (self.deadline is not None and time.monotonic() >= self.deadline) or self.cpu_spent()

  def describe(self) -> str:
    return f"{self.cpu_used / 60:.1f} CPU min" if self.cpu_spent() else f"{self.max_minutes} min"


def _open(cfg: RunConfig, log: Callable[[str], None]) -> tuple[Trainer, ocp.CheckpointManager,
                                                               Any]:
  """The run's trainer, checkpoint manager and data iterator, resumed from the latest save;
  every input is checked before the model loads."""
  check_outputs(cfg)  # a bucket that cannot be written fails before anything loads
  meta = pipeline.dataset_metadata(cfg.data.dir)  # data problems fail before the model loads
  check_data(cfg, meta)
  pretrained.check_init_from(cfg)
  trainer = Trainer(cfg)
  check_data(cfg, meta, trainer.model, trainer.tokenizer)
  d = cfg.data
  ckpt_dir = checkpoints_dir(cfg.checkpoint.dir)
  mngr = checkpoint_manager(ckpt_dir, cfg)
  iterator = pipeline.make_train_iterator(
      d.dir, "train", batch_rows=trainer.local_rows, entries=d.entries, groups=d.groups,
      max_group=cfg.graft.max_group, seed=d.seed, shard_index=trainer.process_index,
      shard_count=trainer.process_count, position_offset=cfg.graft.position_offset)
  try:
    resume_latest(trainer, mngr, iterator, cfg, ckpt_dir, log)
  except BaseException:
    mngr.close()
    _close(iterator)
    raise
  return trainer, mngr, iterator


class _Saver:
  """Saves the train state, the data position and the run config at a step."""

  def __init__(self, mngr: ocp.CheckpointManager, trainer: Trainer, iterator, cfg: RunConfig,
               metrics_log: MetricsLog):
    self.mngr, self.trainer, self.iterator, self.metrics_log = mngr, trainer, iterator, metrics_log
    self.config_dict = cfg.to_dict()
    self.saved = set(mngr.all_steps())

  def __call__(self, step: int) -> None:
    # A stop (time budget, SIGTERM, Ctrl-C) can fall on a step that was just saved or that the
    # run resumed from: orbax refuses to write a step twice, and the state is the same.
    if step in self.saved:
      return
    snapshot = IteratorSnapshot(self.iterator.get_state())
    self.mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(self.trainer.state),
        data=grain.checkpoint.CheckpointSave(snapshot),
        config=ocp.args.JsonSave(self.config_dict)), force=True)
    self.saved.add(step)
    self.metrics_log.flush()


def _timed_step(trainer: Trainer, iterator, cfg: RunConfig, budget: _Budget) -> dict[str, float]:
  """One train step and its metrics, with its time charged to `budget`."""
  t0, c0 = time.perf_counter(), time.process_time()
  m = trainer.step([next(iterator) for _ in range(cfg.data.accum)])
  dt, cpu = time.perf_counter() - t0, time.process_time() - c0
  budget.cpu_used += cpu
  # distill counts teacher windows (up to K tokens from each predicting entry), not groups
  size_key = "mean_window_size" if cfg.train.recipe == "distill" else "mean_group_size"
  m.update({"step_s": dt, "step_cpu_s": cpu, "tokens_per_s": m["tokens"] / dt,
            size_key: m["tokens"] / max(m["groups"], 1.0)})
  return m


def run(cfg: RunConfig, *, max_steps: int | None = None, max_minutes: float | None = None,
        max_cpu_minutes: float | None = None, progress: bool = True,
        log: Callable[[str], None] = print) -> RunResult:
  """Trains until cfg.train.steps (or `max_steps` more steps, or the first step ending after
  `max_minutes` of wall time or `max_cpu_minutes` of this process's CPU time spent in training
  steps), resuming from the latest checkpoint; saves where it stops.

  The CPU-time budget is what keeps two runs on a shared or paused machine comparable (the
  recipe comparison gives each recipe the same CPU minutes): a step's CPU time grows little when
  another job takes the cores (wall time grows a lot), and evaluation is not charged to it. It
  counts per invocation (a resumed run starts a new budget) and charges the first step's
  compilation and the process's background threads (checkpoint writes, data prefetch)."""
  _check_limits(max_steps, max_minutes, max_cpu_minutes)
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  trainer, mngr, iterator = _open(cfg, log)
  t = cfg.train
  start = int(jax.device_get(trainer.state.step))
  end = t.steps if max_steps is None else min(t.steps, start + max_steps)
  metrics_log = MetricsLog(cfg.checkpoint.dir, trainer.process_index == 0)
  save = _Saver(mngr, trainer, iterator, cfg, metrics_log)
  interrupted = []
  previous = signal.signal(signal.SIGTERM, lambda *_: interrupted.append("SIGTERM"))
  checks = RunChecks(trainer, cfg)
  last: dict[str, float] = {}
  bar = tqdm(total=end, initial=start, unit="step", disable=not progress or trainer.process_index)
  budget = _Budget(max_minutes, max_cpu_minutes)
  try:
    if start == 0 < end:  # where the curves start: the initial graft
      first = checks.due(0)
      if first:
        metrics_log.write(0, first)
    for step in range(start, end):
      m = _timed_step(trainer, iterator, cfg, budget)
      done = step + 1
      timed_out = done < end and budget.spent()
      last_step = done == end or timed_out  # a time-boxed stop evaluates and logs like an end
      m.update(checks.due(done, last_step))
      last = m
      if (done % t.log_every == 0 or last_step
          or any(k.startswith(("val_", "fid_")) for k in m)):
        metrics_log.write(done, m)
      bar.update(1)
      bar.set_postfix(loss=f"{m['loss']:.3f}", acc_s2=f"{m.get('acc_s2', 0):.2f}",
                      tok_s=f"{m['tokens_per_s']:.0f}")
      if done % cfg.checkpoint.every == 0 or done == end:
        save(done)
      if interrupted or timed_out:
        log(f"{interrupted[0]}: saving step {done} and stopping" if interrupted else
            f"{budget.describe()} of training: saving step {done} and stopping (run again to "
            "resume)")
        save(done)
        break
  except KeyboardInterrupt:
    done = int(jax.device_get(trainer.state.step))
    log(f"interrupted: saving step {done} and stopping")
    save(done)
    raise
  finally:
    bar.close()
    mngr.wait_until_finished()
    signal.signal(signal.SIGTERM, previous)
    metrics_log.close()
    _close(iterator)
  final = int(jax.device_get(trainer.state.step))
  export_dir = export_graft(trainer, cfg, final, log) if final >= t.steps else None
  mngr.close()
  return RunResult(final - start, final, last, export_dir, bool(interrupted))


@dataclasses.dataclass
class HostedSteps:
  """What `hosted_steps` did: steps and response tokens after it, why it ended, its seconds."""
  steps: int
  tokens: int
  ended: str
  seconds: float


def hosted_steps(trainer: Trainer, batches, lr: Callable[[int, int], dict[str, float]], *,
                 first: int, total: int, tokens: int, stop_at: float, metrics_log: MetricsLog,
                 log_every: int, flops: float, peak,
                 log: Callable[[str], None] = print) -> HostedSteps:
  """Train steps `first`..`total` - 1 over `batches` ((batch, response tokens) pairs) with the
  learning rate fed by the host (`lr(step, total)`, a schedule fixed after measuring, as a
  budgeted window does), until the batches, `total` or the clock (`stop_at`, time.monotonic())
  end; dispatched ahead, synchronised only to log every `log_every` steps."""
  from hamburger_jax.costs import peaks  # pylint: disable=import-outside-toplevel
  ended, done = "the plan's last step", first
  t0 = time.monotonic()
  mark = (t0, tokens, first)
  for step in range(first, total):
    if time.monotonic() > stop_at:
      ended = "the clock (the budget's reserve reached)"
      break
    item = next(batches, None)
    if item is None:
      ended = "the data"
      break
    batch, response = item
    tokens += response
    metrics = trainer.step_async([batch], lr(step, total))
    done = step + 1
    if done % log_every == 0 or done == total:
      m = {k: float(v) for k, v in jax.device_get(metrics).items()}
      now = time.monotonic()
      dt = now - mark[0]
      m.update(response_tokens=tokens, tokens_per_s=(tokens - mark[1]) / dt,
               mfu=peaks.mfu(flops, dt / (done - mark[2]), peak))
      mark = (now, tokens, done)
      metrics_log.write(done, m)
      log(f"step {done}/{total}  loss {m['loss']:.3f}  kl {m.get('kl', float('nan')):.3f}  "
          f"agree merged {m.get('agree_merged', float('nan')):.3f}  tokens/step c0.5 "
          f"{m.get('tf_tokens_per_step_c50', float('nan')):.2f} c0.8 "
          f"{m.get('tf_tokens_per_step_c80', float('nan')):.2f}  {m['tokens_per_s']:,.0f} "
          f"tokens/s  MFU {m['mfu']:.1%}")
  jax.block_until_ready(trainer.state.step)
  metrics_log.flush()
  return HostedSteps(done, tokens, ended, time.monotonic() - t0)
