"""The free-generation suite: its file, its checkers, the judge's figures and verdict, the
answers a window keeps for the next, and infer.eval's --write-suite / --suite on the tiny model."""

from __future__ import annotations

import json
import os
import re
import types

import numpy as np
import pytest

from hamburger_jax.data.tokens import answer_files
from hamburger_jax.data.tokens.answers import Answers
from hamburger_jax.evaluation import suite as suite_lib
from hamburger_jax.evaluation import suite_judge

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")


def _suite() -> suite_lib.Suite:
  items = (suite_lib.SuiteItem("gcd", "gcd/1", (5, 6, 7), 8, "number", "12", (9, 9)),
           suite_lib.SuiteItem("chat", "chat/1", (5, 6), 8, "rouge", None, (3, 4)),
           suite_lib.SuiteItem("synthetic", "s/1", (1,), 4, "tokens", (3, 4, 5, 6), (3, 4)))
  return suite_lib.Suite(items, {"vocab_size": 100, "tokenizer": "t1"})


def test_suite_file_round_trip_and_refusals(tmp_path):
  s = _suite()
  suite_lib.save(s, str(tmp_path))
  back = suite_lib.load(str(tmp_path), vocab_size=100, tokenizer_fingerprint="t1")
  assert back.items == s.items and back.tasks == ["gcd", "chat", "synthetic"]
  with pytest.raises(suite_lib.SuiteError, match="vocabulary of 100"):
    suite_lib.load(str(tmp_path), vocab_size=99)
  with pytest.raises(suite_lib.SuiteError, match="another tokenizer"):
    suite_lib.load(str(tmp_path), tokenizer_fingerprint="t2")
  raw = json.loads((tmp_path / "suite.json").read_text())
  (tmp_path / "suite.json").write_text(json.dumps({**raw, "format": "other"}))
  with pytest.raises(suite_lib.SuiteError, match="write it again"):
    suite_lib.load(str(tmp_path))
  with pytest.raises(suite_lib.SuiteError, match="--write-suite"):
    suite_lib.load(str(tmp_path / "missing"))


def test_checkers():
  number, chat, tokens = _suite().items
  words = {1: "the answer is", 2: "12", 3: "13", 4: "apples", 5: "pears"}
  decode = lambda ids: " ".join(words[i] for i in ids)
  assert suite_lib.score(number, [1, 2], [], decode) == 1.0
  assert suite_lib.score(number, [1, 3], [], decode) == 0.0
  with pytest.raises(suite_lib.SuiteError, match="tokenizer"):
    suite_lib.score(number, [1, 2], [], None)
  # ROUGE-L against the judge's base answer: on words with a tokenizer, on ids without one.
  assert suite_lib.score(chat, [4, 5], [4, 5], decode) == 1.0
  assert suite_lib.score(chat, [4], [4, 5], None) == pytest.approx(2 * 1 / 3)
  assert suite_lib.score(tokens, [3, 4, 0, 6], [], None) == 0.75


def _judgement(name, scores, kv=1.0):
  s = _suite()
  by_c = {}
  for c, sc in scores.items():
    gens = [types.SimpleNamespace(token_ids=[1] * 2, new_tokens=2, macro_steps=2 / kv)
            for _ in s.items]
    by_c[c] = suite_judge._summary(s, gens, sc, suite_judge.BaseRun([], [1.0, 1.0, 1.0], 1.0))
  return suite_judge.Judgement(name, by_c, dict(scores), s.tasks)


def test_merit_and_the_guard_against_the_init():
  s = _suite()
  init = _judgement("init", {0.8: [1.0, 1.0, 1.0]})
  merged = _judgement("merged", {0.8: [1.0, 1.0, 1.0]}, kv=2.0)
  assert merged.by_c[0.8]["kv_compression"] == 2.0 and merged.merit() == 2 * init.merit()
  half = _judgement("half", {0.8: [1.0, 0.5, 1.0]}, kv=2.0)
  assert half.by_c[0.8]["quality"] == pytest.approx((1.0 + 0.5) / 2)
  # Loses on every number item: below the init beyond the paired interval.
  worse = suite_judge.Judgement("worse", {}, {0.8: [0.0, 1.0, 0.0]}, s.tasks)
  loses, delta, (lo, hi) = suite_judge.loses_to(worse, init, s)
  assert loses and delta == -1.0 and hi < 0
  assert not suite_judge.loses_to(merged, init, s)[0]


