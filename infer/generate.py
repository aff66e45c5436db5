"""CLI: generate with the base model, HAMburger and verify mode, side by side.

  python -m infer.generate                                # side by side on the default model
  python -m infer.generate --prompt "Why is the sky blue?" --mode hamburger --confidence 0.8
  python -m infer.generate --prompts-file prompts.txt --json --max-new-tokens 64
  python -m infer.generate --mode verify --draft-confidence 0.3

Modes: base (one token a base forward), hamburger (a group of up to K a forward, one KV entry
each), verify (the base's exact tokens, drafts checked by the base: up to K a forward; a row
drafts what followed its last tokens where they occurred before, else the micro decoder's
guesses), both (base and hamburger) or all (the three).

Progress goes to stderr, one line per phase with its duration (loading weights, compiling each
mode, generating). Compiled programs and converted weights are cached per user (see
hamburger_jax/cache.py), so a second run skips most of the first one's wait.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hamburger_jax import cli

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
  p.add_argument("--mode", choices=("all", "both", "hamburger", "verify", "base"), default=None,
                 help="default: all when a HAMburger checkpoint is available, else base")
  cli.add_model_flags(p, micro_vocab=True)
  cli.add_decode_flags(p)
  p.add_argument("--json", action="store_true", help="one JSON object per prompt and mode")
  p.add_argument("--no-color", action="store_true")
  p.add_argument("--no-compile-cache", action="store_true",
                 help="compile every program and keep none (default: JAX's persistent "
                      "compilation cache under the per-user cache directory)")
  args = p.parse_args(argv)
  cli.check_decode_flags(p, args)  # before the model loads; the engine checks each request too
  return args


def read_prompts(args) -> list[str]:
  prompts = list(args.prompt or [])
  if args.prompts_file:
    prompts += cli.read_prompts_file(args.prompts_file)
  return prompts or list(DEFAULT_PROMPTS)


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
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine, GenerationError  # pylint: disable=C0415

  prompts = read_prompts(args)
  chosen = lambda ckpt: args.mode or {"both": "all"}.get(pretrained.default_mode(ckpt, both=True),
                                                         "base")
  model, tok, checkpoint, mode = cli.load_for_decoding(
      args, lambda ckpt: "both" if chosen(ckpt) == "all" else chosen(ckpt))
  mode = chosen(checkpoint)
  engine = Engine(model, tok, draft_lookup=args.draft_lookup)
  modes = {"all": ("base", "hamburger", "verify"), "both": ("base", "hamburger")}.get(mode,
                                                                                       (mode,))
  colour = sys.stdout.isatty() and not args.no_color
  results = {}
  try:  # each prompt is templated once; both modes decode the same requests
    requests = engine.requests(prompts, max_new_tokens=args.max_new_tokens,
                               sampling=args.sampling, confidence=args.confidence,
                               seed=args.seed, max_group=args.max_group,
                               draft_confidence=args.draft_confidence)
    wall = {}
    for m in modes:
      cli.phase(f"compiling {m}", lambda: engine.compile(requests, mode=m))
      t = time.perf_counter()
      results[m] = cli.phase(f"generating {m}", lambda: engine.generate(requests, mode=m))
      wall[m] = time.perf_counter() - t
  except GenerationError as e:
    raise SystemExit(f"error: {e}") from None
  for i, prompt in enumerate(prompts):
    for m in modes:
      g = results[m][i]
      if args.json:
        print(json.dumps({"prompt": prompt, "mode": m, **g.record(), **g.settings()}))
        continue
      if m == modes[0]:
        print(f"\n=== prompt {i + 1}: {prompt}")
      head = (f"--- {m}: {g.new_tokens} tokens in {g.macro_steps} base forwards "
              f"({g.tokens_per_step:.2f} tokens/forward), its decode {g.decode_s:.2f} s "
              "(from its prefill to its last token, beside its batch mates)")
      print(head)
      print(coloured(tok, g.token_ids, g.groups, colour) if m != "base" else g.text)
  if not args.json and len(modes) > 1:
    print("\n" + summary(results, wall))
  return 0


# What a mode's tokens per forward mean: verify keeps one KV entry per token.
PER_FORWARD = {"base": "", "hamburger": " (tokens per KV entry)",
               "verify": " (the base's tokens, one KV entry each)"}


def summary(results: dict, wall: dict) -> str:
  """One line: each mode's tokens, base forwards and whole-batch time (after compiling)."""
  parts = []
  for m, gens in results.items():
    tokens, steps = sum(g.new_tokens for g in gens), sum(g.macro_steps for g in gens)
    parts.append(f"{m}: {tokens} tokens / {steps} forwards = {tokens / max(steps, 1):.2f} a "
                 f"forward{PER_FORWARD[m]}, {wall[m]:.2f} s")
  return "; ".join(parts) + " (whole batch, prefill and decode, after compiling)"


if __name__ == "__main__":
  sys.exit(main())
