"""Self-distillation: replace training responses by the base model's own greedy responses.

For a small base this keeps HAMburger's target equal to the base's behaviour (the graft learns to
predict what the base would say, not a stronger model's text). Batched through our decode engine;
appends to a JSONL file and resumes where a killed run stopped.

  python -m train.self_distill --mix gsm_symbolic:1000,sharegpt:1500,basic_arithmetic:150,chain_sum:150 \
      --out runs/distill/responses.jsonl --max-new-tokens 160 --batch 16

With --checkpoint the answers are a trained HAMburger's own (on-policy), at the confidences given
(cycled over the prompts), and each line records the groups it emitted them in: prepared with
`train.prepare_data --strategy given`, the teacher then teaches the graft on the text and the
merged entries its own decoding produces, not only on the base's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Iterable, Iterator

from hamburger_jax.data.sources import Conversation, sharegpt_conversations
from hamburger_jax.evaluation import tasks as eval_tasks
from infer import cli

REASONING = {t.name: t for t in (eval_tasks.GSM_SYMBOLIC, eval_tasks.BASIC_ARITHMETIC,
                                 eval_tasks.CHAIN_SUM, eval_tasks.LETTER_COUNTING, eval_tasks.GCD,
                                 eval_tasks.LCM)}
MIX_SOURCES = ("sharegpt", *REASONING)


def reasoning_prompts(name: str, n: int, seed: int = 0) -> Iterator[Conversation]:
  """Training questions in the evaluation prompt format, minus any evaluation question."""
  task = REASONING[name]
  for i, item in enumerate(task.train_items(n, seed,
                                            exclude=eval_tasks.evaluation_questions(name))):
    yield Conversation(task.messages(item["question"]), task.target(item), name, f"{name}/{seed + i}")


def sharegpt_prompts(n: int, tokenizer, max_prompt_tokens: int,
                     skip: int = 0) -> Iterator[Conversation]:
  """The first n ShareGPT prompts of at most max_prompt_tokens, after the first `skip` such."""
  seen = 0
  for conv in sharegpt_conversations():
    if seen >= skip + n:
      return
    if len(tokenizer.encode(conv.prompt_messages[-1]["content"])) > max_prompt_tokens:
      continue
    seen += 1
    if seen > skip:
      yield conv


def parse_mix(spec: str) -> list[tuple[str, int]]:
  out = []
  for part in spec.split(","):
    name, _, n = part.partition(":")
    if name not in MIX_SOURCES or not n.isdigit():
      raise SystemExit(f"error: --mix item {part!r}: use NAME:COUNT with NAME in {MIX_SOURCES}")
    out.append((name, int(n)))
  return out


def interleave(sources: list[list[Conversation]]) -> list[Conversation]:
  """Round-robin over the mix's sources, so that a run stopped early (it resumes, but may never
  finish on a small machine) still holds every source in proportion."""
  out, n = [], max((len(s) for s in sources), default=0)
  for i in range(n):
    for s in sources:
      if i * len(s) // n < (i + 1) * len(s) // n:  # spread the shorter sources evenly
        out.append(s[i * len(s) // n])
  return out


def read_done(path: str) -> set[str]:
  """Ids already written; a partial last line (killed mid-write) is cut off."""
  if not os.path.exists(path):
    return set()
  with open(path, "rb") as f:
    data = f.read()
  keep = data[:data.rfind(b"\n") + 1]
  if len(keep) != len(data):
    with open(path, "wb") as f:
      f.write(keep)
  return {json.loads(line)["id"] for line in keep.decode().splitlines() if line.strip()}


def distill(conversations: Iterable[Conversation], engine, tokenizer, *, max_new_tokens: int,
            batch: int, confidences: tuple[float, ...] | None = None,
            progress=None) -> Iterator[tuple[Conversation, float | None]]:
  """The conversations with the base model's greedy responses and their exact token ids, each
  with the confidence it was decoded at (None: the base).

  `confidences` (the engine's model a HAMburger): its own greedy responses instead, prompt i at
  confidences[i % len], with the groups it emitted them in. Served with continuous batching over
  `batch` slots: a finished row takes the next prompt at once instead of waiting for the slowest
  row of a batch, so the output order is the order in which answers finish.
  """
  from hamburger_jax.decode.requests import Request  # pylint: disable=import-outside-toplevel
  convs = list(conversations)
  conf = (lambda i: confidences[i % len(confidences)]) if confidences else (lambda i: None)
  reqs = [Request(tokenizer.apply_chat_template(c.prompt_messages, tokenize=True),
                  max_new_tokens=max_new_tokens, id=i,
                  **({"confidence": conf(i)} if confidences else {}))
          for i, c in enumerate(convs)]
  for g in engine.serve(reqs, slots=batch, mode="hamburger" if confidences else "base"):
    conv = convs[g.id]
    if g.error:
      raise ValueError(f"{conv.id}: {g.error}")
    yield dataclasses.replace(conv, response=tokenizer.decode(g.token_ids,
                                                              skip_special_tokens=True),
                              prompt_ids=tuple(int(i) for i in reqs[g.id].prompt),
                              response_ids=tuple(g.token_ids),
                              groups=tuple(g.groups) if confidences else None), conf(g.id)
    if progress is not None:
      progress(1)


def parse_confidences(spec: str | None, checkpoint: str | None) -> tuple[float, ...] | None:
  if checkpoint is None:
    if spec is not None:
      raise SystemExit("error: --confidence applies to a HAMburger's answers; add --checkpoint")
    return None
  if spec is None:
    raise SystemExit("error: --checkpoint needs --confidence (e.g. 0.5,0.6,0.7): the "
                     "confidences its answers are decoded at")
  try:
    out = tuple(float(c) for c in spec.split(","))
  except ValueError:
    out = ()
  if not out or not all(0.0 <= c <= 1.0 for c in out):
    raise SystemExit(f"error: --confidence {spec!r}: give comma-separated values in [0, 1]")
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m train.self_distill", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mix", required=True, help="e.g. gsm_symbolic:1000,sharegpt:1500")
  p.add_argument("--out", required=True, help="JSONL output (appended to; resumable)")
  p.add_argument("--max-new-tokens", type=int, default=160)
  p.add_argument("--max-prompt-tokens", type=int, default=96)
  p.add_argument("--batch", type=int, default=16, help="slots served at once (continuous batching)")
  p.add_argument("--seed", type=int, default=0,
                 help="first reasoning-gym seed of each reasoning source")
  p.add_argument("--sharegpt-skip", type=int, default=0, metavar="N",
                 help="start after the first N ShareGPT prompts (with --seed: prompts that an "
                      "earlier run, e.g. the shipped graft's training data, did not use)")
  cli.add_model_flags(p, checkpoint_help="a HAMburger graft: its own answers (on-policy) "
                     "instead of the base's")
  p.add_argument("--confidence", default=None,
                 help="with --checkpoint: confidences to decode at, cycled over the prompts "
                      "(e.g. 0.5,0.6,0.7)")
  args = p.parse_args(argv)
  if args.sharegpt_skip < 0:
    p.error(f"--sharegpt-skip={args.sharegpt_skip} must be >= 0 (how many prompts to skip)")
  confidences = parse_confidences(args.confidence, args.checkpoint)

  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  from hamburger_jax import cache, pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel

  cache.enable_compilation_cache()
  model, tok = pretrained.load("hamburger" if args.checkpoint else "base", args.checkpoint,
                               args.base)
  convs = interleave([list(sharegpt_prompts(n, tok, args.max_prompt_tokens, args.sharegpt_skip)
                           if name == "sharegpt" else reasoning_prompts(name, n, args.seed))
                      for name, n in parse_mix(args.mix)])
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  done = read_done(args.out)
  todo = [c for c in convs if c.id not in done]
  print(f"{len(convs)} prompts, {len(done)} already done, {len(todo)} to generate",
        file=sys.stderr)
  engine = Engine(model, tok)
  t0, new_tokens = time.time(), 0
  with open(args.out, "a") as f, tqdm(total=len(todo), unit="prompt") as bar:
    for conv, confidence in distill(todo, engine, tok, max_new_tokens=args.max_new_tokens,
                                    batch=args.batch, confidences=confidences,
                                    progress=bar.update):
      record = {
          "id": conv.id, "source": conv.source,
          "messages": [*conv.prompt_messages, {"role": "assistant", "content": conv.response}],
          "prompt_ids": list(conv.prompt_ids), "response_ids": list(conv.response_ids),
          "finished": conv.response_ids[-1] in tok.stop_ids}
      if confidences:
        record.update(groups=list(conv.groups), confidence=confidence, checkpoint=args.checkpoint)
      f.write(json.dumps(record) + "\n")
      f.flush()
      new_tokens += len(conv.response_ids)
      bar.set_postfix(tok_s=f"{new_tokens / (time.time() - t0):.0f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
