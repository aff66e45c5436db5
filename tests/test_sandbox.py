"""The OS sandbox for model code (evaluation.sandbox, checked_run): each escape a review found
must fail. Files outside cannot be written or deleted, forks stay inside a process limit
and die with the run, a setsid child does not outlive it, there is no network, the parent's
environment and home cannot be read, and a faked pass (pass marker + os._exit(0), an object equal to
everything) is scored as a fail. The loop and memory-bomb cases are in test_evaluation.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from hamburger_jax.evaluation import checked_run, sandbox, sandbox_codec, tasks

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _isolated() -> None:
  ok, reason = sandbox.isolation_status()
  assert ok, f"no OS sandbox on this machine: {reason}"


@pytest.fixture
def probe_dir():
  """A world-writable directory the sandbox can see (not under /tmp, which it replaces), holding
  a world-writable file: only the sandbox, not file permissions, can stop writes and deletes."""
  parent = REPO / ".pytest_cache"
  parent.mkdir(exist_ok=True)
  path = Path(tempfile.mkdtemp(prefix="sandbox-probe-", dir=parent))
  path.chmod(0o777)
  victim = path / "victim.txt"
  victim.write_text("keep me")
  victim.chmod(0o666)
  try:
    yield path
  finally:
    shutil.rmtree(path, ignore_errors=True)


def _token() -> str:
  return f"sandbox-run-{os.getpid()}-{time.monotonic_ns()}"


def _tagged(code: str, token: str) -> str:
  """`code` re-executed with `token` in its argv: every process it forks carries the token in
  its command line, so the test can find what outlived the run."""
  return ("import os, sys\n"
          "if sys.argv[1:] != [%r]:\n"
          "  os.execv(sys.executable, [sys.executable, '-I', __file__, %r])\n" % (token, token)
          ) + code


def _attempts(*lines: str) -> str:
  """A program that runs each `label: expression` and prints `label OK` or `label BLOCKED`."""
  body = ["import glob, importlib, os, posix, shutil, socket, subprocess, sys, time",
          "def attempt(label, fn):",
          "  try:",
          "    fn()",
          "    print(label, 'OK', flush=True)",
          "  except BaseException as e:",
          "    print(label, 'BLOCKED', type(e).__name__, e, flush=True)"]
  for line in lines:
    label, expr = line.split(":", 1)
    body.append(f"attempt({label.strip()!r}, lambda: {expr.strip()})")
  return "\n".join(body) + "\n"


def _outcomes(output: str) -> dict[str, str]:
  return {parts[0]: parts[1] for parts in (line.split(" ", 2) for line in output.splitlines())
          if len(parts) >= 2 and parts[1] in ("OK", "BLOCKED")}


def _pids_with(token: str) -> list[int]:
  """Host processes whose command line holds `token`: this test's own, not those of a sandbox
  run another pytest worker has going at the same time (both run as the sandbox user)."""
  pids = []
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/cmdline", "rb") as f:
          if token.encode() in f.read():
            pids.append(int(name))
      except OSError:
        pass
  return pids


def test_files_outside_cannot_be_written(probe_dir: Path) -> None:
  host_tmp = Path("/tmp") / f"sandbox-escape-{os.getpid()}.txt"
  code = _attempts(
      f"probe: open({str(probe_dir / 'evil.txt')!r}, 'w').write('x')",
      f"mkdir: os.mkdir({str(probe_dir / 'evil_dir')!r})",
      f"host_tmp: open({str(host_tmp)!r}, 'w').write('x')",
      "dev_shm: open('/dev/shm/sandbox-evil', 'w').write('x')",
      "var_tmp: open('/var/tmp/sandbox-evil', 'w').write('x')",
      "private_tmp: open('/tmp/scratch.txt', 'w').write('x')")
  result = sandbox.run_python(code, timeout_s=10)
  assert result.passed, result.output
  outcomes = _outcomes(result.output)
  assert outcomes == {"probe": "BLOCKED", "mkdir": "BLOCKED", "host_tmp": "OK",
                      "dev_shm": "BLOCKED", "var_tmp": "BLOCKED", "private_tmp": "OK"}, \
      result.output
  # Writes to /tmp land in the program's private tmpfs, gone with it.
  assert not host_tmp.exists()
  assert sorted(p.name for p in probe_dir.iterdir()) == ["victim.txt"]
  assert not os.path.exists("/dev/shm/sandbox-evil") and not os.path.exists(
      "/var/tmp/sandbox-evil")


def test_files_outside_cannot_be_deleted(probe_dir: Path) -> None:
  victim = str(probe_dir / "victim.txt")
  code = _attempts(
      f"os_unlink: os.unlink({victim!r})",
      f"posix_unlink: posix.unlink({victim!r})",
      f"reloaded_unlink: importlib.reload(os).remove({victim!r})",
      f"rename: os.rename({victim!r}, {victim + '.moved'!r})",
      f"truncate: open({victim!r}, 'w').close()",
      f"rmtree: shutil.rmtree({str(probe_dir)!r})",
      f"rm: subprocess.run(['rm', '-r', {str(probe_dir)!r}], check=True)")
  result = sandbox.run_python(code, timeout_s=10)
  assert result.passed, result.output
  assert set(_outcomes(result.output).values()) == {"BLOCKED"}, result.output
  assert (probe_dir / "victim.txt").read_text() == "keep me"


@pytest.mark.parametrize("fork", ["os.fork()", "posix.fork()", "importlib.reload(os).fork()"])
def test_fork_bomb_is_contained(fork: str) -> None:
  bomb = ("import importlib, os, posix\n"
          "while True:\n"
          "  try:\n"
          f"    {fork}\n"
          "  except OSError:\n"
          "    pass\n")
  token = _token()
  start = time.monotonic()
  result = sandbox.run_python(_tagged(bomb, token), timeout_s=2)
  assert result.status == "timeout" and time.monotonic() - start < 8
  assert _pids_with(token) == [], "processes of the run outlived it"


def test_each_run_has_a_user_of_its_own() -> None:
  if os.geteuid() != 0:
    pytest.skip("runs change user only when the caller is root")
  uids = []
  for _ in range(2):
    result = sandbox.run_python("import os\nprint(os.getuid(), os.getgid())\n", timeout_s=10)
    assert result.passed, result.output
    uid, gid = map(int, result.output.split()[:2])
    assert uid == gid >= sandbox.SANDBOX_UID_BASE
    uids.append(uid)
  assert uids[0] != uids[1]


def test_a_fork_bomb_does_not_spend_a_concurrent_run_s_process_limit() -> None:
  """RLIMIT_NPROC counts a user's processes host-wide: a run beside a fork bomb still forks."""
  bomb = ("import os\n"
          "while True:\n"
          "  try:\n"
          "    os.fork()\n"
          "  except OSError:\n"
          "    pass\n")
  ended = []
  thread = threading.Thread(
      target=lambda: ended.append(sandbox.run_python(bomb, timeout_s=4, max_processes=16)))
  thread.start()
  time.sleep(1.0)  # the bomb holds its 16 processes by now
  code = ("import os\n"
          "pids = [os.fork() for _ in range(4)]\n"
          "if 0 in pids:\n"
          "  os._exit(0)\n"
          "for p in pids:\n"
          "  os.waitpid(p, 0)\n"
          "print('forked', len(pids))\n")
  result = sandbox.run_python(code, timeout_s=10, max_processes=16)
  thread.join()
  assert result.passed and "forked 4" in result.output, result.output
  assert ended and ended[0].status == "timeout"


