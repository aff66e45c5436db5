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

With --config the base is a run config's (configs/tiny.yaml: a random model without tokenizer,
whose prompts are the token ids of `--mix synthetic:N`, its answers rendered as their numbers);
--max-minutes stops cleanly at a time budget (a rerun goes on where it stopped).
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
from hamburger_jax import cli

REASONING = {t.name: t for t in (eval_tasks.GSM_SYMBOLIC, eval_tasks.BASIC_ARITHMETIC,
                                 eval_tasks.CHAIN_SUM, eval_tasks.LETTER_COUNTING, eval_tasks.GCD,
                                 eval_tasks.LCM)}
MIX_SOURCES = ("sharegpt", *REASONING, "synthetic")
# Prompt lengths of the token-id prompts (hamburger_jax.testing's draw: [low, high)).
SYNTHETIC_PROMPT_LEN = (4, 12)


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


def synthetic_prompts(n: int, vocab_size: int, seed: int = 0) -> Iterator[Conversation]:
  """Token-id prompts for a model without tokenizer: those of the synthetic training data."""
  from hamburger_jax.testing import synthetic_samples  # pylint: disable=import-outside-toplevel
  samples = synthetic_samples(n, vocab_size, 1, seed, prompt_len=SYNTHETIC_PROMPT_LEN)
  for i, s in enumerate(samples):
    ids = tuple(int(t) for t in s["input_ids"][:s["prompt_len"]])
    yield Conversation([{"role": "user", "content": render_ids(ids)}], "", "synthetic",
                       f"synthetic/{seed + i}", prompt_ids=ids)


