"""A run of several training processes (jax.distributed, joined by train/main.py) that ends in
one line when one of them is lost.

When a process stops sending heartbeats for distributed.heartbeat_timeout_s, jax's coordination
service tells every other process, whose runtime then aborts from its own C++ thread with a
check-failure trace. jax 0.10.2 gives Python no say in that: the client's
missed_heartbeat_callback cannot take a Python function (calling it converts an absl::Status,
which has no Python form: std::bad_cast, then terminate). So each process of such a run trains
in a child of a small supervisor (`supervise`) that passes the child's stderr through, holds back
what follows the service's first report, and when the child dies of that report prints one line
instead: which process was lost and the checkpoint to resume from (exit code LOST_EXIT). A child
that ends any other way gets its held-back output printed and its exit status passed on.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import select
import signal
import subprocess
import time
from typing import BinaryIO, Callable, Iterator

# EX_TEMPFAIL: the run did not fail by itself; starting every process again resumes it.
LOST_EXIT = 75
# Set in the supervised child, which trains instead of supervising again.
SUPERVISED_ENV = "HAMBURGER_JAX_SUPERVISED"
# The coordination service's reports on stderr (absl log lines: severity, date, time, thread,
# file:line]): the first one starts what the supervisor holds back. The preemption notices come
# first when process 0, which runs the service, is gone. Orbax's multi-process errors (Python
# logging, "[process=N]") can come first too: an async save's commit waits at a barrier that
# fails, with a traceback, the moment the service declares the loss.
_REPORT = re.compile(rb"^([EFW]\d{4} [\d:.]+\s+\d+ "
                     rb"(coordination_service\w*\.cc|client\.h|preemption_sync_manager\.cc):\d+\]"
                     rb"|ERROR:absl:\[process=\d+\])")
# The runtime aborts within milliseconds of its first report; held output that no abort follows
# within this long is printed after all, and the gate opens again.
HOLD_S = 10.0
# The runtime's last words before it aborts on such a report (xla client.h).
_FATAL = "Terminating process because the JAX distributed service detected fatal errors"
_UNHEALTHY = re.compile(r"unhealthy \(stopped sending heartbeats\):\s*((?:\d+\s*)+)")
_TIMED_OUT = re.compile(r"Task (\d+) heartbeat timeout")
# An RPC to the coordination service that found nobody there (gRPC status 14: UNAVAILABLE).
_SERVICE_GONE = re.compile(
    r"grpc_status:\s*14|Socket closed|[Ff]ailed to connect|Connection refused")
# A cross-process collective (gloo on CPU) whose peer went away mid-transfer.
_PEER_GONE = re.compile(r"Gloo .*(Connection (closed|reset) by peer|Broken pipe)", re.S)
# How long past the heartbeat timeout a process whose collective lost its peer waits for the
# service's report before it reports the collective's error itself.
_VERDICT_MARGIN_S = 10.0
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
  num_processes: int
  process_id: int
  coordinator: str  # host:port where process 0 runs the coordination service


def supervised() -> bool:
  return os.environ.get(SUPERVISED_ENV) == "1"


def is_peer_loss(error: BaseException) -> bool:
  """An error of a collective whose peer process went away (the coordination service reports
  the loss once the heartbeat timeout has passed)."""
  return bool(_PEER_GONE.search(str(error)))


def await_report(heartbeat_timeout_s: float) -> None:
  time.sleep(heartbeat_timeout_s + _VERDICT_MARGIN_S)


@contextlib.contextmanager
def peer_loss_awaits_report(heartbeat_timeout_s: int) -> Iterator[None]:
  """In a supervised process: an error of a collective whose peer went away (gloo notices at
  once) waits for the coordination service to report the lost process, which ends this process
  and lets the supervisor print its line instead of the error; an error that outlives the wait
  is this process's own, and is raised."""
  try:
    yield
  except Exception as e:
    if is_peer_loss(e):
      await_report(heartbeat_timeout_s)
    raise


def lost_processes(report: str, process_id: int) -> list[int] | None:
  """The processes that the coordination service's `report` says were lost; None when it is no
  such report or names none. A process other than 0 that can no longer reach the service has
  lost process 0, which runs it."""
  if _FATAL not in report:
    return None
  found = _UNHEALTHY.search(report)
  if found:
    return [int(t) for t in found.group(1).split()]
  ids = sorted({int(t) for t in _TIMED_OUT.findall(report)})
  if ids:
    return ids
  return [0] if process_id != 0 and _SERVICE_GONE.search(report) else None


def fatal_status(report: str) -> str:
  """The status the runtime aborted on, on one line (what to print when it names no lost
  process)."""
  tail = report[report.index(_FATAL):] if _FATAL in report else report
  status = tail.split("absl::Status:", 1)[1] if "absl::Status:" in tail else tail
  return " ".join(status.split())[:300]


