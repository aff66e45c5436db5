"""`python -m infer.server` as a client sees it: a real server process on 127.0.0.1 serving the
shipped graft, driven by the official `openai` client (and raw HTTP for malformed bodies).

Greedy answers, streamed or not, are `infer.generate`'s; 32 concurrent clients with mixed
settings are each answered once, with their own id, and the greedy ones as when alone; clients
that go away free their slots; bad input gets a clear 4xx while serving goes on; SIGTERM lets
the requests in flight end and the process exit. The tests share one server, so they run in
one process, in this order (the last one stops it): the README's `--dist loadfile` keeps a
file's tests on one pytest-xdist worker (its `loadgroup` does not group under pytest 9, whose
node ids it can no longer suffix)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from hamburger_jax import assets
from hamburger_jax.benchmarks.server_load import ServerProcess

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
LIMITS = ["--slots", "8", "--max-prompt-tokens", "96", "--max-tokens", "32", "--max-queue", "64"]
PROMPTS = ["What is 2 + 2?", "Name three colours.", "Write a haiku about bread.",
           "Why is the sky blue?", "Give me a word that rhymes with cat.", "Count to five.",
           "What is the capital of Italy?", "Say hello in French."]
REFERENCE_NEW, REFERENCE_CONFIDENCE = 24, 0.5


class _Server(ServerProcess):

  def client(self, **kw) -> "openai.OpenAI":
    return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300, **kw)


@pytest.fixture(scope="module")
def started(tmp_path_factory):
  try:
    assets.smollm2_gguf()
  except assets.AssetError as e:
    pytest.skip(str(e))
  server = _Server(LIMITS, str(tmp_path_factory.mktemp("server") / "stderr.txt"), cwd=str(REPO))
  yield server
  if server.proc.poll() is None:
    server.proc.kill()
    server.proc.wait()


@pytest.fixture(scope="module")
def reference(started):
  """infer.generate's answers (run while the server compiles)."""
  args = [a for p in PROMPTS[:3] for a in ("--prompt", p)]
  res = subprocess.run([sys.executable, "-m", "infer.generate", *args, "--mode", "both",
                        "--max-new-tokens", str(REFERENCE_NEW), "--confidence",
                        str(REFERENCE_CONFIDENCE), "--json"], cwd=REPO, capture_output=True,
                       text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  return {(r["prompt"], r["mode"]): r for r in map(json.loads, res.stdout.splitlines())}


@pytest.fixture(scope="module")
def server(started):
  started.wait_ready()
  return started


def _model(server) -> str:
  return server.client().models.list().data[0].id


def _ask(client, model: str, prompt: str, stream: bool, **kw) -> dict:
  """One chat completion: text, finish reason, usage and every id the answer carried."""
  args = dict(model=model, messages=[{"role": "user", "content": prompt}], **kw)
  if not stream:
    r = client.chat.completions.create(**args)
    return {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
            "usage": r.usage.model_dump(), "ids": {r.id}}
  text, finish, usage, ids = [], None, None, set()
  for chunk in client.chat.completions.create(**args, stream=True,
                                              stream_options={"include_usage": True}):
    ids.add(chunk.id)
    if chunk.usage is not None:
      usage = chunk.usage.model_dump()
    for choice in chunk.choices:
      text.append(choice.delta.content or "")
      finish = choice.finish_reason or finish
  return {"text": "".join(text), "finish": finish, "usage": usage, "ids": ids}


def test_greedy_answers_are_generates(server, reference):
  client, model = server.client(), _model(server)
  for prompt in PROMPTS[:3]:
    for mode in ("hamburger", "base"):
      want = reference[(prompt, mode)]
      for stream in (False, True):
        got = _ask(client, model, prompt, stream, max_tokens=REFERENCE_NEW, temperature=0,
                   extra_body={"mode": mode, "confidence": REFERENCE_CONFIDENCE})
        assert got["text"] == want["text"], (prompt, mode, stream)
        usage = got["usage"]
        assert usage["completion_tokens"] == want["new_tokens"]
        assert usage["macro_steps"] == want["macro_steps"]
        assert usage["kv_entries"] == want["kv_entries"]
        if want["new_tokens"] < REFERENCE_NEW:
          assert got["finish"] == "stop"


def _settings(i: int) -> dict:
  """Client i's settings: modes, confidences, lengths and seeded sampling, mixed."""
  kind = i % 4
  extra = {"mode": "base" if kind == 0 else "hamburger", "confidence": (0.5, 0.8, 1.0)[i % 3]}
  kw = dict(max_tokens=8 + (i * 7) % 25, extra_body=extra)
  if kind == 3:
    kw.update(temperature=0.9, top_p=0.9, seed=1000 + i)
  else:
    kw.update(temperature=0)
  return kw


def test_32_concurrent_streaming_clients(server):
  client, model = server.client(), _model(server)
  results: dict[int, dict] = {}
  errors: dict[int, str] = {}

  def run(i: int) -> None:
    try:
      results[i] = _ask(client, model, PROMPTS[i % len(PROMPTS)], True, **_settings(i))
    except Exception as e:  # pylint: disable=broad-except
      errors[i] = repr(e)

  threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=600)
  assert not any(t.is_alive() for t in threads), "a client hung"
  assert not errors, errors
  assert sorted(results) == list(range(32))
  ids = [next(iter(r["ids"])) for r in results.values()]
  assert all(len(r["ids"]) == 1 for r in results.values()), "one answer, one id"
  assert len(set(ids)) == 32, "every request has its own id"
  for i, r in results.items():
    assert r["usage"]["completion_tokens"] <= _settings(i)["max_tokens"]
    assert r["finish"] in ("stop", "length")
  # Alone, each gives the same answer: greedy ones by definition, sampled ones by their seed.
  for i in range(0, 32, 3):
    alone = _ask(client, model, PROMPTS[i % len(PROMPTS)], False, **_settings(i))
    assert alone["text"] == results[i]["text"], i
    assert alone["usage"] == results[i]["usage"], i


