"""infer.bench --mode base (our base decode against transformers' generate) and --mode
hamburger (HAMburger against its base in one engine, with the micro step's cost ratio r and
the ceiling it allows), each with the launch figures of the programs it times."""

from __future__ import annotations

import os

from hamburger_jax import cli
from hamburger_jax.benchmarks import widths
from hamburger_jax.benchmarks.prompts import PROMPTS, chat_ids
from hamburger_jax.benchmarks.report import (bytes_bound_lines, group_cap, launch_lines,
                                             profiled_lines)
from hamburger_jax.benchmarks.timing import (last_row_steps, lockstep_cost, macro_step_cost,
                                             micro_steps_per_step, step_costs, time_batches,
                                             timed)
from hamburger_jax.decode.micro_rule import cost_parts, micro_sizes
from hamburger_jax.decode.shapes import generate_slots


def transformers_model(base: str, device: str = "cpu"):
  """transformers' model of a base (pretrained.resolve_base's sources) in float32 (for a GGUF
  file, the dtype transformers computes its blocks in: another casts every matmul) on torch's
  `device`, with no EOS: rows run the full length without min_new_tokens (which would mask EOS
  out of the argmax and make greedy rows differ from ours)."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  kind, path = pretrained.resolve_base(base)
  files = {}
  if kind == "gguf":
    path, files = os.path.dirname(path), {"gguf_file": os.path.basename(path)}
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, **files).to(device).eval()
  ref.generation_config.eos_token_id = None
  return ref


def time_transformers(ref, pad_id: int, ids, new_tokens: int, repeats: int
                      ) -> tuple[float, float, list[list[int]]]:
  """transformers' generate on the same prompts (left-padded, greedy, `new_tokens` new tokens
  a row) on `ref`'s device: (decode seconds, prefill seconds, its new tokens), each the best of
  `repeats`. Its prefill is a generate of one new token (one batched forward of the prompts);
  decode = the whole generate less it: the time the batch decoded, as ours is."""
  import torch  # pylint: disable=import-outside-toplevel
  b, width = len(ids), max(map(len, ids))
  input_ids = torch.full((b, width), pad_id, dtype=torch.long)
  mask = torch.zeros((b, width), dtype=torch.long)
  for i, row in enumerate(ids):
    input_ids[i, width - len(row):] = torch.tensor(row)
    mask[i, width - len(row):] = 1
  kwargs = dict(attention_mask=mask.to(ref.device), do_sample=False, pad_token_id=pad_id)

  def run(n):
    out = ref.generate(input_ids.to(ref.device), max_new_tokens=n, **kwargs)
    if out.is_cuda:  # kernels run asynchronously: the clock stops when the last has run
      torch.cuda.synchronize(out.device)
    return out

  with torch.no_grad():
    run(new_tokens)  # warm-up
    total_s = min(timed(lambda: run(new_tokens)) for _ in range(repeats))
    prefill_s = min(timed(lambda: run(1)) for _ in range(repeats))
    out = run(new_tokens)[:, width:].tolist()
  if any(len(h) != new_tokens for h in out):
    raise RuntimeError("transformers stopped early: the EOS override did not take effect")
  return total_s - prefill_s, prefill_s, out


def bench_base(args) -> None:
  import torch  # pylint: disable=import-outside-toplevel
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  from hamburger_jax.costs.peaks import copy_bandwidth_gb_s  # pylint: disable=C0415

  model, tok = pretrained.load("base", base=args.base, dtype=args.dtype,
                               param_dtype=args.dtype)
  # exactly n new tokens per row
  engine = Engine(model, tok, stop_ids=(), matmul_precision=args.precision)
  kind, path = pretrained.resolve_base(args.base or pretrained.DEFAULT_BASE)
  if kind != "gguf":
    raise SystemExit("error: --mode base compares with transformers' generate on a GGUF file: "
                     "pass --base FILE.gguf (or none: SmolLM2)")
  ref = transformers_model(path)
  bw = copy_bandwidth_gb_s()
  wbytes = widths.weight_bytes(model)
  print(f"{pretrained.describe('base', None, args.base)}, weights {args.dtype} "
        f"({wbytes / 1e6:.0f} MB), greedy, "
        f"{args.new_tokens} new tokens/row, torch threads {torch.get_num_threads()}, "
        f"copy bandwidth {bw:.1f} GB/s; tok/s = tokens all rows generated / the time the batch "
        "decoded (the prefills apart: transformers' is a generate of one token)")
  rows = []
  for b in args.batches:
    ids = chat_ids(tok, (PROMPTS * (b // len(PROMPTS) + 1))[:b])
    ours = time_batches(engine, ids, args.new_tokens, args.repeats,
                        {"base": {"mode": "base"}})["base"]
    hf_decode_s, hf_prefill_s, hf_out = time_transformers(
        ref, tok.pad_id or 0, ids, args.new_tokens, args.repeats)
    same = sum(g.token_ids == h for g, h in zip(ours.gens, hf_out))
    rows.append((b, ours.tokens_per_s, b * args.new_tokens / hf_decode_s, ours.compile_s, same,
                 ours.prefill_s, hf_prefill_s))
  print("\n| batch | ours tok/s | transformers tok/s | ratio | identical greedy rows | "
        "prefill s (ours, transformers) | compile s |")
  print("|---|---|---|---|---|---|---|")
  for b, o, h, c, same, p_ours, p_hf in rows:
    print(f"| {b} | {o:.1f} | {h:.1f} | {o / h:.2f}x | {same}/{b} | {p_ours:.2f}, {p_hf:.2f} | "
          f"{c:.1f} |")
  b1 = [r for r in rows if r[0] == 1]
  if b1:
    roofline = bw * 1e9 / wbytes
    print(f"\nbatch-1 roofline: {bw:.1f} GB/s / {wbytes / 1e6:.0f} MB per token = "
          f"{roofline:.1f} tok/s; ours {b1[0][1]:.1f} tok/s = {b1[0][1] / roofline:.0%} of it")
  by_b = {r[0]: r[1] for r in rows}
  if 1 in by_b and 8 in by_b:
    print(f"batch 8 throughput / batch 1: {by_b[8] / by_b[1]:.2f}x")
  print("\n".join(launch_lines(engine.runner, 1, 512,
                               tpu_fusions=not args.no_tpu_fusions)))

def with_micro_vocab(model, checkpoint: str | None, size: int):
  """A second HAMburger sharing `model`'s weights whose micro steps use the checkpoint's first
  `size` micro-vocabulary ids; a missing or unfit list is a one-line error."""
  from hamburger_jax import micro_vocab, pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.model.hamburger import sharing_weights  # pylint: disable=C0415
  try:
    ids = pretrained.micro_vocab_ids(checkpoint, size, model.cfg.base.vocab_size)
  except micro_vocab.MicroVocabError as e:
    raise SystemExit(f"error: {e}") from None
  return sharing_weights(model, micro_vocab=ids)

def bench_hamburger(args) -> None:
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel

  checkpoint = pretrained.resolve_checkpoint(args.checkpoint)
  model, tok = cli.load_model("both", checkpoint, args.base, untrained_ok=True)
  label = checkpoint or ("UNTRAINED graft (random weights; use --confidence 0 to force K-token "
                         "steps)")
  engine = Engine(model, tok, stop_ids=(), matmul_precision=args.precision)
  engines = {"full": engine}
  # Beside the full head, the reduced one the entry points decode with (--micro-vocab 0: none).
  size = cli.micro_vocab_size(args.micro_vocab, checkpoint, "hamburger")
  if size is not None:
    engines["reduced"] = Engine(with_micro_vocab(model, checkpoint, size), tok,
                                stop_ids=(), matmul_precision=args.precision)
  rules = args.micro_rule
  print(f"HAMburger on {pretrained.describe('base', None, args.base)}: {label}")
  print(f"greedy, {args.new_tokens} new tokens/row (EOS ignored), confidence {args.confidence}"
        f"{group_cap(args.max_group)}; r = micro step / base step, measured at each batch size "
        f"({widths.STEPS} steps per jitted loop)")
  print(f"engine layout: {'fused' if engine.fused else 'separate'} projections, "
        f"{engine.dtype}; adapter cost = a base step reading a merged entry (the adapters "
        "folded into the kernels) vs an unmerged one, and one of a batch whose every other row "
        f"reads a merged entry (mixed, in the {engine.mixed} form) vs none; micro vocab "
        "= the ids micro steps choose among (full: the whole vocabulary); micro rule = when a "
        "batch's next micro step runs (decode/micro_rule.py; off: whenever a row goes on); "
        "micro steps/step = micro steps a macro step ran (its largest group's); last row's "
        "steps = the macro steps of the row that finished last (a batch decodes until it "
        "does; the base's: one a token); macro step / base step = a step's time in the "
        "batch's, against the base's (ratio = the base's steps / last row's steps / it); "
        "same tokens = "
        "rows whose tokens equal the full "
        f"vocabulary's with micro rule {rules[0]}; tok/s = tokens all rows generated / the time "
        "the batch decoded (the prefills apart); every setting of a batch is timed in the same "
        "rounds as its base")
  print("\n| batch | micro vocab | micro rule | base tok/s | HAMburger tok/s | ratio | "
        "tokens/step k | micro steps/step | last row's steps | macro step / base step | "
        "KV entries/token | r | "
        "adapter cost (merged, mixed) | ceiling | "
        "of ceiling | same tokens | prefill s (base, ham) | compile s (base, ham) |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  ham = {"mode": "hamburger", "confidence": args.confidence, "max_group": args.max_group}
  measured, profiles = [], []
  for b in args.batches:
    ids = chat_ids(tok, (PROMPTS * (b // len(PROMPTS) + 1))[:b])
    settings = {f"{name} {rule}": eng.with_micro_rule(rule) for name, eng in engines.items()
                for rule in rules}
    out = time_batches(engine, ids, args.new_tokens, args.repeats,
                       {"base": {"mode": "base"}, **{name: ham for name in settings}}, settings)
    base = out["base"]
    first = [g.token_ids for g in out[f"full {rules[0]}"].gens]
    for name, eng in engines.items():
      cost = step_costs(eng.runner, args.repeats, b)
      r = cost["micro"] / cost["base"]
      vocab = "full" if name == "full" else str(size)
      for rule in rules:
        t = out[f"{name} {rule}"]
        k = t.tokens_per_step
        ceiling = args.new_tokens / lockstep_cost(t.gens, r)
        ratio = t.tokens_per_s / base.tokens_per_s
        same = sum(g.token_ids == f for g, f in zip(t.gens, first))
        mixed = "-" if b == 1 else f"{cost['mixed'] / cost['base'] - 1:+.1%}"
        print(f"| {b} | {vocab} | {rule} | {base.tokens_per_s:.1f} | {t.tokens_per_s:.1f} | "
              f"{ratio:.2f}x | {k:.2f} | {micro_steps_per_step(t.gens):.2f} | "
              f"{last_row_steps(t.gens)} | {macro_step_cost(t, base):.2f} | {1 / k:.2f} | "
              f"{r:.3f} | {cost['merged'] / cost['base'] - 1:+.1%}, {mixed} | {ceiling:.2f}x | "
              f"{ratio / ceiling:.0%} | {same}/{b} | {base.prefill_s:.2f}, {t.prefill_s:.2f} | "
              f"{base.compile_s:.0f}, {t.compile_s:.0f} |")
        if rule == "auto":
          slots = generate_slots(b)
          costs = settings[f"{name} {rule}"].micro_costs(eng.layout("hamburger", slots, 1, 1))
          later, step_one, merge = cost_parts(costs, slots)
          measured.append(f"- batch {b}, {vocab} micro vocab: r (r1) " + ", ".join(
              f"{m} rows {c:.3f} ({c1:.3f})" for m, c, c1 in
              zip(micro_sizes(slots), later, step_one)) + f"; m {merge:.3f}")
    if args.profile:
      runs = (("base", engine, {"mode": "base"}), *((n, e, ham) for n, e in settings.items()))
      profiles.extend(profiled_lines(runs, ids, args.new_tokens))
  if measured:
    print("\nmicro rule auto, measured (r by micro batch: a later micro step of that many rows "
          "/ a base step of the batch's slots; r1: micro step 1, which reads the F features "
          "too; m: a base step of them, every other row merged, / a plain one - 1):\n"
          + "\n".join(measured))
  print("\n".join(profiles))
  rows = {"full": None}
  if size is not None:
    rows[str(size)] = engines["reduced"].model.micro_vocab_size
  print("\n".join(bytes_bound_lines(model.cfg, str(engine.dtype), widths.KV_ENTRIES, rows)))
  print("\n".join(launch_lines(engine.runner, 1, widths.KV_ENTRIES, model,
                               tpu_fusions=not args.no_tpu_fusions)))
