"""Builds a HAMburger training set: tokenise, segment by the base model's entropies, write tfds.

  python -m train.prepare_data --config configs/smollm2.yaml --source gsm_symbolic --limit 2000 \
      --out data/gsm_symbolic

Config keys read: model (the base: smollm2 | file.gguf | HF directory | random) and
graft.max_group, from the same run config that train.main takes. The output is a tfds
array_record directory for hamburger_jax.data.pipeline. --self-distill replaces each response by
the base model's own greedy response (train.self_distill is the resumable JSONL version).

The work goes in shards (--shard-size samples each) under OUT.shards/, joined into OUT at the end;
a rerun after a kill skips the finished shards. Several processes (one per host, or several on
one machine) share it without talking to each other: each reads all the sources and computes
every N-th shard, and the last one to finish joins them (or: --join OUT):

  python -m train.prepare_data ... --out OUT --num-processes 2 --process-id 0 &
  python -m train.prepare_data ... --out OUT --num-processes 2 --process-id 1

Each forward pass holds --batch-tokens tokens per device, its rows split over this process's
devices; the records do not depend on the number of processes or devices.
"""

from __future__ import annotations

import argparse
import os
import sys

from hamburger_jax import files
from hamburger_jax.assets import AssetError
from hamburger_jax.data import heldout, prepare, shards, source_specs, sources, teacher_pass
from hamburger_jax.data.tfds_builder import DatasetExistsError, check_output_dir
from hamburger_jax.layout import LayoutError
from hamburger_jax.run_config import DATASET_READER, load_run_config
from hamburger_jax.segmentation import get_strategy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m train.prepare_data", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", help="YAML run config (its model: and graft:)")
  p.add_argument("--source", action="append",
                 help=f"one of: {', '.join(source_specs.PIPELINE_SOURCES)}, optionally SPEC@N for "
                 "at most N of its conversations; repeat to mix sources (read in the order given)")
  p.add_argument("--limit", type=int, default=None,
                 help="at most this many conversations (of each source without its own @N)")
  p.add_argument("--strategy", default="decreasing_v2",
                 help="segmentation: decreasing_v2 (default), fixed:k, sliding, small_group, "
                 "confident:p, or given (the groups recorded with each self-distilled answer "
                 "of `train.self_distill --checkpoint`: on-policy groups); given:STRATEGY "
                 "segments the records that have none by STRATEGY (e.g. given:confident:0.6, "
                 "to mix the base's own answers into on-policy ones)")
  p.add_argument("--max-len", type=int, default=teacher_pass.DEFAULT_MAX_LEN,
                 help="drop samples with more prompt + response tokens (default "
                 f"{teacher_pass.DEFAULT_MAX_LEN})")
  p.add_argument("--val-fraction", type=float, default=0.05)
  p.add_argument("--seed", type=int, default=0,
                 help="validation split and gsm_symbolic problems (must be < 10000)")
  p.add_argument("--batch-tokens", type=int, default=teacher_pass.DEFAULT_BATCH_TOKENS,
                 help="tokens per forward pass and device (padding included)")
  p.add_argument("--self-distill", action="store_true",
                 help="replace responses with the base model's own greedy responses")
  p.add_argument("--distill-tokens", type=int, default=256,
                 help="max new tokens of a self-distilled response")
  p.add_argument("--distill-batch", type=int, default=16)
  p.add_argument("--teacher-top-k", type=int, default=0,
                 help="store teacher signals for the distill recipe: the base's top-k "
                 "log-probabilities per response token and its features at each group's "
                 "predicting position (0: none, the paper recipe)")
  p.add_argument("--keep-split-of", metavar="DIR",
                 help="a dataset this one grows (more answers, or other answers to its "
                      "prompts): a prompt found there keeps its split, new prompts are split at "
                      "--val-fraction, so a model trained on DIR meets none of its training "
                      "prompts in the new validation split")
  p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
  p.add_argument("--token-ids", action="store_true",
                 help="a base without a tokenizer (a run config's random one): every record "
                 "carries its token ids (train.self_distill --config's answers)")
  p.add_argument("--out", help="output dataset directory")
  p.add_argument("--shard-size", type=int, default=256,
                 help="samples per shard: the unit of resuming and of the work shared between "
                 "processes (default 256)")
  p.add_argument("--num-processes", type=int, default=None,
                 help="processes sharing the work (default: JAX_NUM_PROCESSES, else 1); every "
                 "process gets the same flags")
  p.add_argument("--process-id", type=int, default=None,
                 help="this process, 0 .. N-1 (default: JAX_PROCESS_ID, else 0)")
  p.add_argument("--cpu-devices", type=int, default=None,
                 help="fake this many CPU devices (testing the data-parallel pass on one CPU)")
  p.add_argument("--join", metavar="OUT",
                 help="only join the finished shards of OUT (OUT.shards/) into the dataset OUT")
  args = p.parse_args(argv)
  if args.join:
    given = [f for f in ("config", "source", "out") if getattr(args, f)]
    if given:
      p.error(f"--join takes the dataset directory alone (and --overwrite), not "
              f"--{', --'.join(given)}")
    return args
  missing = [f"--{f}" for f in ("config", "source", "out") if not getattr(args, f)]
  if missing:
    p.error(f"the following arguments are required: {', '.join(missing)}")
  env = os.environ
  if args.num_processes is None:
    args.num_processes = int(env.get("JAX_NUM_PROCESSES") or 1)
  if args.process_id is None:
    args.process_id = int(env.get("JAX_PROCESS_ID") or 0)
  if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
    p.error(f"--process-id {args.process_id} must be in [0, --num-processes "
            f"{args.num_processes})")
  if args.shard_size < 1:
    p.error(f"--shard-size={args.shard_size} must be positive")
  if args.self_distill and args.num_processes > 1:
    p.error("--self-distill runs in one process: write the answers with python -m "
            "train.self_distill first, then prepare them (jsonl:PATH) in several processes")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if args.join:
    return _join(args)
  try:
    # Cheap checks first: a typo should not cost a model load.
    check_output_dir(args.out, args.overwrite)
    get_strategy(args.strategy)
    cfg = load_run_config(args.config, shared_only=True)
    max_group = cfg.graft.max_group
    if args.teacher_top_k < 0:
      raise ValueError(f"--teacher-top-k={args.teacher_top_k} must be >= 0")
    # reasoning-gym repeats questions across seeds: drop gsm_symbolic's evaluation questions.
    conversations = source_specs.mixed_sources(
        args.source, args.limit, args.seed,
        exclude=heldout.evaluation_questions("gsm_symbolic"))
    keep_split = prepare.split_of_samples(args.keep_split_of) if args.keep_split_of else None
  except (DatasetExistsError, ValueError, files.StorageError) as e:
    return _fail(e)
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  cache.enable_compilation_cache()
  if args.cpu_devices:
    import jax  # pylint: disable=import-outside-toplevel
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  tfds.disable_progress_bar()  # ours below is the one that means something
  try:
    model, tokenizer = prepare.load_base(cfg.model, args.token_ids)
  except (ValueError, AssetError, FileNotFoundError) as e:
    return _fail(e)
  if args.self_distill:
    from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
    from hamburger_jax.data.self_distill import distill  # pylint: disable=C0415
    conversations = list(conversations)
    with tqdm(total=len(conversations), unit="sample", desc="self-distilling") as bar:
      conversations = [conv for conv, _ in distill(
          conversations, Engine(model, tokenizer), tokenizer, max_new_tokens=args.distill_tokens,
          batch=args.distill_batch, progress=bar.update)]
  try:
    teacher = teacher_pass.teacher_spec(model, cfg.graft, args.teacher_top_k)
  except ValueError as e:
    return _fail(e)
  try:
    with tqdm(unit="sample", desc="segmenting" + (" + teacher" if teacher else "")) as bar:
      stats = prepare.prepare_dataset(
          conversations, model, tokenizer, args.out, strategy=args.strategy,
          max_group=max_group, max_len=args.max_len, val_fraction=args.val_fraction,
          seed=args.seed, overwrite=args.overwrite, batch_tokens=args.batch_tokens,
          metadata={"source": ",".join(args.source), "config": args.config,
                    "base": cfg.model.base},
          teacher=teacher, keep_split=keep_split, progress=bar.update,
          chunk_size=args.shard_size, process_id=args.process_id,
          num_processes=args.num_processes)
  except (sources.SourceError, LayoutError, DatasetExistsError, shards.ShardsError) as e:
    return _fail(e)  # bad data or a mismatched run, named
  print(stats.summary())
  if stats.joined:
    print(f"wrote {args.out}")
  elif not stats.shards_missing:
    print(f"{args.out} was joined by another process")
  else:
    print(f"when every process is done: python -m train.prepare_data --join {args.out}")
  return 0


def _join(args: argparse.Namespace) -> int:
  try:
    files.check_local(args.join, "--join", DATASET_READER)  # before the shards are looked for
    stats = prepare.join_shards(args.join, overwrite=args.overwrite)
  except (shards.ShardsError, DatasetExistsError, files.StorageError) as e:
    return _fail(e)
  print(stats.summary())
  print(f"wrote {args.join}")
  return 0


def _fail(e: Exception) -> int:
  print(f"error: {e}", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main())
