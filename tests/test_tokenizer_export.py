"""A tokenizer written as an HF directory (`Tokenizer.save`, `python -m infer.export_tokenizer`)
reads back as itself, in our loader and in transformers' AutoTokenizer (what lm-evaluation-
harness loads), and each token's bytes (`token_bytes`) make up the text."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hamburger_jax import assets
from hamburger_jax.tokenizer import Tokenizer, load_default_tokenizer

REPO = Path(__file__).resolve().parents[1]
TEXTS = ["Hello world! 12345 \n\n1. item", "caf\u00e9 \u2014 na\u00efve \U0001F600 \u4e2d\u6587",
         "<|im_start|>user\nhi<|im_end|>\n", "def f(x):\n    return x ** 2\n"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
  try:
    assets.smollm2_gguf()
  except assets.AssetError as e:
    pytest.skip(str(e))
  return load_default_tokenizer()


def test_saved_directory_reads_back_as_the_tokenizer(tok, tmp_path):
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  directory = tok.save(tmp_path / "tok")
  back, hf = Tokenizer.from_hf_dir(directory), AutoTokenizer.from_pretrained(directory)
  for text in TEXTS:
    ids = tok.encode(text)
    assert back.encode(text) == ids and hf.encode(text) == ids, text
    assert hf.decode(ids) == text
  assert back.stop_ids == tok.stop_ids and back.chat_template == tok.chat_template
  assert (back.eos_id, back.bos_id, back.pad_id) == (tok.eos_id, tok.bos_id, tok.pad_id)
  messages = [{"role": "user", "content": "Hi!"}]
  assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
      tok.apply_chat_template(messages)


def test_token_bytes_make_up_the_text(tok):
  for text in TEXTS:
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
  pieces = [tok.token_bytes(i) for i in tok.encode(" \U0001F600")]  # split inside the emoji
  assert len(pieces) == 2 and b"".join(pieces) == " \U0001F600".encode("utf-8")


def test_export_cli(tok, tmp_path):
  out = tmp_path / "exported"
  res = subprocess.run([sys.executable, "-m", "infer.export_tokenizer", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr
  assert Tokenizer.from_hf_dir(out).encode(TEXTS[1]) == tok.encode(TEXTS[1])
  res = subprocess.run([sys.executable, "-m", "infer.export_tokenizer", "--base", "nothing.gguf",
                        "--out", str(tmp_path / "x")], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
  assert res.returncode != 0 and "error: --base nothing.gguf: GGUF file nothing.gguf does not " \
      "exist" in res.stderr
