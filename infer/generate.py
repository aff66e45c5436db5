"""CLI: generate with the base model and/or HAMburger, side by side.

  python -m infer.generate                                # side by side on the default model
  python -m infer.generate --prompt "Why is the sky blue?" --mode hamburger --confidence 0.8
  python -m infer.generate --prompts-file prompts.txt --json --max-new-tokens 64

Progress goes to stderr, one line per phase with its duration (loading weights, compiling each
mode, generating). Compiled programs and converted weights are cached per user (see
hamburger_jax/cache.py), so a second run skips most of the first one's wait.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, TypeVar

from hamburger_jax.config import DEFAULT_CONFIDENCE

T = TypeVar("T")

DEFAULT_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the factorial of n.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May? Think step by step.",
)
COLOURS = ("\x1b[48;5;223m", "\x1b[48;5;153m")  # alternating backgrounds, as in the paper's Fig. 1
RESET = "\x1b[0m"


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m infer.generate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--prompt", action="append", help="a user message (repeatable)")
  p.add_argument("--prompts-file", help="a text file with one prompt per line")
  p.add_argument("--mode", choices=("both", "hamburger", "base"), default=None,
                 help="default: both when a HAMburger checkpoint is available, else base")
  p.add_argument("--checkpoint", default=None,
                 help="HAMburger graft checkpoint directory (default: the shipped one)")
  p.add_argument("--base", default=None, help="base model: smollm2 | file.gguf | HF directory")
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--confidence", type=float, default=DEFAULT_CONFIDENCE,
                 help="continue a group while P(continue) >= this (docs/method.md, section 3)")
  p.add_argument("--max-group", type=int, default=None,
                 help="the most tokens one macro step may emit, 1..K (default: the model's K)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", action="store_true", help="one JSON object per prompt and mode")
  p.add_argument("--no-color", action="store_true")
  p.add_argument("--no-compile-cache", action="store_true",
                 help="compile every program and keep none (default: JAX's persistent "
                      "compilation cache under the per-user cache directory)")
  args = p.parse_args(argv)
  # Cheap checks before the model loads (the engine checks the same again per request).
  if args.max_new_tokens < 1:
    p.exit(2, f"error: max_new_tokens={args.max_new_tokens} must be an integer >= 1\n")
  if not 0 <= args.confidence <= 1:
    p.exit(2, f"error: confidence must be in [0, 1], got {args.confidence}\n")
  if args.max_group is not None and args.max_group < 1:
    p.exit(2, f"error: max_group={args.max_group} must be an integer >= 1\n")
  return args


def phase(what: str, fn: Callable[[], T]) -> T:
  """Runs one phase of the run and says on stderr what it was and how long it took."""
  print(f"{what} ...", end="", file=sys.stderr, flush=True)
  t = time.perf_counter()
  try:
    out = fn()
  except BaseException:
    print(f" failed after {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    raise
  print(f" {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
  return out


def read_prompts_file(path: str) -> list[str]:
  """One prompt per non-blank line of a UTF-8 text file; SystemExit saying what is wrong."""
  if not os.path.isfile(path):
    raise SystemExit(f"error: --prompts-file {path} does not exist (or is not a file)")
  try:
    with open(path, encoding="utf-8") as f:
      prompts = [line.rstrip("\n") for line in f if line.strip()]
  except UnicodeDecodeError as e:
    raise SystemExit(f"error: --prompts-file {path} is not UTF-8 text ({e.reason} at byte "
                     f"{e.start}): save it as UTF-8") from None
  if not prompts:
    raise SystemExit(f"error: --prompts-file {path} has no prompts (it is empty or blank): "
                     "write one prompt per line")
  return prompts


def read_prompts(args) -> list[str]:
  prompts = list(args.prompt or [])
  if args.prompts_file:
    prompts += read_prompts_file(args.prompts_file)
  return prompts or list(DEFAULT_PROMPTS)


def check_top_k(sampling, checkpoint: str | None, base: str | None) -> None:
  """--top-k against the model's vocabulary, read from metadata before the weights load."""
  if not sampling.top_k:
    return
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.convert.mapping import WeightsError  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.sampling import SamplingError  # pylint: disable=import-outside-toplevel
  try:
    sampling.check_vocab(pretrained.vocab_size(checkpoint, base))
  except (SamplingError, WeightsError, FileNotFoundError, ValueError, RuntimeError) as e:
    raise SystemExit(f"error: {e}") from None  # RuntimeError: assets.AssetError (not installed)


