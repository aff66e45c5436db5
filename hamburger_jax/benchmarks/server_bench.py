"""infer.bench --mode server: `python -m infer.server` under N concurrent streaming clients,
beside the in-process `serve()` on the same requests, in the same run."""

from __future__ import annotations

import os
import tempfile

import numpy as np

from hamburger_jax import cli
from hamburger_jax.benchmarks.prompts import serve_workload
from hamburger_jax.benchmarks.serving import run_serve


def _in_process(engine, workload, mode: str, slots: int, confidence: float) -> dict:
  """serve() over the workload, all arriving at t = 0 (programs compiled before the clock), in
  the HTTP side's figures (it reports no first-token time)."""
  r = run_serve(engine, workload, mode, slots, confidence)
  gens = r["gens"]
  return {"gens": gens, "requests": len(gens), "answered": len(gens), "failed": 0,
          "duplicated": 0, "wall_s": r["wall"], "requests_per_s": len(gens) / r["wall"],
          "tok_s": r["tok_s"], "ttft_p50": float("nan"), "ttft_p99": float("nan"),
          "latency_p50": r["p50"], "latency_p99": r["p99"],
          "prefill_p50": float(np.median([g.prefill_s for g in gens]))}


def _server_args(args, mode: str, slots: int, workload) -> list[str]:
  # One mode, as serve() runs: the other's programs would only add compile time and memory.
  out = ["--modes", mode, "--slots", str(slots), "--confidence", str(args.confidence),
         "--max-prompt-tokens", str(max(len(ids) for ids, _ in workload)),
         "--max-tokens", str(max(n for _, n in workload)), "--max-queue", str(len(workload))]
  for flag, value in (("--checkpoint", args.checkpoint), ("--base", args.base),
                      ("--micro-vocab", args.micro_vocab)):
    if value is not None:
      out += [flag, str(value)]
  return out


def bench_server(args) -> None:
  # pylint: disable=import-outside-toplevel
  import httpx2 as httpx  # the HTTP client: only this bench needs it (not accelerator hosts)
  from hamburger_jax.benchmarks.server_load import ServerProcess, drive, summary
  from hamburger_jax.decode.engine import Engine

  model, tok, _, mode = cli.load_for_decoding(
      args, lambda ckpt: "hamburger" if ckpt is not None else "base")
  engine = Engine(model, tok)  # stops at end of turn, as the server does: the same tokens
  workload = serve_workload(tok, args.requests, args.new_range)
  slots = args.slots[0]
  print(f"the server against serve(): {len(workload)} requests (ShareGPT held-out + "
        f"gsm_symbolic, max_new_tokens {args.new_range[0]}-{args.new_range[1]}), greedy, "
        f"{mode} c={args.confidence}, {slots} slots, {args.clients} concurrent streaming "
        f"clients ({os.cpu_count()} CPU cores)", flush=True)
  local = _in_process(engine, workload, mode, slots, args.confidence)
  with tempfile.TemporaryDirectory() as tmp:
    server = ServerProcess(_server_args(args, mode, slots, workload),
                           os.path.join(tmp, "server.txt"))
    try:
      server.wait_ready()
      name = httpx.get(server.url + "/v1/models", timeout=60).json()["data"][0]["id"]
      answers = drive(server.url, [{"model": name, "prompt": ids, "max_tokens": n,
                                    "temperature": 0} for ids, n in workload], args.clients)
      health = httpx.get(server.url + "/health", timeout=60).json()
    finally:
      server.stop()
  remote = summary(answers)
  same = sum(a.error is None and a.completion_tokens == g.new_tokens
             for a, g in zip(answers, local["gens"]))
  print("\n| side | answered | failed | duplicated | requests/s | output tok/s | vs serve() | "
        "TTFT p50 s | TTFT p99 s | latency p50 s | latency p99 s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  cell = lambda x: "-" if np.isnan(x) else f"{x:.2f}"  # serve() reports no first-token time
  for side, r in (("serve() in process", local), ("HTTP server", remote)):
    print(f"| {side} | {r['answered']}/{r['requests']} | {r['failed']} | {r['duplicated']} | "
          f"{r['requests_per_s']:.2f} | {r['tok_s']:.1f} | {r['tok_s'] / local['tok_s']:.2f}x | "
          f"{cell(r['ttft_p50'])} | {cell(r['ttft_p99'])} | {r['latency_p50']:.2f} | "
          f"{r['latency_p99']:.2f} |")
  round_s = health["modes"][mode]["round_s_mean"]
  print(f"\ntime to first token p50 {remote['ttft_p50']:.2f} s; one prefill (serve()'s p50, "
        f"{local['prefill_p50']:.2f} s) + one round (the server's mean at this load, "
        f"{round_s:.2f} s) = {local['prefill_p50'] + round_s:.2f} s")
  print(f"answers with serve()'s token count: {same}/{len(workload)}; errors: "
        f"{remote['errors'] or 'none'}")
