"""`python -m infer.server` as a client sees it: a real server process on 127.0.0.1 serving the
shipped graft, driven by the official `openai` client (and raw HTTP for malformed bodies), and
lm-evaluation-harness as its client.

Greedy answers, streamed or not, are `infer.generate`'s; 32 concurrent clients with mixed
settings are each answered once, with their own id, and the greedy ones as when alone; clients
that go away free their slots; bad input gets a clear 4xx while serving goes on; SIGTERM lets
the requests in flight end and the process exit.

Log-probabilities: chat's `logprobs`/`top_logprobs` and the completions' `logprobs`/`echo`,
streamed or not: the same answer as without them, each greedy token the top of its own
alternatives, a stream's pieces the whole answer's; at confidence 1.0 HAMburger's the base's.
lm-eval's `local-completions` scores a multiple-choice task from the prompt's log-likelihoods
(equal to a direct forward of the base) and `local-chat-completions` answers a generate_until
task (the server's own greedy answers).

The tests share one server, so they run in one process, in this order (the last one stops it):
the README's `--dist loadfile` keeps a file's tests on one pytest-xdist worker (its `loadgroup`
does not group under pytest 9, whose node ids it can no longer suffix)."""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hamburger_jax import assets
from hamburger_jax.benchmarks.server_load import ServerProcess

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# 95 prompt tokens + 32 new + 1 fit one 128-entry view: one decode program a mode and sampling
# kind, not two (the views' switching is test_serving's).
LIMITS = ["--slots", "8", "--max-prompt-tokens", "95", "--max-tokens", "32", "--max-queue", "64"]
PROMPTS = ["What is 2 + 2?", "Name three colours.", "Write a haiku about bread.",
           "Why is the sky blue?", "Give me a word that rhymes with cat.", "Count to five.",
           "What is the capital of Italy?", "Say hello in French."]
REFERENCE_NEW, REFERENCE_CONFIDENCE = 24, 0.5
CHAT = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"
MC_DOCS = [{"question": "The capital of France is", "choices": [" Paris", " London", " Rome"],
            "answer": 0},
           {"question": "Two plus two equals", "choices": [" four", " five", " seven"],
            "answer": 0},
           {"question": "The opposite of hot is", "choices": [" warm", " cold"], "answer": 1}]
GEN_DOCS = [{"question": "What is 2 + 2? Answer with a number only.", "answer": "4"},
            {"question": "Name the capital of Italy in one word.", "answer": "Rome"}]


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
  """Each prompt in each mode, streamed and not, sent together (greedy answers do not depend on
  their batch mates: test_32_concurrent_streaming_clients): infer.generate's text, tokens,
  macro steps and KV entries, and a stop before the limit where generate stopped."""
  client, model = server.client(), _model(server)
  asked = [(prompt, mode, stream) for prompt in PROMPTS[:3] for mode in ("hamburger", "base")
           for stream in (False, True)]
  with concurrent.futures.ThreadPoolExecutor(len(asked)) as pool:
    answers = list(pool.map(lambda a: _ask(
        client, model, a[0], a[2], max_tokens=REFERENCE_NEW, temperature=0,
        extra_body={"mode": a[1], "confidence": REFERENCE_CONFIDENCE}), asked))
  for (prompt, mode, stream), got in zip(asked, answers):
    want = reference[(prompt, mode)]
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
     "over this server's limit of 95"),
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


# ----------------------------------------------------------------------------- log-probabilities

def _chat(server, stream: bool, **kw) -> tuple[str, list, str]:
  """(text, logprobs content entries as dicts, finish reason) of one greedy chat answer."""
  args = dict(model=_model(server), messages=CHAT, max_tokens=16, temperature=0, **kw)
  client = server.client()
  if not stream:
    r = client.chat.completions.create(**args)
    lp = r.choices[0].logprobs
    return (r.choices[0].message.content, None if lp is None else
            [c.model_dump() for c in lp.content], r.choices[0].finish_reason)
  text, content, finish = [], [], None
  for chunk in client.chat.completions.create(**args, stream=True):
    for choice in chunk.choices:
      text.append(choice.delta.content or "")
      if choice.logprobs is not None:
        content += [c.model_dump() for c in choice.logprobs.content]
      finish = choice.finish_reason or finish
  return "".join(text), content, finish


