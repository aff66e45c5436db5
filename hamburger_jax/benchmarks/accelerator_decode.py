"""The accelerator check's decode part (`python -m infer.accelerator_check --part decode`): base
against HAMburger and verify mode in one engine per batch size, each run's tokens against the
base's; verify's exactness in the decoding dtype and in float32; the base against transformers'
generate; one verify step's parts; batch 1 again with XLA's GPU command buffers; the micro step's
cost and where the device's time goes. Each line is yielded as soon as it is measured, so a part
stopped at its cap keeps what it measured."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Iterator

from hamburger_jax import cli
from hamburger_jax.config import DEFAULT_DRAFT_CONFIDENCE
from hamburger_jax.subprocess_run import Capped

CHECK = "infer.accelerator_check"  # the entry point that runs a part (and this part's child)
TINY_CONFIG = "configs/tiny.yaml"
DECODE_CONFIDENCES = {"c=0.5": 0.5, "c=0.8": 0.8, "forced": 0.0}
# The confidences also decoded with the batch-aware micro loop measured (decode/micro_rule.py),
# and the one whose decode is profiled beside the base's.
MICRO_RULE_CONFIDENCES = ("c=0.5", "c=0.8")
PROFILED = "c=0.5"
DECODE_HEADER = ("batch", "run", "XLA flags", "tok/s", "vs base", "same tokens as base",
                 "tokens/step", "micro steps/step", "last row's steps", "macro step / base step",
                 "prefill s", "compile s")
DECODE_COLUMNS = len(DECODE_HEADER)
# XLA's GPU command buffers (CUDA graphs) for while loops and conditionals too, added to its
# default command types: the decode loop is a lax.while_loop, and a step launches many small
# kernels at batch 1. A GPU flag that XLA parses on every backend (an unknown flag would abort).
COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
REPEATS = 2  # interleaved rounds of every timing here, the fastest kept


def models(args, default_micro_vocab: bool = False):
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


def same_rows(run, base) -> str:
  """Rows of a run (a BatchTiming) whose tokens equal the base's, as "n/rows"."""
  same = sum(g.token_ids == h.token_ids for g, h in zip(run.gens, base.gens))
  return f"{same}/{len(base.gens)}"


def programs(counts) -> str:
  """What the persistent compilation cache did for a stretch of work (cache.counting)."""
  if not counts.hits + counts.misses:
    return "no program looked up in the persistent compilation cache"
  return f"programs: {counts.hits} loaded from the persistent compilation cache, " \
         f"{counts.misses} compiled"


def decode_rows(engine, ids: list, n_new: int, flags: str,
                timings: dict | None = None) -> Iterator[str]:
  """The decode table's rows of one batch: base and HAMburger at DECODE_CONFIDENCES (those of
  MICRO_RULE_CONFIDENCES also with the micro rule auto) and verify mode (the base's tokens; k:
  tokens a base forward), each run's tok/s over the time the batch decoded (its prefills
  apart), best of REPEATS interleaved rounds, its rows whose tokens are the base's, and the
  lockstep's waste: micro steps a macro step ran against tokens a row emitted in it; `timings`
  gets each run's BatchTiming."""
  from hamburger_jax.benchmarks import timing  # pylint: disable=import-outside-toplevel
  runs = {"base": {"mode": "base"}, **{name: {"mode": "hamburger", "confidence": c}
                                       for name, c in DECODE_CONFIDENCES.items()}}
  runs.update({f"{name} auto": runs[name] for name in MICRO_RULE_CONFIDENCES})
  runs["verify"] = {"mode": "verify"}
  auto = engine.with_micro_rule("auto")
  res = timing.time_batches(engine, ids, n_new, REPEATS, runs,
                            {f"{name} auto": auto for name in MICRO_RULE_CONFIDENCES})
  if timings is not None:
    timings.update(res)
  for name, t in res.items():
    yield (f"| {len(ids)} | {name} | {flags} | {t.tokens_per_s:.1f} | "
           f"{t.tokens_per_s / res['base'].tokens_per_s:.2f}x | {same_rows(t, res['base'])} | "
           f"{t.tokens_per_step:.2f} | {timing.micro_steps_per_step(t.gens):.2f} | "
           f"{timing.last_row_steps(t.gens)} | {timing.macro_step_cost(t, res['base']):.2f} | "
           f"{t.prefill_s:.3f} | {t.compile_s:.0f} |")


