"""A lost process of a multi-process training run: every other process ends in one line (which
process, the checkpoint to resume from), exit code 75, no C++ abort trace; the restart resumes
from that checkpoint and ends where an uninterrupted run ends.

The fast tests drive the supervisor (hamburger_jax/multiprocess.py) with stand-in children; the
slow ones kill a real process of a 2-process CPU run (gloo) with SIGKILL.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hamburger_jax import multiprocess
from hamburger_jax.config import ConfigError
from hamburger_jax.run_config import load_run_config, saved_steps
from train.main import parse_args, process_group
from test_training import (REPO, TINY, _Background, _checkpoint_steps, _free_port, _load_export,
                           _overrides, sub_env)  # noqa: F401  (sub_env: a fixture)

# Short enough for a quick test, long enough that a CPU shared by many busy processes does not
# starve the heartbeat threads into a false loss (at 5 s, a load of 30 on 2 cores did).
HEARTBEAT_S = 10
STEPS = 10
# The coordination service's reports as jax 0.10.2 prints them (its E and F lines, cut short):
# on process 0 when process 1 stopped sending heartbeats, and on process 1 when process 0 died.
UNHEALTHY = (
    "E1127 21:49:45.842700   10019 coordination_service.cc:1549] [1600] Use error polling to "
    "propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy "
    "(stopped sending heartbeats):\n1\nThe tasks have crashed.\n"
    "E1127 21:49:45.843151   10030 coordination_service_agent.cc:289] Polled an error from "
    "coordination service (this can be an error from this or another task).\n"
    "F1127 21:49:45.843906   10030 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors. This most likely indicates that another task died. "
    "absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n"
    "1\nThe tasks have crashed.\n*** Check failure stack trace: ***\n"
    "    @     0x7f32e3840634  absl::log_internal::LogMessage::SendToLog()\n")
COORDINATOR_GONE = (
    "E1127 21:48:51.869260    9264 coordination_service_agent.cc:289] Polled an error from "
    "coordination service (this can be an error from this or another task).\n"
    "F1127 21:48:51.869300    9264 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors.\nAdditional GRPC error information from remote target "
    "coordination_service while calling /xla.coordination.CoordinationService/PollForError:\n"
    ':UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}\n'
    "*** Check failure stack trace: ***\n")
# Orbax's async save on the survivor when the loss falls inside its commit: its barrier fails
# first (Python logging, cut short), then the runtime aborts on the service's report.
ORBAX_BARRIER = (
    "ERROR:absl:[process=0] Failed to run 4 Handler Commit operations or the Commit callback in "
    "background save thread, directory: /tmp/run/checkpoints/3\n"
    "Traceback (most recent call last):\n"
    "jax.errors.JaxRuntimeError: INTERNAL: Barrier failed because: task is set to ERROR: "
    "UNAVAILABLE: Task 1 heartbeat timeout.\n"
    "TimeoutError: Timed out while waiting for async_write_complete barrier.\n")
TRACE = re.compile(r"Check failure|terminate called|\*\*\* |Traceback|coordination_service")


# ----------------------------------------------------------------------------- the supervisor


def test_gate_passes_output_and_holds_from_the_first_report():
  gate = multiprocess.StderrGate()
  chunks = [b"loading\n", b"\r 1/9 steps", b"\r 2/9", b" steps\nE", b"rror: not a report\n",
            UNHEALTHY[:40].encode(), UNHEALTHY[40:].encode(), b"after\n"]
  shown = b"".join(gate.feed(c) for c in chunks)
  assert shown == b"loading\n\r 1/9 steps\r 2/9 steps\nError: not a report\n"
  assert gate.held == UNHEALTHY.encode() + b"after\n"
  assert gate.flush() == UNHEALTHY.encode() + b"after\n"
  mid_line = multiprocess.StderrGate()  # a report's prefix inside a line is no report
  first = UNHEALTHY.splitlines(keepends=True)[0].encode()
  assert mid_line.feed(b"x " + first) == b"x " + first and not mid_line.held


def test_gate_holds_from_an_orbax_barrier_error():
  gate = multiprocess.StderrGate()
  shown = gate.feed(b"step 3\n" + ORBAX_BARRIER.encode() + UNHEALTHY.encode())
  assert shown == b"step 3\n"
  assert gate.held == (ORBAX_BARRIER + UNHEALTHY).encode()
  other = multiprocess.StderrGate()  # another Python error log is no report
  assert other.feed(b"ERROR:absl:not a process report\n") == b"ERROR:absl:not a process report\n"
  assert multiprocess.lost_processes(ORBAX_BARRIER + UNHEALTHY, 0) == [1]


def test_reports_name_the_lost_process():
  assert multiprocess.lost_processes(UNHEALTHY, 0) == [1]
  assert multiprocess.lost_processes(UNHEALTHY.replace("\n1\n", "\n1\n2\n"), 0) == [1, 2]
  assert multiprocess.lost_processes(COORDINATOR_GONE, 1) == [0]
  assert multiprocess.lost_processes(UNHEALTHY.split("F1127")[0], 0) is None  # not fatal
  other = "F1127 1 client.h:80] Terminating process because the JAX distributed service " \
          "detected fatal errors. absl::Status: INTERNAL: Shutdown barrier has failed.\nmore"
  assert multiprocess.lost_processes(other, 1) is None
  assert multiprocess.fatal_status(other) == "INTERNAL: Shutdown barrier has failed. more"
  line = multiprocess.lost_line([1], 2, 20, 6, "gs://b/run/checkpoints", "")
  assert line == ("error: process 1 of 2 was lost (no heartbeat for 20 s); the last complete "
                  "checkpoint is step 6 in gs://b/run/checkpoints: start every process again "
                  "with the same command to resume from it")
  assert "process 0 runs the coordination service" in multiprocess.lost_line([0], 4, 20, 6, "d", "")
  assert "no checkpoint was complete in d" in multiprocess.lost_line([2], 4, 20, None, "d", "")
  assert "ended this run: INTERNAL" in multiprocess.lost_line(None, 2, 20, 6, "d", "INTERNAL")
  assert "checkpoints in d could not be listed (no route): start every process again with the " \
      "same command to resume from the latest" in multiprocess.lost_line([1], 2, 20, None, "d", "",
                                                                          "no route")


def test_the_line_names_the_step_a_restart_resumes_from(tmp_path: Path):
  """The last step orbax finished: a step folder still being written does not count."""
  for name in ("2", "5", "7.orbax-checkpoint-tmp-1795816180"):
    (tmp_path / "checkpoints" / name).mkdir(parents=True)
  group = multiprocess.ProcessGroup(2, 0, "127.0.0.1:1")
  assert multiprocess.describe_loss(UNHEALTHY, group, 5, str(tmp_path)) == (
      f"error: process 1 of 2 was lost (no heartbeat for 5 s); the last complete checkpoint is "
      f"step 5 in {tmp_path}/checkpoints: start every process again with the same command to "
      "resume from it")
  assert "no checkpoint was complete" in multiprocess.describe_loss(
      COORDINATOR_GONE, multiprocess.ProcessGroup(2, 1, "127.0.0.1:1"), 5, str(tmp_path / "x"))


def _child(code: str) -> list[str]:
  return [sys.executable, "-c", "import os, sys, time\n" + code]


def _supervise(code: str) -> tuple[int, str, list[str]]:
  sink, reports = io.BytesIO(), []
  rc = multiprocess.supervise(_child(code), sink,
                              lambda report: reports.append(report) or "error: LOST")
  return rc, sink.getvalue().decode(), reports


def test_a_child_dying_of_a_report_ends_in_the_line():
  rc, shown, reports = _supervise(
      f"sys.stderr.write('step 1\\n'); sys.stderr.write({UNHEALTHY!r}); sys.stderr.flush()\n"
      "os.abort()")
  assert rc == multiprocess.LOST_EXIT
  assert shown == "step 1\nerror: LOST\n"
  assert reports == [UNHEALTHY]
  rc, shown, _ = _supervise(f"sys.stderr.write({UNHEALTHY!r}); sys.exit(1)")
  assert (rc, shown) == (multiprocess.LOST_EXIT, "error: LOST\n")  # its words, then a failure
  rc, shown, reports = _supervise(  # a save's failed barrier first
      f"sys.stderr.write({ORBAX_BARRIER!r}); sys.stderr.flush(); time.sleep(0.2)\n"
      f"sys.stderr.write({UNHEALTHY!r}); sys.stderr.flush(); os.abort()")
  assert (rc, shown, reports) == (multiprocess.LOST_EXIT, "error: LOST\n",
                                  [ORBAX_BARRIER + UNHEALTHY])


@pytest.mark.parametrize("end,want", [("sys.exit(0)", 0), ("sys.exit(3)", 3),
                                      ("os.kill(os.getpid(), 9)", 128 + 9)])
def test_a_child_ending_otherwise_keeps_its_output_and_status(end: str, want: int):
  """A report that does not end the child (or a child that ends for another reason) hides
  nothing: everything it wrote is shown, and its own exit status is the supervisor's."""
  rc, shown, reports = _supervise(
      f"sys.stderr.write('a\\n' + {UNHEALTHY.split('F1127')[0]!r} + 'b\\n'); sys.stderr.flush()\n"
      + end)
  assert (rc, reports) == (want, [])
  assert shown == "a\n" + UNHEALTHY.split("F1127")[0] + "b\n"
  rc, shown, _ = _supervise(f"sys.stderr.write({UNHEALTHY!r}); sys.exit(0)")
  assert (rc, shown) == (0, UNHEALTHY)  # a run that ends well after all: nothing lost
  rc, shown, _ = _supervise("sys.stderr.write('Traceback: boom\\n'); os.abort()")
  assert (rc, shown) == (128 + signal.SIGABRT, "Traceback: boom\n")


