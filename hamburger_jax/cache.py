"""Per-user caches that make a second run start fast: JAX's persistent compilation cache, and the
float32 arrays that GGUF conversion produces.

They live under one directory, `cache_root()`:
  $HAMBURGER_JAX_CACHE_DIR, else $XDG_CACHE_HOME/hamburger_jax, else ~/.cache/hamburger_jax
with `jax/` for compiled programs (unless $JAX_COMPILATION_CACHE_DIR names another place),
`weights/` for converted weights and `buckets/` for local copies of base weights read from a
bucket (files.mirror). Switches (any value but "", "0", "false", "no" turns them on):
  HAMBURGER_JAX_NO_COMPILE_CACHE=1   compile everything, write nothing
  HAMBURGER_JAX_NO_WEIGHT_CACHE=1    convert GGUF files on every load, write nothing
Deleting the directory is always safe: the caches are rebuilt on the next run.

JAX writes no program that calls back to Python (a stream's io_callback): reading one back
needs its callbacks bound again, which JAX's reader does not do, so a server compiled its
streaming decode programs again at every start. Those are kept in `jax/callbacks/` under JAX's
own cache key, and loaded with the callbacks of the process that asks for them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import inspect
import os
import sys
import threading

import jax

from hamburger_jax import files

CACHE_DIR_ENV = "HAMBURGER_JAX_CACHE_DIR"
NO_COMPILE_CACHE_ENV = "HAMBURGER_JAX_NO_COMPILE_CACHE"
NO_WEIGHT_CACHE_ENV = "HAMBURGER_JAX_NO_WEIGHT_CACHE"
JAX_CACHE_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"  # JAX's own variable: it wins when set

# JAX writes only programs that took >= 1 s to compile by default. Our engine's programs take
# longer on a CPU but less on an accelerator, and the small ones (a bench step, the training
# evaluation) add up, so every program is kept; tiny entries cost a file of a few kB each.
MIN_COMPILE_TIME_S = 0.0
_FINGERPRINT_BYTES = 2**20
# Where programs with host callbacks are kept, under JAX's cache directory. Only on backends
# whose callbacks are FFI custom calls naming their callback by its index in the lowering's list
# (jax._src.callback.emit_python_callback), so that the same module binds the same callbacks,
# and where reading one back was tested: the CPU. (GPUs lower callbacks the same way, untested:
# there such programs still compile at each start.)
CALLBACK_PROGRAMS_DIR = "callbacks"
CALLBACK_PLATFORMS = ("cpu",)


@dataclasses.dataclass
class CompileCounts:
  """Programs of this process that the persistent compilation cache served (hits), and those
  it was asked for and did not have: compiled (misses)."""
  hits: int = 0
  misses: int = 0


_COUNTS = CompileCounts()
# Programs compile on a thread pool (decode/programs.py), and JAX reports each lookup from the
# thread that compiles it: a read-modify-write of the counts from two threads at once loses one.
_COUNTS_LOCK = threading.Lock()
# The counts of one stretch of work (`counting`), wherever its programs compile: the process's
# counts mix every thread's (a server compiles in the background while it serves).
_SCOPE: contextvars.ContextVar[CompileCounts | None] = contextvars.ContextVar(
    "hamburger_jax_compile_counts", default=None)


@contextlib.contextmanager
def counting(counts: CompileCounts):
  """Adds to `counts` every program this context compiles or reads back, and every one compiled
  in a copy of it (decode/programs.py runs its compile jobs in copies of the caller's)."""
  token = _SCOPE.set(counts)
  try:
    yield counts
  finally:
    _SCOPE.reset(token)


def _add(hits: int, misses: int) -> None:
  with _COUNTS_LOCK:
    for counts in (_COUNTS, _SCOPE.get()):
      if counts is not None:
        counts.hits, counts.misses = counts.hits + hits, counts.misses + misses
# JAX records a request for each program it looks up, then a hit when it finds it.
_JAX_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"
_JAX_HIT = "/jax/compilation_cache/cache_hits"


def _switched_on(name: str) -> bool:
  return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def cache_root() -> str:
  """The per-user cache directory (created on first write, not here)."""
  if os.environ.get(CACHE_DIR_ENV):
    return os.path.abspath(os.path.expanduser(os.environ[CACHE_DIR_ENV]))
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(os.path.abspath(base), "hamburger_jax")


def enable_compilation_cache(enabled: bool = True,
                             min_compile_time_s: float = MIN_COMPILE_TIME_S) -> str | None:
  """Turns JAX's persistent compilation cache on (the entry points call this first thing), so a
  second run loads the programs the first one compiled. Returns the directory, or None when the
  cache is off (`enabled=False`, e.g. infer.generate --no-compile-cache, or
  $HAMBURGER_JAX_NO_COMPILE_CACHE). Must run before the first compilation of the process: JAX
  opens the cache once."""
  if not enabled or _switched_on(NO_COMPILE_CACHE_ENV):
    # Also off when the user's environment set JAX_COMPILATION_CACHE_DIR: off means off.
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  directory = os.environ.get(JAX_CACHE_DIR_ENV) or os.path.join(cache_root(), "jax")
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
  # -1: no size floor (0 would let JAX pick one per filesystem, skipping small programs).
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  _keep_callback_programs()
  return directory


@dataclasses.dataclass(frozen=True)
class CachedProgram:
  """One entry of JAX's persistent compilation cache: the jitted function's name (jit_f), the
  seconds XLA took to compile it (JAX records them in the entry, truncated to whole seconds: a
  program under 1 s reads 0) and the entry's size."""
  name: str
  compile_s: int
  nbytes: int


def cached_programs(directory: str) -> list[CachedProgram]:
  """The programs in a compilation cache directory (`enable_compilation_cache`'s), wherever
  they were compiled: the tests' own processes and the entry points they run alike. Entries
  JAX cannot read back are left out."""
  from jax._src import compilation_cache as jax_cache  # pylint: disable=import-outside-toplevel
  out = []
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if not name.endswith("-cache") or not os.path.isfile(path):
      continue
    with open(path, "rb") as f:
      raw = f.read()
    try:
      _, seconds = jax_cache.extract_executable_and_time(jax_cache.decompress_executable(raw))
    except Exception:  # pylint: disable=broad-except
      continue  # written by another JAX, or cut short
    # Entries are named {function}-{hash}-cache (JAX's key: the function's name, then a digest).
    out.append(CachedProgram(name.rsplit("-", 2)[0], int(seconds), len(raw)))
  return out


def compile_counts() -> CompileCounts:
  """A copy of this process's counts so far (subtract an earlier copy for a stretch of work)."""
  with _COUNTS_LOCK:
    return dataclasses.replace(_COUNTS)


def _count_jax_event(event: str, **_) -> None:
  if event == _JAX_REQUEST:
    _add(0, 1)
  elif event == _JAX_HIT:
    _add(1, -1)


def _callback_program_path(backend, computation, devices, options, host_callbacks) -> str | None:
  """Where the program goes when it has host callbacks and the cache is on; else None."""
  from jax._src import compilation_cache as jax_cache  # pylint: disable=import-outside-toplevel
  directory = jax.config.jax_compilation_cache_dir
  if (not host_callbacks or backend.platform not in CALLBACK_PLATFORMS or not directory
      or files.is_remote(directory) or not jax_cache.is_cache_used(backend)):
    return None
  try:
    key = jax_cache.get_cache_key(computation, devices, options, backend)
  except Exception as e:  # pylint: disable=broad-except
    warn(f"no compilation cache key for a program with host callbacks ({e}); compiling it")
    return None
  return os.path.join(directory, CALLBACK_PROGRAMS_DIR, key)


_COMPILE_PARAMETERS = ("backend", "computation", "devices", "compile_options", "host_callbacks",
                       "executable_devices")


def _keep_callback_programs() -> None:
  """Wraps JAX's compile-or-read step (once per process) so that programs with host callbacks
  are read from and written to CALLBACK_PROGRAMS_DIR; any other program goes to JAX as before."""
  # pylint: disable=import-outside-toplevel
  from jax._src import compilation_cache as jax_cache, compiler
  jax_compile = compiler.compile_or_get_cached
  if getattr(jax_compile, "keeps_callback_programs", False):
    return
  # A private function: a JAX whose signature differs keeps its own behaviour (such programs
  # compile again at each start) rather than receiving arguments this wrapper misreads.
  names = tuple(inspect.signature(jax_compile).parameters)[:len(_COMPILE_PARAMETERS)]
  if names != _COMPILE_PARAMETERS:
    warn(f"jax's compile_or_get_cached takes {names}, not {_COMPILE_PARAMETERS}: programs with "
         "host callbacks are not kept in the compilation cache")
    return
  jax.monitoring.register_event_listener(_count_jax_event)

  def compile_or_get_cached(backend, computation, devices, compile_options, host_callbacks,
                            executable_devices, *args, **kw):
    path = _callback_program_path(backend, computation, devices, compile_options,
                                  host_callbacks)
    if path is not None and os.path.exists(path):
      try:
        with open(path, "rb") as f:
          serialized = jax_cache.decompress_executable(f.read())
        loaded = backend.deserialize_executable(serialized, executable_devices, compile_options,
                                                host_callbacks=list(host_callbacks))
        _add(1, 0)
        return loaded
      except Exception as e:  # pylint: disable=broad-except
        warn(f"compilation cache entry {path} is unreadable ({type(e).__name__}: {e}); "
             "compiling instead")
    executable = jax_compile(backend, computation, devices, compile_options, host_callbacks,
                             executable_devices, *args, **kw)
    if path is not None and jax.process_index() == 0:  # JAX counted the miss
      _write_atomically(path, jax_cache.compress_executable(
          backend.serialize_executable(executable)))
    return executable

  compile_or_get_cached.keeps_callback_programs = True
  compiler.compile_or_get_cached = compile_or_get_cached


def _write_atomically(path: str, data: bytes) -> None:
  """A reader sees the whole entry or none; a failed write is a warning."""
  try:
    files.makedirs(os.path.dirname(path))
    files.write_bytes_atomic(path, data)
  except OSError as e:
    warn(f"could not write compilation cache entry {path}: {e}")


def weight_cache_enabled() -> bool:
  return not _switched_on(NO_WEIGHT_CACHE_ENV)


def weights_path(source: str, suffix: str) -> str:
  """Where the converted weights of the file `source` are cached: one entry per source path,
  overwritten when the file changes (the entry records the fingerprint it was built from)."""
  source = os.path.abspath(source)
  stem = os.path.splitext(os.path.basename(source))[0]
  digest = hashlib.sha256(source.encode()).hexdigest()[:16]
  return os.path.join(cache_root(), "weights", f"{stem}-{digest}{suffix}")


def file_fingerprint(path: str, version: int) -> str:
  """A cheap identity of a file's contents: size, modification time and the first and last MiB,
  plus `version` (the converting code's, so a change to it invalidates old entries). Reading 2 MiB
  instead of hashing the whole file keeps a cache hit fast; the modification time catches
  rewrites that keep the size and both ends."""
  st = os.stat(path)
  h = hashlib.sha256(f"{version}:{st.st_size}:{st.st_mtime_ns}".encode())
  with open(path, "rb") as f:
    h.update(f.read(_FINGERPRINT_BYTES))
    if st.st_size > _FINGERPRINT_BYTES:
      f.seek(max(st.st_size - _FINGERPRINT_BYTES, _FINGERPRINT_BYTES))
      h.update(f.read())
  return h.hexdigest()


def warn(message: str) -> None:
  """A cache problem never fails a run: it is said on stderr and the work is done uncached."""
  print(f"warning: {message}", file=sys.stderr)