def test_micro_tokens_the_base_would_choose(monkeypatch):
  monkeypatch.setattr(suite_judge, "base_choices", lambda base, rows, batch=8: [
      (np.asarray(r) + 1) % 50 for r in rows])
  item = suite_lib.SuiteItem("t", "t/1", (10, 11), 8, "tokens", (), ())
  # Groups [3, 2]: micro tokens are the answer's tokens 1, 2 and 4. The base continues 11 with
  # 12, 13, 14, ...: tokens 1 (13) and 4 (16) are its choices, token 2 (20) is not.
  gen = types.SimpleNamespace(token_ids=[12, 13, 20, 21, 22], groups=[3, 2])
  assert suite_judge.micro_base_share(None, [item], [gen]) == (2, 3)


def test_the_bases_choices_follow_every_prefix_of_rows_of_any_length():
  """Rows of mixed lengths, batched by length and padded: each row's argmax after every prefix
  is the one its own unpadded forward gives, in the rows' order."""
  import jax.numpy as jnp  # pylint: disable=C0415
  from hamburger_jax.testing import tiny_decode_model  # pylint: disable=C0415
  base = tiny_decode_model().base
  rng = np.random.default_rng(0)
  rows = [list(rng.integers(1, 90, n)) for n in (5, 40, 3, 17, 33, 9, 16)]
  got = suite_judge.base_choices(base, rows, batch=3)
  for row, choice in zip(rows, got):
    want = np.argmax(np.asarray(base(jnp.asarray(row, jnp.int32)[None])[0]), axis=-1)
    np.testing.assert_array_equal(choice, want)


def test_answer_files_round_trip_in_files_of_a_limit(tmp_path):
  rng = np.random.default_rng(0)
  lengths = rng.integers(20, 60, 40)
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  tokens = rng.integers(0, 49152, int(lengths.sum())).astype(np.int32)
  a = Answers(tokens, np.stack([starts, lengths], 1),
              np.stack([np.arange(40), starts + 5, starts + lengths], 1),
              (rng.random(len(tokens)) < 0.4).astype(np.uint8))
  paths = answer_files.save(a, list(range(100, 140)), str(tmp_path), vocab_size=49152,
                            tokenizer="t1", corpus="c1", max_file_mb=0.006)  # ~6 KB: several
  assert len(paths) >= 3 and all(os.path.getsize(p) <= 0.006 * 2**20 for p in paths)
  with np.load(paths[0]) as z:
    assert z["tokens"].dtype == np.uint16
  back, prompts = answer_files.load([str(tmp_path)], vocab_size=49152, tokenizer="t1",
                                    corpus="c1")
  for name in ("tokens", "samples", "responses", "starts"):
    np.testing.assert_array_equal(getattr(back, name), getattr(a, name), err_msg=name)
  assert prompts.tolist() == list(range(100, 140))
  with pytest.raises(answer_files.AnswerFilesError, match="another base or tokenizer"):
    answer_files.load([str(tmp_path)], vocab_size=128256, tokenizer="t1", corpus="c1")
  with pytest.raises(answer_files.AnswerFilesError, match="holds no"):
    answer_files.load([str(tmp_path / "none")], vocab_size=49152, tokenizer="t1", corpus="c1")


def test_answers_are_read_only_beside_the_corpus_they_answer(tmp_path):
  """Answer files name their prompts by sample number: they carry the corpus's fingerprint, and
  beside another corpus they are refused (its sample numbers name other prompts)."""
  from hamburger_jax.data.synthetic import write_synthetic_corpus  # pylint: disable=C0415
  from hamburger_jax.data.tokens.corpus import TokenCorpus  # pylint: disable=C0415
  fingerprint = {}
  for name, seed in (("a", 0), ("again", 0), ("b", 1)):
    write_synthetic_corpus(str(tmp_path / name), 256, 40, seed=seed)
    c = TokenCorpus.load(str(tmp_path / name))
    fingerprint[name] = answer_files.corpus_fingerprint(c.tokens, c.samples, c.responses)
  assert fingerprint["a"] == fingerprint["again"] != fingerprint["b"]
  a = Answers(np.arange(10, dtype=np.int32), np.array([[0, 10]]), np.array([[0, 4, 10]]),
              np.ones(10, np.uint8))
  answer_files.save(a, [7], str(tmp_path / "answers"), vocab_size=256, tokenizer=None,
                    corpus=fingerprint["a"])
  _, prompts = answer_files.load([str(tmp_path / "answers")], vocab_size=256, tokenizer=None,
                                 corpus=fingerprint["again"])
  assert prompts.tolist() == [7]
  with pytest.raises(answer_files.AnswerFilesError,
                     match=f"another corpus \\(fingerprint {fingerprint['a']}, this one's "
                           f"{fingerprint['b']}\\).*leave them out"):
    answer_files.load([str(tmp_path / "answers")], vocab_size=256, tokenizer=None,
                      corpus=fingerprint["b"])


