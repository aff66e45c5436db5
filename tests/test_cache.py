"""The per-user caches (hamburger_jax/cache.py): JAX's persistent compilation cache is used by a
second process and can be turned off; converted GGUF weights are reused bit for bit while the
file is unchanged and rebuilt when it changes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from hamburger_jax import cache, pretrained
from hamburger_jax.convert import gguf
from hamburger_jax.testing import write_tiny_llama_gguf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWITCHES = (cache.CACHE_DIR_ENV, cache.NO_COMPILE_CACHE_ENV, cache.NO_WEIGHT_CACHE_ENV,
            cache.JAX_CACHE_DIR_ENV)

# A program of its own (not compiled by any other test) and the eager ops that feed it.
PROGRAM = """
import jax, jax.numpy as jnp
from hamburger_jax import cache
cache.enable_compilation_cache()
f = jax.jit(lambda x: jnp.tanh(x @ x.T + 0.123).sum(axis=0))
print(float(f(jnp.arange(48.0).reshape(6, 8)).sum()))
"""


def _run_program(program: str = PROGRAM, **env: str) -> str:
  clean = {k: v for k, v in os.environ.items() if k not in SWITCHES}
  res = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                       cwd=REPO, env={**clean, **env}, timeout=300)
  assert res.returncode == 0, res.stderr[-2000:]
  return res.stdout


def _entries(directory) -> set[str]:
  return set(os.listdir(directory)) if os.path.isdir(directory) else set()


def test_a_second_process_compiles_nothing_new(tmp_path):
  root = str(tmp_path / "user-cache")
  first_out = _run_program(**{cache.CACHE_DIR_ENV: root})
  first = _entries(os.path.join(root, "jax"))
  assert first, "the first run wrote no compilation cache entries"
  assert _run_program(**{cache.CACHE_DIR_ENV: root}) == first_out
  assert _entries(os.path.join(root, "jax")) == first  # every program came from the cache


# A program that streams to Python each step (as the server's decode programs do): JAX itself
# keeps no program with host callbacks.
CALLBACK_PROGRAM = """
import jax, jax.numpy as jnp, numpy as np
from hamburger_jax import cache
cache.enable_compilation_cache()
seen = []
def step(i):
  seen.append(int(i))
  return np.bool_(int(i) >= 3)
def body(c):
  i, total, stop = c
  stop = jax.experimental.io_callback(step, jax.ShapeDtypeStruct((), jnp.bool_), i, ordered=True)
  return i + 1, total + i * 0.457, stop
