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
  decode        base against HAMburger in one engine per batch size: the shipped graft (the
                entry points' default micro vocabulary) at confidence 0.5 and 0.8, and forced
                groups (confidence 0), batches 32 and 1
                (tok/s over the time the batch decoded, prefills apart); batch 1 again with
                XLA's GPU command buffers on for while loops and conditionals (each row names
                its XLA flags); then r (micro step / base step) and the adapters' cost at
                batch 1, beside r where bytes bound a step
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

from hamburger_jax import cli
from hamburger_jax.pipeline.budget import share_of_left
from hamburger_jax.subprocess_run import Capped, run_capped

PARTS = ("environment", "tests", "reference", "precision", "decode", "decode_1b", "train_1b")
# Shares of the budget, in order; a part's minutes are its share of what is left among the
# parts still to run (a quick part hands its minutes on).
SHARES = {"environment": 0.03, "tests": 0.3, "reference": 0.11, "precision": 0.09,
          "decode": 0.2, "decode_1b": 0.14, "train_1b": 0.13}
TINY_CONFIG = "configs/tiny.yaml"
REFERENCE_FILE = "greedy_reference.json"  # in the shipped checkpoint's directory
REFERENCE_TOKENS = 32
REFERENCE_CONFIDENCES = (0.5, 0.8)
DECODE_CONFIDENCES = {"c=0.5": 0.5, "c=0.8": 0.8, "forced": 0.0}
# The confidences also decoded with the batch-aware micro loop measured (decode/micro_rule.py),
# and the one whose decode is profiled beside the base's.
MICRO_RULE_CONFIDENCES = ("c=0.5", "c=0.8")
PROFILED = "c=0.5"
DECODE_HEADER = ("batch", "run", "XLA flags", "tok/s", "vs base", "tokens/step",
                 "micro steps/step", "last row's steps", "macro step / base step", "prefill s",
                 "compile s")
DECODE_COLUMNS = len(DECODE_HEADER)
# XLA's GPU command buffers (CUDA graphs) for while loops and conditionals too, added to its
# default command types: the decode loop is a lax.while_loop, and a step launches many small
# kernels at batch 1. A GPU flag that XLA parses on every backend (an unknown flag would abort).
COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
# Modules a part imports beyond the library: the wheel list of docs/accelerators.md must cover
# what they (and the library) import there (tests/test_repo.py checks it).
PART_MODULES = ("hamburger_jax.decode.engine", "hamburger_jax.training", "hamburger_jax.data",
                "hamburger_jax.evaluation.tasks", "hamburger_jax.benchmarks.timing", "infer.bench",
                "train.bench", "pytest")


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


def _models(args, default_micro_vocab: bool = False):
  """(model, tokenizer, prompts as token ids) the decoding parts use: the full micro-step head,
  or with `default_micro_vocab` the entry points' default (cli.micro_vocab_size), which the
  speed parts measure. The stored reference is the full head's."""
  if args.tiny:  # configs/tiny.yaml's model: random weights, token-id prompts
    from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
    model, _ = pretrained.load_run(TINY_CONFIG)
    prompts = [[3 + (7 * i + j) % 250 for j in range(5 + 3 * i)] for i in range(8)]
    return model, None, prompts
  from hamburger_jax.benchmarks.prompts import PROMPTS, chat_ids  # pylint: disable=C0415
  try:
    model, tok = cli.load_model("both", None, None, **(
        {"micro_vocab": None} if default_micro_vocab else {}))
  except cli.ModelLoadError as e:
    raise SystemExit(f"error: {e}") from None
  return model, tok, chat_ids(tok, PROMPTS)


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
  model, tok, prompts = _models(args)
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
  model, tok, prompts = _models(args)
  dtype = (getattr(args, "dtype", None)
           or precision.decode_defaults(jax.devices()[0].platform)["dtype"])
  f32 = greedy_tokens(model, tok, prompts, dtype="float32", matmul_precision="highest")
  got = greedy_tokens(model, tok, prompts, dtype=dtype)
  return [f"- decoding in {dtype} (precision \"default\") against float32 "
          f"at \"highest\", {len(prompts)} prompts, {REFERENCE_TOKENS} tokens", "",
          *compare(got, f32)]


