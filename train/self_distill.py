"""Self-distillation: replace training responses by the base model's own greedy responses.

For a small base this keeps HAMburger's target equal to the base's behaviour (the graft learns to
predict what the base would say, not a stronger model's text). Batched through our decode engine;
appends to a JSONL file and resumes where a killed run stopped.

  python -m train.self_distill --mix gsm_symbolic:1000,sharegpt:1500,basic_arithmetic:150,chain_sum:150 \
      --out runs/distill/responses.jsonl --max-new-tokens 160 --batch 16
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


def sharegpt_prompts(n: int, tokenizer, max_prompt_tokens: int) -> Iterator[Conversation]:
  seen = 0
  for conv in sharegpt_conversations():
    if seen >= n:
      return
    if len(tokenizer.encode(conv.prompt_messages[-1]["content"])) > max_prompt_tokens:
      continue
    seen += 1
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
            batch: int, progress=None) -> Iterator[Conversation]:
  """The conversations with the base model's greedy responses and their exact token ids.

  Served with continuous batching over `batch` slots: a finished row takes the next prompt at
  once instead of waiting for the slowest row of a batch, so the output order is the order in
  which answers finish.
  """
  from hamburger_jax.decode.requests import Request  # pylint: disable=import-outside-toplevel
  convs = list(conversations)
  reqs = [Request(tokenizer.apply_chat_template(c.prompt_messages, tokenize=True),
                  max_new_tokens=max_new_tokens, id=i) for i, c in enumerate(convs)]
  for g in engine.serve(reqs, slots=batch, mode="base"):
    conv = convs[g.id]
    if g.error:
      raise ValueError(f"{conv.id}: {g.error}")
    yield dataclasses.replace(conv, response=tokenizer.decode(g.token_ids,
                                                              skip_special_tokens=True),
                              prompt_ids=tuple(int(i) for i in reqs[g.id].prompt),
                              response_ids=tuple(g.token_ids))
    if progress is not None:
      progress(1)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m train.self_distill", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mix", required=True, help="e.g. gsm_symbolic:1000,sharegpt:1500")
  p.add_argument("--out", required=True, help="JSONL output (appended to; resumable)")
  p.add_argument("--base", default="smollm2")
  p.add_argument("--max-new-tokens", type=int, default=160)
  p.add_argument("--max-prompt-tokens", type=int, default=96)
  p.add_argument("--batch", type=int, default=16, help="slots served at once (continuous batching)")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)

  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  from hamburger_jax import cache, pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel

  cache.enable_compilation_cache()
  model, tok = pretrained.load_llama(args.base)
  convs = interleave([list(sharegpt_prompts(n, tok, args.max_prompt_tokens) if name == "sharegpt"
                           else reasoning_prompts(name, n, args.seed))
                      for name, n in parse_mix(args.mix)])
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  done = read_done(args.out)
  todo = [c for c in convs if c.id not in done]
  print(f"{len(convs)} prompts, {len(done)} already done, {len(todo)} to generate",
        file=sys.stderr)
  engine = Engine(model, tok)
  t0, new_tokens = time.time(), 0
  with open(args.out, "a") as f, tqdm(total=len(todo), unit="prompt") as bar:
    for conv in distill(todo, engine, tok, max_new_tokens=args.max_new_tokens, batch=args.batch,
                        progress=bar.update):
      f.write(json.dumps({
          "id": conv.id, "source": conv.source,
          "messages": [*conv.prompt_messages, {"role": "assistant", "content": conv.response}],
          "prompt_ids": list(conv.prompt_ids), "response_ids": list(conv.response_ids),
          "finished": conv.response_ids[-1] in tok.stop_ids}) + "\n")
      f.flush()
      new_tokens += len(conv.response_ids)
      bar.set_postfix(tok_s=f"{new_tokens / (time.time() - t0):.0f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
