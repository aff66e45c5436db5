"""A command in its own process, its output read line by line as it prints, stopped after a cap
of seconds with every process it started: what the accelerator check's parts and the commands
they run share (infer/accelerator_check.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
from typing import Iterator, Sequence


class Capped:
  """`cmd` run once by `lines()`, stopped at `seconds` (None: never). `own_group` (the default):
  in a process group of its own, so that stopping it stops what it started too (pytest's
  workers would otherwise go on using the device under the next command); False: in this
  process's group, so that whatever stops this process stops it too (a stop at `seconds` kills
  it alone). After `lines()` is exhausted: `code` (the exit code; None when it was stopped) and
  `stderr` (all of it; kept in a file, not a pipe, so that a command writing much there never
  blocks)."""

  def __init__(self, cmd: Sequence[str], seconds: float | None = None,
               env: dict[str, str] | None = None, own_group: bool = True):
    self.cmd, self.seconds, self.env, self.own_group = list(cmd), seconds, env, own_group
    self.code: int | None = None
    self.stderr = ""

  def lines(self) -> Iterator[str]:
    """stdout a line at a time (each with its newline) as the command prints it; a caller that
    stops reading early stops the command."""
    stopped = threading.Event()
    with tempfile.TemporaryFile(mode="w+") as err:
      with subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                            env=self.env, start_new_session=self.own_group) as proc:
        end = (lambda: kill_group(proc)) if self.own_group else proc.kill

        def stop() -> None:
          stopped.set()
          end()

        timer = threading.Timer(self.seconds, stop) if self.seconds is not None else None
        if timer is not None:
          timer.start()
        try:
          yield from proc.stdout
          proc.wait()
        finally:
          if timer is not None:
            timer.cancel()
          if proc.poll() is None:  # the caller stopped reading: the command stops too
            end()
      self.code = None if stopped.is_set() else proc.returncode
      err.seek(0)
      self.stderr = err.read()


def kill_group(proc: subprocess.Popen) -> None:
  """Kills the process group `proc` leads (started with start_new_session), if still there.
  Does not reap `proc`: a caller that does not leave `with Popen` waits for it."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass  # already gone (a group whose processes changed user id is not ours to signal either)


def run_capped(cmd: Sequence[str], seconds: float | None,
               env: dict[str, str] | None = None) -> tuple[int | None, str, str]:
  """Runs `cmd` for at most `seconds`: (exit code, or None when stopped; stdout; stderr), what
  it printed before a stop included."""
  run = Capped(cmd, seconds, env)
  out = "".join(run.lines())
  return run.code, out, run.stderr
