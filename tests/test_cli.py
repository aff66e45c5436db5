"""infer.generate on the real default model: JSON fields, side by side, and argument errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from flax import nnx

from hamburger_jax import assets, pretrained


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
  pretrained.save_graft(model, path, "smollm2")
  return path


@pytest.mark.slow
def test_json_side_by_side(graft_checkpoint):
  res = _run("--prompt", "What is 2 + 2?", "--prompt", "Name a colour.", "--max-new-tokens", "6",
             "--checkpoint", graft_checkpoint, "--mode", "both", "--confidence", "1.0", "--json")
  assert res.returncode == 0, res.stderr[-2000:]
  rows = [json.loads(line) for line in res.stdout.splitlines()]
  assert [(r["prompt"], r["mode"]) for r in rows] == [
      ("What is 2 + 2?", "base"), ("What is 2 + 2?", "hamburger"),
      ("Name a colour.", "base"), ("Name a colour.", "hamburger")]
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
])
def test_errors_are_one_line(args, match):
  res = _run(*args, "--mode", "base") if "--mode" not in args else _run(*args)
  assert res.returncode != 0
  assert match in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