def _health(server) -> dict:
  return httpx.get(server.url + "/health", timeout=30).json()


def test_clients_that_go_away_free_their_slots(server):
  model = _model(server)
  cancelled = _health(server)["cancelled"]
  body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
          "max_tokens": 32, "temperature": 0, "stream": True, "confidence": 1.0}
  with httpx.Client(timeout=120) as http:
    for _ in range(8):  # every slot, one after the other
      with http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        next(line for line in lines if line.startswith("data:") and "content" in line)
      # Leaving the block closes the connection mid-answer.
  end = time.monotonic() + 60
  while (h := _health(server))["in_flight"] and time.monotonic() < end:
    time.sleep(0.2)
  assert h["in_flight"] == 0 and h["waiting"] == 0, h
  assert h["cancelled"] - cancelled == 8, h
  got = _ask(server.client(), model, PROMPTS[0], False, max_tokens=4, temperature=0)
  assert got["usage"]["completion_tokens"] >= 1


BAD = [
    ("{not json", 400, "not valid JSON"),
    ({"messages": "hi"}, 400, "messages must be a non-empty list"),
    ({"messages": []}, 400, "messages must be a non-empty list"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "'wizard' is not one of"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content must be"),
    ({"messages": [{"role": "user", "content": "  "}]}, 400, "every message is empty"),
    ({"max_tokens": 0}, 400, "max_tokens must be an integer >= 1"),
    ({"max_tokens": "ten"}, 400, "max_tokens must be an integer >= 1"),
    ({"max_tokens": 33}, 400, "max_tokens=33 is over this server's limit of 32"),
    ({"messages": [{"role": "user", "content": "word " * 200}]}, 400,
     "over this server's limit of 96"),
    ({"temperature": -1}, 400, "temperature=-1.0 must be >= 0"),
    ({"top_p": 0}, 400, "top_p=0.0 must be in (0, 1]"),
    ({"top_p": 1.5}, 400, "top_p=1.5 must be in (0, 1]"),
    ({"n": 2}, 400, "n=2: this server returns one choice"),
    ({"model": "gpt-4"}, 404, "the model 'gpt-4' does not exist here"),
    ({"confidence": 1.5}, 400, "confidence must be in [0, 1], got 1.5"),
    ({"stream": "yes"}, 400, "stream must be true or false"),
    ({"mode": "turbo"}, 400, "mode 'turbo' is not served here"),
    ({"tools": [{"type": "function"}]}, 400, "tools is not supported"),
    ("x" * (3 << 20), 413, "the limit is 1048576"),
]


def test_bad_input_gets_a_clear_4xx(server):
  model = _model(server)
  good = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
  with httpx.Client(timeout=120) as http:
    for body, status, message in BAD:
      content = body.encode() if isinstance(body, str) else json.dumps({**good, **body})
      r = http.post(server.url + "/v1/chat/completions", content=content,
                    headers={"content-type": "application/json"})
      assert r.status_code == status, (body if isinstance(body, dict) else body[:20], r.text)
      error = r.json()["error"]
      assert message in error["message"], (error, message)
      assert set(error) == {"message", "type", "param", "code"}
    r = http.post(server.url + "/v1/completions", json={"model": model, "prompt": ""})
    assert r.status_code == 400 and "prompt is empty" in r.json()["error"]["message"]
    r = http.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
  with pytest.raises(openai.BadRequestError, match="n=2: this server returns one choice"):
    server.client().chat.completions.create(model=model, n=2, **{
        k: v for k, v in good.items() if k != "model"})
  # Still serving.
  assert _health(server)["status"] == "ok"
  done = server.client().completions.create(model=model, prompt="The capital of France is",
                                            max_tokens=6, temperature=0, stop=["."])
  assert done.choices[0].text and "." not in done.choices[0].text


def test_sigterm_ends_requests_in_flight(server):
  """Run last: it stops the module's server."""
  client, model = server.client(), _model(server)
  outcome: dict[int, str] = {}
  first = threading.Event()

  def run(i: int) -> None:
    try:
      if i % 2:
        got = _ask(client, model, PROMPTS[i % 8], False, max_tokens=32, temperature=0)
        outcome[i] = got["finish"]
      else:
        for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[i % 8]}], max_tokens=32,
            temperature=0, stream=True):
          first.set()
          if chunk.choices and chunk.choices[0].finish_reason:
            outcome[i] = chunk.choices[0].finish_reason
    except Exception as e:  # pylint: disable=broad-except
      outcome[i] = f"error: {type(e).__name__}"

  threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
  for t in threads:
    t.start()
  assert first.wait(120)
  server.proc.send_signal(signal.SIGTERM)
  for t in threads:
    t.join(timeout=120)
  assert not any(t.is_alive() for t in threads), "a request hung after SIGTERM"
  assert len(outcome) == 12, outcome
  assert server.proc.wait(timeout=120) == 0, server.stderr()[-3000:]
  assert "server stopped by SIGTERM" in server.stderr()
  with pytest.raises(openai.APIConnectionError):
    server.client().models.list()