@pytest.mark.slow
def test_eval_writes_a_suite_and_judges_two_grafts_on_it(tmp_path, capsys):
  from infer import eval as eval_cli  # pylint: disable=import-outside-toplevel
  suite_dir, out = str(tmp_path / "suite"), str(tmp_path / "out")
  assert eval_cli.main(["--config", TINY, "--write-suite", suite_dir, "--suite-examples", "4",
                        "--batch", "8"]) == 0
  s = suite_lib.load(suite_dir, vocab_size=256)
  assert len(s.items) == 8 and {it.checker for it in s.items} == {"tokens", "rouge"}
  assert all(len(it.base) == it.max_new for it in s.items)  # no stop tokens on a random model
  assert "suite: the base: 8/8 answered" in capsys.readouterr().err  # progress
  assert eval_cli.main(["--config", TINY, "--suite", suite_dir, "--batch", "8", "--out",
                        out]) == 0
  results = json.loads(open(os.path.join(out, "suite-results.json"), encoding="utf-8").read())
  graft = results["grafts"]["graft"]
  assert set(graft) == {"c0.5", "c0.7", "c0.8", "merit"} and results["base_same_as_suite"] == 1.0
  # The same weights as the base's at c = 0.8 (an untrained graft's stop head rarely goes on).
  assert graft["c0.8"]["tasks"]["synthetic_vs_base"]["score"] > 0.5
  for bad in (["--tasks", "gcd"], ["--against", suite_dir], ["--write-suite", out]):
    with pytest.raises(SystemExit):
      eval_cli.parse_args(["--config", TINY, "--suite", suite_dir, *bad])


def test_chat_sources_take_mt_bench_first():
  assert suite_lib.chat_sources(None) == suite_lib.CHAT_SOURCES
  assert suite_lib.chat_sources(8) == (("mt_bench", 8),)
  assert suite_lib.chat_sources(100) == (("mt_bench", 80), ("sharegpt_heldout", 20))
  assert suite_lib.chat_sources(0) == ()


def test_suite_served_in_one_run_with_the_reference_tokens(monkeypatch):
  """The suite's items, short and long prompts at several budgets, go through one serving run
  (one layout: one program set a mode); each item gets the per-row reference's tokens at its
  own budget, in suite order, and progress comes every `batch` answers."""
  from hamburger_jax import testing  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  model = testing.tiny_decode_model()
  engine = Engine(model, None, stop_ids=[testing.DECODE_STOP])
  item = lambda i, prompt, budget: suite_lib.SuiteItem("t", f"t/{i}", tuple(prompt), budget,
                                                       "tokens", (1,))
  items = [item(0, range(10, 16), 10), item(1, range(20, 24), 6), item(2, range(3, 9), 10),
           item(3, [(7 * j) % 90 + 1 for j in range(110)], 20), item(4, range(30, 37), 6)]
  runs, seen = [], []
  serve = engine.serve
  monkeypatch.setattr(engine, "serve", lambda reqs, **kw: runs.append((len(reqs), kw)) or
                      serve(reqs, **kw))
  gens = suite_lib.decode_items(engine, items, mode="hamburger", confidence=0.5, batch=4,
                                progress=lambda done, total: seen.append((done, total)))
  assert runs == [(5, {"slots": 4, "mode": "hamburger"})] and seen == [(4, 5), (5, 5)]
  for it, g in zip(items, gens):
    want = testing.reference_hamburger(model, list(it.prompt), it.max_new, 0.5,
                                       testing.DECODE_STOP, pad=160)
    assert (g.token_ids, g.groups) == want


