"""The reduced micro-step vocabulary: the build command, the stored list's checks at load time,
and decoding with it against the plain reference loop (micro tokens restricted, token 0 not)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hamburger_jax import graft_checkpoint, micro_vocab, pretrained, testing
from hamburger_jax.decode.engine import Engine
from hamburger_jax.model.hamburger import sharing_weights
from hamburger_jax.testing import DECODE_CFG, DECODE_STOP, tiny_decode_model
from train import micro_vocab as build

V = DECODE_CFG.vocab_size
PROMPTS = [[1, 2, 3, 4, 5], [9, 8], list(range(10, 31))]


@pytest.fixture(scope="module")
def model():
  return tiny_decode_model()


@pytest.fixture
def checkpoint(tmp_path) -> str:
  """A checkpoint directory whose metadata is the shipped graft's (vocabulary 49152)."""
  with open(os.path.join(pretrained.DEFAULT_CHECKPOINT, graft_checkpoint.META_FILE)) as f:
    meta = json.load(f)
  (tmp_path / graft_checkpoint.META_FILE).write_text(json.dumps(meta))
  return str(tmp_path)


def write_answers(path, answers) -> str:
  with open(path, "w") as f:
    for ids in answers:
      f.write(json.dumps({"messages": [], "response_ids": ids}) + "\n")
  return str(path)


# ------------------------------------------------------------------ decoding


@pytest.mark.parametrize("confidence", [0.0, 0.5])
def test_reduced_vocabulary_decodes_as_the_reference_restricted_to_it(model, confidence):
  ids = np.random.default_rng(0).choice(V, 40, replace=False).astype(np.int32)
  ids = np.union1d(ids, [DECODE_STOP]).astype(np.int32)  # a list may or may not hold EOS
  engine = Engine(sharing_weights(model, micro_vocab=ids), None, stop_ids=[DECODE_STOP])
  gens = engine.generate(PROMPTS, max_new_tokens=12, confidence=confidence)
  micro_tokens = 0
  for prompt, g in zip(PROMPTS, gens):
    tokens, groups = testing.reference_hamburger(model, prompt, 12, confidence, DECODE_STOP,
                                                 micro_ids=ids.tolist())
    assert (g.token_ids, g.groups) == (tokens, groups)
    start = 0
    for size in groups:  # every token after the first of a group is from the list
      assert set(tokens[start + 1:start + size]) <= set(ids.tolist())
      micro_tokens += size - 1
      start += size
  if confidence == 0.0:
    assert micro_tokens > 0  # groups of several tokens were decoded


def test_the_whole_vocabulary_as_a_list_decodes_as_without_one(model):
  engine = Engine(model, None, stop_ids=[DECODE_STOP])
  listed = Engine(sharing_weights(model, micro_vocab=np.arange(V)), None,
                  stop_ids=[DECODE_STOP])
  a = engine.generate(PROMPTS, max_new_tokens=12, confidence=0.0)
  b = listed.generate(PROMPTS, max_new_tokens=12, confidence=0.0)
  assert [(g.token_ids, g.groups) for g in a] == [(g.token_ids, g.groups) for g in b]


def test_clearing_the_list_restores_the_full_head(model):
  m = sharing_weights(model, micro_vocab=np.arange(5))
  m.set_micro_vocab(None)
  assert m.micro_ids is None and m.micro_head is None


# ------------------------------------------------------------------ the list: build and load


def test_build_command_stores_answer_tokens_by_frequency(checkpoint, tmp_path, capsys):
  answers = write_answers(tmp_path / "a.jsonl", [[7, 7, 7, 3, 3, 9], [3, 7, 11]])
  more = write_answers(tmp_path / "b.jsonl", [[11, 11, 11, 11]])
  assert build.main(["--responses", f"{answers},{more}", "--checkpoint", checkpoint,
                     "--size", "3"]) == 0
  doc = json.load(open(os.path.join(checkpoint, micro_vocab.FILE)))
  assert doc["ids"] == [11, 7, 3] and doc["counts"] == [5, 4, 3]  # 9 (once) did not fit
  assert doc["vocab_size"] == 49152 and doc["answer_tokens"] == 13
  assert "3 answers" in capsys.readouterr().out
  np.testing.assert_array_equal(micro_vocab.load(checkpoint, 2, 49152), [11, 7])
  # Asked for more ids than occur: only those that occur are stored.
  build.main(["--responses", answers, "--checkpoint", checkpoint, "--size", "100"])
  assert json.load(open(os.path.join(checkpoint, micro_vocab.FILE)))["ids"] == [7, 3, 9, 11]