class _Writes(io.BytesIO):
  def __init__(self):
    super().__init__()
    self.writes = []

  def write(self, data: bytes) -> int:
    if data:
      self.writes.append(data)
    return super().write(data)


def test_a_report_that_no_abort_follows_is_printed_while_the_child_runs(
    monkeypatch: pytest.MonkeyPatch):
  """A warning of the coordination service in a healthy run holds the output back for
  HOLD_S at most, not until the run ends."""
  monkeypatch.setattr(multiprocess, "HOLD_S", 0.3)
  warning = UNHEALTHY.split("\n")[0] + "\n"
  sink = _Writes()
  rc = multiprocess.supervise(_child(
      f"sys.stderr.write({warning!r}); sys.stderr.flush(); time.sleep(3)\n"
      "sys.stderr.write('after\\n')"), sink, str)
  assert rc == 0
  assert sink.writes == [warning.encode(), b"after\n"]


@pytest.mark.parametrize("to_group", [False, True], ids=["sigterm", "ctrl-c"])
def test_a_stop_signal_reaches_the_child_once(to_group: bool):
  """A scheduler's SIGTERM to the supervisor, or a terminal's Ctrl-C (SIGINT to the process
  group), lets the training child save and stop, once."""
  code = ("import signal\nn = []\nfor s in (signal.SIGTERM, signal.SIGINT):\n"
          "  signal.signal(s, lambda *a: n.append(1))\n"
          "sys.stderr.write('ready\\n'); sys.stderr.flush()\n"
          "while not n: time.sleep(0.01)\ntime.sleep(0.3)\n"
          "sys.stderr.write(f'stopping after {len(n)}\\n'); sys.exit(0)")
  script = ("import io, sys\nfrom hamburger_jax import multiprocess\n"
            f"sys.exit(multiprocess.supervise({_child(code)!r}, sys.stderr.buffer, str))")
  with subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stderr=subprocess.PIPE,
                        text=True, start_new_session=True) as proc:
    try:
      assert proc.stderr.readline() == "ready\n"
      if to_group:
        os.killpg(proc.pid, signal.SIGINT)
      else:
        proc.send_signal(signal.SIGTERM)
      _, err = proc.communicate(timeout=30)
    finally:
      proc.kill()  # the child dies with it
    assert (proc.returncode, err) == (0, "stopping after 1\n")


