"""Graft checkpoints: save/load round trip (one file or shards of a size limit), atomic export,
and mismatches or damage caught with clear errors."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from hamburger_jax import assets, graft_checkpoint, pretrained, segmentation
from hamburger_jax.config import GraftConfig, HamburgerConfig, LlamaConfig, from_dict
from hamburger_jax.convert.mapping import WeightsError
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import GraftParam

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
                  num_kv_heads=2)


def _model(seed: int, graft: GraftConfig = GraftConfig(merger_head_dim=16)) -> Hamburger:
  return Hamburger(HamburgerConfig(CFG, graft), rngs=nnx.Rngs(seed))


def _params(model, kind) -> dict:
  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, kind))}


@pytest.mark.parametrize("include_base", [False, True])
def test_graft_checkpoint_round_trip(tmp_path, include_base):
  src, dst = _model(0), _model(1)
  path = str(tmp_path / "ckpt")
  graft_checkpoint.save_graft(src, path, "random", dtype="float32", include_base=include_base)
  assert sorted(os.listdir(path)) == sorted(
      ["graft.safetensors", "hamburger.json"] + (["base.safetensors"] if include_base else []))
  assert not os.path.exists(path + ".tmp")
  before = _params(dst, nnx.Param)
  pretrained.load_graft(dst, path)
  for p, v in _params(src, GraftParam).items():
    np.testing.assert_array_equal(_params(dst, GraftParam)[p], v)
  after = _params(dst, nnx.Param)
  src_all = _params(src, nnx.Param)
  for p in before:
    if p not in _params(src, GraftParam):  # base params: loaded only when saved
      want = src_all[p] if include_base else before[p]
      np.testing.assert_array_equal(after[p], want)


def test_bfloat16_export_is_close(tmp_path):
  src, dst = _model(0), _model(1)
  graft_checkpoint.save_graft(src, str(tmp_path / "c"), "random")  # default bfloat16
  pretrained.load_graft(dst, str(tmp_path / "c"))
  for p, v in _params(src, GraftParam).items():
    np.testing.assert_allclose(_params(dst, GraftParam)[p], v, rtol=1e-2, atol=1e-3)


def test_mismatches_are_named(tmp_path):
  path = str(tmp_path / "c")
  graft_checkpoint.save_graft(_model(0), path, "random", dtype="float32")
  other = _model(0, GraftConfig(merger_head_dim=16, micro_layers=2))
  with pytest.raises(WeightsError, match="graft config"):
    pretrained.load_graft(other, path)
  with pytest.raises(WeightsError, match="not a HAMburger checkpoint"):
    pretrained.load_graft(_model(0), str(tmp_path))
  meta_path = os.path.join(path, "hamburger.json")
  meta = json.load(open(meta_path))
  with open(meta_path, "w") as f:  # claims the default base: its architecture differs
    json.dump({**meta, "base_source": "smollm2"}, f)
  try:
    assets.smollm2_gguf()
  except assets.AssetError:
    pytest.skip("needs the SmolLM2 weights package")
  with pytest.raises(WeightsError, match="trained on a different base"):
    pretrained.load_hamburger(path)


def test_load_hamburger_means_the_shipped_checkpoint_unless_told_untrained(monkeypatch,
                                                                          tmp_path):
  assert pretrained.resolve_checkpoint(None) == pretrained.DEFAULT_CHECKPOINT
  assert pretrained.resolve_checkpoint(str(tmp_path)) == str(tmp_path)
  with pytest.raises(ValueError, match="configures an untrained graft only"):
    pretrained.load_hamburger(graft=GraftConfig())  # would be ignored: the checkpoint has one
  monkeypatch.setattr(pretrained, "DEFAULT_CHECKPOINT", str(tmp_path / "not-shipped"))
  assert pretrained.resolve_checkpoint(None) is None
  with pytest.raises(WeightsError, match="load_hamburger\\('untrained'\\)"):
    pretrained.load_hamburger()


def test_a_gguf_architecture_is_read_once_per_version_of_the_file(tmp_path):
  """The architecture read is kept per process, and a file rewritten in place is read again."""
  import gguf as gguf_lib  # pylint: disable=import-outside-toplevel
  from hamburger_jax.config import ConfigError  # pylint: disable=import-outside-toplevel
  from hamburger_jax.convert import gguf  # pylint: disable=import-outside-toplevel
  from hamburger_jax.testing import write_tiny_llama_gguf  # pylint: disable=import-outside-toplevel
  path = str(tmp_path / "base.gguf")
  written = write_tiny_llama_gguf(path)
  assert gguf.read_config(path) == written == gguf.GGUFFile(path).config()
  assert gguf.read_config(path) is gguf.read_config(path)
  w = gguf_lib.GGUFWriter(path, "gpt2")  # the same path, another architecture
  w.add_block_count(2)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.close()
  with pytest.raises(ConfigError, match="architecture is 'gpt2'"):
    gguf.read_config(path)


def test_abstract_run_models_are_each_their_own():
  """abstract_run_model traces a config's model once; every call still returns a module with its
  own variables, the shapes of a direct abstract build."""
  from hamburger_jax.run_config import load_run_config  # pylint: disable=import-outside-toplevel
  cfg = load_run_config("configs/tiny.yaml", shared_only=True)
  a, b = pretrained.abstract_run_model(cfg), pretrained.abstract_run_model(cfg)
  direct = nnx.eval_shape(lambda: Hamburger(
      HamburgerConfig(pretrained.architecture(cfg.model), cfg.graft), rngs=nnx.Rngs(0)))
  shapes = lambda m: jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(m))
  assert shapes(a) == shapes(b) == shapes(direct)
  first = nnx.to_flat_state(nnx.state(a, nnx.Param))[0][1]
  first.set_value(jax.ShapeDtypeStruct((1,), np.float32))
  assert shapes(b) == shapes(direct)


def test_untrained_graft_and_checkpoint_round_trip_on_a_gguf_base(monkeypatch, tmp_path):
  """load_hamburger builds a checkpointed model abstractly and fills it (base from the GGUF file,
  graft and adapters from the checkpoint): the same params as the model that was saved."""
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  from hamburger_jax.testing import write_tiny_llama_gguf  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv(cache.NO_WEIGHT_CACHE_ENV, "1")
  base_path = str(tmp_path / "tiny.gguf")
  write_tiny_llama_gguf(base_path)
  graft = GraftConfig(num_features=2, merger_head_dim=16, micro_layers=1, base_lora_rank=4)
  src, _ = pretrained.load_hamburger(pretrained.UNTRAINED, base_path, graft=graft, seed=3)
  assert src.cfg.graft == graft
  base, _ = pretrained.load_llama(base_path)
  want = Hamburger(HamburgerConfig(base.cfg, graft), rngs=nnx.Rngs(3), base=base)
  for p, v in _params(want, nnx.Param).items():
    np.testing.assert_array_equal(_params(src, nnx.Param)[p], v)
  for path, var in nnx.to_flat_state(nnx.state(src, GraftParam)):  # make every graft param count
    var.set_value(var[...] + 0.01 * (1 + len(path)))
  ckpt = str(tmp_path / "ckpt")
  graft_checkpoint.save_graft(src, ckpt, base_path, dtype="float32")
  loaded, tok = pretrained.load_hamburger(ckpt)
  got, saved = _params(loaded, nnx.Param), _params(src, nnx.Param)
  assert got.keys() == saved.keys()
  for p, v in saved.items():
    np.testing.assert_array_equal(got[p], v, err_msg=str(p))
  assert tok.encode("AB") == [63]


@pytest.mark.slow
def test_shipped_checkpoint_loads_is_trained_and_is_the_base_at_confidence_1():
  """The shipped graft fits the repo budget, loads onto the real base, and has learned: on the
  base's own greedy answer to a prompt (grouped in pairs), its teacher-forced loss is far below
  that of an untrained graft of the same architecture. With nothing merged (confidence 1.0) it
  decodes exactly the base's greedy tokens on real prompts (its adapters act on merged entries
  only)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from hamburger_jax import layout  # pylint: disable=import-outside-toplevel
  from hamburger_jax.objectives.losses import hamburger_loss  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel

  ckpt = pretrained.DEFAULT_CHECKPOINT
  size = sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt))
  assert size <= 64 * 2**20, f"{ckpt} is {size / 2**20:.1f} MiB, over the 64 MiB repo budget"
  trained, tok = pretrained.load_hamburger()  # no argument: the shipped checkpoint
  # (options the checkpoint predates read as their defaults: config.GraftConfig)
  assert trained.cfg.graft == from_dict(GraftConfig, graft_checkpoint.read_meta(ckpt)["graft"])
  untrained, _ = pretrained.load_hamburger(pretrained.UNTRAINED, graft=trained.cfg.graft)
  # One engine and one layout of programs for the whole test (SmolLM2's compile dominates it).
  engine = Engine(trained, tok)
  # Encoded once: the prompt the loss scores is the one the engine answered.
  prompts = [tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
             for text in ("Describe how a bicycle works in three sentences.", "What is 17 + 25?",
                          "Write a haiku about the sea.", "List three uses of copper.")]
  base = engine.generate(prompts, max_new_tokens=24, mode="base")
  answer = base[0].token_ids
  assert len(answer) >= 16, answer  # enough merged pairs to score
  k = trained.max_group
  pairs = segmentation.fixed(np.zeros(len(answer)), k, 2)
  lay = layout.layout_sample(prompts[0], answer, pairs, k)
  batch = {n: jnp.asarray(v) for n, v in layout.pack_rows(
      [[lay]], lay.num_entries, lay.num_groups, k).as_dict().items()}
  graphdef, _ = nnx.split(trained)  # the same architecture: one program scores both
  lm_loss = jax.jit(
      lambda params: hamburger_loss(nnx.merge(graphdef, params), batch)[1]["lm_loss"])
  loss = {name: float(lm_loss(nnx.state(m)))
          for name, m in (("trained", trained), ("untrained", untrained))}
  # Measured: trained 3.6, untrained 13.4 nats (a mis-loaded graft scores like the
  # untrained one).
  assert loss["untrained"] > 2 * loss["trained"], loss
  one = engine.generate(prompts, max_new_tokens=24, mode="hamburger", confidence=1.0)
  for b, h in zip(base, one):
    assert h.token_ids == b.token_ids and h.groups == [1] * h.new_tokens