def verify_exactness(model, tok, prompt: list[int], n_new: int, dtype: str,
                     timings: dict[int, dict]) -> str:
  """Whether verify's tokens are the base's in every row: in the decoding dtype at each batch
  (decode_rows' `timings`, batch -> run -> BatchTiming), and, where that dtype is not float32,
  at batch 1 again in an engine of float32 with matmuls at "highest" (the precision the stored
  reference is computed at), its compiles reported."""
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks import timing  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  measured = ", ".join(f"batch {b} {same_rows(t['verify'], t['base'])}"
                       for b, t in timings.items())
  head = f"- verify's rows whose tokens are the base's: {dtype}, the decoding dtype: {measured}"
  if dtype == "float32":
    return f"{head}; float32 at \"highest\": the same dtype here, not decoded again"
  engine = Engine(model, tok, stop_ids=(), dtype="float32", matmul_precision="highest")
  with cache.counting(cache.CompileCounts()) as counts:
    res = timing.time_batches(engine, [prompt], n_new, REPEATS,
                              {"base": {"mode": "base"}, "verify": {"mode": "verify"}})
  base, verify = res["base"], res["verify"]
  return (f"{head}; float32 at \"highest\", an engine of its own: batch 1 "
          f"{same_rows(verify, base)} (base {base.tokens_per_s:.1f} tok/s, verify "
          f"{verify.tokens_per_s:.1f}; compile s: base {base.compile_s:.0f}, verify "
          f"{verify.compile_s:.0f}; {programs(counts)})")


