"""Run untrusted, model-written Python inside an operating-system sandbox.

The boundary is the kernel's, set up with util-linux's `unshare` and `setpriv` (no extra package):

- new mount, PID, network, IPC and UTS namespaces (as root; otherwise also a user namespace): no
  network at all (only a loopback device that is down), its own process tree whose first process
  is a small trusted init; when that init exits, the kernel kills every process left in the tree,
  `setsid` or not;
- a read-only view of the whole filesystem, except a private, size-limited tmpfs at /tmp (the
  working directory, holding main.py); the parent's home, /root, /home, /run, /var/tmp and /dev/shm
  are hidden under empty read-only tmpfs (the interpreter is bound back in if it lives there);
- the program runs with no capabilities, no_new_privs and, when the caller is root, as an
  unprivileged user id of its own, no account's (so RLIMIT_NPROC binds to this run alone and
  root-only files stay closed); its environment holds only PATH, HOME=/tmp, locale and
  thread-count variables;
- resource limits: address space, CPU time, processes, file size, open files, no core files; a
  wall-clock limit kept by the init, outside the program's reach, ends the whole tree.

`run_python(code)` runs a script and reports how it ended. Its exit status belongs to the program,
so it is no verdict on untrusted code: `checked_run.run_checked` is, built on `start_program`
and `finish_program` with a runner of its own (the bootstrap's part that serves calls).

When no isolation is available (no `unshare`, or namespaces are not permitted here) running model
code raises SandboxUnavailable, unless the caller opts into unsafe execution
(`set_unsafe_exec(True)`, `--unsafe-exec` on infer.eval): then the program runs as a plain
subprocess with the same resource limits and wall clock, and nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from hamburger_jax.subprocess_run import kill_group

# The user ids programs run as when the caller is root: one per run, above any account's.
# RLIMIT_NPROC counts every process of a real user id on the host, so runs sharing one (or
# sharing "nobody" with the host's daemons) would spend each other's process limits: a fork bomb
# in one run would make another's fork fail.
SANDBOX_UID_BASE = 1 << 30
_RUNS = itertools.count()


def run_uid() -> int:
  """A user id for one run: this process's id and a counter, so concurrent runs (threads, or
  processes) never share one."""
  return SANDBOX_UID_BASE + ((os.getpid() % (1 << 20)) << 8) + next(_RUNS) % 256

# Exit code the program's bootstrap uses for a MemoryError under the address-space limit.
_EXIT_MEMORY = 87
# Seconds the parent waits past the init's own wall clock before it kills the tree itself.
GRACE_S = 10.0
# Directories hidden from the program (besides the parent's $HOME), each under an empty tmpfs.
MASKED_DIRS = ("/root", "/home", "/run", "/var/tmp", "/dev/shm")
# Tools; module attributes so tests can point them at a missing file.
UNSHARE = "unshare"
SETPRIV = "setpriv"

_unsafe_exec = False


class SandboxUnavailable(RuntimeError):
  """Model-written code cannot be isolated here, and unsafe execution was not asked for."""


def set_unsafe_exec(allow: bool) -> None:
  """Lets run_python/run_checked fall back to a plain subprocess when no isolation is available
  (--unsafe-exec). Only for code you would run yourself."""
  global _unsafe_exec
  _unsafe_exec = bool(allow)


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  passed: bool
  status: str  # 'passed' | 'failed' | 'timeout' | 'memory' | 'error'
  output: str  # the program's stdout and stderr interleaved (tail kept), then the harness's notes
  elapsed_s: float = 0.0


# The trusted init, first process of the new namespaces (sandbox_child.py: filesystem, limits,
# wall clock, reports), run by path with the base interpreter and no site-packages.
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")

# The program's bootstrap, inside the sandbox: the head, a runner's source, then the tail, which
# calls the runner's run() and turns a MemoryError under the address-space limit into its own exit
# code. The runner sees `cfg` (the caller's runner_cfg plus "workdir") and `program` (main.py).
_BOOTSTRAP_HEAD = r"""
import json, os, sys, traceback
cfg = json.loads(sys.argv[1])
if hasattr(sys, "set_int_max_str_digits"):
  sys.set_int_max_str_digits(0)