def test_process_limit() -> None:
  # Sleeping children (the CPU limit does not stop them): the count stops at max_processes.
  code = ("import os, time\n"
          "n = 0\n"
          "for _ in range(500):\n"
          "  try:\n"
          "    if os.fork() == 0:\n"
          "      time.sleep(30)\n"
          "      os._exit(0)\n"
          "    n += 1\n"
          "  except OSError:\n"
          "    break\n"
          "print('children', n)\n")
  token = _token()
  result = sandbox.run_python(_tagged(code, token), timeout_s=10, max_processes=16)
  assert result.passed, result.output
  assert int(result.output.split()[1]) < 16
  assert _pids_with(token) == [], "sleeping children outlived the run"


@pytest.mark.parametrize("ending", ["print('returning')", "time.sleep(60)"])
def test_setsid_child_dies_with_the_run(probe_dir: Path, ending: str) -> None:
  token = _token()
  late_file = probe_dir / "written_later.txt"
  # The escapee: a detached process, recognisable by its command line, that writes later.
  escapee = f"import time; time.sleep(1); open({str(late_file)!r}, 'w'); time.sleep(60)"
  code = (
      "import os, sys, time\n"
      "if os.fork() == 0:\n"
      "  os.setsid()\n"
      "  if os.fork() == 0:\n"
      f"    os.execv(sys.executable, [sys.executable, '-c', {escapee!r}, {token!r}])\n"
      "  os._exit(0)\n"
      "time.sleep(0.3)\n"
      f"{ending}\n")
  result = sandbox.run_python(code, timeout_s=2)
  assert result.status == ("passed" if "print" in ending else "timeout"), result.output
  assert _pids_with(token) == [], "a setsid child outlived the run"
  time.sleep(1.5)
  assert not late_file.exists()


