"""`python -m infer.server` on tiny models (a 2-layer GGUF base and an untrained graft): a second
start with the same layout reads every program back from the compilation cache (its /health
counts the hits and misses) and answers as the first did; GET /metrics, scraped under a load
of concurrent streams, parses as Prometheus text and adds up to what the clients were told.
And each app counts in a registry of its own."""

from __future__ import annotations

import os
import threading
import time

import httpx2 as httpx
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hamburger_jax import cache, graft_checkpoint, pretrained
from hamburger_jax.benchmarks.server_load import ServerProcess, drive
from hamburger_jax.benchmarks.server_start import time_to_health, time_to_prepared
from hamburger_jax.config import GraftConfig
from hamburger_jax.decode.admission import AdmissionLoop, Limits
from hamburger_jax.decode.engine import Engine, GenerationError
from hamburger_jax.decode.requests import Request
from hamburger_jax.openai_api.app import Server
from hamburger_jax.openai_api.protocol import Defaults
from hamburger_jax.testing import DECODE_STOP, tiny_decode_model, write_tiny_llama_gguf

# Long enough that a stream closed after its first chunk is cancelled mid-answer.
MAX_TOKENS = 160
LIMITS = ["--modes", "hamburger", "--slots", "2", "--max-prompt-tokens", "32", "--max-tokens",
          str(MAX_TOKENS), "--max-queue", "64"]
REQUESTS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
  tmp = tmp_path_factory.mktemp("tiny-server")
  base = str(tmp / "tiny.gguf")
  write_tiny_llama_gguf(base)
  graft = GraftConfig(num_features=2, micro_layers=1, merger_head_dim=16)
  model, _ = pretrained.load_hamburger(pretrained.UNTRAINED, base, graft=graft)
  ckpt = str(tmp / "graft")
  graft_checkpoint.save_graft(model, ckpt, base, dtype="float32")
  return {"base": base, "checkpoint": ckpt, "cache": str(tmp / "user-cache"), "tmp": str(tmp)}


def _start(tiny, name: str) -> tuple[ServerProcess, dict]:
  """A server on the tiny models with its own fresh cache directory; (it, its /health)."""
  env = {k: v for k, v in os.environ.items()
         if k not in (cache.JAX_CACHE_DIR_ENV, cache.NO_COMPILE_CACHE_ENV)}
  env[cache.CACHE_DIR_ENV] = tiny["cache"]
  server = ServerProcess(["--base", tiny["base"], "--checkpoint", tiny["checkpoint"], *LIMITS],
                         os.path.join(tiny["tmp"], f"{name}.txt"), env=env)
  try:
    _, health = time_to_health(server, timeout_s=900)
  except BaseException:
    server.stop()
    raise
  return server, health