# ----------------------------------------------------------------------------- sharded exports

# 32 KiB shards of a model whose largest tensors are 64 KiB in float32 (32 KiB in bfloat16): tens
# of files per table, the largest tensors split across files, in either dtype.
SHARD_MB = 1 / 32
WIDE = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_layers=4,
                   num_heads=4, num_kv_heads=2)


def _wide(seed: int) -> Hamburger:
  return Hamburger(HamburgerConfig(WIDE, GraftConfig(merger_head_dim=16)), rngs=nnx.Rngs(seed))


def _files(path) -> dict[str, int]:
  return {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)}


def _saved_tensors(path) -> dict[str, dict[str, np.ndarray]]:
  meta = graft_checkpoint.read_meta(path)
  names = ["graft"] + (["base"] if meta.get("include_base") else [])
  return {n: graft_checkpoint.read_tensors(path, n, meta) for n in names}


@pytest.mark.parametrize("include_base", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_export_loads_the_same_params_as_one_file(tmp_path, include_base, dtype):
  src = _wide(0)
  one, sharded = str(tmp_path / "one"), str(tmp_path / "sharded")
  graft_checkpoint.save_graft(src, one, "random", dtype=dtype, include_base=include_base)
  graft_checkpoint.save_graft(src, sharded, "random", dtype=dtype, include_base=include_base,
                              max_shard_mb=SHARD_MB)
  files, limit = _files(sharded), int(SHARD_MB * 2**20)
  tables = ["graft"] + (["base"] if include_base else [])
  meta = graft_checkpoint.read_meta(sharded)
  assert set(meta["shards"]) == set(tables)
  for name in tables:
    listed = [f["file"] for f in meta["shards"][name]["files"]]
    n = len(listed)
    assert n > 1 and listed == [f"{name}-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert meta["shards"][name]["split"], "tensors larger than a shard must be split"
  assert set(files) == {"hamburger.json"} | {f["file"] for t in tables
                                             for f in meta["shards"][t]["files"]}
  over = {n: s for n, s in files.items() if s > limit}
  assert not over, f"files over the {limit}-byte limit: {over}"
  assert not os.path.exists(sharded + ".tmp") and not os.path.exists(sharded + ".old")
  # The same tensors, bit for bit, as the one-file export.
  want, got = _saved_tensors(one), _saved_tensors(sharded)
  for name in tables:
    assert got[name].keys() == want[name].keys()
    for k, v in want[name].items():
      assert got[name][k].dtype == v.dtype
      np.testing.assert_array_equal(got[name][k], v, err_msg=k)
  # load_graft reads either form into identical params.
  a, b = _wide(1), _wide(1)
  pretrained.load_graft(a, one)
  pretrained.load_graft(b, sharded)
  pa, pb = _params(a, nnx.Param), _params(b, nnx.Param)
  for p, v in pa.items():
    np.testing.assert_array_equal(pb[p], v, err_msg=str(p))


def test_reshard_round_trip_is_bit_exact(tmp_path):
  path = str(tmp_path / "c")
  graft_checkpoint.save_graft(_wide(0), path, "random", dtype="float32", include_base=True)
  want = _saved_tensors(path)
  meta = graft_checkpoint.read_meta(path)
  with open(os.path.join(path, "micro_vocab.json"), "w") as f:
    f.write('{"ids": [3, 1]}')  # a side file of the checkpoint: resharding keeps it
  assert graft_checkpoint.reshard_graft(path, max_shard_mb=SHARD_MB) == path  # in place
  assert len(_files(path)) > 3 and "graft.safetensors" not in _files(path)
  copy = graft_checkpoint.reshard_graft(path, str(tmp_path / "one"), max_shard_mb=None)
  assert sorted(_files(copy)) == ["base.safetensors", "graft.safetensors", "hamburger.json",
                                  "micro_vocab.json"]
  with open(os.path.join(copy, "micro_vocab.json")) as f:
    assert f.read() == '{"ids": [3, 1]}'
  assert graft_checkpoint.read_meta(copy) == meta  # the metadata survives, the index goes
  for tensors in (_saved_tensors(path), _saved_tensors(copy)):
    for name, table in want.items():
      for k, v in table.items():
        np.testing.assert_array_equal(tensors[name][k], v, err_msg=k)
  assert not [n for n in os.listdir(tmp_path) if n.endswith((".tmp", ".old"))]


@pytest.fixture(name="sharded")
def _sharded(tmp_path):
  path = tmp_path / "ckpt"
  graft_checkpoint.save_graft(_wide(0), str(path), "random", dtype="float32",
                              max_shard_mb=SHARD_MB)
  return path


@pytest.mark.parametrize("damage, message", [
    ("missing", "is missing: the checkpoint is incomplete"),
    ("truncated", "the file is truncated or was not copied whole"),
    ("flipped", "is corrupted"),
])
def test_damaged_shard_is_named(sharded, damage, message):
  meta = graft_checkpoint.read_meta(str(sharded))
  shard = sharded / meta["shards"]["graft"]["files"][1]["file"]
  data = shard.read_bytes()
  if damage == "missing":
    shard.unlink()
  elif damage == "truncated":
    shard.write_bytes(data[:len(data) // 2])
  else:  # same size, one byte of tensor data changed: only the checksum sees it
    shard.write_bytes(data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:])
  with pytest.raises(WeightsError) as info:
    pretrained.load_graft(_wide(1), str(sharded))
  assert str(shard) in str(info.value) and message in str(info.value)


def test_damaged_shard_index_is_named(sharded):
  meta_path = sharded / "hamburger.json"
  meta = json.loads(meta_path.read_text())
  for bad in ({"graft": {"files": "graft-00001-of-00002.safetensors", "split": {}}},  # not a list
              {"graft": {"files": [{"file": "../escape.safetensors", "bytes": 1, "sha256": "0"}],
                         "split": {}}},
              ["graft"]):
    meta_path.write_text(json.dumps({**meta, "shards": bad}))
    with pytest.raises(WeightsError) as info:
      pretrained.load_graft(_wide(1), str(sharded))
    assert str(meta_path) in str(info.value)
  # A shard of another export (valid file, right checksum, other split): the join is refused.
  files = meta["shards"]["graft"]["files"]
  meta_path.write_text(json.dumps({**meta, "shards": {"graft": {
      "files": files[:1] + files[2:], "split": meta["shards"]["graft"]["split"]}}}))
  with pytest.raises(WeightsError, match="graft-\\*-of-"):
    pretrained.load_graft(_wide(1), str(sharded))


def test_export_over_a_checkpoint_is_atomic(sharded, monkeypatch):
  """A failed export leaves the previous checkpoint as it was and nothing beside it; a good one
  replaces it whole (no shard of the old one stays)."""
  before = _files(sharded)
  calls = []

  def failing(tensors, path, *a, **k):
    calls.append(path)
    if len(calls) == 2:
      raise OSError("disk full")
    return real(tensors, path, *a, **k)

  real = graft_checkpoint.save_file
  monkeypatch.setattr(graft_checkpoint, "save_file", failing)
  with pytest.raises(OSError, match="disk full"):
    graft_checkpoint.save_graft(_wide(2), str(sharded), "random", dtype="float32",
                                max_shard_mb=SHARD_MB)
  assert _files(sharded) == before
  assert sorted(os.listdir(sharded.parent)) == ["ckpt"]
  monkeypatch.setattr(graft_checkpoint, "save_file", real)
  graft_checkpoint.save_graft(_wide(2), str(sharded), "random", dtype="float32")  # one file now
  assert sorted(_files(sharded)) == ["graft.safetensors", "hamburger.json"]
  assert sorted(os.listdir(sharded.parent)) == ["ckpt"]
  with pytest.raises(ValueError, match="too small"):
    graft_checkpoint.save_graft(_wide(2), str(sharded), "random",
                                max_shard_mb=graft_checkpoint.MIN_SHARD_BYTES / 2**21)


def test_sharded_checkpoint_loads_on_its_gguf_base(monkeypatch, tmp_path):
  """load_hamburger reads a sharded graft (with adapters) exactly as the one-file form."""
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  from hamburger_jax.testing import write_tiny_llama_gguf  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv(cache.NO_WEIGHT_CACHE_ENV, "1")
  base_path = str(tmp_path / "tiny.gguf")
  write_tiny_llama_gguf(base_path)
  graft = GraftConfig(num_features=2, merger_head_dim=16, micro_layers=1, base_lora_rank=4)
  src, _ = pretrained.load_hamburger(pretrained.UNTRAINED, base_path, graft=graft, seed=3)
  ckpt = str(tmp_path / "ckpt")
  graft_checkpoint.save_graft(src, ckpt, base_path, dtype="float32", max_shard_mb=SHARD_MB)
  assert "graft.safetensors" not in os.listdir(ckpt)
  loaded, _ = pretrained.load_hamburger(ckpt)
  got, saved = _params(loaded, nnx.Param), _params(src, nnx.Param)
  for p, v in saved.items():
    np.testing.assert_array_equal(got[p], v, err_msg=str(p))


def test_shipped_checkpoint_reshards_into_16_mib_files(tmp_path):
  """The shipped (one-file) checkpoint reads unchanged, and its 16 MiB shards hold the same
  tensors: what leaves a machine whose transfers cap each file at 16 MiB."""
  ckpt = pretrained.DEFAULT_CHECKPOINT
  before = _files(ckpt)
  meta = graft_checkpoint.read_meta(ckpt)
  assert "shards" not in meta
  want = graft_checkpoint.read_tensors(ckpt, "graft", meta)
  out = graft_checkpoint.reshard_graft(ckpt, str(tmp_path / "out"), max_shard_mb=16)
  sizes = _files(out)
  assert len(sizes) >= 3 and max(sizes.values()) <= 16 * 2**20, sizes
  got = graft_checkpoint.read_tensors(out, "graft", graft_checkpoint.read_meta(out))
  assert got.keys() == want.keys()
  for k, v in want.items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)
  assert _files(ckpt) == before  # resharding writes beside the shipped files, never into them
  assert "micro_vocab.json" in sizes  # the list goes with the shards


def test_train_main_export_shard_mb(tmp_path, monkeypatch, capsys):
  """`train.main ... --export-shard-mb MB` leaves the export in files of at most MB MiB, and
  refuses a limit no shard can keep before any training."""
  from hamburger_jax import training  # pylint: disable=import-outside-toplevel
  from train import main as train_main  # pylint: disable=import-outside-toplevel
  export = str(tmp_path / "export")

  def fake_export_step(cfg, step):  # the real one restores a run's checkpoint first
    graft_checkpoint.save_graft(_wide(0), export, "random", dtype="float32")
    return export

  monkeypatch.setattr(training, "export_step", fake_export_step)
  config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                        "tiny.yaml")
  args = ["--config", config, "--set", f"checkpoint.dir={tmp_path / 'run'}", "--export-step", "5"]
  assert train_main.main(args + ["--export-shard-mb", str(SHARD_MB)]) == 0
  sizes = _files(export)
  assert "graft.safetensors" not in sizes and len(sizes) > 3
  assert max(sizes.values()) <= SHARD_MB * 2**20
  assert "files of at most" in capsys.readouterr().out
  pretrained.load_graft(_wide(1), export)
  for bad in ("0", "-1", "nan"):
    with pytest.raises(SystemExit):
      train_main.parse_args(args + ["--export-shard-mb", bad])
  with pytest.raises(SystemExit, match="too small"):
    train_main.main(args + ["--export-shard-mb", "0.001"])