program = os.path.join(cfg["workdir"], "main.py")
sys.argv = [program]
"""
_BOOTSTRAP_TAIL = r"""
try:
  run()
except MemoryError:
  try:
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
  finally:
    os._exit(%d)
""" % _EXIT_MEMORY
# run_python's runner: main.py as __main__. A partial, not a def, so that the program's
# tracebacks show no frame of the bootstrap's between <module> and runpy.
_SCRIPT_RUNNER = r"""
import functools, runpy
run = functools.partial(runpy.run_path, program, run_name="__main__")
"""


# ---------------------------------------------------------------------------------------------
# Parent side.


def _python() -> str:
  """The base interpreter (not a venv's wrapper): the program needs only the standard library."""
  return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _under(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip("/") + "/")


def _covers() -> tuple[list[tuple[str, bool]], list[str]]:
  """The tmpfs mounts ([(path, private)]: /tmp first, then the masks) and the directories to bind
  back under them (the interpreter's)."""
  python = _python()
  needed = sorted({os.path.realpath(sys.base_prefix), os.path.dirname(python)})
  masks = []
  for path in (os.path.expanduser("~"), *MASKED_DIRS):
    real = os.path.realpath(path)
    if real != "/" and os.path.isdir(real) and not _under(real, "/tmp"):
      masks.append(real)
  # Outermost only: a mask inside another is already hidden.
  masks = [m for m in sorted(set(masks)) if not any(o != m and _under(m, o) for o in masks)]
  covers = [("/tmp", True)] + [(m, False) for m in masks]
  keep = [d for d in needed if any(_under(d, c) for c, _ in covers)]
  keep = [d for d in keep if not any(o != d and _under(d, o) for o in keep)]
  return covers, keep


def read_tail(path: str, max_chars: int) -> str:
  """The last `max_chars` characters of a run's output file, with a note if cut."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    # 4 bytes per char at most in UTF-8: read just enough of the tail.
    f.seek(max(0, size - 4 * max_chars))
    text = f.read().decode("utf-8", errors="replace")
  if len(text) > max_chars or size > 4 * max_chars:
    text = text[-max_chars:]
    return f"[... output truncated to the last {max_chars} chars ...]\n{text}"
  return text


@dataclasses.dataclass
class SandboxRun:
  """One program started in the sandbox (or unsafely)."""
  proc: subprocess.Popen
  status_r: int
  out_path: str
  isolated: bool


def start_program(code: str, root: str, *, timeout_s: float, memory_mb: int, max_file_mb: int,
                  max_processes: int, isolate: bool, runner: str = _SCRIPT_RUNNER,
                  runner_cfg: dict | None = None, pass_fds: tuple[int, ...] = ()) -> SandboxRun:
  """Starts `code` as main.py under `runner`, with `pass_fds` open; output in root/output.txt."""
  status_r, status_w = os.pipe()
  as_root = os.geteuid() == 0
  python = _python()
  if isolate:
    covers, keep = _covers()
    workdir, uid = "/tmp", (run_uid() if as_root else 0)
  else:
    covers, keep = [], []
    workdir, uid = os.path.join(root, "work"), os.geteuid()
    os.mkdir(workdir)
  program_cfg = {"workdir": workdir, **(runner_cfg or {})}
  bootstrap = _BOOTSTRAP_HEAD + runner + _BOOTSTRAP_TAIL
  argv = [python, "-I", "-B", "-c", bootstrap, json.dumps(program_cfg)]
  if isolate:
    ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if as_root else []
    argv = [shutil.which(SETPRIV) or SETPRIV, *ids, "--inh-caps=-all", "--bounding-set=-all",
            "--no-new-privs", "--", *argv]
  env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
         "LC_ALL": "C.UTF-8",
         # Keep numeric libraries from reserving per-thread arenas that blow the RLIMIT_AS budget.
         "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
  init_cfg = {
      "status_fd": status_w, "isolate": isolate, "covers": covers, "keep": keep, "uid": uid,
      "workdir": workdir, "tmp_mb": max(4 * max_file_mb, 16),
      "host_mnt_ns": os.readlink("/proc/self/ns/mnt") if isolate else "",
      "memory_bytes": memory_mb * 2**20,
      # The CPU cap only backs up the wall clock (which also counts sleeping), so it is looser.
      "cpu_s": int(timeout_s) + 2, "fsize_bytes": max_file_mb * 2**20,
      "max_processes": max_processes, "timeout_s": timeout_s, "argv": argv, "env": env,
      "pass_fds": list(pass_fds)}
  cmd = [python, "-I", "-S", "-B", CHILD, json.dumps(init_cfg)]
  if isolate:
    namespaces = ["--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child",
                  "--mount-proc"]
    if not as_root:
      namespaces = ["--user", "--map-root-user", *namespaces]
    cmd = [shutil.which(UNSHARE) or UNSHARE, *namespaces, "--", *cmd]
  out_path = os.path.join(root, "output.txt")
  # Output goes to a file, not a pipe: a pipe could block on a stray process holding it open, and
  # RLIMIT_FSIZE bounds the file. The source goes in on stdin, read by the init before the limits.
  with open(out_path, "wb") as out, tempfile.TemporaryFile() as source:
    source.write(code.encode("utf-8", errors="surrogateescape"))
    source.seek(0)
    try:
      proc = subprocess.Popen(cmd, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, stdin=source,
                              stdout=out, stderr=subprocess.STDOUT, pass_fds=[status_w, *pass_fds],
                              start_new_session=True)  # the backstop kills the whole group
    finally:
      os.close(status_w)
  return SandboxRun(proc, status_r, out_path, isolate)


def _wait(run: SandboxRun, timeout_s: float) -> tuple[dict, bool]:
  """Waits for the init (its own wall clock, plus a grace) and returns its last report and whether
  the parent's backstop had to kill it."""
  killed = False
  try:
    run.proc.wait(timeout=timeout_s + GRACE_S)
  except subprocess.TimeoutExpired:
    killed = True
  kill_group(run.proc)
  run.proc.wait()
  with os.fdopen(run.status_r, "rb") as f:
    lines = f.read().decode("utf-8", errors="replace").splitlines()
  events = {}
  for line in lines:
    try:
      event = json.loads(line)
      events[event["event"]] = event
    except (ValueError, KeyError, TypeError):
      pass
  return events, killed


def _status(events: dict, killed: bool, out_size: int, *, timeout_s: float, memory_mb: int,
            max_file_mb: int) -> tuple[str, str]:
  """(status, note) from the init's reports."""
  if "setup_error" in events:
    return "error", f"[sandbox: could not set up: {events['setup_error'].get('message')}]"
  if "timeout" in events or killed:
    return "timeout", f"[sandbox: killed after the {timeout_s:g} s wall-clock limit]"
  if "exit" not in events:
    return "error", "[sandbox: the sandbox did not start (see the output above)]"
  rc = events["exit"].get("returncode")
  if rc == 0:
    return "passed", ""
  if rc == _EXIT_MEMORY:
    return "memory", f"[sandbox: MemoryError under the {memory_mb} MiB address-space limit]"
  if rc == -signal.SIGXCPU:
    return "timeout", "[sandbox: killed by the CPU-time limit]"
  if rc == -signal.SIGKILL:
    return "memory", "[sandbox: killed by SIGKILL, most likely the OOM killer]"
  if rc == -signal.SIGXFSZ or (isinstance(rc, int) and rc > 0 and
                               out_size >= max_file_mb * 2**20):
    # Python ignores SIGXFSZ, so an output flood usually ends as an OSError exit (rc 1).
    return "failed", f"[sandbox: output reached the {max_file_mb} MiB file-size limit]"
  if isinstance(rc, int) and rc > 0:
    return "failed", ""
  try:
    name = signal.Signals(-rc).name
  except (ValueError, TypeError):
    name = str(rc)
  return "error", f"[sandbox: killed by signal {name}]"


def finish_program(run: SandboxRun, *, timeout_s: float, memory_mb: int, max_file_mb: int,
                   max_output_chars: int) -> tuple[str, str, str]:
  """Waits for a started program to end (or ends it) and returns (status, note, output): how it
  ended (see run_python), a note on why when the limits or the sandbox ended it, and its output."""
  events, killed = _wait(run, timeout_s)
  out_size = os.path.getsize(run.out_path)
  output = read_tail(run.out_path, max_output_chars)
  status, note = _status(events, killed, out_size, timeout_s=timeout_s, memory_mb=memory_mb,
                         max_file_mb=max_file_mb)
  return status, note, output


def check_limits(timeout_s: float, memory_mb: int) -> None:
  if not timeout_s > 0 or memory_mb <= 0:
    raise ValueError(f"timeout_s={timeout_s} and memory_mb={memory_mb} must both be positive")


def isolate_or_refuse(unsafe: bool | None) -> bool:
  """True: isolate. False: run unsafely (asked for, and no isolation here). Raises otherwise."""
  ok, reason = isolation_status()
  if ok:
    return True
  if _unsafe_exec if unsafe is None else unsafe:
    return False
  raise SandboxUnavailable(
      f"refusing to run model-written code without isolation: {reason}. Run where util-linux's "
      "unshare can create mount, PID and network namespaces (as root, or with unprivileged user "
      "namespaces enabled), or pass --unsafe-exec (infer.eval) / set_unsafe_exec(True) to run it "
      "as a plain subprocess, only if you trust the code")


@functools.cache
def isolation_status() -> tuple[bool, str]:
  """(True, '') if a sandboxed run works here, else (False, why); checked once per process."""
  tools = [UNSHARE] + [SETPRIV]
  missing = [t for t in tools if shutil.which(t) is None]
  if missing:
    return False, f"{' and '.join(missing)} not found (util-linux)"
  with tempfile.TemporaryDirectory(prefix="hamburger_sandbox_") as root:
    run = start_program("print('isolated')", root, timeout_s=10, memory_mb=512, max_file_mb=1,
                        max_processes=16, isolate=True)
    events, _ = _wait(run, 10)
    output = read_tail(run.out_path, 2000).strip()
  if events.get("exit", {}).get("returncode") == 0 and output == "isolated":
    return True, ""
  why = events.get("setup_error", {}).get("message") or output.splitlines()[-1:] or ["no report"]
  return False, f"a test run in namespaces failed ({why if isinstance(why, str) else why[0]})"


def run_python(
    code: str,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    *,
    max_output_chars: int = 8192,
    max_file_mb: int = 16,
    max_processes: int = 32,
    unsafe: bool | None = None,
) -> SandboxResult:
  """Runs `code` as a script in the sandbox; never raises for anything the code does.

  Statuses: 'passed' (exit 0), 'failed' (non-zero exit: exception, failed assert, sys.exit(1),
  output over max_file_mb), 'timeout' (wall clock or CPU limit), 'memory' (MemoryError under the
  RLIMIT_AS cap, or SIGKILL, i.e. the kernel OOM killer), 'error' (the sandbox could not be set
  up, or the program died from another signal such as SIGSEGV). The exit status is the program's
  own: use checked_run.run_checked to score untrusted code. Raises SandboxUnavailable when there
  is no isolation here and unsafe execution is off (`unsafe=None` follows set_unsafe_exec).
  """
  check_limits(timeout_s, memory_mb)
  isolate = isolate_or_refuse(unsafe)
  start = time.monotonic()
  with tempfile.TemporaryDirectory(prefix="hamburger_sandbox_", ignore_cleanup_errors=True) as root:
    try:
      run = start_program(code, root, timeout_s=timeout_s, memory_mb=memory_mb,
                          max_file_mb=max_file_mb, max_processes=max_processes, isolate=isolate)
    except OSError as e:
      return SandboxResult(False, "error", f"could not start the sandbox process: {e}")
    status, note, output = finish_program(run, timeout_s=timeout_s, memory_mb=memory_mb,
                                          max_file_mb=max_file_mb,
                                          max_output_chars=max_output_chars)
  if note:
    output += "\n" + note
  return SandboxResult(status == "passed", status, output, time.monotonic() - start)
