"""Builds a graft checkpoint's reduced micro-step vocabulary from the answers it was trained on.

  python -m train.micro_vocab --responses runs/distill/responses.jsonl \
      --checkpoint checkpoints/smollm2-135m-hamburger --size 8192

Counts the answer tokens (`response_ids`) of `train.self_distill`'s JSONL files and writes the
`--size` most frequent ids, by falling frequency, to CHECKPOINT/micro_vocab.json; decoding then
takes the first N of them (`--micro-vocab N`, `pretrained.load(..., micro_vocab=N)`). Prints the
share of answer tokens the first 1024 / 2048 / 4096 / 8192 ids cover.
"""

from __future__ import annotations

import argparse
import json
import sys

from hamburger_jax import files, graft_checkpoint, micro_vocab, pretrained

DEFAULT_SIZE = 8192
REPORTED_SIZES = (1024, 2048, 4096, 8192)


def read_answers(path: str) -> list[list[int]]:
  """The response_ids of every record of a self_distill JSONL file; SystemExit naming the line
  that is not such a record."""
  if not files.isfile(path):
    raise SystemExit(f"error: --responses {path} does not exist")
  answers = []
  with files.open_file(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        ids = json.loads(line)["response_ids"]
      except (ValueError, KeyError, TypeError):
        raise SystemExit(f"error: {path} line {n} is not a train.self_distill record with "
                         "response_ids") from None
      if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise SystemExit(f"error: {path} line {n}: response_ids must be a list of token ids")
      answers.append(ids)
  if not answers:
    raise SystemExit(f"error: {path} holds no answers")
  return answers


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m train.micro_vocab", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--responses", required=True,
                 help="comma-separated train.self_distill JSONL files (the training answers)")
  p.add_argument("--checkpoint", default=None,
                 help="graft checkpoint directory to store the list in (default: the shipped one)")
  p.add_argument("--size", type=int, default=DEFAULT_SIZE,
                 help=f"ids to store (default {DEFAULT_SIZE}); decoding may use any first N")
  args = p.parse_args(argv)
  if args.size < 1:
    p.error(f"--size {args.size} must be >= 1")
  checkpoint = pretrained.resolve_checkpoint(args.checkpoint)
  if checkpoint is None or not files.isfile(files.join(checkpoint, graft_checkpoint.META_FILE)):
    p.error(f"--checkpoint {checkpoint}: not a graft checkpoint directory (no "
            f"{graft_checkpoint.META_FILE})")
  paths = args.responses.split(",")
  try:
    answers = [a for path in paths for a in read_answers(path)]  # all read before any write
    vocab = pretrained.vocab_size(checkpoint)
    counts = micro_vocab.count_tokens(answers, vocab)
    doc = micro_vocab.save(checkpoint, counts, args.size, paths)
  except (ValueError, OSError) as e:
    raise SystemExit(f"error: {e}") from None
  ids = doc["ids"]
  print(f"{len(answers)} answers, {doc['answer_tokens']} tokens, {int((counts > 0).sum())} "
        f"distinct; wrote {len(ids)} ids to {files.join(checkpoint, micro_vocab.FILE)}")
  for n in REPORTED_SIZES:
    if n <= len(ids):
      print(f"  first {n}: {micro_vocab.coverage(counts, ids[:n]):.1%} of answer tokens")
  return 0


if __name__ == "__main__":
  sys.exit(main())