def transformers_line(model, tiny: bool, prompt: list[int], n_new: int, dtype: str,
                      ours) -> str:
  """The base's batch-1 rate (`ours`: decode_rows' base run, in `dtype`) against transformers'
  generate of the same weights (infer.bench --mode base's model and timing) on the same device
  where torch sees it; a missing package or a failure is the line instead."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    return f"- batch 1, the base against transformers' generate: not run, {e.name} is missing"
  import jax  # pylint: disable=import-outside-toplevel
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks import decode_bench  # pylint: disable=import-outside-toplevel
  from hamburger_jax.convert import hf  # pylint: disable=import-outside-toplevel
  on_gpu = jax.default_backend() == "gpu"
  device = "cuda" if on_gpu and torch.cuda.is_available() else "cpu"
  blind = ", torch sees no GPU" if on_gpu and device == "cpu" else ""
  head = (f"- batch 1, the base against transformers' generate (transformers "
          f"{transformers.__version__}, torch {torch.__version__}; ours {dtype}, transformers "
          f"float32 on torch's {device}{blind})")
  try:
    with tempfile.TemporaryDirectory() as tmp:
      base = pretrained.DEFAULT_BASE
      if tiny:  # random weights: transformers reads them from an HF directory written here
        base = os.path.join(tmp, "base")
        hf.save(model.base, model.cfg.base, base)
      ref = decode_bench.transformers_model(base, device)
    t = time.perf_counter()
    # one row: no padding, whatever the pad id
    decode_s, prefill_s, out = decode_bench.time_transformers(ref, 0, [prompt], n_new, REPEATS)
    spent = time.perf_counter() - t
  except Exception as e:  # pylint: disable=broad-except
    return f"{head}: failed, {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
  theirs = n_new / decode_s
  same = sum(g.token_ids == h for g, h in zip(ours.gens, out))
  return (f"{head}: ours {ours.tokens_per_s:.1f} tok/s, transformers {theirs:.1f}: "
          f"{ours.tokens_per_s / theirs:.2f}x; identical greedy rows {same}/1; prefill s "
          f"{ours.prefill_s:.3f}, {prefill_s:.3f}; compile s: ours {ours.compile_s:.0f} "
          f"(the base row's), transformers none (its {spent:.0f} s of runs include an untimed "
          "warm-up)")


def verify_profile_lines(runner, timings: dict) -> Iterator[str]:
  """One verify step at batch 1, its parts timed alone (verify_bench.step_profile_lines) against
  the whole step as decode_rows measured it (`timings`: its runs at batch 1): the decode time
  over the forwards, verify's and the base's."""
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks.verify_bench import step_profile_lines  # pylint: disable=C0415
  per_step = lambda t: t.decode_s / sum(g.macro_steps for g in t.gens)
  whole = {DEFAULT_DRAFT_CONFIDENCE: (per_step(timings["verify"]), per_step(timings["base"]))}
  t = time.perf_counter()
  with cache.counting(cache.CompileCounts()) as counts:
    lines = step_profile_lines(runner, whole, REPEATS)
  yield from lines
  yield ""
  yield (f"- its parts compiled and timed in {time.perf_counter() - t:.0f} s "
         f"({programs(counts)})")


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
  cmd = [sys.executable, "-m", CHECK, "--part", "decode_command_buffers",
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
  model, tok, prompts = models(args, default_micro_vocab=True)
  engine = Engine(model, tok, stop_ids=())
  n_new = 32 if args.tiny else 128
  yield from decode_rows(engine, prompts[:1], n_new, xla_flags())
  yield from profile_lines(engine, prompts[:1], n_new, xla_flags())


def part_decode(args) -> Iterator[str]:
  """Its markdown a line at a time, in priority order: the many-row batch (its table, then where
  its device time goes), batch 1's table, verify's exactness in both dtypes, the base against
  transformers, one verify step's parts, batch 1 again with XLA's GPU command buffers on for
  while loops and conditionals, then the step costs and batch 1's profiles."""
  import jax  # pylint: disable=import-outside-toplevel
  from hamburger_jax import cache  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks import report, timing, widths  # pylint: disable=C0415
  model, tok, prompts = models(args, default_micro_vocab=True)
  cache_dir = jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
  n_new = 32 if args.tiny else 128
  many = 4 if args.tiny else 32
  vocab = ("the full vocabulary" if model.micro_vocab_size is None else
           f"the default micro vocabulary's {model.micro_vocab_size} ids")
  yield (f"- {model.cfg.base.num_layers}-layer base, {n_new} new tokens a row (EOS ignored); "
         f"micro steps choose among {vocab}; "
         "tok/s = tokens all rows generated / the time the batch decoded, its prefills apart "
         f"(prefill s: the rows' prefills, added up); best of {REPEATS} interleaved rounds; same "
         "tokens as base: rows whose tokens equal the base run's (verify's must all; "
         "HAMburger's need not); compile s: compiled, or loaded from the persistent compilation cache "
         f"({cache_dir or 'off here'}) where an earlier part or run compiled it")
  yield ("- the rows with command buffers run in a process of their own (XLA reads its "
         "flags when the backend starts), which allocates device memory as it goes")
  if jax.default_backend() != "gpu":
    yield (f"- `{COMMAND_BUFFERS}`: a GPU flag, no effect on "
           f"{jax.default_backend()} (its rows rehearse the plumbing)")
  timings, engines = {}, {}  # batch -> run -> BatchTiming; batch -> (engine, its prompts)
  for b in (many, 1):
    ids = (prompts * (b // len(prompts) + 1))[:b]
    engine = Engine(model, tok, stop_ids=())  # one per batch size; the confidences share it
    engines[b], timings[b] = (engine, ids), {}
    yield ""
    yield (f"- batch {b}: decoding layout {'fused' if engine.fused else 'separate'} "
           f"{engine.dtype}")
    yield ""
    yield "| " + " | ".join(DECODE_HEADER) + " |"
    yield "|" + "---|" * DECODE_COLUMNS
    with cache.counting(cache.CompileCounts()) as counts:
      yield from decode_rows(engine, ids, n_new, xla_flags(), timings[b])
    yield ""
    yield f"- batch {b}'s {programs(counts)}"
    if b == many:  # where its time goes, before batch 1 (whose figures an earlier run has)
      yield from profile_lines(engine, ids, n_new, xla_flags())
  first, ids1 = engines[1]
  yield ""
  yield verify_exactness(model, tok, ids1[0], n_new, str(first.dtype), timings)
  yield transformers_line(model, args.tiny, ids1[0], n_new, str(first.dtype),
                          timings[1]["base"])
  yield ""
  yield from verify_profile_lines(first.runner, timings[1])
  # After verify's figures: the child compiles every program again, under other flags.
  defaults = {name: t.tokens_per_s for name, t in timings[1].items()}
  versus, later = {}, []  # with command buffers over the defaults; the child's profiles
  yield ""
  yield (f"- batch 1 again, XLA flags `{COMMAND_BUFFERS}` added (its own process):")
  yield ""
  yield "| " + " | ".join(DECODE_HEADER) + " |"
  yield "|" + "---|" * DECODE_COLUMNS
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
  cost = timing.step_costs(first.runner, REPEATS, 1)
  yield (f"- batch 1, steps in a jitted loop: r = micro step / base step = "
         f"{cost['micro'] / cost['base']:.3f}; a base step reading a merged entry costs "
         f"{cost['merged'] / cost['base'] - 1:+.1%}")
  bound = report.bytes_bound_lines(model.cfg, str(first.dtype), widths.KV_ENTRIES,
                                   {"full": None})
  yield f"- {bound[0].strip()}"
  yield from (f"  {line}" for line in bound[1:])
  yield from profile_lines(first, ids1, n_new, xla_flags())
  yield from later