def _complete(server: ServerProcess, ids: list[int], max_tokens: int) -> dict:
  r = httpx.post(server.url + "/v1/completions", timeout=120, json={
      "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "confidence": 0.5})
  assert r.status_code == 200, r.text
  return r.json()


PROBE = [5, 9, 12, 40, 33]


@pytest.fixture(scope="module")
def second(tiny):
  """The second start (against the first's cache), with the first's /health and answer."""
  first, first_health = _start(tiny, "first")
  try:
    first_answer = _complete(first, PROBE, 16)
    _, first_prepared = time_to_prepared(first, 900)
  finally:
    assert first.stop() == 0
  server, health = _start(tiny, "second")
  _, prepared = time_to_prepared(server, 900)
  yield {"server": server, "health": health, "first_health": first_health,
         "first_answer": first_answer, "first_prepared": first_prepared, "prepared": prepared}
  server.stop()


@pytest.mark.slow
def test_a_second_start_compiles_nothing(second):
  before, after = second["first_health"]["compile"], second["health"]["compile"]
  assert before["cache_misses"] > 0, before  # the first start compiled (and wrote) its programs
  assert after["cache_misses"] == 0, after  # the second compiled none: all came from the cache
  assert after["cache_hits"] == before["cache_hits"] + before["cache_misses"], (before, after)
  # The programs prepared while serving: every one read back too, and none left pending.
  rest, rest_after = second["first_prepared"]["prepared"], second["prepared"]["prepared"]
  assert rest["cache_misses"] > 0 and rest_after["cache_misses"] == 0, (rest, rest_after)
  assert rest_after["error"] is None and not any(second["prepared"]["pending"].values())
  assert "compilation cache: " in second["server"].stderr()
  # The decode programs read back stream through the callbacks of this process.
  again = _complete(second["server"], PROBE, 16)
  assert again["choices"][0]["text"] == second["first_answer"]["choices"][0]["text"]
  assert again["usage"] == second["first_answer"]["usage"]


def _scrape(server: ServerProcess) -> dict[tuple[str, tuple], float]:
  """/metrics as {(sample name, sorted labels): value}."""
  r = httpx.get(server.url + "/metrics", timeout=30)
  assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in text_string_to_metric_families(r.text) for s in family.samples}


def _get(m: dict, name: str, **labels) -> float:
  return m[(name, tuple(sorted(labels.items())))]


def _delta(after: dict, before: dict, name: str, **labels) -> float:
  return _get(after, name, **labels) - _get(before, name, **labels)


@pytest.mark.slow
def test_metrics_add_up_under_load(second):
  server = second["server"]
  before = _scrape(server)
  during, stop = [], threading.Event()

  def scrape_while_loaded() -> None:
    while not stop.is_set():
      during.append(_scrape(server))
      time.sleep(0.02)

  scraper = threading.Thread(target=scrape_while_loaded)
  scraper.start()
  bodies = [{"prompt": [(7 * i + j) % 60 + 2 for j in range(3 + i)], "max_tokens": 64 + 8 * i,
             "temperature": 0, "confidence": 0.5} for i in range(REQUESTS)]
  try:
    answers = drive(server.url, bodies, clients=6, timeout_s=300)
  finally:
    stop.set()
    scraper.join()
  assert all(a.error is None for a in answers), [a.error for a in answers]
  after = _scrape(server)
  hb = dict(mode="hamburger")
  assert _delta(after, before, "hamburger_requests_total", state="finished", **hb) == REQUESTS
  assert _delta(after, before, "hamburger_generation_tokens_total", **hb) == sum(
      a.completion_tokens for a in answers)
  assert _delta(after, before, "hamburger_macro_steps_total", **hb) == sum(
      a.macro_steps for a in answers)
  assert _delta(after, before, "hamburger_prompt_tokens_total", **hb) == sum(
      len(b["prompt"]) for b in bodies)
  # Every macro step of a finished request is one observation of its group's size.
  assert _delta(after, before, "hamburger_tokens_per_macro_step_count", **hb) == sum(
      a.macro_steps for a in answers)
  assert _delta(after, before, "hamburger_tokens_per_macro_step_sum", **hb) == sum(
      a.completion_tokens for a in answers)
  assert _delta(after, before, "hamburger_time_to_first_token_seconds_count", **hb) == REQUESTS
  assert _delta(after, before, "hamburger_time_per_output_token_seconds_count", **hb) == sum(
      a.completion_tokens > 1 for a in answers)
  # Under load: requests waited and ran (6 clients, 2 slots), and held KV blocks.
  assert max(_get(m, "hamburger_requests_active", state="running") for m in during) >= 1
  assert max(_get(m, "hamburger_kv_blocks", mode="hamburger", state="used")
             for m in during) >= 1
  for m in during:  # never more than the clients, never more than sent
    assert _get(m, "hamburger_requests_active", state="running") <= 2
    assert (_get(m, "hamburger_requests_active", state="running")
            + _get(m, "hamburger_requests_active", state="queued")) <= 6
    assert _delta(m, before, "hamburger_requests_total", state="finished", **hb) <= REQUESTS
  total = sum(_get(after, "hamburger_kv_blocks", mode="hamburger", state=s)
              for s in ("used", "free"))
  assert _get(after, "hamburger_kv_blocks", mode="hamburger", state="used") == 0
  assert total == _get(before, "hamburger_kv_blocks", mode="hamburger", state="free")


def _wait_idle(server: ServerProcess) -> dict:
  end = time.monotonic() + 60
  while (h := httpx.get(server.url + "/health", timeout=30).json())["in_flight"]:
    assert time.monotonic() < end, h
    time.sleep(0.1)
  return h


@pytest.mark.slow
def test_cancelled_and_refused_requests_are_counted(second):
  server = second["server"]
  before = _scrape(server)
  with httpx.Client(timeout=120) as http:
    r = http.post(server.url + "/v1/completions", json={"prompt": PROBE,
                                                        "max_tokens": MAX_TOKENS + 1})
    assert r.status_code == 400 and "over this server's limit" in r.text
    body = {"prompt": PROBE, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "confidence": 1.0}
    with http.stream("POST", server.url + "/v1/completions", json=body) as r:
      assert r.status_code == 200
      next(line for line in r.iter_lines() if line.startswith("data:") and '"text": "' in line)
    # Leaving the block closed the connection mid-answer.
  _wait_idle(server)
  after = _scrape(server)
  hb = dict(mode="hamburger")
  assert _delta(after, before, "hamburger_requests_total", state="refused", **hb) == 1
  assert _delta(after, before, "hamburger_requests_total", state="cancelled", **hb) == 1
  assert _delta(after, before, "hamburger_requests_total", state="finished", **hb) == 0
  sent = _delta(after, before, "hamburger_generation_tokens_total", **hb)
  assert 1 <= sent < MAX_TOKENS
  assert _delta(after, before, "hamburger_prompt_tokens_total", **hb) == len(PROBE)


def _parse(text: str) -> dict[tuple[str, tuple], float]:
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


def test_each_app_counts_in_a_registry_of_its_own():
  engine = Engine(tiny_decode_model(), None, stop_ids=[DECODE_STOP])
  limits = Limits(slots=2, max_prompt_tokens=16, max_tokens=8)
  servers = [Server(AdmissionLoop(engine, ("hamburger", "base"), limits),
                    Defaults(model="tiny", mode="hamburger", max_tokens=8, confidence=0.5))
             for _ in range(2)]
  with pytest.raises(GenerationError, match="over this server's limit"):
    servers[0].loop.submit(Request([1, 2, 3], max_new_tokens=9), "base")
  texts = [s.metrics.render().decode() for s in servers]
  types = [line.split()[2] for line in texts[0].splitlines() if line.startswith("# TYPE")]
  assert len(types) == len(set(types)) >= 8, types  # one family per name
  counts = [_parse(t) for t in texts]
  refused = [_get(c, "hamburger_requests_total", mode="base", state="refused") for c in counts]
  assert refused == [1, 0]
  usable = servers[0].loop.usable["base"]
  assert _get(counts[1], "hamburger_kv_blocks", mode="base", state="free") == usable
  assert _get(counts[1], "hamburger_kv_blocks", mode="base", state="used") == 0
  assert _get(counts[1], "hamburger_requests_active", state="queued") == 0
  # Nothing went to the process-wide default registry.
  assert not [m for m in prometheus_client.REGISTRY.collect() if m.name.startswith("hamburger")]


def test_a_failing_on_done_is_logged_and_counted(caplog):
  """An on_done callback that raises (its client's event loop gone, say) is logged with its
  request's id and error, and counted in /metrics; serving goes on."""
  engine = Engine(tiny_decode_model(), None, stop_ids=[DECODE_STOP])
  loop = AdmissionLoop(engine, ("hamburger",), Limits(slots=2, max_prompt_tokens=16,
                                                      max_tokens=8))
  server = Server(loop, Defaults(model="tiny", mode="hamburger", max_tokens=8, confidence=0.5))
  count = lambda: _get(_parse(server.metrics.render().decode()), "hamburger_on_done_errors_total",
                       mode="hamburger")
  assert count() == 0

  def gone(gen):
    raise RuntimeError("event loop is closed")
  loop.start()
  with caplog.at_level("WARNING", logger="hamburger_jax.decode.admission"):
    try:
      broken = loop.submit(Request([1, 2, 3], max_new_tokens=4, id="req-7"), on_done=gone)
      fine = loop.submit(Request([4, 5], max_new_tokens=4, id="req-8"))
      assert broken.wait(60).error is None and fine.wait(60).error is None
    finally:
      loop.close()  # joins the loop's thread: every on_done has run
  assert count() == 1
  failed = [r for r in caplog.records if r.name == "hamburger_jax.decode.admission"]
  assert len(failed) == 1 and "req-7" in failed[0].getMessage()
  assert "event loop is closed" in failed[0].getMessage()
