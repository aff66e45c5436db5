"""Load on an OpenAI-compatible server: N concurrent streaming clients over a list of requests,
each timed from its send to its first text (time to first token) and to its end.

Requests go to /v1/completions as token ids, so the server decodes exactly the prompts an
in-process `serve()` gets (no chat template or tokenizer in between).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import httpx2 as httpx
import numpy as np


class ServerProcess:
  """`python -m infer.server` on a free port of 127.0.0.1, its stderr in `log`; `env`: its
  environment (default this process's)."""

  def __init__(self, args: list[str], log: str, cwd: str | None = None,
               env: dict[str, str] | None = None):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      self.port = s.getsockname()[1]
    self.url = f"http://127.0.0.1:{self.port}"
    self.log = log
    with open(log, "w", encoding="utf-8") as err:
      self.proc = subprocess.Popen(
          [sys.executable, "-m", "infer.server", "--port", str(self.port), *args], cwd=cwd,
          stdout=subprocess.DEVNULL, stderr=err, env={**(os.environ if env is None else env),
                                                      "PYTHONUNBUFFERED": "1"})

  def stderr(self) -> str:
    with open(self.log, encoding="utf-8", errors="replace") as f:
      return f.read()

  def wait_ready(self, timeout_s: float = 1800) -> None:
    """Returns once the server listens; RuntimeError with its stderr's tail if it exits or
    takes longer than `timeout_s` (loading and compiling)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
      if self.proc.poll() is not None:
        raise RuntimeError(f"the server exited ({self.proc.returncode}):\n"
                           f"{self.stderr()[-3000:]}")
      if "serving " in self.stderr():
        return
      time.sleep(0.5)
    raise RuntimeError(f"the server was not up after {timeout_s} s:\n{self.stderr()[-3000:]}")

  def stop(self) -> int:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=120)
      except subprocess.TimeoutExpired:
        self.proc.kill()
    return self.proc.wait()


@dataclasses.dataclass
class Answer:
  """One request's answer as its client saw it."""
  index: int
  ids: set[str]  # the response ids its chunks carried (one when all is well)
  text: str = ""
  completion_tokens: int = 0
  macro_steps: int = 0
  finish_reason: str | None = None
  sent: float = 0.0
  first: float | None = None  # when its first text arrived
  end: float = 0.0
  error: str | None = None


async def _one(http: httpx.AsyncClient, url: str, index: int, body: dict) -> Answer:
  answer = Answer(index, set())
  answer.sent = time.perf_counter()
  try:
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
      if r.status_code != 200:
        answer.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
        return answer
      async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
          answer.error = chunk["error"]["message"]
          continue
        answer.ids.add(chunk["id"])
        for choice in chunk["choices"]:
          if choice["text"] and answer.first is None:
            answer.first = time.perf_counter()
          answer.text += choice["text"]
          answer.finish_reason = choice["finish_reason"] or answer.finish_reason
        if chunk.get("usage"):
          answer.completion_tokens = chunk["usage"]["completion_tokens"]
          answer.macro_steps = chunk["usage"]["macro_steps"]
  except httpx.HTTPError as e:
    answer.error = f"{type(e).__name__}: {e}"
  finally:
    answer.end = time.perf_counter()
  return answer


def drive(url: str, bodies: list[dict], clients: int, timeout_s: float = 3600) -> list[Answer]:
  """Sends `bodies` (completion requests; streamed, with usage) from `clients` concurrent
  clients, each taking the next request when its last one ends; returns the answers by index.
  A request that does not end within `timeout_s` is an error ("hung")."""

  async def run() -> list[Answer]:
    queue: asyncio.Queue = asyncio.Queue()
    for i, body in enumerate(bodies):
      queue.put_nowait((i, {**body, "stream": True, "stream_options": {"include_usage": True}}))
    out: list[Answer] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as http:

      async def client() -> None:
        while not queue.empty():
          i, body = queue.get_nowait()
          out.append(await _one(http, url, i, body))

      await asyncio.gather(*(client() for _ in range(clients)))
    return sorted(out, key=lambda a: a.index)

  return asyncio.run(run())


def summary(answers: list[Answer]) -> dict:
  """Requests/s, output tok/s, time to first token and latency (p50, p99), and what was lost
  (no answer), duplicated (two ids, or one id twice) or failed."""
  ok = [a for a in answers if a.error is None and a.finish_reason is not None]
  start = min(a.sent for a in answers)
  wall = max(a.end for a in answers) - start
  ttft = np.asarray([a.first - a.sent for a in ok if a.first is not None])
  latency = np.asarray([a.end - a.sent for a in ok])
  ids = [i for a in answers for i in a.ids]
  pct = lambda x, q: float(np.percentile(x, q)) if len(x) else float("nan")
  tokens = sum(a.completion_tokens for a in ok)
  return {"requests": len(answers), "answered": len(ok), "failed": len(answers) - len(ok),
          "duplicated": len(ids) - len(set(ids)) + sum(len(a.ids) > 1 for a in answers),
          "wall_s": wall, "requests_per_s": len(ok) / wall, "tok_s": tokens / wall,
          "tokens": tokens, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
          "latency_p50": pct(latency, 50), "latency_p99": pct(latency, 99),
          "errors": sorted({a.error for a in answers if a.error})[:3]}
