"""The sandbox's trusted init (hamburger_jax/evaluation/sandbox.py): the first process of the new
namespaces. It makes the filesystem read-only, mounts the private /tmp and the masks, sets the
limits, starts the program with no capabilities, keeps the wall clock and reports on its own pipe
(which the program does not inherit).

`sandbox.start_program` runs this file by path, `python -I -S -B sandbox_child.py CONFIG_JSON`,
with the program's source on stdin: the base interpreter, without site-packages, so that it
imports the standard library only (never this package).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import resource
import select
import signal
import subprocess
import sys
import time
from typing import Callable

USAGE = ("usage: python -m hamburger_jax.evaluation.sandbox_child CONFIG_JSON < main.py\n"
         "The sandbox's init; sandbox.start_program starts it, as the first process of fresh "
         "namespaces.\n")
# Exit code when the program could not be started (reported as setup_error first).
EXIT_SETUP = 70

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME = 1 << 21
# statvfs f_flag bits -> the mount flags a remount must keep (locked flags may not be dropped).
_KEEP = ((2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME), (2048, MS_NODIRATIME),
         (4096, MS_RELATIME))


def mount(src: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
  enc = lambda s: None if s is None else os.fsencode(s)
  if _libc().mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mount {target}: {os.strerror(err)}")


def make_readonly(path: str) -> None:
  flags = os.statvfs(path).f_flag
  if not flags & 1:
    keep = sum(ms for st, ms in _KEEP if flags & st)
    # MS_BIND: change this mount's flag only, never the superblock (shared with the host).
    mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def mountpoints() -> list[str]:
  with open("/proc/self/mountinfo", "rb") as f:
    lines = f.read().splitlines()
  unescape = lambda m: bytes([int(m.group(1), 8)])
  return [os.fsdecode(re.sub(rb"\\([0-7]{3})", unescape, line.split()[4])) for line in lines]


def under(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip("/") + "/")


def setup(cfg: dict, code: bytes) -> None:
  """The filesystem of the fresh mount namespace: everything read-only, the private /tmp holding
  main.py, the masks, the interpreter's directories bound back under them."""
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


def limit(kind: int, soft: int, hard: int | None = None) -> None:
  hard = soft if hard is None else hard
  _, cap = resource.getrlimit(kind)
  if cap != resource.RLIM_INFINITY:
    soft, hard = min(soft, cap), min(hard, cap)
  resource.setrlimit(kind, (soft, hard))


@functools.cache
def _libc() -> ctypes.CDLL:
  return ctypes.CDLL(None, use_errno=True)


def start(cfg: dict) -> subprocess.Popen:
  """Reads the program from stdin, sets up its filesystem and limits and starts it."""
  code = sys.stdin.buffer.read()
  devnull = os.open("/dev/null", os.O_RDONLY)
  os.dup2(devnull, 0)
  if cfg["isolate"]:
    setup(cfg, code)
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
  return subprocess.Popen(cfg["argv"], env=cfg["env"], stdin=subprocess.DEVNULL,
                          pass_fds=cfg["pass_fds"], close_fds=True)


def supervise(cfg: dict, proc: subprocess.Popen, report: Callable[..., None]) -> None:
  """Waits for the program until the wall clock runs out; reports how it ended, then exits."""
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
        os.killpg(0, signal.SIGKILL)  # our group (setsid): the program and the children it kept
      os._exit(0)  # as PID 1: the kernel kills everything left in the namespace
    if pidfd is not None:
      select.select([pidfd], [], [], left)
    else:
      time.sleep(min(left, 0.02))
  report(event="exit", returncode=proc.returncode)
  if not cfg["isolate"]:
    os.killpg(0, signal.SIGKILL)
  os._exit(0)


def main(argv: list[str]) -> None:
  if len(argv) != 1 or argv[0].startswith("-"):
    sys.stdout.write(USAGE)
    raise SystemExit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
  cfg = json.loads(argv[0])
  status = os.fdopen(cfg["status_fd"], "w")

  def report(**kw) -> None:
    status.write(json.dumps(kw) + "\n")
    status.flush()

  # Default dispositions (inherited by the program): as PID 1 of its namespace, the init then gets
  # no signal from the program at all (the kernel drops them), and Python's SIGINT handler is gone.
  signal.signal(signal.SIGINT, signal.SIG_DFL)
  try:
    proc = start(cfg)
  except BaseException as e:  # pylint: disable=broad-exception-caught
    report(event="setup_error", message=f"{type(e).__name__}: {e}")
    os._exit(EXIT_SETUP)
  for fd in cfg["pass_fds"]:
    os.close(fd)
  report(event="started")
  supervise(cfg, proc, report)


if __name__ == "__main__":
  main(sys.argv[1:])
