"""The capped command runner the accelerator check's parts and commands share."""

from __future__ import annotations

import sys
import time

from hamburger_jax.subprocess_run import Capped, run_capped


def _python(code: str) -> list[str]:
  return [sys.executable, "-c", code]


def test_lines_come_as_printed_and_the_exit_and_stderr_after():
  run = Capped(_python("import sys, time\nprint('one', flush=True)\ntime.sleep(2)\n"
                       "print('two')\nsys.exit('went wrong')"), 60)
  lines = run.lines()
  t = time.monotonic()
  assert next(lines) == "one\n" and time.monotonic() - t < 2  # before the command ends
  assert list(lines) == ["two\n"]
  assert (run.code, run.stderr.strip()) == (1, "went wrong")


def test_a_stopped_command_keeps_what_it_printed_and_has_no_exit_code():
  for own_group in (True, False):
    run = Capped(_python("import time\nprint('started', flush=True)\ntime.sleep(60)"), 2,
                 own_group=own_group)
    t = time.monotonic()
    assert list(run.lines()) == ["started\n"] and time.monotonic() - t < 30
    assert run.code is None


def test_run_capped_collects_the_output():
  assert run_capped(_python("import sys\nprint('a')\nprint('b', file=sys.stderr)"), 30) == (
      0, "a\n", "b\n")
