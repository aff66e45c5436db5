"""Run untrusted, model-written Python inside an operating-system sandbox.

The boundary is the kernel's, set up with util-linux's `unshare` and `setpriv` (no extra package):

- new mount, PID, network, IPC and UTS namespaces (as root; otherwise also a user namespace): no
  network at all (only a loopback device that is down), its own process tree whose first process
  is a small trusted init; when that init exits, the kernel kills every process left in the tree,
  `setsid` or not;
- a read-only view of the whole filesystem, except a private, size-limited tmpfs at /tmp (the
  working directory, holding main.py); the parent's home, /root, /home, /run, /var/tmp and /dev/shm
  are hidden under empty read-only tmpfs (the interpreter is bound back in if it lives there);
- the program runs with no capabilities, no_new_privs and, when the caller is root, as the
  unprivileged user 65534 (so RLIMIT_NPROC binds and root-only files stay closed); its environment
  holds only PATH, HOME=/tmp, locale and thread-count variables;
- resource limits: address space, CPU time, processes, file size, open files, no core files; a
  wall-clock limit kept by the init, outside the program's reach, ends the whole tree.

`run_python(code)` runs a script and reports how it ended. Its exit status belongs to the program,
so it is no verdict on untrusted code: `run_checked(program, entry_point, check_source)` is. The
program runs in the sandbox and serves calls to `entry_point`; the trusted check (e.g. HumanEval's
`check`) runs in a separate, unsandboxed checker process that the program cannot reach (another
user, outside its PID namespace). Arguments and return values cross as plain data through
`sandbox_codec`, and the verdict is the checker's exit status: a program that prints a pass marker
and exits 0, or returns an object whose `__eq__` always says True, fails.

When no isolation is available (no `unshare`, or namespaces are not permitted here) running model
code raises SandboxUnavailable, unless the caller opts into unsafe execution
(`set_unsafe_exec(True)`, `--unsafe-exec` on infer.eval): then the program runs as a plain
subprocess with the same resource limits and wall clock, and nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from hamburger_jax.evaluation import sandbox_codec

# The unprivileged user the program runs as when the caller is root ("nobody").
SANDBOX_UID = 65534
# Exit code the program's bootstrap uses for a MemoryError under the address-space limit.
_EXIT_MEMORY = 87
# Frames between the checker and the program are at most this large.
MAX_FRAME_BYTES = 16 * 2**20
# Seconds the parent waits past the init's own wall clock before it kills the tree itself.
_GRACE_S = 10.0
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


# ---------------------------------------------------------------------------------------------
# The trusted init: first process of the new namespaces. It makes the filesystem read-only, mounts
# the private /tmp and the masks, sets the limits, starts the program with no capabilities, keeps
# the wall clock and reports on its own pipe (which the program does not inherit). Run with
# `python -I -S -B -c _INIT CONFIG_JSON`, the program's source on stdin.
_INIT = r"""
import ctypes, json, os, re, resource, select, signal, subprocess, sys, time
cfg = json.loads(sys.argv[1])
status = os.fdopen(cfg["status_fd"], "w")
def report(**kw):
  status.write(json.dumps(kw) + "\n")
  status.flush()
# Default dispositions (inherited by the program): as PID 1 of its namespace, the init then gets
# no signal from the program at all (the kernel drops them), and Python's SIGINT handler is gone.
signal.signal(signal.SIGINT, signal.SIG_DFL)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME = 1 << 21
# statvfs f_flag bits -> the mount flags a remount must keep (locked flags may not be dropped).
_KEEP = ((2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME), (2048, MS_NODIRATIME),
         (4096, MS_RELATIME))
_libc = ctypes.CDLL(None, use_errno=True)

def mount(src, target, fstype, flags, data=None):
  enc = lambda s: None if s is None else os.fsencode(s)
  if _libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mount {target}: {os.strerror(err)}")

def make_readonly(path):
  flags = os.statvfs(path).f_flag
  if not flags & 1:
    keep = sum(ms for st, ms in _KEEP if flags & st)
    # MS_BIND: change this mount's flag only, never the superblock (shared with the host).
    mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)

def mountpoints():
  with open("/proc/self/mountinfo", "rb") as f:
    lines = f.read().splitlines()
  unescape = lambda m: bytes([int(m.group(1), 8)])
  return [os.fsdecode(re.sub(rb"\\([0-7]{3})", unescape, line.split()[4])) for line in lines]

def under(path, root):
  return path == root or path.startswith(root.rstrip("/") + "/")

