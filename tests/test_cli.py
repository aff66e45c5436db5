"""infer.generate on the real default model: JSON fields, side by side, and argument errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hamburger_jax import assets, pretrained
from hamburger_jax.graft_checkpoint import save_graft


def _run(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "infer.generate", *args], capture_output=True,
                        text=True, timeout=600)


@pytest.fixture(scope="module")
def graft_checkpoint(tmp_path_factory) -> str:
  try:
    assets.smollm2_gguf()
  except assets.AssetError as e:
    pytest.skip(str(e))
  # An untrained graft: enough to check the plumbing.
  model, _ = pretrained.load_hamburger(pretrained.UNTRAINED)
  path = str(tmp_path_factory.mktemp("ckpt") / "graft")
  save_graft(model, path, "smollm2")
  return path


@pytest.mark.slow
def test_json_side_by_side(graft_checkpoint):
  res = _run("--prompt", "What is 2 + 2?", "--prompt", "Name a colour.", "--max-new-tokens", "6",
             "--checkpoint", graft_checkpoint, "--mode", "all", "--confidence", "1.0", "--json")
  assert res.returncode == 0, res.stderr[-2000:]
  rows = [json.loads(line) for line in res.stdout.splitlines()]
  assert [(r["prompt"], r["mode"]) for r in rows] == [
      (p, m) for p in ("What is 2 + 2?", "Name a colour.") for m in ("base", "hamburger",
                                                                     "verify")]
  # Verify mode is the base's output whatever its drafts (here an untrained graft's).
  for base, verify in zip(rows[::3], rows[2::3]):
    assert verify["token_ids"] == base["token_ids"]
    assert verify["draft_confidence"] == 0.0 and verify["macro_steps"] == len(verify["groups"])
  rows = [r for r in rows if r["mode"] != "verify"]
  for r in rows:
    assert {"text", "token_ids", "new_tokens", "decode_tokens_per_s", "groups", "macro_steps",
            "kv_entries"} <= set(r)
    assert r["new_tokens"] == len(r["token_ids"]) == sum(r["groups"]) <= 6
  # At confidence 1 every macro step emits one token: HAMburger's output is the base's.
  for base, ham in zip(rows[::2], rows[1::2]):
    assert ham["token_ids"] == base["token_ids"] and ham["groups"] == [1] * ham["new_tokens"]


@pytest.mark.parametrize("args,match", [
    (["--temperature", "-1"], "temperature=-1.0 must be >= 0"),
    (["--top-p", "0"], "top_p=0.0 must be in"),
    (["--max-new-tokens", "0"], "max_new_tokens=0 must be an integer >= 1"),
    (["--prompts-file", "/nonexistent.txt"], "does not exist"),
    (["--mode", "hamburger", "--checkpoint", "/nonexistent"], "not a HAMburger checkpoint"),
    (["--prompt", " "], "empty prompt"),
    (["--confidence", "1.5"], "confidence must be in [0, 1], got 1.5"),
    (["--draft-confidence", "-0.1"], "draft_confidence must be in [0, 1], got -0.1"),
    (["--draft-lookup", "4"], "argument --draft-lookup: invalid choice: 4"),
    (["--max-group", "0"], "max_group=0 must be an integer in [1, K]"),
    (["--top-k", "60000", "--temperature", "1"], "top_k=60000 exceeds the vocabulary (49152"),
])
def test_errors_are_one_line(args, match):
  res = _run(*args, "--mode", "base") if "--mode" not in args else _run(*args)
  assert res.returncode != 0
  assert match in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]


def _serve(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "infer.serve", *args], capture_output=True,
                        text=True, timeout=600)


@pytest.mark.slow
def test_serve_json_lines(graft_checkpoint, tmp_path):
  """infer.serve: one JSON line per request as it finishes, a bad request fails alone, and at
  confidence 1.0 each served HAMburger request is the base's greedy answer."""
  reqs = tmp_path / "requests.jsonl"
  reqs.write_text("\n".join(json.dumps(r) for r in [
      {"prompt": "What is 2 + 2?", "max_new_tokens": 6, "id": "a"},
      {"prompt": "   ", "id": "blank"},
      {"prompt": "Name a colour.", "max_new_tokens": 4, "id": "b"},
      {"prompt": "Count to three.", "max_new_tokens": 5, "id": "c", "top_p": 2.0},
      {"prompt": "Say yes.", "max_new_tokens": 5, "id": "d", "max_group": 0}]) + "\n")
  rows = {}
  for mode in ("hamburger", "base"):
    res = _serve("--prompts-file", str(reqs), "--slots", "2", "--json", "--mode", mode,
                 "--checkpoint", graft_checkpoint, "--confidence", "1.0")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "requests served (3 failed)" in res.stderr and "Traceback" not in res.stderr
    rows[mode] = {r["id"]: r for r in map(json.loads, res.stdout.splitlines())}
  ham, base = rows["hamburger"], rows["base"]
  assert set(ham) == {"a", "blank", "b", "c", "d"}
  assert "empty prompt" in ham["blank"]["error"] and "top_p=2.0" in ham["c"]["error"]
  assert "max_group=0 must be an integer in [1, 4]" in ham["d"]["error"]
  for rid, n in (("a", 6), ("b", 4)):
    assert {"queue_s", "latency_s", "preemptions", "kv_entries", "groups"} <= set(ham[rid])
    assert ham[rid]["new_tokens"] == len(ham[rid]["token_ids"]) == sum(ham[rid]["groups"]) <= n
    assert ham[rid]["token_ids"] == base[rid]["token_ids"]


def test_top_k_beyond_the_vocabulary_fails_before_loading(graft_checkpoint):
  """The vocabulary comes from metadata (the checkpoint's, or the GGUF header in base mode)."""
  assert pretrained.vocab_size(graft_checkpoint) == pretrained.vocab_size(pretrained.UNTRAINED) \
      == 49152
  for run, mode_args in ((_run, ["--mode", "base"]),
                         (_serve, ["--mode", "hamburger", "--checkpoint", graft_checkpoint])):
    extra = [] if run is _run else ["--prompts-file", __file__]
    res = run("--top-k", "60000", "--temperature", "1", *mode_args, *extra)
    assert res.returncode != 0 and "top_k=60000 exceeds the vocabulary (49152" in res.stderr
    assert "loading weights" not in res.stderr and "Traceback" not in res.stderr, \
        res.stderr[-2000:]


@pytest.mark.parametrize("content,match", [
    ("", "has no prompts"),
    ("  \n\n", "has no prompts"),
    (b"\xff\xfe bad", "is not UTF-8"),
])
def test_prompt_file_errors_before_loading(tmp_path, content, match):
  f = tmp_path / "prompts.txt"
  (f.write_bytes if isinstance(content, bytes) else f.write_text)(content)
  for run in (_run, _serve):
    res = run("--prompts-file", str(f), "--mode", "base")
    assert res.returncode != 0 and match in res.stderr and "Traceback" not in res.stderr, \
        res.stderr[-2000:]
    assert "loading weights" not in res.stderr  # refused before the model loads


def test_serve_jsonl_errors_before_loading(tmp_path):
  f = tmp_path / "r.jsonl"
  f.write_text('{"prompt": "hi"}\nnot json\n')
  res = _serve("--prompts-file", str(f))
  assert res.returncode != 0 and "line 2 is not JSON" in res.stderr
  f.write_text('{"prompt": "hi", "temp": 1}\n')
  res = _serve("--prompts-file", str(f))
  assert res.returncode != 0 and "unknown fields ['temp']" in res.stderr
