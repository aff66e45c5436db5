"""CLI: an OpenAI-compatible HTTP server; requests join the running batch as they arrive.

  python -m infer.server --port 8000
  python -m infer.server --port 8000 --slots 16 --max-prompt-tokens 2048 --max-tokens 512

Routes: POST /v1/chat/completions, POST /v1/completions (`stream: true` for server-sent events),
GET /v1/models, GET /health. HAMburger's settings travel as extra body fields: `confidence`,
`max_group`, and `mode` ("hamburger" or "base": a graft serves both, each with its own KV pool).
Log-probabilities: chat's `logprobs`/`top_logprobs`, the completions' `logprobs`/`echo`
(hamburger_jax/openai_api/logprobs.py; what they are in each mode: decode/scoring.py).
The layout is fixed at start from the flags: a request over --max-prompt-tokens or --max-tokens
is refused (400), and one beyond --max-queue waiting requests gets 503. SIGTERM stops taking
requests, lets those in flight finish (up to --shutdown-timeout s), then fails what remains.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from hamburger_jax import cli
from hamburger_jax.config import DEFAULT_PREFIX_CACHE_TOKENS


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m infer.server", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
  p.add_argument("--port", type=int, default=8000)
  p.add_argument("--mode", choices=("hamburger", "base", "verify"), default=None,
                 help="a request's mode when it names none (default: hamburger when a "
                 "checkpoint is available, else base); verify: the base's exact output, "
                 "drafted by the micro decoder")
  p.add_argument("--modes", default=None,
                 help="the modes served, comma-separated, each with its own KV pool and "
                 "programs (default: hamburger,base with a checkpoint, else base; add verify "
                 "to serve it)")
  cli.add_model_flags(p, micro_vocab=True)
  p.add_argument("--served-model-name", default=None,
                 help="the model id clients send (default: the checkpoint's or base's name)")
  p.add_argument("--slots", type=int, default=8, help="requests decoded at once, per mode")
  p.add_argument("--kv-blocks", type=int, default=None,
                 help="KV pool size in blocks, per mode (default: every slot's longest request)")
  p.add_argument("--block-size", type=int, default=16, help="KV entries per block")
  p.add_argument("--max-prompt-tokens", type=int, default=1024)
  p.add_argument("--max-tokens", type=int, default=512,
                 help="the most tokens a request may ask for (and its default)")
  p.add_argument("--max-queue", type=int, default=256,
                 help="requests waiting for a slot before new ones get 503")
  p.add_argument("--round-steps", type=int, default=None,
                 help="macro steps a decode round runs before arrivals are admitted "
                 "(default: decode/admission.py's)")
  p.add_argument("--tensor", type=int, default=1,
                 help="devices the weights are sharded over (tensor parallel)")
  p.add_argument("--prefix-cache-tokens", type=int, default=DEFAULT_PREFIX_CACHE_TOKENS,
                 help="KV entries of earlier turns kept for requests that repeat them")
  p.add_argument("--shutdown-timeout", type=float, default=30.0,
                 help="seconds in-flight requests get to finish after SIGTERM")
  cli.add_decode_flags(p, max_new_tokens=None, max_new_help=argparse.SUPPRESS)
  p.add_argument("--no-compile-cache", action="store_true")
  args = p.parse_args(argv)
  for name in ("slots", "block_size", "max_prompt_tokens", "max_tokens", "max_queue", "tensor"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1")
  if args.round_steps is not None and args.round_steps < 1:
    p.error("--round-steps must be >= 1")
  if not 0 < args.port < 65536:
    p.error(f"--port {args.port} must be in 1..65535")
  if args.kv_blocks is not None and args.kv_blocks < 2:
    p.error("--kv-blocks must be >= 2 (one block is reserved)")
  if args.prefix_cache_tokens < 0:
    p.error("--prefix-cache-tokens must be >= 0 (0 turns prefix caching off)")
  args.max_new_tokens = args.max_tokens
  cli.check_decode_flags(p, args)
  return args


# The modes a graft checkpoint serves (the base is served by any).
GRAFT_MODES = ("hamburger", "verify")


def served_modes(args: argparse.Namespace, available: str) -> tuple[str, tuple[str, ...]]:
  """(a request's default mode, the modes served) from --mode and --modes; `available` is
  "hamburger" when a graft checkpoint is there, else "base"."""
  if args.modes:
    modes = tuple(dict.fromkeys(m.strip() for m in args.modes.split(",")))
  else:
    modes = ("hamburger", "base") if available == "hamburger" else ("base",)
  if args.mode and not args.modes and args.mode not in modes and available == "hamburger":
    modes = (args.mode, *modes)  # --mode verify alone serves it beside the default modes
  if not set(modes) <= set(GRAFT_MODES) | {"base"}:
    raise SystemExit(f"error: --modes {args.modes}: list hamburger, verify and/or base")
  needs = [m for m in modes if m in GRAFT_MODES]
  if needs and available != "hamburger":
    raise SystemExit(f"error: mode {needs[0]} needs a graft checkpoint (--checkpoint); or serve "
                     "--modes base")
  mode = args.mode or modes[0]
  if mode not in modes:
    raise SystemExit(f"error: --mode {mode} is not among the modes served ({','.join(modes)})")
  return mode, modes


def build(args: argparse.Namespace):
  """(the Server, its AdmissionLoop started) for these flags; SystemExit when the model cannot
  load or the flags do not fit it."""
  # pylint: disable=import-outside-toplevel
  import jax
  from hamburger_jax import pretrained
  from hamburger_jax.decode.admission import DEFAULT_ROUND_STEPS, AdmissionLoop, Limits
  from hamburger_jax.decode.aot import tensor_mesh
  from hamburger_jax.decode.engine import Engine, GenerationError
  from hamburger_jax.openai_api.app import Server
  from hamburger_jax.openai_api.protocol import Defaults

  if args.tensor > len(jax.devices()):
    raise SystemExit(f"error: --tensor {args.tensor}: only {len(jax.devices())} devices here")
  served = lambda ckpt: served_modes(args, pretrained.default_mode(ckpt))
  graft = lambda ms: any(m in GRAFT_MODES for m in ms)
  model, tok, checkpoint, _ = cli.load_for_decoding(
      args, lambda ckpt: "hamburger" if graft(served(ckpt)[1]) else "base")
  mode, modes = served(checkpoint)
  loaded = "hamburger" if graft(modes) else "base"
  mesh = tensor_mesh(jax.devices(), args.tensor) if args.tensor > 1 else None
  if args.tensor > 1 and mesh is None:
    raise SystemExit(f"error: --tensor {args.tensor}: the first {args.tensor} devices do not "
                     "form a rectangular block, which a TPU mesh needs; try another count")
  engine = Engine(model, tok, block_size=args.block_size, mesh=mesh,
                  prefix_cache_tokens=args.prefix_cache_tokens, draft_lookup=args.draft_lookup)
  name = args.served_model_name or os.path.basename(os.path.normpath(
      checkpoint if loaded == "hamburger" else (args.base or pretrained.DEFAULT_BASE)))
  try:
    loop = AdmissionLoop(engine, modes, Limits(
        slots=args.slots, max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
        kv_blocks=args.kv_blocks, max_queue=args.max_queue),
                         round_steps=args.round_steps or DEFAULT_ROUND_STEPS)
  except GenerationError as e:
    raise SystemExit(f"error: {e}") from None
  cli.phase(f"compiling the programs that answer every request: {args.slots} slots, prompts up "
            f"to {args.max_prompt_tokens} tokens, up to {args.max_tokens} new "
            f"({', '.join(modes)})", loop.start)
  defaults = Defaults(model=name, mode=mode, max_tokens=args.max_tokens,
                      confidence=args.confidence, max_group=args.max_group,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      seed=args.seed, draft_confidence=args.draft_confidence)
  return Server(loop, defaults), loop


def check_port(host: str, port: int) -> None:
  """Fails now, not after minutes of loading and compiling, when the address is taken."""
  import socket  # pylint: disable=import-outside-toplevel
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind((host, port))
    except OSError as e:
      raise SystemExit(f"error: cannot listen on {host}:{port} ({e.strerror}): pick another "
                       "--port or --host") from None


def main(argv=None) -> int:
  args = parse_args(argv)
  check_port(args.host, args.port)
  import uvicorn  # pylint: disable=import-outside-toplevel
  server, loop = build(args)
  config = uvicorn.Config(server.app, host=args.host, port=args.port, log_level="warning",
                          timeout_graceful_shutdown=args.shutdown_timeout)
  if not args.no_compile_cache:
    print(f"compilation cache: {loop.compile_cache.hits} programs read, "
          f"{loop.compile_cache.misses} compiled and written", file=sys.stderr, flush=True)
  pending = sum(len(v) for v in loop.pending().values())
  if pending:
    print(f"{pending} more programs (faster for some requests, the same tokens) are prepared "
          "while serving: GET /health lists them", file=sys.stderr, flush=True)
  print(f"serving {server.defaults.model} ({', '.join(loop.modes)}) on "
        f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
  # uvicorn shuts down gracefully on SIGTERM/SIGINT and then raises the signal again for the
  # handler it found: this one, so that the loop below is closed and the exit status is 0.
  stopped = []
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda signum, _: stopped.append(signal.Signals(signum).name))
  try:
    uvicorn.Server(config).run()
  finally:
    loop.close(drain=False, timeout=60)
  print(f"server stopped{' by ' + stopped[0] if stopped else ''}", file=sys.stderr, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