f = jax.jit(lambda x: jax.lax.while_loop(lambda c: (c[0] < 10) & ~c[2], body, (x, 0.0, False)))
out = f(jnp.int32(1))
counts = cache.compile_counts()
print(int(out[0]), round(float(out[1]), 4), seen, counts.hits, counts.misses)
"""


def test_a_program_with_host_callbacks_comes_from_the_cache(tmp_path):
  env = {cache.CACHE_DIR_ENV: str(tmp_path / "user-cache")}
  first = _run_program(CALLBACK_PROGRAM, **env).split()
  assert first[:-2] == ["4", "2.742", "[1,", "2,", "3]"]
  assert int(first[-1]) >= 1  # at least the loop itself compiled
  second = _run_program(CALLBACK_PROGRAM, **env).split()
  # The same answer, the callback called at each step, and nothing compiled: every program the
  # first process compiled, the one with the callback included, is read back.
  assert second[:-2] == first[:-2]
  assert (int(second[-2]), int(second[-1])) == (int(first[-2]) + int(first[-1]), 0)
  assert os.listdir(tmp_path / "user-cache" / "jax" / cache.CALLBACK_PROGRAMS_DIR)


def test_compilation_cache_off_switch_and_jax_variable(tmp_path):
  root = str(tmp_path / "user-cache")
  _run_program(**{cache.CACHE_DIR_ENV: root, cache.NO_COMPILE_CACHE_ENV: "1"})
  assert not _entries(os.path.join(root, "jax"))
  # JAX's own variable, when the user set it, says where the entries go; off still means off.
  theirs = str(tmp_path / "theirs")
  _run_program(**{cache.CACHE_DIR_ENV: root, cache.JAX_CACHE_DIR_ENV: theirs,
                  cache.NO_COMPILE_CACHE_ENV: "1"})
  assert not _entries(theirs)
  _run_program(**{cache.CACHE_DIR_ENV: root, cache.JAX_CACHE_DIR_ENV: theirs})
  assert _entries(theirs) and not _entries(os.path.join(root, "jax"))


def test_a_jax_whose_compile_signature_differs_is_left_unwrapped(monkeypatch, capsys):
  """The wrapper reads JAX's private compile function by its parameters' names; a JAX where
  they differ keeps its own function (with a warning), so compiling still works there."""
  from jax._src import compiler  # pylint: disable=import-outside-toplevel
  def other(backend, module, devices, options, callbacks, executable_devices):
    return "compiled"
  monkeypatch.setattr(compiler, "compile_or_get_cached", other)
  cache._keep_callback_programs()  # pylint: disable=protected-access
  assert compiler.compile_or_get_cached is other
  assert "not kept in the compilation cache" in capsys.readouterr().err


def test_cache_root(monkeypatch, tmp_path):
  for name in SWITCHES + ("XDG_CACHE_HOME",):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert cache.cache_root() == str(tmp_path / "home" / ".cache" / "hamburger_jax")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert cache.cache_root() == str(tmp_path / "xdg" / "hamburger_jax")
  monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "mine"))
  assert cache.cache_root() == str(tmp_path / "mine")


# ----------------------------------------------------------------------------- converted weights


def _params(model) -> dict:
  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_same(a: dict, b: dict) -> None:
  assert a.keys() == b.keys()
  for p in a:  # bit for bit: the cache stores the converted float32 arrays themselves
    assert a[p].dtype == b[p].dtype and np.array_equal(a[p], b[p]), p


@pytest.fixture
def weights_env(monkeypatch, tmp_path):
  for name in SWITCHES:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "user-cache"))
  return tmp_path / "user-cache" / "weights"


def _uncached(path: str, monkeypatch) -> dict:
  with monkeypatch.context() as m:
    m.setenv(cache.NO_WEIGHT_CACHE_ENV, "1")
    return _params(pretrained.load_llama(path)[0])


def test_converted_weights_are_reused_bit_for_bit(weights_env, tmp_path, monkeypatch):
  path = str(tmp_path / "tiny.gguf")
  write_tiny_llama_gguf(path, seed=0)
  want = _uncached(path, monkeypatch)
  assert not _entries(weights_env)  # the switch: nothing written

  assert not gguf.read_converted(path).from_cache  # converted, then written
  (entry,) = _entries(weights_env)
  hit = gguf.read_converted(path)
  assert hit.from_cache and hit.metadata == gguf.GGUFFile(path).metadata
  model, tok = pretrained.load_llama(path)
  _assert_same(_params(model), want)
  assert tok.encode("ABC") == [63, 34]  # the tokenizer, from the cached metadata

  # The file changes (same size, other weights): the entry is rebuilt in place, not reused.
  write_tiny_llama_gguf(path, seed=1)
  assert not gguf.read_converted(path).from_cache
  new = _params(pretrained.load_llama(path)[0])
  _assert_same(new, _uncached(path, monkeypatch))
  assert any(not np.array_equal(new[p], want[p]) for p in want)
  assert _entries(weights_env) == {entry}  # one entry per source file, no temp files left
  assert gguf.read_converted(path).from_cache

  # New conversion code (a bumped version) does not trust entries written by the old one.
  monkeypatch.setattr(gguf, "CONVERSION_VERSION", gguf.CONVERSION_VERSION + 1)
  assert not gguf.read_converted(path).from_cache
  assert gguf.read_converted(path).from_cache


def test_corrupt_or_unwritable_weight_cache_is_survived(weights_env, tmp_path, monkeypatch,
                                                        capsys):
  path = str(tmp_path / "tiny.gguf")
  write_tiny_llama_gguf(path)
  want = _uncached(path, monkeypatch)
  gguf.read_converted(path)
  (entry,) = _entries(weights_env)
  with open(weights_env / entry, "r+b") as f:  # cut short, as by a full disk
    f.truncate(os.path.getsize(weights_env / entry) // 2)
  _assert_same(_params(pretrained.load_llama(path)[0]), want)
  assert "corrupt converted-weights cache entry" in capsys.readouterr().err
  assert gguf.read_converted(path).from_cache  # rewritten whole

  blocked = tmp_path / "blocked"
  blocked.write_text("a file where the cache directory should be")
  monkeypatch.setenv(cache.CACHE_DIR_ENV, str(blocked))
  _assert_same(_params(pretrained.load_llama(path)[0]), want)
  assert "could not write the converted-weights cache" in capsys.readouterr().err


def test_counts_from_many_compiling_threads_are_exact(monkeypatch):
  """Programs compile on a thread pool, each lookup reported from its own thread: every request
  and hit counted, none lost to two threads updating the counts at once. The counts here let
  other threads run between reading a count and writing it back (the GIL makes a plain
  attribute update atomic on CPython 3.11, not on a free-threaded Python)."""
  import threading  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  class YieldingCounts:
    def __init__(self):
      self._hits = self._misses = 0

    def _get(name):
      def get(self):
        value = getattr(self, name)
        time.sleep(0)  # another thread may update the count now
        return value
      return property(get, lambda self, v: setattr(self, name, v))

    hits, misses = _get("_hits"), _get("_misses")

  counts = YieldingCounts()
  monkeypatch.setattr(cache, "_COUNTS", counts)

  def lookups():
    for i in range(300):
      cache._count_jax_event(cache._JAX_REQUEST)  # pylint: disable=protected-access
      if i % 2:
        cache._count_jax_event(cache._JAX_HIT)  # pylint: disable=protected-access
  threads = [threading.Thread(target=lookups) for _ in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert (counts.hits, counts.misses) == (8 * 150, 8 * 150)


def test_cached_programs_read_each_entry_name_and_compile_seconds(tmp_path):
  """The suite's per-program table (tests/suite_timings.py --programs) reads JAX's own entries:
  the jitted function's name and the compile seconds JAX stored, skipping what it cannot read."""
  from jax._src import compilation_cache as jax_cache  # pylint: disable=import-outside-toplevel
  import suite_timings  # pylint: disable=import-outside-toplevel
  entry = lambda seconds: jax_cache.compress_executable(
      jax_cache.combine_executable_and_time(b"an executable", seconds))
  (tmp_path / "jit__decode_impl-1a2b-cache").write_bytes(entry(7))
  (tmp_path / "jit__decode_impl-3c4d-cache").write_bytes(entry(2))
  (tmp_path / "jit_add-5e6f-cache").write_bytes(entry(0))
  (tmp_path / "jit_cut-7a8b-cache").write_bytes(entry(3)[:5])  # cut short: left out
  (tmp_path / "jit_add-9c0d-atime").write_bytes(b"")  # JAX's access times: not programs
  got = sorted((p.name, p.compile_s) for p in cache.cached_programs(str(tmp_path)))
  assert got == [("jit__decode_impl", 2), ("jit__decode_impl", 7), ("jit_add", 0)]
  table = suite_timings.programs_table(str(tmp_path), top=10)
  assert "3 programs" in table and "9 s compiling" in table
  assert "| jit__decode_impl | 2 | 9 | 1 | 100.0% |" in table