GLOO_PEER_GONE = ("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] "
                  "Connection closed by peer [127.0.0.1]:22946")


def test_a_collective_that_lost_its_peer_waits_for_the_report(monkeypatch: pytest.MonkeyPatch):
  """gloo notices a dead peer at once; its error waits (for the service's report, which ends
  the process) and is raised if the process outlives the wait. Other errors are raised at once."""
  waits = []
  monkeypatch.setattr(multiprocess, "await_report", waits.append)
  reset = RuntimeError("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc"
                       ":538] Read error [127.0.0.1]:12009: Connection reset by peer")
  for error, waited in ((ValueError(GLOO_PEER_GONE), [7]), (reset, [7]),
                        (ValueError("Gloo: bad shape"), []), (KeyError("x"), [])):
    waits.clear()
    with pytest.raises(type(error)) as raised:
      with multiprocess.peer_loss_awaits_report(7):
        raise error
    assert raised.value is error and waits == waited


def test_heartbeat_timeout_setting():
  assert load_run_config(TINY).distributed.heartbeat_timeout_s == 20  # a pod's default
  assert load_run_config(TINY, ["distributed.heartbeat_timeout_s=5"]).distributed \
      .heartbeat_timeout_s == 5
  with pytest.raises(ConfigError, match="distributed.heartbeat_timeout_s=1 must be >= 2"):
    load_run_config(TINY, ["distributed.heartbeat_timeout_s=1"])


