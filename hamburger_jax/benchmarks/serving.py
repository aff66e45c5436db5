"""Serving a stream of requests once, timed, with what the engine's serve reports."""

from __future__ import annotations

import time

import numpy as np

from hamburger_jax.decode.requests import Request, pooled_tokens_per_step
from hamburger_jax.decode.serving import mean_blocks_held


def run_serve(engine, workload, mode: str, slots: int, confidence: float,
              kv_blocks: int | None = None, round_steps: int | None = None,
              max_group: int | None = None) -> dict[str, float]:
  """Serves the workload once (programs compiled beforehand, not timed); every request arrives
  at t = 0, so latency = queueing + prefill + decode. "gens": the Generations, in workload
  order."""
  reqs = lambda: [Request(ids, max_new_tokens=n, confidence=confidence, id=i,
                          max_group=max_group) for i, (ids, n) in enumerate(workload)]
  lengths = [len(ids) for ids, _ in workload]
  layout = engine.layout(mode, slots, max(n for _, n in workload), max(lengths), kv_blocks)
  compile_s = engine.compile_programs(layout, [ids for ids, _ in workload], stochastic=False)
  t = time.perf_counter()
  run = engine.serve(reqs(), slots=slots, kv_blocks=kv_blocks, mode=mode,
                     round_steps=round_steps)
  out = list(run)
  wall = time.perf_counter() - t
  if any(g.error for g in out):
    raise RuntimeError(next(g.error for g in out if g.error))
  tokens = sum(g.new_tokens for g in out)
  lat = np.asarray([g.latency_s for g in out])
  stats = run.stats
  return {"tok_s": tokens / wall, "p50": float(np.percentile(lat, 50)),
          "p95": float(np.percentile(lat, 95)), "p99": float(np.percentile(lat, 99)),
          "gens": sorted(out, key=lambda g: g.id), "k": pooled_tokens_per_step(out),
          "in_flight": stats.mean_in_flight, "queued_in_flight": stats.in_flight_while_queued,
          "peak_blocks": max(stats.blocks_used),
          "preemptions": stats.preemptions, "wall": wall, "compile": compile_s,
          "rounds": stats.rounds, "prefill": sum(g.prefill_s for g in out),
          "prefix_hits": stats.prefix_hits, "prefix_tokens": stats.prefix_tokens,
          "kv_per_token": sum(g.kv_entries - g.prompt_tokens for g in out) / tokens,
          "blocks_held": mean_blocks_held(out, engine.block_size)}
