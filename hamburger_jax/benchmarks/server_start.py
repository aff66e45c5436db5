"""How long `python -m infer.server` takes to serve, start after start, against one compilation
cache: to answer /health (the programs that answer every request ready), to answer a first chat
completion, and until the rest of its programs are prepared. The first start compiles and writes
every program, a later one with the same layout should read them all back (its /health reports
the cache's hits and misses)."""

from __future__ import annotations

import os
import time

import httpx2 as httpx

from hamburger_jax import cache
from hamburger_jax.benchmarks.server_load import ServerProcess


def time_to_health(server: ServerProcess, timeout_s: float) -> tuple[float, dict]:
  """(seconds from now until /health answers 200, its body); RuntimeError with the server's
  stderr if it exits first or is not up after `timeout_s`."""
  t = time.perf_counter()
  while time.perf_counter() - t < timeout_s:
    if server.proc.poll() is not None:
      raise RuntimeError(f"the server exited ({server.proc.returncode}):\n"
                         f"{server.stderr()[-3000:]}")
    try:
      r = httpx.get(server.url + "/health", timeout=5)
      if r.status_code == 200:
        return time.perf_counter() - t, r.json()
    except httpx.HTTPError:
      pass  # not listening yet
    time.sleep(0.1)
  raise RuntimeError(f"no /health after {timeout_s} s:\n{server.stderr()[-3000:]}")


def first_answer_s(server: ServerProcess, timeout_s: float) -> float:
  """Seconds a short chat completion takes (8 tokens, the server's default mode)."""
  t = time.perf_counter()
  r = httpx.post(server.url + "/v1/chat/completions", timeout=timeout_s, json={
      "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
      "temperature": 0})
  if r.status_code != 200:
    raise RuntimeError(f"the first chat completion failed ({r.status_code}): {r.text[:500]}")
  return time.perf_counter() - t


def time_to_prepared(server: ServerProcess, timeout_s: float) -> tuple[float, dict]:
  """(seconds until /health lists nothing pending, its body)."""
  t = time.perf_counter()
  while True:
    health = httpx.get(server.url + "/health", timeout=5).json()
    if not any(health.get("pending", {}).values()) or time.perf_counter() - t > timeout_s:
      return time.perf_counter() - t, health
    time.sleep(0.5)


def time_starts(server_args: list[str], compile_cache_dir: str, starts: int, log_dir: str,
                timeout_s: float = 1800, cwd: str | None = None) -> list[dict]:
  """Starts the server `starts` times one after the other with `server_args`, its compiled
  programs in `compile_cache_dir` (JAX's variable, so converted weights stay where they are);
  per start: seconds to /health, to a first chat completion answered after it, and until every
  program is prepared; the ready phase's compile seconds, cache hits and misses, and the
  background's."""
  env = {**os.environ, cache.JAX_CACHE_DIR_ENV: compile_cache_dir}
  env.pop(cache.NO_COMPILE_CACHE_ENV, None)
  rows = []
  for i in range(starts):
    server = ServerProcess(server_args, os.path.join(log_dir, f"start-{i + 1}.txt"), cwd=cwd,
                           env=env)
    try:
      seconds, health = time_to_health(server, timeout_s)
      answer = first_answer_s(server, timeout_s)
      rest, done = time_to_prepared(server, timeout_s)
    finally:
      server.stop()
    rows.append({"start": i + 1, "health_s": seconds, "answer_s": answer,
                 "prepared_s": seconds + answer + rest,
                 **{k: health["compile"][k] for k in ("seconds", "cache_hits", "cache_misses")},
                 **{f"prepared_{k}": done["prepared"][k]
                    for k in ("seconds", "cache_hits", "cache_misses")}})
  return rows