def setup(code):
  if os.getpid() != 1 or os.readlink("/proc/self/ns/mnt") == cfg["host_mnt_ns"]:
    raise RuntimeError("not in fresh PID and mount namespaces")
  mount(None, "/", None, MS_REC | MS_PRIVATE)
  # Directories to show again under a mask (the interpreter), opened before anything covers them.
  keeps = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in cfg["keep"]}
  for mp in mountpoints():
    try:
      make_readonly(mp)
    except (FileNotFoundError, PermissionError):
      pass  # a mount point covered by another mount, or closed to us: unreachable from here
  for path, private in cfg["covers"]:
    owner = cfg["uid"] if private else 0
    mode = "700" if private else "755"
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={cfg['tmp_mb'] if private else 1}m,mode={mode},uid={owner},gid={owner}")
    for keep, fd in keeps.items():
      if under(keep, path):
        os.makedirs(keep, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", keep, None, MS_BIND | MS_REC)
        for mp in mountpoints():
          if under(mp, keep):
            make_readonly(mp)
    if private:
      program = os.path.join(path, "main.py")
      with open(program, "wb") as f:
        f.write(code)
      os.chown(program, cfg["uid"], cfg["uid"])
    else:
      make_readonly(path)
  for fd in keeps.values():
    os.close(fd)
  for mp in mountpoints():
    try:
      flags = os.statvfs(mp).f_flag
    except OSError:
      continue
    if not flags & 1 and mp != cfg["workdir"]:
      raise RuntimeError(f"{mp} is still writable")

def limit(kind, soft, hard=None):
  hard = soft if hard is None else hard
  _, cap = resource.getrlimit(kind)
  if cap != resource.RLIM_INFINITY:
    soft, hard = min(soft, cap), min(hard, cap)
  resource.setrlimit(kind, (soft, hard))

try:
  code = sys.stdin.buffer.read()
  devnull = os.open("/dev/null", os.O_RDONLY)
  os.dup2(devnull, 0)
  if cfg["isolate"]:
    setup(code)
  else:
    with open(os.path.join(cfg["workdir"], "main.py"), "wb") as f:
      f.write(code)
  os.chdir(cfg["workdir"])
  limit(resource.RLIMIT_AS, cfg["memory_bytes"])
  # SIGXCPU at the soft limit, SIGKILL one second later if the program ignores it.
  limit(resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1)
  limit(resource.RLIMIT_FSIZE, cfg["fsize_bytes"])
  limit(resource.RLIMIT_CORE, 0)
  limit(resource.RLIMIT_NOFILE, 256)
  limit(resource.RLIMIT_NPROC, cfg["max_processes"])
  proc = subprocess.Popen(cfg["argv"], env=cfg["env"], stdin=subprocess.DEVNULL,
                          pass_fds=cfg["pass_fds"], close_fds=True)
except BaseException as e:
  report(event="setup_error", message=f"{type(e).__name__}: {e}")
  os._exit(70)
for fd in cfg["pass_fds"]:
  os.close(fd)
report(event="started")
deadline = time.monotonic() + cfg["timeout_s"]
try:
  pidfd = os.pidfd_open(proc.pid)
except (AttributeError, OSError):
  pidfd = None
while proc.poll() is None:
  left = deadline - time.monotonic()
  if left <= 0:
    report(event="timeout")
    if not cfg["isolate"]:
      os.killpg(0, signal.SIGKILL)  # our process group (setsid): the program and the children it kept
    os._exit(0)  # as PID 1: the kernel kills everything left in the namespace
  if pidfd is not None:
    select.select([pidfd], [], [], left)
  else:
    time.sleep(min(left, 0.02))
report(event="exit", returncode=proc.returncode)
if not cfg["isolate"]:
  os.killpg(0, signal.SIGKILL)
os._exit(0)
"""

# The program's bootstrap, inside the sandbox: runs main.py as __main__ ('script'), or runs it and
# then answers calls to its entry point from the checker ('serve'). The codec is pasted in front.
_PROGRAM = r"""
import json, os, sys, traceback
cfg = json.loads(sys.argv[1])
if hasattr(sys, "set_int_max_str_digits"):
  sys.set_int_max_str_digits(0)
program = os.path.join(cfg["workdir"], "main.py")
sys.argv = [program]

def read_frame(f):
  head = f.read(4)
  if len(head) < 4:
    return None
  size = int.from_bytes(head, "big")
  data = f.read(size) if size <= cfg["max_frame"] else b""
  return data.decode("utf-8") if len(data) == size else None

def serve():
  ns = {"__name__": "__main__", "__file__": program, "__builtins__": __builtins__}
  with open(program, encoding="utf-8") as f:
    source = f.read()
  requests = os.fdopen(cfg["requests_fd"], "rb", 0)
  replies = os.fdopen(cfg["replies_fd"], "wb", 0)
  exec(compile(source, program, "exec"), ns)
  while True:
    msg = read_frame(requests)
    if msg is None:
      return
    try:
      fn = ns.get(cfg["entry_point"])
      if not callable(fn):
        raise NameError(f"the program defines no function {cfg['entry_point']!r}")
      args, kwargs = decode(msg)
      reply = encode(("ok", fn(*args, **kwargs)))
    except MemoryError:
      raise
    except Exception as e:
      reply = encode(("error", f"{type(e).__name__}: {e}"))
    data = reply.encode("utf-8")
    replies.write(len(data).to_bytes(4, "big") + data)

try:
  if cfg["mode"] == "serve":
    serve()
  else:
    import runpy
    runpy.run_path(program, run_name="__main__")
except MemoryError:
  try:
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
  finally:
    os._exit(%d)
""" % _EXIT_MEMORY

# The trusted checker, outside the sandbox: defines the check from trusted source (stdin), then
# calls check(candidate) with a proxy that forwards each call to the program. Exit 0 = passed.
_CHECKER = r"""
import json, os, sys
cfg = json.loads(sys.argv[1])
if hasattr(sys, "set_int_max_str_digits"):
  sys.set_int_max_str_digits(0)
requests = os.fdopen(cfg["requests_fd"], "wb", 0)
replies = os.fdopen(cfg["replies_fd"], "rb", 0)

class CandidateError(Exception):
  pass

def candidate(*args, **kwargs):
  data = encode((args, kwargs)).encode("utf-8")
  try:
    requests.write(len(data).to_bytes(4, "big") + data)
  except BrokenPipeError:
    raise CandidateError("the program ended before the checks did") from None
  head = replies.read(4)
  if len(head) < 4:
    raise CandidateError("the program ended (exit, crash or time limit) before answering")
  size = int.from_bytes(head, "big")
  if size > cfg["max_frame"]:
    raise CandidateError(f"the program's answer is over {cfg['max_frame']} bytes")
  data = replies.read(size)
  if len(data) < size:
    raise CandidateError("the program ended in the middle of an answer")
  reply = decode(data.decode("utf-8"))
  if not (isinstance(reply, tuple) and len(reply) == 2 and reply[0] in ("ok", "error")):
    raise CandidateError("malformed answer from the program")
  if reply[0] == "error":
    raise CandidateError(f"the program raised {reply[1]}")
  return reply[1]

ns = {"__name__": "__check__"}
exec(compile(sys.stdin.read(), "<check>", "exec"), ns)
# The entry point's own name also means the program's function, as when the check and the program
# share a module (HumanEval/33's tests call sort_third by name).
ns[cfg["entry_point"]] = candidate
ns["check"](candidate)
print("checks returned")
"""


def _codec_source() -> str:
  with open(sandbox_codec.__file__, encoding="utf-8") as f:
    return f.read()


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
  except (ProcessLookupError, PermissionError):
    pass  # already gone
  proc.wait()


@dataclasses.dataclass
class _Run:
  """One program started in the sandbox (or unsafely)."""
  proc: subprocess.Popen
  status_r: int
  out_path: str
  isolated: bool


def _start(code: str, root: str, *, mode: str, timeout_s: float, memory_mb: int,
           max_file_mb: int, max_processes: int, isolate: bool,
           serve_fds: tuple[int, int] | None = None, entry_point: str = "") -> _Run:
  status_r, status_w = os.pipe()
  as_root = os.geteuid() == 0
  python = _python()
  if isolate:
    covers, keep = _covers()
    workdir, uid = "/tmp", (SANDBOX_UID if as_root else 0)
  else:
    covers, keep = [], []
    workdir, uid = os.path.join(root, "work"), os.geteuid()
    os.mkdir(workdir)
  program_cfg = {"mode": mode, "workdir": workdir, "max_frame": MAX_FRAME_BYTES,
                 "entry_point": entry_point}
  pass_fds: list[int] = []
  if serve_fds is not None:
    program_cfg["requests_fd"], program_cfg["replies_fd"] = serve_fds
    pass_fds = list(serve_fds)
  argv = [python, "-I", "-B", "-c", _codec_source() + _PROGRAM, json.dumps(program_cfg)]
  if isolate:
    ids = [f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups"] if as_root else []
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
      "pass_fds": pass_fds}
  cmd = [python, "-I", "-S", "-B", "-c", _INIT, json.dumps(init_cfg)]
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
  return _Run(proc, status_r, out_path, isolate)


def _finish(run: _Run, timeout_s: float) -> tuple[dict, bool]:
  """Waits for the init (its own wall clock, plus a grace) and returns its last report and whether
  the parent's backstop had to kill it."""
  killed = False
  try:
    run.proc.wait(timeout=timeout_s + _GRACE_S)
  except subprocess.TimeoutExpired:
    killed = True
  _kill_group(run.proc)
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


def _check_args(timeout_s: float, memory_mb: int) -> None:
  if not timeout_s > 0 or memory_mb <= 0:
    raise ValueError(f"timeout_s={timeout_s} and memory_mb={memory_mb} must both be positive")


def _isolate_or_refuse(unsafe: bool | None) -> bool:
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
    run = _start("print('isolated')", root, mode="script", timeout_s=10, memory_mb=512,
                 max_file_mb=1, max_processes=16, isolate=True)
    events, _ = _finish(run, 10)
    output = _read_tail(run.out_path, 2000).strip()
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
  own: use run_checked to score untrusted code. Raises SandboxUnavailable when there is no
  isolation here and unsafe execution is off (`unsafe=None` follows set_unsafe_exec).
  """
  _check_args(timeout_s, memory_mb)
  isolate = _isolate_or_refuse(unsafe)
  start = time.monotonic()
  with tempfile.TemporaryDirectory(prefix="hamburger_sandbox_", ignore_cleanup_errors=True) as root:
    try:
      run = _start(code, root, mode="script", timeout_s=timeout_s, memory_mb=memory_mb,
                   max_file_mb=max_file_mb, max_processes=max_processes, isolate=isolate)
    except OSError as e:
      return SandboxResult(False, "error", f"could not start the sandbox process: {e}")
    events, killed = _finish(run, timeout_s)
    out_size = os.path.getsize(run.out_path)
    output = _read_tail(run.out_path, max_output_chars)
  status, note = _status(events, killed, out_size, timeout_s=timeout_s, memory_mb=memory_mb,
                         max_file_mb=max_file_mb)
  if note:
    output += "\n" + note
  return SandboxResult(status == "passed", status, output, time.monotonic() - start)


def run_checked(
    program: str,
    entry_point: str,
    check_source: str,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    *,
    max_output_chars: int = 8192,
    max_file_mb: int = 16,
    max_processes: int = 32,
    unsafe: bool | None = None,
) -> SandboxResult:
  """Scores untrusted `program` with trusted `check_source` (which defines check(candidate)).

  The program runs in the sandbox (module as __main__, then it serves calls to `entry_point`);
  check_source runs in a separate checker process outside it and calls check() with a proxy for
  the entry point. Passed means the checker's check() returned: the program cannot forge it.
  Otherwise the status says how the program ended ('failed', 'timeout', 'memory', 'error').
  """
  _check_args(timeout_s, memory_mb)
  isolate = _isolate_or_refuse(unsafe)
  start = time.monotonic()
  with tempfile.TemporaryDirectory(prefix="hamburger_sandbox_", ignore_cleanup_errors=True) as root:
    req_r, req_w = os.pipe()  # checker -> program
    rep_r, rep_w = os.pipe()  # program -> checker
    checker = None
    try:
      try:
        run = _start(program, root, mode="serve", timeout_s=timeout_s, memory_mb=memory_mb,
                     max_file_mb=max_file_mb, max_processes=max_processes, isolate=isolate,
                     serve_fds=(req_r, rep_w), entry_point=entry_point)
      finally:
        os.close(req_r)
        os.close(rep_w)
      checker_cfg = {"requests_fd": req_w, "replies_fd": rep_r, "max_frame": MAX_FRAME_BYTES,
                     "entry_point": entry_point}
      check_out = os.path.join(root, "checker.txt")
      with open(check_out, "wb") as out, tempfile.TemporaryFile() as source:
        source.write(check_source.encode("utf-8"))
        source.seek(0)
        checker = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", _codec_source() + _CHECKER,
             json.dumps(checker_cfg)],
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, stdin=source, stdout=out,
            stderr=subprocess.STDOUT, pass_fds=[req_w, rep_r], start_new_session=True)
    except OSError as e:
      return SandboxResult(False, "error", f"could not start the sandbox process: {e}")
    finally:
      os.close(req_w)
      os.close(rep_r)
    try:
      checker.wait(timeout=timeout_s + _GRACE_S)
    except subprocess.TimeoutExpired:
      pass
    _kill_group(checker)
    events, killed = _finish(run, timeout_s)
    out_size = os.path.getsize(run.out_path)
    output = _read_tail(run.out_path, max_output_chars)
    check_output = _read_tail(check_out, max_output_chars)
  if checker.returncode == 0:
    return SandboxResult(True, "passed", output, time.monotonic() - start)
  status, note = _status(events, killed, out_size, timeout_s=timeout_s, memory_mb=memory_mb,
                         max_file_mb=max_file_mb)
  if status == "passed":
    status = "failed"  # the program ended cleanly, but the checks did not return
  output += "\n[checker: the checks did not pass]\n" + check_output.rstrip()
  if note:
    output += "\n" + note
  return SandboxResult(False, status, output, time.monotonic() - start)