@pytest.mark.parametrize("mode", ["base", "hamburger"])
def test_chat_logprobs(server, mode):
  extra = {"extra_body": {"mode": mode, "confidence": 0.5}}
  plain, none, _ = _chat(server, False, **extra)
  assert none is None
  text, content, finish = _chat(server, False, logprobs=True, top_logprobs=3, **extra)
  assert text == plain
  for c in content:
    assert len(c["top_logprobs"]) == 3
    best = c["top_logprobs"][0]  # greedy: the token is the top of its own distribution
    assert (best["token"], best["bytes"], best["logprob"]) == (c["token"], c["bytes"],
                                                                 c["logprob"])
    assert c["logprob"] <= 0 and [a["logprob"] for a in c["top_logprobs"]] == sorted(
        (a["logprob"] for a in c["top_logprobs"]), reverse=True)
  shown = b"".join(bytes(c["bytes"]) for c in content).decode()
  assert shown == text + ("<|im_end|>" if finish == "stop" else "")
  streamed = _chat(server, True, logprobs=True, top_logprobs=3, **extra)
  assert streamed == (text, content, finish)
  alone, few, _ = _chat(server, False, logprobs=True, **extra)  # top_logprobs 0: none listed
  assert alone == text and [c["top_logprobs"] for c in few] == [[]] * len(content)
  assert [c["logprob"] for c in few] == [c["logprob"] for c in content]


def test_hamburger_at_confidence_1_scores_as_the_base(server):
  got = {m: _chat(server, False, logprobs=True, extra_body={"mode": m, "confidence": 1.0})
         for m in ("base", "hamburger")}
  assert got["base"][0] == got["hamburger"][0]
  np.testing.assert_allclose([c["logprob"] for c in got["hamburger"][1]],
                             [c["logprob"] for c in got["base"][1]], atol=1e-4)


def _complete(server, **body) -> dict:
  r = httpx.post(server.url + "/v1/completions", timeout=600, json={
      "model": _model(server), "prompt": PROMPT, "temperature": 0, **body})
  assert r.status_code == 200, r.text
  return r.json()


def test_completions_echo_scores_the_prompt(server):
  r = _complete(server, max_tokens=1, logprobs=2, echo=True)  # what lm-eval sends
  choice = r["choices"][0]
  lp, n = choice["logprobs"], r["usage"]["prompt_tokens"]
  assert len(lp["tokens"]) == n + 1 and choice["text"].startswith(PROMPT)
  assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
  assert "".join(lp["tokens"]) == choice["text"]
  assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(n + 1)]
  for t in range(1, n + 1):  # the token itself among its alternatives, as in vLLM
    assert lp["top_logprobs"][t][lp["tokens"][t]] == lp["token_logprobs"][t]
    assert 2 <= len(lp["top_logprobs"][t]) <= 3
  assert max(lp["top_logprobs"][n].values()) == lp["token_logprobs"][n]  # greedy
  # The prompt is never merged: scored by the base in both modes; max_tokens 0 scores it alone.
  for mode in ("base", "hamburger"):
    alone = _complete(server, max_tokens=0, logprobs=0, echo=True, mode=mode)["choices"][0]
    assert alone["text"] == PROMPT and alone["finish_reason"] == "length"
    np.testing.assert_allclose(alone["logprobs"]["token_logprobs"][1:],
                               lp["token_logprobs"][1:n], atol=1e-4)
  # Streamed: the same pieces, the echoed prompt first.
  with httpx.stream("POST", server.url + "/v1/completions", timeout=600, json={
      "model": _model(server), "prompt": PROMPT, "temperature": 0, "max_tokens": 1,
      "logprobs": 2, "echo": True, "stream": True}) as s:
    chunks = [json.loads(line[6:]) for line in s.iter_lines()
              if line.startswith("data: {")]
  assert chunks[0]["choices"][0]["text"] == PROMPT
  joined = {k: [v for c in chunks if c["choices"][0]["logprobs"]
                for v in c["choices"][0]["logprobs"][k]] for k in lp}
  assert joined == lp
  assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