def test_judge_compiles_both_modes_before_it_decodes(monkeypatch):
  """compile_judge compiles every program the base's and HAMburger's serving runs of the suite
  use, on a pool of threads: decoding then compiles nothing more."""
  from hamburger_jax import testing  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode import programs  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  engine = Engine(testing.tiny_decode_model(), None, stop_ids=[testing.DECODE_STOP])
  item = lambda i, prompt, budget: suite_lib.SuiteItem("t", f"t/{i}", tuple(prompt), budget,
                                                       "tokens", (1,))
  items = [item(0, range(10, 16), 10), item(1, [(7 * j) % 90 + 1 for j in range(40)], 20),
           item(2, range(30, 37), 6)]
  pools, lines = [], []
  real_pool = programs.concurrent.futures.ThreadPoolExecutor
  monkeypatch.setattr(programs.concurrent.futures, "ThreadPoolExecutor",
                      lambda n: pools.append(n) or real_pool(n))
  suite = suite_lib.Suite(tuple(items), {})
  assert suite_judge.compile_judge(engine, suite, 2, lines.append) > 0
  compiled = dict(engine.programs)
  modes = {key[1].mode for key in compiled}
  assert modes == {"base", "hamburger"} and len(pools) == 1, (modes, pools)
  assert len(lines) == 1 and re.fullmatch(rf"judge: {len(compiled)} programs compiled in \d+ s "
                                          r"\(base and HAMburger together\)", lines[0]), lines
  base = suite_judge.run_base(engine, suite, 2)
  suite_judge.judge(engine, suite, base, "graft", confidences=(0.5,), batch=2, micro_share=False)
  assert engine.programs.keys() == compiled.keys()
  assert suite_judge.compile_judge(engine, suite, 2) == 0.0


def _tiny_suite(directory: str) -> str:
  """Four synthetic items for the tiny config's random model (vocabulary 256, no tokenizer)."""
  items = tuple(suite_lib.SuiteItem("synthetic", f"s/{i}", tuple(range(3 + i, 9 + i)), 6,
                                    "tokens" if i % 2 else "rouge",
                                    tuple(range(20, 26)) if i % 2 else None) for i in range(4))
  suite_lib.save(suite_lib.Suite(items, {"vocab_size": 256, "tokenizer": None,
                                         "tasks": ["synthetic"]}), directory)
  return directory


def _tiny_grafts(tmp_path) -> dict[str, str]:
  """Graft checkpoints of the tiny config's random base, as runs write them: `listed` stores a
  micro vocabulary of 128 ids; `trained` (trained from it, before exports carried the list) has
  none; `carried` is exported from `listed` with its list; `other` has a list for a vocabulary
  of another base."""
  from hamburger_jax import graft_checkpoint, micro_vocab, pretrained  # pylint: disable=C0415
  model, _ = pretrained.load_run(TINY)
  paths = {name: str(tmp_path / name) for name in ("listed", "trained", "carried", "other")}
  for name in ("listed", "trained", "other"):
    graft_checkpoint.save_graft(model, paths[name], "random", dtype="float32")
  micro_vocab.save(paths["listed"], np.arange(256, 0, -1), 128, ["test"])
  micro_vocab.save(paths["other"], np.arange(300, 0, -1), 128, ["test"])
  graft_checkpoint.save_graft(model, paths["carried"], "random", dtype="float32",
                              micro_vocab_from=paths["listed"])
  return paths


def test_exports_carry_their_init_s_micro_vocabulary(tmp_path):
  """A graft exported by a run started from a checkpoint (save_graft's micro_vocab_from, which
  training/loop.export_graft passes train.init_from) carries that checkpoint's micro_vocab.json
  where it is for the export's vocabulary."""
  from hamburger_jax import graft_checkpoint, micro_vocab, pretrained  # pylint: disable=C0415
  from hamburger_jax.run_config import load_run_config  # pylint: disable=C0415
  from hamburger_jax.training import loop  # pylint: disable=C0415
  paths = _tiny_grafts(tmp_path)
  listed = lambda p: (tmp_path / p / micro_vocab.FILE).read_text(encoding="utf-8")
  assert listed("carried") == listed("listed")
  assert micro_vocab.load(paths["carried"], 128, 256).tolist() == list(range(128))
  model, _ = pretrained.load_run(TINY, paths["carried"])
  # The run's export: the init's list when it fits, none for another base's, none without one.
  for init, carries in ((paths["listed"], True), (paths["other"], False), ("''", False)):
    out = str(tmp_path / "export")
    cfg = load_run_config(TINY, [f"train.init_from={init}", f"checkpoint.export={out}"])
    trainer = types.SimpleNamespace(current_model=lambda: model, process_index=0,
                                    trains_base=False)
    lines = []
    assert loop.export_graft(trainer, cfg, 3, lines.append) == out
    assert os.path.isfile(os.path.join(out, micro_vocab.FILE)) == carries, init
    assert ("micro vocabulary" in lines[0]) == carries
    assert graft_checkpoint.read_meta(out)["trained_steps"] == 3