def render_ids(ids) -> str:
  """Token ids as text, where there is no tokenizer to decode them (JSONL needs text)."""
  return " ".join(str(int(i)) for i in ids)


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
  row of a batch, so the output order is the order in which answers finish. A conversation
  with `prompt_ids` is served as those ids; `tokenizer` None (a model without one) renders the
  answers as their numbers.
  """
  from hamburger_jax.decode.requests import Request  # pylint: disable=import-outside-toplevel
  convs = list(conversations)
  conf = (lambda i: confidences[i % len(confidences)]) if confidences else (lambda i: None)
  reqs = [Request(list(c.prompt_ids) if c.prompt_ids is not None else
                  tokenizer.apply_chat_template(c.prompt_messages, tokenize=True),
                  max_new_tokens=max_new_tokens, id=i,
                  **({"confidence": conf(i)} if confidences else {}))
          for i, c in enumerate(convs)]
  for g in engine.serve(reqs, slots=batch, mode="hamburger" if confidences else "base"):
    conv = convs[g.id]
    if g.error:
      raise ValueError(f"{conv.id}: {g.error}")
    text = (render_ids(g.token_ids) if tokenizer is None else
            tokenizer.decode(g.token_ids, skip_special_tokens=True))
    yield dataclasses.replace(conv, response=text,
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


@dataclasses.dataclass(frozen=True)
class Outcome:
  prompts: int  # in the mix
  answers: int  # in --out after this run
  stopped: bool  # at --max-minutes, with prompts left (a rerun goes on)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m train.self_distill", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mix", required=True,
                 help="e.g. gsm_symbolic:1000,sharegpt:1500 (synthetic:N: token-id prompts)")
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
  p.add_argument("--config", default=None,
                 help="the base of this run config instead of --base (e.g. configs/tiny.yaml)")
  p.add_argument("--confidence", default=None,
                 help="with --checkpoint: confidences to decode at, cycled over the prompts "
                      "(e.g. 0.5,0.6,0.7)")
  p.add_argument("--max-minutes", type=float, default=None,
                 help="stop after the first answer that ends past this many minutes (a rerun "
                      "goes on)")
  args = p.parse_args(argv)
  if args.sharegpt_skip < 0:
    p.error(f"--sharegpt-skip={args.sharegpt_skip} must be >= 0 (how many prompts to skip)")
  if args.max_minutes is not None and not args.max_minutes >= 0:
    p.error(f"--max-minutes={args.max_minutes} must be >= 0 (0: stop after one answer)")
  if args.config and (args.base or args.checkpoint):
    p.error("--config names the base: leave out --base and --checkpoint")
  args.confidences = parse_confidences(args.confidence, args.checkpoint)
  return args


def load_model(args):
  """(model, tokenizer or None) to answer with."""
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  if args.config:
    from hamburger_jax.config import ConfigError  # pylint: disable=import-outside-toplevel
    from hamburger_jax.run_config import load_run_config  # pylint: disable=import-outside-toplevel
    try:
      cfg = load_run_config(args.config, shared_only=True)
    except (ConfigError, FileNotFoundError) as e:
      raise SystemExit(f"error: {e}") from None
    # The seed the trainer builds a random base with: the answers are that base's.
    return pretrained.load_base_for_run(cfg.model, cfg.train.seed)
  return pretrained.load("hamburger" if args.checkpoint else "base", args.checkpoint, args.base)


def prompts(mix: list[tuple[str, int]], args, tok, vocab_size: int) -> list[Conversation]:
  if tok is None and any(name != "synthetic" for name, _ in mix):
    raise SystemExit("error: this model has no tokenizer: its prompts are token ids (--mix "
                     "synthetic:N)")
  return interleave([
      list(synthetic_prompts(n, vocab_size, args.seed)) if name == "synthetic" else
      list(sharegpt_prompts(n, tok, args.max_prompt_tokens, args.sharegpt_skip))
      if name == "sharegpt" else list(reasoning_prompts(name, n, args.seed)) for name, n in mix])


def run(args: argparse.Namespace) -> Outcome:
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel

  mix = parse_mix(args.mix)
  start = time.monotonic()  # the budget counts the model's load too
  cache.enable_compilation_cache()
  model, tok = load_model(args)
  vocab = (model.base if hasattr(model, "base") else model).cfg.vocab_size
  convs = prompts(mix, args, tok, vocab)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  done = read_done(args.out)
  todo = [c for c in convs if c.id not in done]
  print(f"{len(convs)} prompts, {len(done)} already done, {len(todo)} to generate",
        file=sys.stderr)
  engine = Engine(model, tok)
  t0, new_tokens, answered = time.time(), 0, 0
  deadline = None if args.max_minutes is None else start + 60 * args.max_minutes
  confidences = args.confidences
  stop_ids = tok.stop_ids if tok is not None else ()
  with open(args.out, "a") as f, tqdm(total=len(todo), unit="prompt") as bar:
    for conv, confidence in distill(todo, engine, tok, max_new_tokens=args.max_new_tokens,
                                    batch=args.batch, confidences=confidences,
                                    progress=bar.update):
      record = {
          "id": conv.id, "source": conv.source,
          "messages": [*conv.prompt_messages, {"role": "assistant", "content": conv.response}],
          "prompt_ids": list(conv.prompt_ids), "response_ids": list(conv.response_ids),
          "finished": conv.response_ids[-1] in stop_ids}
      if confidences:
        record.update(groups=list(conv.groups), confidence=confidence, checkpoint=args.checkpoint)
      f.write(json.dumps(record) + "\n")
      f.flush()
      answered += 1
      new_tokens += len(conv.response_ids)
      bar.set_postfix(tok_s=f"{new_tokens / (time.time() - t0):.0f}")
      if deadline is not None and time.monotonic() >= deadline and answered < len(todo):
        print(f"--max-minutes={args.max_minutes} reached after {answered} answers: stopping "
              "(run again to go on)", file=sys.stderr)
        break
  return Outcome(len(convs), len(done) + answered, answered < len(todo))


def main(argv=None) -> int:
  run(parse_args(argv))
  return 0


if __name__ == "__main__":
  sys.exit(main())
