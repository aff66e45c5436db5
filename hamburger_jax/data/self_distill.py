"""Self-distillation: training responses replaced by the base model's own greedy responses (or,
from a graft checkpoint, a trained HAMburger's own: on-policy, with the groups it emitted).

For a small base this keeps HAMburger's target equal to the base's behaviour (the graft learns to
predict what the base would say, not a stronger model's text). Served with continuous batching;
appends to a JSONL file and resumes where a killed run stopped. `train.self_distill` is its
command line; train.pipeline calls `run`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Iterable, Iterator

from hamburger_jax.data.source_specs import parse_mix, reasoning_prompts
from hamburger_jax.data.sources import Conversation, sharegpt_conversations

# Prompt lengths of the token-id prompts (hamburger_jax.data.synthetic's draw: [low, high)).
SYNTHETIC_PROMPT_LEN = (4, 12)


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
  from hamburger_jax.data.synthetic import synthetic_samples  # pylint: disable=C0415
  samples = synthetic_samples(n, vocab_size, 1, seed, prompt_len=SYNTHETIC_PROMPT_LEN)
  for i, s in enumerate(samples):
    ids = tuple(int(t) for t in s["input_ids"][:s["prompt_len"]])
    yield Conversation([{"role": "user", "content": render_ids(ids)}], "", "synthetic",
                       f"synthetic/{seed + i}", prompt_ids=ids)


def render_ids(ids) -> str:
  """Token ids as text, where there is no tokenizer to decode them (JSONL needs text)."""
  return " ".join(str(int(i)) for i in ids)


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


@dataclasses.dataclass(frozen=True)
class Outcome:
  prompts: int  # in the mix
  answers: int  # in --out after this run
  stopped: bool  # at --max-minutes, with prompts left (a rerun goes on)


@dataclasses.dataclass(frozen=True)
class Settings:
  """One self-distillation run (train.self_distill's flags)."""
  mix: str  # NAME:COUNT,... (source_specs.parse_mix)
  out: str  # JSONL, appended to
  max_new_tokens: int = 160
  max_prompt_tokens: int = 96
  batch: int = 16
  seed: int = 0
  sharegpt_skip: int = 0
  checkpoint: str | None = None  # a graft: its own answers, at `confidences`
  base: str | None = None
  config: str | None = None  # a run config's base instead (a random one has no tokenizer)
  confidences: tuple[float, ...] | None = None
  max_minutes: float | None = None


def answering_model(s: Settings):
  """(model, tokenizer or None) to answer with."""
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  if s.config:
    from hamburger_jax.run_config import load_run_config  # pylint: disable=C0415
    cfg = load_run_config(s.config, shared_only=True)
    # The seed the trainer builds a random base with: the answers are that base's.
    return pretrained.load_base_for_run(cfg.model, cfg.train.seed)
  return pretrained.load("hamburger" if s.checkpoint else "base", s.checkpoint, s.base)


def prompts(mix: list[tuple[str, int]], s: Settings, tok, vocab_size: int) -> list[Conversation]:
  if tok is None and any(name != "synthetic" for name, _ in mix):
    raise ValueError("this model has no tokenizer: its prompts are token ids (--mix "
                     "synthetic:N)")
  return interleave([
      list(synthetic_prompts(n, vocab_size, s.seed)) if name == "synthetic" else
      list(sharegpt_prompts(n, tok, s.max_prompt_tokens, s.sharegpt_skip))
      if name == "sharegpt" else list(reasoning_prompts(name, n, s.seed)) for name, n in mix])


def run(s: Settings) -> Outcome:
  """Answers the mix's prompts not yet in s.out, appending each as it finishes, until done or
  s.max_minutes (a rerun goes on). ValueError: a bad mix or a prompt the model cannot take."""
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel

  mix = parse_mix(s.mix)
  start = time.monotonic()  # the budget counts the model's load too
  cache.enable_compilation_cache()
  model, tok = answering_model(s)
  vocab = (model.base if hasattr(model, "base") else model).cfg.vocab_size
  convs = prompts(mix, s, tok, vocab)
  os.makedirs(os.path.dirname(os.path.abspath(s.out)), exist_ok=True)
  done = read_done(s.out)
  todo = [c for c in convs if c.id not in done]
  print(f"{len(convs)} prompts, {len(done)} already done, {len(todo)} to generate",
        file=sys.stderr)
  engine = Engine(model, tok)
  t0, new_tokens, answered = time.time(), 0, 0
  deadline = None if s.max_minutes is None else start + 60 * s.max_minutes
  confidences = s.confidences
  stop_ids = tok.stop_ids if tok is not None else ()
  with open(s.out, "a") as f, tqdm(total=len(todo), unit="prompt") as bar:
    for conv, confidence in distill(todo, engine, tok, max_new_tokens=s.max_new_tokens,
                                    batch=s.batch, confidences=confidences,
                                    progress=bar.update):
      record = {
          "id": conv.id, "source": conv.source,
          "messages": [*conv.prompt_messages, {"role": "assistant", "content": conv.response}],
          "prompt_ids": list(conv.prompt_ids), "response_ids": list(conv.response_ids),
          "finished": conv.response_ids[-1] in stop_ids}
      if confidences:
        record.update(groups=list(conv.groups), confidence=confidence, checkpoint=s.checkpoint)
      f.write(json.dumps(record) + "\n")
      f.flush()
      answered += 1
      new_tokens += len(conv.response_ids)
      bar.set_postfix(tok_s=f"{new_tokens / (time.time() - t0):.0f}")
      if deadline is not None and time.monotonic() >= deadline and answered < len(todo):
        print(f"--max-minutes={s.max_minutes} reached after {answered} answers: stopping "
              "(run again to go on)", file=sys.stderr)
        break
  return Outcome(len(convs), len(done) + answered, answered < len(todo))