def decode_rows(engine, ids: list, n_new: int, flags: str,
                tps: dict[str, float] | None = None) -> Iterator[str]:
  """The decode table's rows of one batch: base and HAMburger at DECODE_CONFIDENCES (those of
  MICRO_RULE_CONFIDENCES also with the micro rule auto) and verify mode (the base's tokens; k:
  tokens a base forward), each run's tok/s over the time the batch decoded (its prefills
  apart), best of 2 interleaved rounds, and the lockstep's waste: micro steps a macro step ran
  against tokens a row emitted in it; `tps` gets each run's tok/s."""
  from hamburger_jax.benchmarks import timing  # pylint: disable=import-outside-toplevel
  runs = {"base": {"mode": "base"}, **{name: {"mode": "hamburger", "confidence": c}
                                       for name, c in DECODE_CONFIDENCES.items()}}
  runs.update({f"{name} auto": runs[name] for name in MICRO_RULE_CONFIDENCES})
  runs["verify"] = {"mode": "verify"}
  auto = engine.with_micro_rule("auto")
  res = timing.time_batches(engine, ids, n_new, 2, runs,
                            {f"{name} auto": auto for name in MICRO_RULE_CONFIDENCES})
  for name, t in res.items():
    if tps is not None:
      tps[name] = t.tokens_per_s
    k = t.tokens_per_step
    yield (f"| {len(ids)} | {name} | {flags} | {t.tokens_per_s:.1f} | "
           f"{t.tokens_per_s / res['base'].tokens_per_s:.2f}x | {k:.2f} | "
           f"{timing.micro_steps_per_step(t.gens):.2f} | {timing.last_row_steps(t.gens)} | "
           f"{timing.macro_step_cost(t, res['base']):.2f} | {t.prefill_s:.3f} | "
           f"{t.compile_s:.0f} |")


def profile_lines(engine, ids: list, n_new: int, flags: str) -> Iterator[str]:
  """Where the device's time goes in one decode of the batch, base and HAMburger at PROFILED
  (the micro rule off and auto): device time by kind of operation, a macro step's share."""
  from hamburger_jax.benchmarks import report  # pylint: disable=import-outside-toplevel
  ham = {"mode": "hamburger", "confidence": DECODE_CONFIDENCES[PROFILED]}
  runs = (("base", engine, {"mode": "base"}), (PROFILED, engine, ham),
          (f"{PROFILED} auto", engine.with_micro_rule("auto"), ham))
  yield from report.profiled_lines(runs, ids, n_new, f", XLA flags {flags}")


def xla_flags() -> str:
  """The XLA flags this process runs with, as a table cell."""
  return f"`{os.environ['XLA_FLAGS']}`" if os.environ.get("XLA_FLAGS") else "none (defaults)"


