"""CLI: serve a file of requests with continuous batching over a paged KV pool.

  python -m infer.serve --prompts-file prompts.txt --slots 8 --json
  python -m infer.serve --prompts-file requests.jsonl --slots 16 --kv-blocks 400 --mode base

A `.jsonl` file holds one request per line: {"prompt": "...", "max_new_tokens": 64,
"confidence": 0.8, "max_group": 2, "temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 1,
"id": "q1"} (all but "prompt" optional; the flags give the defaults). Any other file: one prompt per line. Results
print as requests finish (not in file order): with --json one object per line with the fields
of `infer.generate --json` plus id, queue_s, latency_s and preemptions; a request that cannot be
served prints its error and the others go on. Progress and a summary go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from hamburger_jax.config import DEFAULT_PREFIX_CACHE_TOKENS
from hamburger_jax import cli

REQUEST_FIELDS = ("prompt", "max_new_tokens", "confidence", "max_group", "temperature",
                  "top_k", "top_p", "seed", "id", "draft_confidence")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m infer.serve", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--prompts-file", required=True, help="requests: .jsonl, or one prompt a line")
  p.add_argument("--slots", type=int, default=8, help="requests decoded at once")
  p.add_argument("--kv-blocks", type=int, default=None,
                 help="KV pool size in blocks (default: enough for every slot's longest request)")
  p.add_argument("--block-size", type=int, default=16, help="KV entries per block")
  p.add_argument("--mode", choices=("hamburger", "base", "verify"), default=None,
                 help="default: hamburger when a checkpoint is available, else base; verify: "
                 "the base's exact output, drafted by the micro decoder")
  cli.add_model_flags(p, micro_vocab=True)
  cli.add_decode_flags(p)  # every request's defaults; a .jsonl line may set its own
  p.add_argument("--json", action="store_true", help="one JSON object per finished request")
  p.add_argument("--prefix-cache-tokens", type=int, default=DEFAULT_PREFIX_CACHE_TOKENS,
                 help="KV entries of earlier turns kept for requests that repeat them "
                      f"(default {DEFAULT_PREFIX_CACHE_TOKENS}; 0 turns prefix caching off)")
  p.add_argument("--no-compile-cache", action="store_true")
  args = p.parse_args(argv)
  if args.prefix_cache_tokens < 0:
    p.error("--prefix-cache-tokens must be >= 0 (0 turns prefix caching off)")
  for name in ("slots", "block_size"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1")
  if args.kv_blocks is not None and args.kv_blocks < 2:
    p.error("--kv-blocks must be >= 2 (one block is reserved)")
  cli.check_decode_flags(p, args)  # the defaults fail here, not once per request
  return args


def read_requests(args) -> list[dict]:
  """Raw request dicts (checked later, one by one, so a bad one fails alone)."""
  if not args.prompts_file.endswith(".jsonl"):
    return [{"prompt": p} for p in cli.read_prompts_file(args.prompts_file)]
  try:
    with open(args.prompts_file, encoding="utf-8") as f:
      lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
  except FileNotFoundError:
    raise SystemExit(f"error: --prompts-file {args.prompts_file} does not exist") from None
  except UnicodeDecodeError as e:
    raise SystemExit(f"error: --prompts-file {args.prompts_file} is not UTF-8 ({e.reason})") \
        from None
  if not lines:
    raise SystemExit(f"error: --prompts-file {args.prompts_file} has no requests")
  out = []
  for i, line in lines:
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise SystemExit(f"error: {args.prompts_file} line {i} is not JSON ({e.msg})") from None
    if not isinstance(obj, dict) or "prompt" not in obj:
      raise SystemExit(f"error: {args.prompts_file} line {i}: a request is an object with a "
                       "\"prompt\"")
    unknown = set(obj) - set(REQUEST_FIELDS)
    if unknown:
      raise SystemExit(f"error: {args.prompts_file} line {i}: unknown fields {sorted(unknown)}; "
                       f"use {', '.join(REQUEST_FIELDS)}")
    out.append(obj)
  return out


def to_request(raw: dict, index: int, args):
  """A Request, or (id, error) when its settings are invalid."""
  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.sampling import SamplingError
  from hamburger_jax.decode.requests import Request
  rid = raw.get("id", index)
  try:
    sampling = cli.sampling_params(raw.get("temperature", args.temperature),
                                   raw.get("top_k", args.top_k), raw.get("top_p", args.top_p))
  except SamplingError as e:
    return rid, str(e)
  return Request(raw["prompt"], max_new_tokens=raw.get("max_new_tokens", args.max_new_tokens),
                 confidence=raw.get("confidence", args.confidence), sampling=sampling,
                 seed=raw.get("seed", args.seed), id=rid,
                 max_group=raw.get("max_group", args.max_group),
                 draft_confidence=raw.get("draft_confidence", args.draft_confidence))


def main(argv=None) -> int:
  args = parse_args(argv)
  raws = read_requests(args)  # before the model loads: a bad file fails in a second
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine, GenerationError  # pylint: disable=C0415

  model, tok, _, mode = cli.load_for_decoding(
      args, lambda ckpt: args.mode or pretrained.default_mode(ckpt))
  engine = Engine(model, tok, block_size=args.block_size, draft_lookup=args.draft_lookup,
                  prefix_cache_tokens=args.prefix_cache_tokens)
  requests, failed = [], []
  for i, raw in enumerate(raws):
    r = to_request(raw, i, args)
    (failed if isinstance(r, tuple) else requests).append(r)
  bar = tqdm(total=len(raws), desc=f"serving ({mode}, {args.slots} slots)", unit="req",
             file=sys.stderr)
  tokens = steps = errors = 0

  def emit(rid, record: dict) -> None:
    print(json.dumps({"id": rid, "mode": mode, **record}) if args.json else
          (f"=== {rid}: error: {record['error']}" if "error" in record else
           f"=== {rid} ({record['new_tokens']} tokens, {record['macro_steps']} steps, latency "
           f"{record['latency_s']:.2f} s)\n{record['text']}"), flush=True)
    bar.update(1)

  for rid, error in failed:
    errors += 1
    emit(rid, {"error": error})
  try:
    run = engine.serve(requests, slots=args.slots, kv_blocks=args.kv_blocks, mode=mode)
    for g in run:
      if g.error:
        errors += 1
        emit(g.id, g.record())
        continue
      tokens, steps = tokens + g.new_tokens, steps + g.macro_steps
      emit(g.id, {**g.record(), "queue_s": round(g.queue_s, 3),
                  "latency_s": round(g.latency_s, 3), "preemptions": g.preemptions,
                  **g.settings()})
  except GenerationError as e:
    raise SystemExit(f"error: {e}") from None
  finally:
    bar.close()
  elapsed = bar.format_dict["elapsed"]
  stats = run.stats
  in_flight = (f", {stats.mean_in_flight:.1f} requests in flight on average, "
               f"{stats.prefix_tokens} prompt tokens copied from the prefix cache"
               if stats.rounds else "")
  serving_s = elapsed - stats.compile_s
  print(f"{len(raws) - errors} requests served ({errors} failed), {tokens} tokens in "
        f"{serving_s:.1f} s after {stats.compile_s:.1f} s of compiling "
        f"({tokens / max(serving_s, 1e-9):.1f} tokens/s, {tokens / max(steps, 1):.2f} tokens "
        f"per macro step){in_flight}; queue_s and latency_s count from the end of compiling",
        file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
