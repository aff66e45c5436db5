"""Train HAMburger: python -m train.main --config configs/X.yaml [--stage S] [--set key=value ...]

Resumes from the latest checkpoint in checkpoint.dir automatically. Multi-host: pass
--num-processes/--process-id/--coordinator (or set JAX_NUM_PROCESSES, JAX_PROCESS_ID,
JAX_COORDINATOR_ADDRESS); each process then feeds its own shard of the data. On CPU the processes
talk through gloo (see train/launch_local.sh). When one process is lost (no heartbeat for
distributed.heartbeat_timeout_s), every other one ends with a line naming it and the checkpoint
to resume from, exit code 75.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import TYPE_CHECKING

from hamburger_jax import multiprocess

if TYPE_CHECKING:
  from hamburger_jax.run_config import RunConfig


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m train.main", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="YAML run config (see configs/)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="override a config value, e.g. --set train.steps=100 (repeatable)")
  p.add_argument("--stage", default=None,
                 help="for a config with `stages:`, the stage to run (each starts from the "
                 "previous stage's export)")
  p.add_argument("--max-steps", type=int, default=None,
                 help="stop after this many steps in this invocation (resume later)")
  p.add_argument("--max-minutes", type=float, default=None,
                 help="stop (and save) after the first step that ends past this many minutes")
  p.add_argument("--max-cpu-minutes", type=float, default=None,
                 help="stop (and save) after the first step that brings this process's CPU time "
                 "in training steps past this many minutes (all cores counted: comparable runs "
                 "on a shared CPU)")
  p.add_argument("--num-processes", type=int, default=None)
  p.add_argument("--process-id", type=int, default=None)
  p.add_argument("--coordinator", default=None, help="host:port of process 0")
  p.add_argument("--cpu-devices", type=int, default=None,
                 help="fake this many CPU devices per process (testing sharding on one machine)")
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--export-step", type=int, default=None, metavar="STEP",
                 help="train nothing: export the checkpoint saved at STEP (e.g. the best by the "
                 "generation check) to checkpoint.export, or checkpoint.dir/export")
  p.add_argument("--export-shard-mb", type=float, default=None, metavar="MB",
                 help="write the export in files of at most MB MiB (graft-00001-of-0000N"
                 ".safetensors ..., indexed in hamburger.json; e.g. 16 where files leave a "
                 "machine in transfers capped per file); loading reads either form")
  args = p.parse_args(argv)
  if args.max_steps is not None and args.max_steps < 1:
    p.error(f"--max-steps={args.max_steps} must be a positive number of steps (leave it out to "
            "train to train.steps)")
  if args.max_minutes is not None and not args.max_minutes >= 0:
    p.error(f"--max-minutes={args.max_minutes} must be >= 0 (0: stop after one step)")
  if args.export_step is not None and args.export_step < 1:
    p.error(f"--export-step={args.export_step} must be a saved step (>= 1)")
  if args.max_cpu_minutes is not None and not args.max_cpu_minutes >= 0:
    p.error(f"--max-cpu-minutes={args.max_cpu_minutes} must be >= 0 (0: stop after one step)")
  if args.export_shard_mb is not None and not args.export_shard_mb > 0:
    p.error(f"--export-shard-mb={args.export_shard_mb} must be a positive size in MiB (leave it "
            "out for one file per table)")
  return args


def process_group(args: argparse.Namespace) -> multiprocess.ProcessGroup | None:
  """The run's processes from flags or the usual environment variables; None for one process."""
  n = args.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0") or 0)
  if n <= 1:
    return None
  pid = args.process_id if args.process_id is not None else os.environ.get("JAX_PROCESS_ID")
  coord = args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if pid is None or coord is None:
    raise SystemExit(f"error: a run of {n} processes needs each one's --process-id (or "
                     "JAX_PROCESS_ID) and --coordinator host:port (or JAX_COORDINATOR_ADDRESS)")
  if not str(pid).isdigit() or not int(pid) < n:
    raise SystemExit(f"error: process id {pid} is not one of the run's processes 0..{n - 1}")
  return multiprocess.ProcessGroup(n, int(pid), coord)


