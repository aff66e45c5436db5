"""Score untrusted, model-written code (HumanEval completions) with trusted checks.

A sandboxed program's exit status is its own, so it is no verdict: code that prints a pass marker
and exits 0, or returns an object whose `__eq__` always says True, would pass any check that ran
beside it. Here the program runs in the sandbox (`sandbox.start_program` with a runner that
serves calls to its entry point), and the trusted check (e.g. HumanEval's `check`) runs in a
separate, unsandboxed checker process that the program cannot reach (another user, outside its
PID namespace). Arguments and return values cross as plain data through `sandbox_codec`, and the
verdict is the checker's exit status. This module is that protocol; sandbox.py is the isolation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from hamburger_jax.evaluation import sandbox, sandbox_codec
from hamburger_jax.subprocess_run import kill_group

# Frames between the checker and the program are at most this large.
MAX_FRAME_BYTES = 16 * 2**20

# The program's runner (see sandbox's bootstrap): runs main.py, then answers the checker's calls
# to its entry point until the checker closes the requests pipe. The codec is pasted in front.
_SERVE_RUNNER = r"""
def read_frame(f):
  head = f.read(4)
  if len(head) < 4:
    return None
  size = int.from_bytes(head, "big")
  data = f.read(size) if size <= cfg["max_frame"] else b""
  return data.decode("utf-8") if len(data) == size else None

def run():
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
"""

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
) -> sandbox.SandboxResult:
  """Scores untrusted `program` with trusted `check_source` (which defines check(candidate)).

  The program runs in the sandbox (module as __main__, then it serves calls to `entry_point`);
  check_source runs in a separate checker process outside it and calls check() with a proxy for
  the entry point. Passed means the checker's check() returned: the program cannot forge it.
  Otherwise the status says how the program ended ('failed', 'timeout', 'memory', 'error').
  Raises SandboxUnavailable as sandbox.run_python does.
  """
  sandbox.check_limits(timeout_s, memory_mb)
  isolate = sandbox.isolate_or_refuse(unsafe)
  start = time.monotonic()
  with tempfile.TemporaryDirectory(prefix="hamburger_sandbox_", ignore_cleanup_errors=True) as root:
    req_r, req_w = os.pipe()  # checker -> program
    rep_r, rep_w = os.pipe()  # program -> checker
    checker = None
    try:
      try:
        run = sandbox.start_program(
            program, root, timeout_s=timeout_s, memory_mb=memory_mb, max_file_mb=max_file_mb,
            max_processes=max_processes, isolate=isolate,
            runner=_codec_source() + _SERVE_RUNNER,
            runner_cfg={"max_frame": MAX_FRAME_BYTES, "entry_point": entry_point,
                        "requests_fd": req_r, "replies_fd": rep_w},
            pass_fds=(req_r, rep_w))
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
      return sandbox.SandboxResult(False, "error", f"could not start the sandbox process: {e}")
    finally:
      os.close(req_w)
      os.close(rep_r)
    try:
      checker.wait(timeout=timeout_s + sandbox.GRACE_S)
    except subprocess.TimeoutExpired:
      pass
    kill_group(checker)
    checker.wait()
    status, note, output = sandbox.finish_program(run, timeout_s=timeout_s, memory_mb=memory_mb,
                                                  max_file_mb=max_file_mb,
                                                  max_output_chars=max_output_chars)
    check_output = sandbox.read_tail(check_out, max_output_chars)
  if checker.returncode == 0:
    return sandbox.SandboxResult(True, "passed", output, time.monotonic() - start)
  if status == "passed":
    status = "failed"  # the program ended cleanly, but the checks did not return
  output += "\n[checker: the checks did not pass]\n" + check_output.rstrip()
  if note:
    output += "\n" + note
  return sandbox.SandboxResult(False, status, output, time.monotonic() - start)