def coloured(tokenizer, token_ids: list[int], groups: list[int], colour: bool) -> str:
  """The text with each macro step's group on an alternating background."""
  parts, start = [], 0
  for i, size in enumerate(groups):
    text = tokenizer.decode(token_ids[start:start + size], skip_special_tokens=True)
    start += size
    parts.append(f"{COLOURS[i % 2]}{text}{RESET}" if colour else (f"[{text}]" if size > 1 else text))
  return "".join(parts)


def main(argv=None) -> int:
  args = parse_args(argv)
  # Imports after argument parsing so --help is instant.
  from hamburger_jax import cache, pretrained
  from hamburger_jax.decode.engine import Engine, GenerationError
  from hamburger_jax.decode.sampling import SamplingError, SamplingParams

  cache.enable_compilation_cache(enabled=not args.no_compile_cache)
  try:
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
  except SamplingError as e:
    raise SystemExit(f"error: {e}") from None
  prompts = read_prompts(args)
  checkpoint = pretrained.resolve_checkpoint(args.checkpoint)
  mode = args.mode or ("both" if checkpoint else "base")
  if mode != "base" and checkpoint is None:
    raise SystemExit("error: --mode hamburger needs a trained checkpoint (--checkpoint DIR); "
                     "none is shipped at " + pretrained.DEFAULT_CHECKPOINT)
  check_top_k(sampling, None if mode == "base" else checkpoint, args.base)
  if mode == "base":
    what = f"base {args.base or pretrained.DEFAULT_BASE}"
    load = lambda: pretrained.load_llama(args.base or pretrained.DEFAULT_BASE)
  else:
    what = f"HAMburger {checkpoint}" + (f" on {args.base}" if args.base else "")
    load = lambda: pretrained.load_hamburger(checkpoint, args.base)
  try:
    model, tok = phase(f"loading weights ({what})", load)
  except (ValueError, RuntimeError, FileNotFoundError) as e:  # weights/config/asset errors
    raise SystemExit(f"error: {e}") from None
  engine = Engine(model, tok)
  modes = ("base", "hamburger") if mode == "both" else (mode,)
  colour = sys.stdout.isatty() and not args.no_color
  results = {}
  for m in modes:
    try:
      phase(f"compiling {m}", lambda: engine.compile(
          prompts, max_new_tokens=args.max_new_tokens, mode=m, sampling=sampling))
      results[m] = phase(f"generating {m}", lambda: engine.generate(
          prompts, max_new_tokens=args.max_new_tokens, mode=m, sampling=sampling,
          confidence=args.confidence, seed=args.seed, max_group=args.max_group))
    except GenerationError as e:
      raise SystemExit(f"error: {e}") from None
  for i, prompt in enumerate(prompts):
    for m in modes:
      g = results[m][i]
      if args.json:
        print(json.dumps({"prompt": prompt, "mode": m, **g.record(),
                          **({"confidence": args.confidence, "max_group": args.max_group}
                             if m == "hamburger" else {})}))
        continue
      if m == modes[0]:
        print(f"\n=== prompt {i + 1}: {prompt}")
      head = (f"--- {m}: {g.new_tokens} tokens in {g.macro_steps} base forwards "
              f"({g.tokens_per_step:.2f} tokens/forward), batch decode {g.decode_s:.2f} s")
      print(head)
      print(coloured(tok, g.token_ids, g.groups, colour) if m == "hamburger" else g.text)
  if not args.json and len(modes) == 2:
    b, h = results["base"], results["hamburger"]
    tb, th = sum(g.new_tokens for g in b), sum(g.new_tokens for g in h)
    sb, sh = sum(g.macro_steps for g in b), sum(g.macro_steps for g in h)
    print(f"\nbase: {tb} tokens / {sb} forwards; hamburger: {th} tokens / {sh} forwards "
          f"({th / max(sh, 1):.2f} tokens per KV entry); decode time base {b[0].decode_s:.2f} s, "
          f"hamburger {h[0].decode_s:.2f} s (whole batch, after compilation)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