def command_buffer_rows(args, defaults: dict[str, float], versus: dict[str, float],
                        later: list[str]) -> Iterator[str]:
  """Batch 1 again in a child process whose XLA_FLAGS add COMMAND_BUFFERS (read once, when the
  backend starts: this process's backend is running already), its rows as they come; `versus`
  gets each run's tok/s over its tok/s in `defaults`, `later` the child's other lines (its
  profiles, for after the table). A failed or stopped child leaves a row saying so, and the
  part goes on."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} {COMMAND_BUFFERS}".strip()
  # This process holds most of the device's memory (JAX preallocates it): the child allocates
  # what it uses, as it goes (its first, untimed, round allocates what the timed ones reuse).
  env = {**os.environ, "XLA_FLAGS": flags, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  cmd = [sys.executable, "-m", "infer.accelerator_check", "--part", "decode_command_buffers",
         *(["--tiny"] if args.tiny else [])]
  # In the part's process group (the part's cap stops it too), capped at a third of the part's
  # minutes: the step costs and the profiles come after it.
  run = Capped(cmd, getattr(args, "seconds", 600.0) / 3, env, own_group=False)
  for line in run.lines():
    cells = [c.strip() for c in line.split("|")]  # decode_rows' own row: batch, run, flags, tok/s
    if len(cells) > 5 and cells[2] in defaults:
      versus[cells[2]] = float(cells[4]) / defaults[cells[2]]
    if line.startswith("|") and not later:  # its rows, then its profiles
      yield line.rstrip("\n")
    else:
      later.append(line.rstrip("\n"))
  if run.code is None:
    yield f"| 1 | command buffers: stopped at {run.seconds:.0f} s |{' |' * (DECODE_COLUMNS - 2)}"
  elif run.code:
    last = run.stderr.strip().splitlines()[-1:] or [""]
    yield (f"| 1 | command buffers: exit {run.code} ({last[0][-200:]}) |"
           f"{' |' * (DECODE_COLUMNS - 2)}")


def part_decode_command_buffers(args) -> Iterator[str]:
  """decode_rows at batch 1 in this process, whose XLA_FLAGS the decode part set, then its
  profiles."""
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  model, tok, prompts = _models(args, default_micro_vocab=True)
  engine = Engine(model, tok, stop_ids=())
  n_new = 32 if args.tiny else 128
  yield from decode_rows(engine, prompts[:1], n_new, xla_flags())
  yield from profile_lines(engine, prompts[:1], n_new, xla_flags())


def part_decode(args) -> Iterator[str]:
  """Yields its markdown a line at a time, each table row as soon as it is measured, so a part
  stopped at its cap keeps what it measured: the many-row batch first (its table, then where its
  device time goes), then batch 1 and batch 1 again with XLA's GPU command buffers on for while
  loops and conditionals, then the step costs and batch 1's profiles."""
  import jax  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks import report, timing, widths  # pylint: disable=C0415
  model, tok, prompts = _models(args, default_micro_vocab=True)
  n_new = 32 if args.tiny else 128
  many = 4 if args.tiny else 32
  vocab = ("the full vocabulary" if model.micro_vocab_size is None else
           f"the default micro vocabulary's {model.micro_vocab_size} ids")
  yield (f"- {model.cfg.base.num_layers}-layer base, {n_new} new tokens a row (EOS ignored); "
         f"micro steps choose among {vocab}; "
         "tok/s = tokens all rows generated / the time the batch decoded, its prefills apart "
         "(prefill s: the rows' prefills, added up); best of 2 interleaved rounds; compile s: "
         "compiled, or loaded from the persistent compilation cache where an earlier part or "
         "run compiled it")
  yield ("- the rows with command buffers run in a process of their own (XLA reads its "
         "flags when the backend starts), which allocates device memory as it goes")
  if jax.default_backend() != "gpu":
    yield (f"- `{COMMAND_BUFFERS}`: a GPU flag, no effect on "
           f"{jax.default_backend()} (its rows rehearse the plumbing)")
  defaults, versus, later = {}, {}, []  # batch 1's tok/s; with command buffers over it
  engines = {}
  for b in (many, 1):
    ids = (prompts * (b // len(prompts) + 1))[:b]
    engine = Engine(model, tok, stop_ids=())  # one per batch size; the confidences share it
    engines[b] = (engine, ids)
    yield ""
    yield (f"- batch {b}: decoding layout {'fused' if engine.fused else 'separate'} "
           f"{engine.dtype}")
    yield ""
    yield "| " + " | ".join(DECODE_HEADER) + " |"
    yield "|" + "---|" * DECODE_COLUMNS
    yield from decode_rows(engine, ids, n_new, xla_flags(), defaults if b == 1 else None)
    if b == many:  # where its time goes, before batch 1 (whose figures an earlier run has)
      yield ""
      yield from profile_lines(engine, ids, n_new, xla_flags())
  # Last of batch 1's rows: its child compiles the programs again under other flags.
  yield from command_buffer_rows(args, defaults, versus, later)
  yield ""
  yield ("- runs named `auto`: the batch-aware micro loop, its costs measured "
         "(decode/micro_rule.py); micro steps/step: micro steps a macro step ran (as many as "
         "its largest group needs) against tokens/step - 1 that each row's group added; last "
         "row's steps: the macro steps the batch ran (it decodes until its slowest row "
         "finishes; the base's: one a token); macro step / base step: a step's time in the "
         "batch's, against the base's (vs base = the base's steps / last row's steps / it)")
  if versus:
    yield ("- batch 1 with command buffers against the defaults: "
           + ", ".join(f"{name} {v:.2f}x" for name, v in versus.items()))
  # What bounds the ratios: r and the adapters' cost at batch 1, measured (three more programs
  # to compile), beside r where bytes would bound a step.
  first = engines[1][0]
  cost = timing.step_costs(first.runner, 2, 1)
  yield (f"- batch 1, steps in a jitted loop: r = micro step / base step = "
         f"{cost['micro'] / cost['base']:.3f}; a base step reading a merged entry costs "
         f"{cost['merged'] / cost['base'] - 1:+.1%}")
  bound = report.bytes_bound_lines(model.cfg, str(first.dtype), widths.KV_ENTRIES,
                                   {"full": None})
  yield f"- {bound[0].strip()}"
  yield from (f"  {line}" for line in bound[1:])
  yield from profile_lines(*engines[1], n_new, xla_flags())
  yield from later


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
  model, tok, prompts = _models(argparse.Namespace(tiny=False))
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
  p.add_argument("--out", default="accelerator_check.md", help="the markdown report")
  p.add_argument("--tiny", action="store_true", help="tiny models: the plumbing, on a CPU")
  p.add_argument("--part", choices=list(RUNNERS), default=None,
                 help="run this part alone, its markdown on stdout (no report, no cap)")
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
    for line in RUNNERS[args.part](args):
      print(line, flush=True)
    return 0
  sections, summary = run_parts(args)
  text = report(args, sections, summary)
  from hamburger_jax import files  # pylint: disable=import-outside-toplevel
  files.write_text_atomic(args.out, text)
  print(text)
  return 0 if all(s == "done" for _, s, _, _ in summary) else 1


if __name__ == "__main__":
  sys.exit(main())