def test_a_multi_process_run_needs_every_process_named(monkeypatch: pytest.MonkeyPatch):
  for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(name, raising=False)
  flags = ["--config", TINY, "--num-processes", "2", "--coordinator", "10.0.0.1:8476"]
  assert process_group(parse_args(flags[:2])) is None
  assert process_group(parse_args([*flags, "--process-id", "1"])) == multiprocess.ProcessGroup(
      2, 1, "10.0.0.1:8476")
  with pytest.raises(SystemExit, match="needs each one's --process-id"):
    process_group(parse_args(flags))
  with pytest.raises(SystemExit, match="process id 2 is not one of the run's processes 0..1"):
    process_group(parse_args([*flags, "--process-id", "2"]))
  monkeypatch.setenv("JAX_PROCESS_ID", "x")
  with pytest.raises(SystemExit, match="process id x is not one"):
    process_group(parse_args(flags))


# ----------------------------------------------------------------------------- real processes


def _start(run_dir: Path, data_dir: str, env: dict[str, str], logs: Path) -> list[_Background]:
  """The 2 processes of a STEPS-step run saving every step, as launch_local.sh starts them."""
  sets = [a for o in _overrides(data_dir, run_dir, {
      "train.steps": STEPS, "checkpoint.every": 1,
      "distributed.heartbeat_timeout_s": HEARTBEAT_S}) for a in ("--set", o)]
  port = str(_free_port())
  return [_Background([sys.executable, "-m", "train.main", "--config", TINY, "--no-progress",
                       "--cpu-devices", "1", "--num-processes", "2", "--process-id", str(i),
                       "--coordinator", f"127.0.0.1:{port}", *sets], env, logs / str(i))
          for i in range(2)]


def _finish(procs: list[_Background], timeout: float) -> list[subprocess.CompletedProcess]:
  try:
    return [p.result(timeout) for p in procs]
  finally:
    for p in procs:
      p.stop()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, tiny_data_dir: str,
                  sub_env) -> Path:
  run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
  done = _finish(_start(run_dir, tiny_data_dir, sub_env, run_dir.parent / "logs"), 400)
  assert [p.returncode for p in done] == [0, 0], done[0].stderr[-3000:] + done[1].stderr[-3000:]
  return run_dir


