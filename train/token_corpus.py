"""Writes a token-id training corpus: whole conversations rendered with the default model's chat
template, in samples of at most --max-len tokens, with every assistant response marked.

  python -m train.token_corpus --out runs/tokens/smollm2 --mix sharegpt,gsm_symbolic:5000

Sources (--mix, comma-separated): sharegpt (the whole file, multi-turn, minus the held-out
evaluation records and any conversation asking a held-out or MT-Bench prompt), and NAME:N for N
training problems of a reasoning-gym task the evaluation uses (gsm_symbolic, basic_arithmetic,
chain_sum, letter_counting, gcd, lcm; seeds below the evaluation's). The format is described in
hamburger_jax/data/tokens/corpus.py; a trainer reads it with TokenCorpus.load.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from hamburger_jax.assets import AssetError
from hamburger_jax.data import source_specs, sources
from hamburger_jax.data.tokens import build, corpus


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m train.token_corpus", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="output directory (written whole, atomically)")
  p.add_argument("--mix", default="sharegpt",
                 help=f"comma-separated sources, of: {', '.join(source_specs.CORPUS_SOURCES)} "
                 "(default: sharegpt)")
  p.add_argument("--max-len", type=int, default=1024,
                 help="tokens per sample at most; longer conversations are cut at turn pairs "
                 "(default 1024)")
  p.add_argument("--max-tokens", type=int, default=None,
                 help="stop adding ShareGPT conversations before the corpus exceeds this many "
                 "tokens (the reasoning-gym sources are added whole, first)")
  p.add_argument("--validation-fraction", type=float, default=0.01,
                 help="share of conversations in the validation split (default 0.01)")
  p.add_argument("--seed", type=int, default=0, help="seed of the validation split's hash")
  p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  mix = [part for part in args.mix.split(",") if part.strip()]
  try:
    # Cheap checks first: a typo should not cost a tokenizer load.
    names = [name for name, _ in source_specs.parse_sources(mix)]
    build.check_output(args.out, args.overwrite)
    if args.max_len < 1 or (args.max_tokens is not None and args.max_tokens < 1):
      raise corpus.CorpusError("--max-len and --max-tokens must be positive")
    if not 0.0 <= args.validation_fraction < 1.0:
      raise corpus.CorpusError(
          f"--validation-fraction {args.validation_fraction} must be in [0, 1)")
    if "sharegpt" in names:
      sources.sharegpt_path()  # AssetError with the install command when missing
    # Here, not at the top: the tokenizer module imports flax (~0.7 s), which --help and a
    # rejected argument should not wait for.
    from hamburger_jax.tokenizer import load_default_tokenizer  # pylint: disable=C0415
    tokenizer = load_default_tokenizer()
    start = time.perf_counter()
    meta = build.build_corpus(
        args.out, tokenizer, mix, max_len=args.max_len, max_tokens=args.max_tokens,
        validation_fraction=args.validation_fraction, seed=args.seed, overwrite=args.overwrite,
        progress=lambda line: print(line, file=sys.stderr, flush=True))
  except (corpus.CorpusError, AssetError) as e:
    return _fail(e)
  print(build.summary(meta))
  print(f"wrote {os.path.abspath(args.out)} in {time.perf_counter() - start:.1f} s")
  return 0


def _fail(e: Exception) -> int:
  print(f"error: {e}", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main())
