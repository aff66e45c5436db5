"""Write a base model's tokenizer as an HF directory, for clients that tokenize themselves.

The directory holds tokenizer.json, tokenizer_config.json and the chat template, what such a
client reads: e.g. lm-evaluation-harness against `python -m infer.server`:

  python -m infer.export_tokenizer --out runs/tokenizer
  lm_eval run --model local-completions --tasks arc_easy --model_args \\
      base_url=http://127.0.0.1:8000/v1/completions,model=smollm2-135m-hamburger,\\
tokenizer=runs/tokenizer,tokenizer_backend=huggingface,tokenized_requests=True

A graft's tokenizer is its base's: pass the server's --base (default smollm2).
"""

from __future__ import annotations

import argparse
import sys

from hamburger_jax import assets, pretrained


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m infer.export_tokenizer", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--base", default=pretrained.DEFAULT_BASE,
                 help="base model: smollm2 | file.gguf | HF directory (default: %(default)s)")
  p.add_argument("--out", required=True, help="the directory to write (created if missing)")
  args = p.parse_args(argv)
  try:
    tok = pretrained.load_tokenizer(args.base)
  except (OSError, ValueError, assets.AssetError) as e:
    raise SystemExit(f"error: --base {args.base}: {e}") from None
  print(tok.save(args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