def test_judge_against_a_graft_that_decodes_otherwise(tmp_path, monkeypatch, capsys):
  """infer.eval --suite --checkpoint A --against B judges both as the entry points decode them,
  which must be alike: A storing the default's micro vocabulary and B none is one line saying
  what to do, before any weights load; B exported with A's list is judged beside it, both on
  the list; --micro-vocab 0 judges both on the full vocabulary."""
  from hamburger_jax import micro_vocab  # pylint: disable=C0415
  from infer import eval as eval_cli  # pylint: disable=C0415
  paths = _tiny_grafts(tmp_path)
  suite_dir = _tiny_suite(str(tmp_path / "suite"))
  # The tiny vocabulary holds 256 ids: a default of 64 makes `listed` decode as the shipped
  # graft does by default (its list holds at least the default's ids).
  monkeypatch.setattr(micro_vocab, "DEFAULT_SIZE", 64)
  run = lambda *argv: eval_cli.main(["--config", TINY, "--suite", suite_dir, "--batch", "4",
                                     "--confidence", "0.8", "--checkpoint", paths["listed"],
                                     *argv])
  assert run("--against", paths["trained"], "--out", str(tmp_path / "no")) == 1
  err = capsys.readouterr().err
  line = [x for x in err.splitlines() if x.startswith("error: ")]
  assert len(line) == 1 and "Traceback" not in err and "loading weights" not in err, err
  assert f"--against {paths['trained']} stores none" in line[0]
  assert "--micro-vocab 0" in line[0] and f"copy its {micro_vocab.FILE}" in line[0]
  assert run("--against", paths["trained"], "--micro-vocab", "64", "--out",
             str(tmp_path / "no")) == 1
  assert f"--against {paths['trained']} stores 0 micro vocabulary ids" in capsys.readouterr().err
  for argv, vocab in ((["--against", paths["carried"]], 64),
                      (["--against", paths["trained"], "--micro-vocab", "0"], None)):
    out = str(tmp_path / f"out{vocab}")
    assert run(*argv, "--out", out) == 0, capsys.readouterr().err
    results = json.loads(open(os.path.join(out, "suite-results.json"), encoding="utf-8").read())
    assert results["micro_vocab"] == vocab and set(results["grafts"]) == {paths["listed"],
                                                                           argv[1]}
    assert "vs_" + paths["listed"] in results["grafts"][argv[1]]


def test_judge_grafts_refuses_grafts_that_decode_otherwise():
  """The library's judge refuses grafts of different micro vocabularies before it compiles
  anything (an engine's programs are of one graph), naming each one's."""
  from hamburger_jax import testing  # pylint: disable=C0415
  from hamburger_jax.model.hamburger import sharing_weights  # pylint: disable=C0415
  model = testing.tiny_decode_model()
  reduced = sharing_weights(model, micro_vocab=np.arange(32))
  suite = suite_lib.Suite((suite_lib.SuiteItem("t", "t/1", (1, 2), 4, "tokens", (3,)),), {})
  with pytest.raises(suite_lib.SuiteError, match="a has the full vocabulary; b has the first 32 "
                     r"ids .*--micro-vocab 0"):
    suite_judge.judge_grafts({"a": model, "b": reduced}, None, suite)


def test_judge_grafts_of_different_layers_each_decode_in_their_own_programs():
  """A graft merging at layer L and one merging at 0 have different programs: the judge gives
  the second its own engine (the base's answers decoded once) and judges both."""
  from hamburger_jax import testing  # pylint: disable=C0415
  from hamburger_jax.model.hamburger import with_merge_layer, with_merged_entry  # pylint: disable=C0415
  model = testing.tiny_decode_model()
  at_2 = with_merged_entry(with_merge_layer(model, 2), "last_token")
  items = tuple(suite_lib.SuiteItem("synthetic", f"s/{i}", (1 + i, 2, 3), 6, "rouge", None)
                for i in range(3))
  suite = suite_lib.Suite(items, {})
  out = suite_judge.judge_grafts({"L2": at_2, "L0": model}, None, suite, confidences=(0.8,),
                                 batch=4, micro_share=False)
  assert set(out["grafts"]) == {"L2", "L0"} and "vs_L2" in out["grafts"]["L0"]