def lost_line(lost: list[int] | None, num_processes: int, heartbeat_timeout_s: int,
              checkpoint: int | None, ckpt_dir: str, status: str,
              unreadable: str = "") -> str:
  """The one line a surviving process ends with (`unreadable`: why `ckpt_dir` could not be
  listed)."""
  if lost is None:
    what = f"the coordination service ended this run: {status}"
  else:
    what = (f"process{'es' if len(lost) > 1 else ''} {', '.join(map(str, lost))} of "
            f"{num_processes} {'were' if len(lost) > 1 else 'was'} lost " +
            ("(process 0 runs the coordination service, which stopped answering)" if 0 in lost
             else f"(no heartbeat for {heartbeat_timeout_s} s)"))
  if unreadable:
    resume = (f"its checkpoints in {ckpt_dir} could not be listed ({unreadable}): start every "
              "process again with the same command to resume from the latest")
  elif checkpoint is not None:
    resume = (f"the last complete checkpoint is step {checkpoint} in {ckpt_dir}: start every "
              "process again with the same command to resume from it")
  else:
    resume = (f"no checkpoint was complete in {ckpt_dir}: starting every process again starts "
              "the run over")
  return f"error: {what}; {resume}"


class StderrGate:
  """Passes a child's stderr through until a coordination-service report, and holds everything
  from there on (`held`) until `release`. A line that starts like a report (E, F or W at a line
  start) waits for its end before it passes; other text passes at once (progress bars too)."""
  MAX_PENDING = 4096  # a longer unfinished line is no report: it passes

  def __init__(self):
    self.held = b""
    self.held_since = 0.0  # time.monotonic() when the hold began
    self._pending = b""  # the unfinished start of a line that may be a report
    self._at_line_start = True

  def feed(self, data: bytes) -> bytes:
    """`data` read from the child; returns what to print now."""
    if self.held:
      self.held += data
      return b""
    out, data, self._pending = b"", self._pending + data, b""
    while data:
      ends = [i for i in (data.find(b"\n"), data.find(b"\r")) if i >= 0]
      end = min(ends) + 1 if ends else len(data)
      if (self._at_line_start and data[:1] in (b"E", b"F", b"W") and not ends
          and len(data) < self.MAX_PENDING):
        self._pending = data  # too early to tell
        break
      line, data = data[:end], data[end:]
      if self._at_line_start and _REPORT.match(line):
        self.held, self.held_since = line + data, time.monotonic()
        break
      out += line
      self._at_line_start = bool(ends)
    return out

  def release(self) -> bytes:
    """What is held (to print when no abort followed), the gate open again."""
    out, self.held = self.held, b""
    self._at_line_start = out.endswith((b"\n", b"\r"))
    return out

  def flush(self) -> bytes:
    """What is held or pending (to print when the child ended some other way)."""
    out, self._pending = self.release() + self._pending, b""
    return out


def _die_with_parent() -> None:
  """In the child before it execs: Linux kills it when the supervisor dies (a host that goes
  down takes both; a supervisor killed alone must not leave a trainer without a terminal)."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):
    pass  # not Linux: the child outlives a killed supervisor


def supervise(cmd: list[str], sink: BinaryIO, on_lost: Callable[[str], str]) -> int:
  """Runs `cmd` (this process's training, in a child) with its stderr through a StderrGate into
  `sink`. The child stays in this process group, so a terminal's Ctrl-C or hangup reaches it
  directly (this process waits for it); a SIGTERM sent to this process (a scheduler's) is passed
  on. A child that
  dies of a coordination-service report: `on_lost(report)` is the line printed instead of the
  report, and the exit code is LOST_EXIT; otherwise the child's own exit code (128 + signal
  for a signal), its output all printed (a report that no abort follows, after HOLD_S)."""
  env = {**os.environ, SUPERVISED_ENV: "1"}
  proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
  # Set after the child started, which keeps the default handlers (Python's KeyboardInterrupt).
  previous = {signal.SIGINT: signal.signal(signal.SIGINT, lambda *_: None),
              signal.SIGHUP: signal.signal(signal.SIGHUP, lambda *_: None),
              signal.SIGTERM: signal.signal(signal.SIGTERM, lambda n, _: proc.send_signal(n))}
  gate, fd = StderrGate(), proc.stderr.fileno()
  try:
    while True:
      if not select.select([fd], [], [], 1.0 if gate.held else None)[0]:
        if time.monotonic() - gate.held_since > HOLD_S:
          sink.write(gate.release())
          sink.flush()
        continue
      if not (chunk := os.read(fd, 1 << 16)):
        break
      sink.write(gate.feed(chunk))
      sink.flush()
    code = proc.wait()
    proc.stderr.close()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  report = gate.held.decode(errors="replace")
  if code != 0 and _FATAL in report:
    sink.write(on_lost(report).encode() + b"\n")
    code = LOST_EXIT
  else:
    sink.write(gate.flush())
    code = code if code >= 0 else 128 - code
  sink.flush()
  return code


def describe_loss(report: str, group: ProcessGroup, heartbeat_timeout_s: int,
                  run_dir: str) -> str:
  """lost_line for a coordination-service `report`, with the last checkpoint of the run in
  `run_dir` (checkpoint.dir) that orbax finished writing: the one a restart resumes from."""
  from hamburger_jax.run_config import checkpoints_dir, saved_steps  # pylint: disable=C0415
  last, unreadable = None, ""
  try:
    last = max(saved_steps(run_dir) or (), default=None)
  except OSError as e:  # the line still names the lost process
    unreadable = " ".join(str(e).split())[:200]
  return lost_line(lost_processes(report, group.process_id), group.num_processes,
                   heartbeat_timeout_s, last, checkpoints_dir(run_dir), fatal_status(report),
                   unreadable)
