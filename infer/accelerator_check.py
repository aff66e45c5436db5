"""One command for a GPU or TPU host: what works there and what it costs, in a time budget.

  python -m infer.accelerator_check --budget-minutes 8 --out report.md
  python -m infer.accelerator_check --tiny --budget-minutes 8      # the plumbing, on a CPU

Runs its parts in priority order, each in its own process with its share of the minutes left
(a part that runs over is stopped; what it printed is kept), and writes one markdown report:

  environment   python, jax and the backend's devices; the packages the check imports
  tests         the portable test suite (pytest -m portable)
  reference     greedy tokens of the base and the shipped graft against the ones stored with the
                checkpoint (computed on a CPU in float32, matmuls at "highest": the policy of
                hamburger_jax/precision.py, pinned here too)
  precision     the backend's decoding dtype (or --dtype) against float32: tokens equal, first
                divergence
  decode        base against HAMburger and verify mode in one engine per batch size: the
                shipped graft (the entry points' default micro vocabulary) at confidence 0.5
                and 0.8, and forced groups (confidence 0), batches 32 and 1 (tok/s over the
                time the batch decoded, prefills apart; each run's rows whose tokens are the
                base's; compile s); verify's tokens against the base's in the decoding dtype
                and in float32 at "highest"; the base against transformers' generate at batch
                1; one verify step's parts timed alone; batch 1 again with XLA's GPU command
                buffers on for while loops and conditionals (each row names its XLA flags);
                then r (micro step / base step) and the adapters' cost at batch 1, beside r
                where bytes bound a step (hamburger_jax/benchmarks/accelerator_decode.py)
  decode_1b     Llama-3.2-1B on random weights: a macro step's MFU and roofline, engine tok/s;
                batch 1, then 32 (a command each, its lines kept as they come)
  train_1b      its train step (the paper's setting, trainable all): MFU

`--tiny`: the same parts on configs/tiny.yaml's random model (the reference tokens computed on
this host's CPU device in the same run), to prove the plumbing.
`--write-reference` (on a CPU) writes the stored reference tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from typing import Iterator

from hamburger_jax.benchmarks.accelerator_decode import (TINY_CONFIG, models, part_decode,
                                                        part_decode_command_buffers)
from hamburger_jax.pipeline.budget import share_of_left
from hamburger_jax.subprocess_run import Capped, run_capped

PARTS = ("environment", "tests", "reference", "precision", "decode", "decode_1b", "train_1b")
# Shares of the budget, in order; a part's minutes are its share of what is left among the
# parts still to run (a quick part hands its minutes on).
SHARES = {"environment": 0.03, "tests": 0.3, "reference": 0.11, "precision": 0.09,
          "decode": 0.2, "decode_1b": 0.14, "train_1b": 0.13}
DEFAULT_OUT = "accelerator_check.md"
REFERENCE_FILE = "greedy_reference.json"  # in the shipped checkpoint's directory
REFERENCE_TOKENS = 32
REFERENCE_CONFIDENCES = (0.5, 0.8)
# Modules a part imports beyond the library: the wheel list of docs/accelerators.md must cover
# what they (and the library) import there (tests/test_repo.py checks it).
PART_MODULES = ("hamburger_jax.decode.engine", "hamburger_jax.training", "hamburger_jax.data",
                "hamburger_jax.evaluation.tasks", "hamburger_jax.benchmarks.timing",
                "hamburger_jax.benchmarks.decode_bench", "hamburger_jax.benchmarks.verify_bench",
                "hamburger_jax.convert.hf", "infer.bench", "train.bench", "pytest")


# ----------------------------------------------------------------------------- the parts


def part_environment(args) -> list[str]:
  import importlib  # pylint: disable=import-outside-toplevel
  import importlib.metadata as md  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  for name in PART_MODULES:
    importlib.import_module(name)
  d = jax.devices()
  stats = d[0].memory_stats() or {}
  out = [f"- python {platform.python_version()}, jax {jax.__version__}, backend "
         f"{jax.default_backend()}: {len(d)} x {d[0].device_kind}"
         + (f", {stats['bytes_limit'] / 2**30:.1f} GiB usable each" if "bytes_limit" in stats
            else "")]
  versions = []
  for dist in ("jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorflow-datasets",
               "torch", "transformers", "gguf"):
    try:
      versions.append(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
      versions.append(f"{dist} missing")
  out.append("- " + ", ".join(versions))
  out.append(f"- every module the parts import loads: {', '.join(PART_MODULES)}")
  return out


def pytest_workers(cpus: int) -> int:
  """pytest-xdist workers for the portable suite: most of it is compiling, on the host's cores
  (2 on a 2-core machine, 4 on an accelerator host's 16)."""
  return max(2, min(4, cpus // 4))


def part_tests(args) -> list[str]:
  cmd = [sys.executable, "-m", "pytest", "-m", "portable", "-q", "-p", "no:cacheprovider",
         "--no-header", "-rf"]
  if args.tiny:
    cmd += ["-x", "tests/test_decode_layout.py"]
  else:  # test processes sharing one device: each allocates what it uses, not most of it
    cmd += ["-n", str(pytest_workers(os.cpu_count() or 2))]
  env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  # pytest stops short of the part's cap, so that how far it got reaches the report.
  seconds = max(args.seconds - 20, 10)
  code, out, _ = run_capped(cmd, seconds, env=env)
  lines = [l for l in out.splitlines() if l.strip()]
  tail = [f"- {l}" for l in lines if "passed" in l or "failed" in l or l.startswith("FAILED")]
  if code is not None:
    return [f"- `{' '.join(cmd[1:])}`: exit {code}", *tail[-12:]]
  # pytest -q's progress lines: one character per test, then "[ NN%]".
  marks = "".join(p for p in (l.split("[")[0].strip() for l in lines) if set(p) <= set(".sxFE"))
  return [f"- `{' '.join(cmd[1:])}`: stopped at {seconds:.0f} s, {marks.count('.')} passed and "
          f"{marks.count('F') + marks.count('E')} failed or errored so far", *tail[-12:]]


def greedy_tokens(model, tok, prompts, **engine_kw) -> dict[str, list[list[int]]]:
  """Greedy tokens of every prompt: base mode and HAMburger at REFERENCE_CONFIDENCES."""
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  engine = Engine(model, tok, stop_ids=(), **engine_kw)
  out = {"base": [g.token_ids for g in engine.generate(prompts, max_new_tokens=REFERENCE_TOKENS,
                                                       mode="base")]}
  for c in REFERENCE_CONFIDENCES:
    out[f"hamburger c={c}"] = [g.token_ids for g in engine.generate(
        prompts, max_new_tokens=REFERENCE_TOKENS, mode="hamburger", confidence=c)]
  return out


def compare(got: dict, want: dict) -> list[str]:
  """Rows equal and first divergences, per run, as markdown lines."""
  out = ["| run | rows equal | first divergence (row: token) |", "|---|---|---|"]
  for name, rows in want.items():
    equal = sum(a == b for a, b in zip(got[name], rows))
    firsts = [f"{i}: {next(j for j, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y)}"
              for i, (a, b) in enumerate(zip(got[name], rows)) if a != b]
    out.append(f"| {name} | {equal}/{len(rows)} | {', '.join(firsts) or '-'} |")
  return out


def reference_path() -> str:
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  return os.path.join(pretrained.DEFAULT_CHECKPOINT, REFERENCE_FILE)


def part_reference(args) -> list[str]:
  import jax  # pylint: disable=import-outside-toplevel
  from hamburger_jax import precision  # pylint: disable=import-outside-toplevel
  model, tok, prompts = models(args)
  precision.pin(decode_dtype="float32", matmuls="highest")
  if args.tiny:  # computed here on the CPU device, as the stored one was
    with jax.default_device(jax.devices("cpu")[0]):
      want = greedy_tokens(model, tok, prompts)
  else:
    with open(reference_path(), encoding="utf-8") as f:
      want = json.load(f)["tokens"]
  got = greedy_tokens(model, tok, prompts)
  return [f"- {len(prompts)} prompts, {REFERENCE_TOKENS} tokens, float32 at \"highest\", "
          f"on {jax.devices()[0].device_kind}", "", *compare(got, want)]


def part_precision(args) -> list[str]:
  import jax  # pylint: disable=import-outside-toplevel
  from hamburger_jax import precision  # pylint: disable=import-outside-toplevel
  model, tok, prompts = models(args)
  dtype = (getattr(args, "dtype", None)
           or precision.decode_defaults(jax.devices()[0].platform)["dtype"])
  f32 = greedy_tokens(model, tok, prompts, dtype="float32", matmul_precision="highest")
  got = greedy_tokens(model, tok, prompts, dtype=dtype)
  return [f"- decoding in {dtype} (precision \"default\") against float32 "
          f"at \"highest\", {len(prompts)} prompts, {REFERENCE_TOKENS} tokens", "",
          *compare(got, f32)]


def cli_part(argv: list[str]) -> Iterator[str]:
  """Runs `python -m ARGV`, yielding its output a line at a time as it prints (a part stopped
  at its cap keeps what the command printed so far), then its exit code and, when it failed,
  the end of its stderr."""
  yield f"- `python -m {' '.join(argv)}`:"
  yield ""
  run = Capped([sys.executable, "-m", *argv], own_group=False)  # the part's cap stops it too
  yield from (line.rstrip("\n") for line in run.lines())
  yield ""
  yield f"- exit {run.code}"
  if run.code:
    yield from ["", "stderr:", *run.stderr.strip().splitlines()[-15:]]


def part_decode_1b(args):
  """One command per batch size, the smallest first: a part stopped at its cap keeps batch 1."""
  config = TINY_CONFIG if args.tiny else "configs/llama3_2_1b.yaml"
  for batch in ("1", "4") if args.tiny else ("1", "32"):
    yield from cli_part(["infer.bench", "--config", config, "--random-weights", "--batches",
                          batch, "--new-tokens", "16" if args.tiny else "32", "--repeats", "2"])
    yield ""


def part_train_1b(args):
  if args.tiny:
    return cli_part(["train.bench", "--config", TINY_CONFIG, "--random-weights",
                     "--rows", "2", "--steps", "1", "--trainable", "all", "--no-sft",
                     "--input-batches", "2"])
  return cli_part(["train.bench", "--config", "configs/llama3_2_1b_h100.yaml",
                   "--random-weights", "--rows", "4", "--entries", "1024", "--steps", "2",
                   "--trainable", "all", "--no-sft", "--input-batches", "2"])


RUNNERS = {"environment": part_environment, "tests": part_tests, "reference": part_reference,
           "precision": part_precision, "decode": part_decode, "decode_1b": part_decode_1b,
           "train_1b": part_train_1b,
           # a child of the decode part, with XLA_FLAGS of its own (not a part of the report)
           "decode_command_buffers": part_decode_command_buffers}


# ----------------------------------------------------------------------------- the run


def run_parts(args) -> tuple[list[str], list[tuple[str, str, float, float]]]:
  """Each part in its own process, capped; returns the report's sections and its summary."""
  sections, summary = [], []
  start = time.monotonic()
  total = 60 * args.budget_minutes
  for i, part in enumerate(PARTS):
    left = total - (time.monotonic() - start)
    # The environment (seconds) runs whatever the budget: the report says what host it was.
    cap = share_of_left(SHARES, PARTS[:i], left, part)
    if part == "environment":
      cap = max(cap, min(60.0, max(left, 0)))
    print(f"== {part}: up to {cap:.0f} s", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "infer.accelerator_check", "--part", part,
           "--seconds", f"{cap:.0f}"]
    if args.tiny:
      cmd.append("--tiny")
    if args.dtype:
      cmd += ["--dtype", args.dtype]
    t = time.monotonic()
    status, body = "done", []
    if cap < 5:
      status = "not run: no minutes left"
    else:
      code, out, err = run_capped(cmd, cap)
      body = out.strip().splitlines()
      if code is None:
        status = f"stopped at its cap ({cap:.0f} s)"
      elif code:
        status = f"failed (exit {code})"
        body += ["", "stderr:", *err.strip().splitlines()[-15:]]
    spent = time.monotonic() - t
    summary.append((part, status, spent, cap))
    sections += [f"## {part}", "", *(body or ["(no output)"]), ""]
  return sections, summary


def report(args, sections, summary) -> str:
  import jax  # pylint: disable=import-outside-toplevel
  d = jax.devices()[0]
  head = [f"# Accelerator check, {datetime.date.today().isoformat()}", "",
          f"{d.device_kind} ({jax.default_backend()}), {platform.node()}; budget "
          f"{args.budget_minutes:g} minutes{'; tiny models' if args.tiny else ''}; command "
          f"`python -m infer.accelerator_check {' '.join(sys.argv[1:])}`", "",
          "| part | status | seconds | cap s |", "|---|---|---|---|"]
  head += [f"| {p} | {s} | {t:.0f} | {c:.0f} |" for p, s, t, c in summary]
  return "\n".join(head + [""] + sections) + "\n"


def write_reference() -> str:
  """The stored greedy tokens (on a CPU: float32, matmuls at "highest")."""
  import jax  # pylint: disable=import-outside-toplevel
  from hamburger_jax import files, precision  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks.prompts import PROMPTS  # pylint: disable=import-outside-toplevel
  if jax.default_backend() != "cpu":
    raise SystemExit("error: the reference is computed on a CPU (JAX_PLATFORMS=cpu)")
  precision.pin(decode_dtype="float32", matmuls="highest")
  model, tok, prompts = models(argparse.Namespace(tiny=False))
  tokens = greedy_tokens(model, tok, prompts)
  files.write_json_atomic(reference_path(), {
      "prompts": PROMPTS, "max_new_tokens": REFERENCE_TOKENS, "dtype": "float32",
      "matmul_precision": "highest", "eos": "ignored", "device": "cpu",
      "command": "python -m infer.accelerator_check --write-reference", "tokens": tokens})
  return reference_path()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m infer.accelerator_check", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--budget-minutes", type=float, default=8.0)
  p.add_argument("--out", default=None, help="the markdown report (default "
                 f"{DEFAULT_OUT}); with --part, that part's markdown, written as it comes")
  p.add_argument("--tiny", action="store_true", help="tiny models: the plumbing, on a CPU")
  p.add_argument("--part", choices=list(RUNNERS), default=None,
                 help="run this part alone, its markdown on stdout (no cap: run it under "
                 "`timeout`)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                 help="the decoding dtype the precision part compares against float32 at "
                 "\"highest\" (default: the backend's, hamburger_jax/precision.py)")
  p.add_argument("--seconds", type=float, default=600.0, help=argparse.SUPPRESS)  # a part's cap
  p.add_argument("--write-reference", action="store_true",
                 help=f"write the shipped graft's {REFERENCE_FILE} (on a CPU) and stop")
  args = p.parse_args(argv)
  if not args.budget_minutes > 0:
    p.error(f"--budget-minutes {args.budget_minutes} must be > 0")
  if args.write_reference:
    print(f"wrote {write_reference()}")
    return 0
  if args.part:  # a child: one part, its markdown on stdout, each line as it comes
    from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
    cache.enable_compilation_cache()  # a later part (or run) loads what an earlier one compiled
    # Line by line into --out too: a part stopped by a timeout leaves what it measured there.
    with open(args.out or os.devnull, "w", encoding="utf-8") as out:
      for line in RUNNERS[args.part](args):
        print(line, flush=True)
        out.write(line + "\n")
        out.flush()
    return 0
  sections, summary = run_parts(args)
  text = report(args, sections, summary)
  from hamburger_jax import files  # pylint: disable=import-outside-toplevel
  files.write_text_atomic(args.out or DEFAULT_OUT, text)
  print(text)
  return 0 if all(s == "done" for _, s, _, _ in summary) else 1


if __name__ == "__main__":
  sys.exit(main())