def _kill_after_a_checkpoint(run_dir: Path, tiny_data_dir: str, env: dict[str, str],
                             victim: int, logs: Path) -> tuple[subprocess.CompletedProcess, float]:
  """Kills process `victim` (SIGKILL: no chance to say goodbye) once step 2 is saved; returns
  the other's result and its seconds from the kill to its end."""
  procs = _start(run_dir, tiny_data_dir, env, logs)
  try:
    deadline = time.monotonic() + 300
    while not [s for s in _checkpoint_steps(run_dir / "checkpoints") if s >= 2]:
      assert all(p.proc.poll() is None for p in procs), "a process ended before the kill"
      assert time.monotonic() < deadline, "no checkpoint at step >= 2 in time"
      time.sleep(0.02)
    os.kill(procs[victim].proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    survivor = procs[1 - victim].result(HEARTBEAT_S + 60)
    return survivor, time.monotonic() - killed
  finally:
    for p in procs:
      p.stop()


def _assert_one_line(survivor: subprocess.CompletedProcess, seconds: float, lost: str,
                     run_dir: Path) -> int:
  """The survivor ended in time with the one line naming `lost` and the last complete
  checkpoint, and nothing of the runtime's abort; returns that checkpoint's step."""
  assert survivor.returncode == multiprocess.LOST_EXIT, survivor.stderr[-5000:]
  assert seconds < HEARTBEAT_S + 30, seconds
  assert not TRACE.search(survivor.stderr), survivor.stderr[-5000:]
  lines = [l for l in survivor.stderr.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and survivor.stderr.rstrip().endswith(lines[0]), survivor.stderr[-3000:]
  found = re.fullmatch(rf"error: process {lost} of 2 was lost \(.*\); the last complete checkpoint "
                       rf"is step (\d+) in {re.escape(str(run_dir / 'checkpoints'))}: start every "
                       r"process again with the same command to resume from it", lines[0])
  assert found, lines[0]
  step = int(found.group(1))
  assert step == max(saved_steps(str(run_dir))) and 2 <= step < STEPS
  return step


@pytest.mark.slow  # three 2-process runs: ~3 min on 2 cores
def test_a_lost_process_ends_the_other_in_one_line_and_the_restart_is_exact(
    uninterrupted: Path, tiny_data_dir: str, tmp_path: Path, sub_env):
  run_dir = tmp_path / "run"
  survivor, seconds = _kill_after_a_checkpoint(run_dir, tiny_data_dir, sub_env, 1,
                                               tmp_path / "killed")
  step = _assert_one_line(survivor, seconds, "1", run_dir)
  assert f"no heartbeat for {HEARTBEAT_S} s" in survivor.stderr
  assert not (run_dir / "export").exists(), "the run finished before the kill"

  restarted = _finish(_start(run_dir, tiny_data_dir, sub_env, tmp_path / "restarted"), 400)
  for p in restarted:
    assert p.returncode == 0, p.stderr[-5000:]
    assert re.search(r"resumed from step (\d+)", p.stdout).group(1) == str(step)
  got, want = _load_export(run_dir / "export"), _load_export(uninterrupted / "export")
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.slow  # a 2-process run: ~1 min on 2 cores
def test_losing_the_coordinator_ends_the_other_in_one_line(tiny_data_dir: str, tmp_path: Path,
                                                           sub_env):
  """Process 0 runs the coordination service: the others lose it at once, not a heartbeat
  timeout later."""
  run_dir = tmp_path / "run"
  survivor, seconds = _kill_after_a_checkpoint(run_dir, tiny_data_dir, sub_env, 0,
                                               tmp_path / "killed")
  _assert_one_line(survivor, seconds, "0", run_dir)
  assert "process 0 runs the coordination service" in survivor.stderr