def test_no_network() -> None:
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(1)
  listener.setblocking(False)
  port = listener.getsockname()[1]
  try:
    code = _attempts(
        f"loopback: socket.create_connection(('127.0.0.1', {port}), timeout=2)",
        "outbound_tcp: socket.create_connection(('1.1.1.1', 53), timeout=2)",
        "outbound_udp: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', "
        "('8.8.8.8', 53))",
        "dns: socket.getaddrinfo('example.com', 80)")
    code += "print('interfaces', [name for _, name in socket.if_nameindex()])\n"
    result = sandbox.run_python(code, timeout_s=10)
    assert result.passed, result.output
    assert set(_outcomes(result.output).values()) == {"BLOCKED"}, result.output
    assert "interfaces ['lo']" in result.output  # and it is down
    with pytest.raises(BlockingIOError):
      listener.accept()  # nobody knocked
  finally:
    listener.close()


def test_parent_environment_and_home_are_unreadable(probe_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
  secret = f"s3cret-{time.monotonic_ns()}"
  home = probe_dir / "home"
  home.mkdir(mode=0o755)
  (home / "credentials").write_text(secret)
  (home / "credentials").chmod(0o644)
  monkeypatch.setenv("HAMBURGER_TEST_SECRET", secret)
  monkeypatch.setenv("HOME", str(home))
  code = ("import glob, os\n"
          "print('environ', dict(os.environ))\n"
          f"paths = ['/proc/%d/environ' % os.getppid(), '/proc/{os.getpid()}/environ',\n"
          f"         {str(home / 'credentials')!r}]\n"
          "paths += glob.glob('/proc/*/environ') + glob.glob('/proc/*/task/*/environ')\n"
          "for p in paths:\n"
          "  try:\n"
          "    print(p, open(p, 'rb').read())\n"
          "  except OSError as e:\n"
          "    print(p, 'BLOCKED', e)\n"
          f"for d in ({str(home)!r}, '/root', '/home'):\n"
          "  try:\n"
          "    print(d, os.listdir(d))\n"
          "  except OSError as e:\n"
          "    print(d, 'BLOCKED', e)\n")
  result = sandbox.run_python(code, timeout_s=10)
  assert result.passed, result.output
  assert secret not in result.output
  assert "['credentials']" not in result.output
  assert f"{home}/credentials BLOCKED" in result.output


@pytest.fixture(scope="module")
def humaneval_0() -> tasks.Example:
  return tasks.HUMANEVAL.examples(1)[0]


def _fence(code: str) -> str:
  return f"```python\n{code}\n```"


FAKES = {
    "marker_then_exit": "import os\nprint('__humaneval_check_returned__')\n"
                        "print('checks returned', flush=True)\nos._exit(0)",
    "exit_at_call": "import os\ndef has_close_elements(numbers, threshold):\n"
                    "    print('__humaneval_check_returned__', flush=True)\n    os._exit(0)",
    "always_equal": "class Yes:\n    def __eq__(self, other):\n        return True\n"
                    "    def __bool__(self):\n        return True\n"
                    "def has_close_elements(numbers, threshold):\n    return Yes()",
    "sys_exit_0": "import sys\nsys.exit(0)",
    "patched_assert": "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\n"
                      "def has_close_elements(numbers, threshold):\n    return False",
}


@pytest.mark.parametrize("name", sorted(FAKES))
def test_faked_pass_is_a_fail(humaneval_0: tasks.Example, name: str) -> None:
  result = tasks.HUMANEVAL.run(_fence(FAKES[name]), humaneval_0)
  assert (result.passed, result.status) == (False, "failed"), result.output


def test_checked_pass_and_fail(humaneval_0: tasks.Example) -> None:
  problem = humaneval_0.reference
  assert tasks.HUMANEVAL.run(problem["prompt"] + problem["canonical_solution"], humaneval_0).passed
  # Output on stdout and an exception inside a call are the program's business, not the verdict.
  noisy = "def has_close_elements(numbers, threshold):\n    print('PASS')\n    raise ValueError(1)"
  result = tasks.HUMANEVAL.run(_fence(noisy), humaneval_0)
  assert (result.passed, result.status) == (False, "failed")
  assert "ValueError" in result.output
  loop = "def has_close_elements(numbers, threshold):\n    while True:\n        pass"
  start = time.monotonic()
  result = checked_run.run_checked(loop, "has_close_elements",
                                   tasks.humaneval_check_source(problem), timeout_s=2)
  assert (result.passed, result.status) == (False, "timeout")
  assert time.monotonic() - start < 8


def test_refuses_without_isolation(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setattr(sandbox, "UNSHARE", "/nonexistent/unshare")
  sandbox.isolation_status.cache_clear()
  try:
    assert sandbox.isolation_status()[0] is False
    with pytest.raises(sandbox.SandboxUnavailable, match="--unsafe-exec"):
      sandbox.run_python("print(1)")
    with pytest.raises(sandbox.SandboxUnavailable, match="unshare"):
      checked_run.run_checked("def f():\n  return 1", "f",
                              "def check(c):\n  assert c() == 1\n")
    # Explicitly unsafe: a plain subprocess with the limits, and the verdict still the checker's.
    assert sandbox.run_python("print(1)", unsafe=True).output == "1\n"
    assert checked_run.run_checked("def f():\n  return 1", "f",
                                   "def check(c):\n  assert c() == 1\n", unsafe=True).passed
    assert not checked_run.run_checked("import os\nos._exit(0)", "f",
                                       "def check(c):\n  assert c() == 1\n", unsafe=True).passed
  finally:
    sandbox.isolation_status.cache_clear()


@pytest.mark.parametrize("value", [
    None, True, False, 0, -7, 2**100, 1.5, -0.0, float("inf"), -float("inf"), 1 + 2j, "a'\"\n",
    b"\x00\xff", [], (), (1,), [1, (2, 3), {"a": [None]}], {1: "x", (1, 2): 3.0}, set(),
    {1, 2}, frozenset({"a"}),
])
def test_codec_round_trip(value) -> None:
  decoded = sandbox_codec.decode(sandbox_codec.encode(value))
  assert decoded == value and type(decoded) is type(value)


def test_codec_refuses_anything_but_data() -> None:
  import collections  # pylint: disable=import-outside-toplevel
  assert sandbox_codec.decode(sandbox_codec.encode(collections.Counter("aab"))) == {"a": 2, "b": 1}
  assert sandbox_codec.decode(sandbox_codec.encode(float("nan"))) != 0  # nan crosses as nan
  for bad in (object(), lambda: 1, iter([1]), Path("/")):
    with pytest.raises(sandbox_codec.CodecError):
      sandbox_codec.encode(bad)
  for text in ("__import__('os').system('true')", "x", "(1).__class__", "[i for i in ()]",
               "open('/etc/passwd')", "float('1e5')", "{[1]: 2}", "{**{}}", "1 if 1 else 2"):
    with pytest.raises(sandbox_codec.CodecError):
      sandbox_codec.decode(text)
  with pytest.raises(sandbox_codec.CodecError):
    sandbox_codec.decode("[" * 500 + "]" * 500)


def test_sandbox_reports_are_not_in_the_program_reach() -> None:
  # The init's report pipe and the checker's pipes are not among the program's open files.
  result = sandbox.run_python("import os\nprint(sorted(os.listdir('/proc/self/fd')))")
  assert json.loads(result.output.strip().replace("'", '"')) == ["0", "1", "2", "3"]


def test_eval_refuses_humaneval_without_isolation(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
  from infer import eval as infer_eval  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(sandbox, "UNSHARE", "/nonexistent/unshare")
  sandbox.isolation_status.cache_clear()
  try:
    for tasks_arg in (["--tasks", "basic_arithmetic,humaneval"], []):
      with pytest.raises(SystemExit) as exit_info:
        infer_eval.parse_args(tasks_arg)
      assert exit_info.value.code == 2
      err = capsys.readouterr().err.strip().splitlines()[-1]
      assert "no OS sandbox here" in err and "--unsafe-exec" in err
    assert infer_eval.parse_args(["--tasks", "humaneval", "--unsafe-exec"]).unsafe_exec
    assert not infer_eval.parse_args(["--tasks", "basic_arithmetic"]).unsafe_exec
  finally:
    sandbox.isolation_status.cache_clear()


@pytest.mark.slow  # 164 sandboxed runs: ~30 s on 2 busy cores
def test_every_canonical_humaneval_solution_passes_through_the_checker() -> None:
  # The checker calls the program's function across processes with plain data: no HumanEval
  # problem needs more than that (HumanEval/33's tests call the entry point by name).
  failures = []
  for ex in tasks.HUMANEVAL.examples():
    problem = ex.reference
    result = tasks.HUMANEVAL.run(problem["prompt"] + problem["canonical_solution"], ex)
    if not result.passed:
      failures.append(f"{ex.id}: {result.status} {result.output[-300:]}")
  assert not failures, "\n".join(failures[:5])