def test_build_command_refuses_bad_answers_and_writes_nothing(checkpoint, tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"messages": []}\n')
  with pytest.raises(SystemExit, match="line 1 is not a train.self_distill record"):
    build.main(["--responses", str(bad), "--checkpoint", checkpoint])
  foreign = write_answers(tmp_path / "foreign.jsonl", [[1, 2, 60000]])
  with pytest.raises(SystemExit, match="token id 60000, outside the vocabulary"):
    build.main(["--responses", foreign, "--checkpoint", checkpoint])
  assert not os.path.exists(os.path.join(checkpoint, micro_vocab.FILE))


def _store(checkpoint, **doc):
  full = {"format": micro_vocab.FORMAT, "vocab_size": 49152, "ids": [5, 6, 7]}
  full.update(doc)
  with open(os.path.join(checkpoint, micro_vocab.FILE), "w") as f:
    json.dump(full, f)


@pytest.mark.parametrize("doc,size,vocab,match", [
    (None, 2, 49152, "does not exist: build the checkpoint's list with `python -m "
                     "train.micro_vocab"),
    ({}, 4, 49152, "size 4 exceeds the 3 ids stored"),
    ({}, 0, 49152, "must be >= 1"),
    ({}, 2, 32000, "built for a vocabulary of 49152 tokens but the model has 32000"),
    ({"ids": [5, 49152]}, 2, 49152, r"holds ids outside \[0, 49152\)"),
    ({"ids": [5, 5, 6]}, 2, 49152, "repeats token ids"),
    ({"format": "other"}, 2, 49152, "has format 'other'"),
    ({"ids": "5,6"}, 2, 49152, "is not a micro vocabulary list"),
])
def test_a_list_that_does_not_fit_is_a_clear_error(checkpoint, doc, size, vocab, match):
  if doc is not None:
    _store(checkpoint, **doc)
  with pytest.raises(micro_vocab.MicroVocabError, match=match):
    micro_vocab.load(checkpoint, size, vocab)


def test_load_checks_the_list_before_the_weights(checkpoint):
  # The checkpoint has metadata but no weights: the list's error comes first.
  with pytest.raises(micro_vocab.MicroVocabError, match="does not exist"):
    pretrained.load("hamburger", checkpoint, micro_vocab=8)
  with pytest.raises(micro_vocab.MicroVocabError, match="the base alone has none"):
    pretrained.load("base", micro_vocab=8)


def test_cli_reports_a_missing_list_in_one_line(checkpoint):
  from infer import generate  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit, match=r"error: .*micro_vocab.json does not exist"):
    generate.main(["--checkpoint", checkpoint, "--micro-vocab", "16", "--max-new-tokens", "4",
                   "--prompt", "hello"])


def test_eval_of_a_run_config_needs_the_checkpoint_that_holds_the_list(tmp_path, capsys):
  from infer import eval as eval_cli  # pylint: disable=import-outside-toplevel
  assert eval_cli.main(["--config", "configs/tiny.yaml", "--micro-vocab", "4", "--tasks",
                        "synthetic", "--limit", "2", "--out", str(tmp_path / "out"),
                        "--no-plots"]) == 1
  assert "stored with a trained graft checkpoint" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()


def test_entry_points_default_to_the_stored_list_where_it_is_long_enough(checkpoint):
  """--micro-vocab left out: micro_vocab.DEFAULT_SIZE where the checkpoint stores that many ids
  (the shipped one does), else the full vocabulary; 0: the full vocabulary; N: N; a base model:
  none."""
  from hamburger_jax import cli  # pylint: disable=import-outside-toplevel
  size = micro_vocab.DEFAULT_SIZE
  assert cli.micro_vocab_size(None, None, "both") == size  # the shipped checkpoint's list
  assert micro_vocab.stored_size(pretrained.DEFAULT_CHECKPOINT) >= size
  assert cli.micro_vocab_size(None, checkpoint, "hamburger") is None  # no list stored
  counts = np.arange(2 * size, 0, -1)  # every id of a 2 * size vocabulary occurs
  micro_vocab.save(checkpoint, counts, size - 1, ["answers.jsonl"])
  assert micro_vocab.stored_size(checkpoint) == size - 1
  assert cli.micro_vocab_size(None, checkpoint, "hamburger") is None  # too short a list
  micro_vocab.save(checkpoint, counts, size, ["answers.jsonl"])
  assert cli.micro_vocab_size(None, checkpoint, "hamburger") == size
  assert cli.micro_vocab_size(0, checkpoint, "hamburger") is None
  assert cli.micro_vocab_size(16, checkpoint, "hamburger") == 16
  assert cli.micro_vocab_size(None, checkpoint, "base") is None
  # A run config's model without a checkpoint is a fresh graft: no list, whatever is shipped.
  assert cli.micro_vocab_size(None, None, "both", shipped=False) is None
