"""Builds a HAMburger training set: tokenise, segment by the base model's entropies, write tfds.

  python -m train.prepare_data --config configs/smollm2.yaml --source gsm_symbolic --limit 2000 \
      --out data/gsm_symbolic

Config keys read: model (the base: smollm2 | file.gguf | HF directory | random) and
graft.max_group, from the same run config that train.main takes. The output is a tfds
array_record directory for hamburger_jax.data.pipeline. --self-distill replaces each response by
the base model's own greedy response (see train/self_distill.py for a resumable JSONL version).
"""

from __future__ import annotations

import argparse
import sys

from hamburger_jax.assets import AssetError
from hamburger_jax.data import prepare, sources
from hamburger_jax.data.tfds_builder import DatasetExistsError, check_output_dir
from hamburger_jax.evaluation import tasks as eval_tasks
from hamburger_jax.layout import LayoutError
from hamburger_jax.run_config import load_run_config
from hamburger_jax.segmentation import get_strategy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m train.prepare_data", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="YAML run config (its model: and graft:)")
  p.add_argument("--source", required=True, action="append",
                 help=f"one of: {', '.join(sources.SOURCE_SPECS)}, optionally SPEC@N for at most "
                 "N of its conversations; repeat to mix sources (read in the order given)")
  p.add_argument("--limit", type=int, default=None,
                 help="at most this many conversations (of each source without its own @N)")
  p.add_argument("--strategy", default="decreasing_v2",
                 help="segmentation: decreasing_v2 (default), fixed:k, sliding, small_group, "
                 "confident:p, or given (the groups recorded with each self-distilled answer "
                 "of `train.self_distill --checkpoint`: on-policy groups); given:STRATEGY "
                 "segments the records that have none by STRATEGY (e.g. given:confident:0.6, "
                 "to mix the base's own answers into on-policy ones)")
  p.add_argument("--max-len", type=int, default=384,
                 help="drop samples with more prompt + response tokens (default 384)")
  p.add_argument("--val-fraction", type=float, default=0.05)
  p.add_argument("--seed", type=int, default=0,
                 help="validation split and gsm_symbolic problems (must be < 10000)")
  p.add_argument("--batch-tokens", type=int, default=2048,
                 help="tokens per entropy forward batch (padding included)")
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
  p.add_argument("--out", required=True, help="output dataset directory")
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    # Cheap checks first: a typo should not cost a model load.
    check_output_dir(args.out, args.overwrite)
    get_strategy(args.strategy)
    cfg = load_run_config(args.config, shared_only=True)
    max_group = cfg.graft.max_group
    if args.teacher_top_k < 0:
      raise ValueError(f"--teacher-top-k={args.teacher_top_k} must be >= 0")
    # reasoning-gym repeats questions across seeds: drop gsm_symbolic's evaluation questions.
    conversations = sources.mixed_sources(
        args.source, args.limit, args.seed,
        exclude=eval_tasks.evaluation_questions("gsm_symbolic"))
    keep_split = prepare.split_of_samples(args.keep_split_of) if args.keep_split_of else None
  except (DatasetExistsError, ValueError) as e:
    return _fail(e)
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  cache.enable_compilation_cache()
  tfds.disable_progress_bar()  # ours below is the one that means something
  try:
    model, tokenizer = prepare.load_base(cfg.model)
  except (ValueError, AssetError, FileNotFoundError) as e:
    return _fail(e)
  if args.self_distill:
    from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
    from train.self_distill import distill  # pylint: disable=import-outside-toplevel
    conversations = list(conversations)
    with tqdm(total=len(conversations), unit="sample", desc="self-distilling") as bar:
      conversations = [conv for conv, _ in distill(
          conversations, Engine(model, tokenizer), tokenizer, max_new_tokens=args.distill_tokens,
          batch=args.distill_batch, progress=bar.update)]
  teacher = None
  if args.teacher_top_k:
    from hamburger_jax.segmentation import TeacherSpec  # pylint: disable=import-outside-toplevel
    if args.teacher_top_k > model.cfg.vocab_size:
      return _fail(ValueError(f"--teacher-top-k={args.teacher_top_k} exceeds the vocabulary "
                              f"({model.cfg.vocab_size})"))
    teacher = TeacherSpec(args.teacher_top_k,
                          cfg.graft.resolved_feature_layers(model.cfg.num_layers))
  try:
    with tqdm(unit="sample", desc="segmenting" + (" + teacher" if teacher else "")) as bar:
      stats = prepare.prepare_dataset(
          conversations, model, tokenizer, args.out, strategy=args.strategy,
          max_group=max_group, max_len=args.max_len, val_fraction=args.val_fraction,
          seed=args.seed, overwrite=args.overwrite, batch_tokens=args.batch_tokens,
          metadata={"source": ",".join(args.source), "config": args.config,
                    "base": cfg.model.base},
          teacher=teacher, keep_split=keep_split, progress=bar.update)
  except (sources.SourceError, LayoutError, DatasetExistsError) as e:  # bad data, named
    return _fail(e)
  print(stats.summary())
  print(f"wrote {args.out}")
  return 0


def _fail(e: Exception) -> int:
  print(f"error: {e}", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main())