def init_distributed(args: argparse.Namespace, group: multiprocess.ProcessGroup | None,
                     heartbeat_timeout_s: int) -> None:
  """Fake CPU devices and jax.distributed, before any backend starts (entry point only)."""
  import jax  # pylint: disable=import-outside-toplevel
  if args.cpu_devices:
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if group is None:
    return
  # Only affects the CPU client (cross-process collectives on CPU); set before any backend starts.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=group.coordinator,
                             num_processes=group.num_processes, process_id=group.process_id,
                             heartbeat_timeout_seconds=heartbeat_timeout_s)


def supervise(argv: list[str], cfg: RunConfig, group: multiprocess.ProcessGroup) -> int:
  """Trains in a child process and ends in one line if another process of the run is lost
  (hamburger_jax/multiprocess.py)."""
  return multiprocess.supervise(
      [sys.executable, "-m", "train.main", *argv], sys.stderr.buffer,
      lambda report: multiprocess.describe_loss(report, group, cfg.distributed.heartbeat_timeout_s,
                                                cfg.checkpoint.dir))


def main(argv=None) -> int:
  args = parse_args(argv)
  from hamburger_jax.config import ConfigError  # pylint: disable=import-outside-toplevel
  from hamburger_jax.run_config import (  # pylint: disable=import-outside-toplevel
      check_training_inputs, load_run_config)
  try:
    cfg = load_run_config(args.config, args.set, stage=args.stage)
    if args.export_step is None:  # an export reads the run's checkpoints, not its data
      check_training_inputs(cfg)  # before jax starts and the model loads
  except ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  group = process_group(args)
  if group is not None and not multiprocess.supervised():
    return supervise(sys.argv[1:] if argv is None else list(argv), cfg, group)
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  cache.enable_compilation_cache()
  init_distributed(args, group, cfg.distributed.heartbeat_timeout_s)
  from hamburger_jax import graft_checkpoint  # pylint: disable=import-outside-toplevel
  from hamburger_jax import training  # pylint: disable=import-outside-toplevel
  from hamburger_jax.files import StorageError  # pylint: disable=import-outside-toplevel
  try:
    graft_checkpoint.check_shard_limit(args.export_shard_mb)  # before hours of training, not after
  except ValueError as e:
    raise SystemExit(f"error: --export-shard-mb: {e}") from None
  awaits = (multiprocess.peer_loss_awaits_report(cfg.distributed.heartbeat_timeout_s)
            if group is not None else contextlib.nullcontext())
  with awaits:
    if args.export_step is not None:
      try:
        export_dir = training.export_step(cfg, args.export_step)
      except (ConfigError, FileNotFoundError, StorageError) as e:
        raise SystemExit(f"error: {e}") from None
      print(f"done: step {args.export_step} exported to {export_dir}" + shard_export(args,
                                                                                 export_dir))
      return 0
    try:
      result = training.run(cfg, max_steps=args.max_steps, max_minutes=args.max_minutes,
                           max_cpu_minutes=args.max_cpu_minutes,
                           progress=not args.no_progress)
    except (ConfigError, FileNotFoundError, StorageError) as e:
      raise SystemExit(f"error: {e}") from None
  print(f"done: {result.steps_done} steps this run, at step {result.final_step}/{cfg.train.steps}"
        + (f"; export in {result.export_dir}" + shard_export(args, result.export_dir)
           if result.export_dir else ""))
  return 0


def shard_export(args, export_dir: str) -> str:
  """With --export-shard-mb, rewrites the export just written in files of at most that size (by
  the process that wrote it); returns what to add to the closing line."""
  import jax  # pylint: disable=import-outside-toplevel
  from hamburger_jax import files, graft_checkpoint  # pylint: disable=import-outside-toplevel
  if args.export_shard_mb is None or jax.process_index() != 0:
    return ""
  graft_checkpoint.reshard_graft(export_dir, max_shard_mb=args.export_shard_mb)
  n = len([f for f in files.listdir(export_dir) if f.endswith(".safetensors")])
  return f" ({n} files of at most {args.export_shard_mb:g} MiB)"


if __name__ == "__main__":
  sys.exit(main())