LOGPROBS_BAD = [  # (endpoint, body, message)
    ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs=21 is over 20"),
    ("chat", {"top_logprobs": -1, "logprobs": True}, "top_logprobs must be an integer >= 0"),
    ("chat", {"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ("chat", {"logprobs": 3}, "logprobs must be true or false"),
    ("chat", {"echo": True}, "echo is a /v1/completions field"),
    ("completions", {"logprobs": 6}, "an integer in 0..5; got 6"),
    ("completions", {"logprobs": True}, "an integer in 0..5; got True"),
    ("completions", {"top_logprobs": 2}, "top_logprobs is a chat field"),
    ("completions", {"echo": "yes"}, "echo must be true or false"),
    ("completions", {"echo": True, "n": 2}, "n=2: this server returns one choice"),
    ("completions", {"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ("completions", {"max_tokens": 0, "echo": True, "prompt": "word " * 200},
     "over this server's limit of 95"),
    ("completions", {"max_tokens": 0, "echo": True, "prompt": [1, 10 ** 6]},
     "prompt token ids must be in [0, 49152)"),
]


def test_bad_logprobs_input_gets_a_clear_4xx(server):
  model = _model(server)
  good = {"chat": {"model": model, "messages": CHAT, "max_tokens": 4},
          "completions": {"model": model, "prompt": PROMPT, "max_tokens": 4}}
  with httpx.Client(timeout=120) as http:
    for endpoint, body, message in LOGPROBS_BAD:
      path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
      r = http.post(server.url + path, json={**good[endpoint], **body})
      assert r.status_code == 400, (body, r.text)
      error = r.json()["error"]
      assert message in error["message"], (error, message)
      assert set(error) == {"message", "type", "param", "code"}


def _task(tmp: Path, name: str, docs: list[dict], spec: str) -> None:
  data = tmp / f"{name}.jsonl"
  data.write_text("".join(json.dumps(d) + "\n" for d in docs))
  (tmp / f"{name}.yaml").write_text(
      f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
      f"test_split: test\ndoc_to_text: \"{{{{question}}}}\"\n{spec}")


def _lm_eval(server, tmp: Path, task: str, model: str, args: str, *extra: str) -> list[dict]:
  """lm_eval run on `task` through the server: its logged samples, in document order."""
  out = tmp / f"out-{task}"
  env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
  res = subprocess.run(
      [sys.executable, "-m", "lm_eval", "run", "--model", model, "--tasks", task,
       "--include_path", str(tmp), "--model_args",
       f"base_url={server.url}/v1/{args},model={_model(server)},timeout=1200", "--log_samples",
       "--output_path", str(out), *extra], cwd=tmp, env=env, capture_output=True, text=True,
      timeout=1200)
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  (path,) = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
  return sorted(map(json.loads, Path(path).read_text().splitlines()), key=lambda s: s["doc_id"])


def _direct_loglikelihoods(tok, pairs: list[tuple[str, str]]) -> list[float]:
  """log p(continuation | context) from a plain forward of the base, the pair split into
  tokens as lm-eval splits it (the whole encoded, the context's tokens first)."""
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  base, _ = pretrained.load_llama()
  graphdef, params = nnx.split(base)
  # The weights are an argument: closed over, they would be a constant of the program, and
  # compiling 0.5 GB of constants takes 1.5 GB more memory than the weights themselves.
  forward = jax.jit(lambda p, ids: jax.nn.log_softmax(nnx.merge(graphdef, p)(ids[None])[0],
                                                      axis=-1))
  out = []
  for context, continuation in pairs:
    ctx = tok.encode(context)
    whole = tok.encode(context + continuation)
    assert whole[:len(ctx)] == ctx
    padded = jnp.zeros((64,), jnp.int32).at[:len(whole)].set(jnp.asarray(whole))
    logp = forward(params, padded)
    out.append(float(sum(logp[t - 1, whole[t]] for t in range(len(ctx), len(whole)))))
  return out


def test_lm_eval_multiple_choice_and_generation(server, tmp_path):
  pytest.importorskip("lm_eval")
  from hamburger_jax.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
  tok_dir = tmp_path / "tokenizer"
  res = subprocess.run([sys.executable, "-m", "infer.export_tokenizer", "--out", str(tok_dir)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  _task(tmp_path, "hj_mc", MC_DOCS, "output_type: multiple_choice\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "target_delimiter: \"\"\nmetric_list:\n  - metric: acc\n")
  samples = _lm_eval(server, tmp_path, "hj_mc", "local-completions",
                     f"completions,tokenizer={tok_dir},tokenizer_backend=huggingface,"
                     "tokenized_requests=True")
  pairs = [(d["question"], c) for d in MC_DOCS for c in d["choices"]]
  got = [float(resp[0][0]) for s in samples for resp in s["resps"]]  # logged as strings
  assert len(got) == len(pairs)
  want = _direct_loglikelihoods(Tokenizer.from_hf_dir(tok_dir), pairs)
  np.testing.assert_allclose(got, want, atol=1e-3)
  at = np.cumsum([0] + [len(d["choices"]) for d in MC_DOCS])
  for s, d, lo, hi in zip(samples, MC_DOCS, at[:-1], at[1:]):  # the choice a direct forward makes
    assert s["acc"] == float(np.argmax(want[lo:hi]) == d["answer"])

  _task(tmp_path, "hj_gen", GEN_DOCS, "output_type: generate_until\n"
        "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n"
        "  max_gen_toks: 16\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")
  samples = _lm_eval(server, tmp_path, "hj_gen", "local-chat-completions", "chat/completions",
                     "--apply_chat_template")
  client = server.client()
  for s, doc in zip(samples, GEN_DOCS):
    own = client.chat.completions.create(
        model=_model(server), messages=[{"role": "user", "content": doc["question"]}],
        max_tokens=16, temperature=0, stop=["\n"])
    assert s["resps"][0][0] == own.choices[0].message.content


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
