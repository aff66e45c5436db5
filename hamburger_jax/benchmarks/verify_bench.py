"""infer.bench --mode verify: verify mode against the base in one engine (the same tokens,
several a forward where the micro decoder's drafts are kept), at each --draft-confidence, and
what a forward of k new tokens costs against one of 1 (the verify step's price)."""

from __future__ import annotations

import collections

from hamburger_jax import cli
from hamburger_jax.benchmarks import widths
from hamburger_jax.benchmarks.prompts import PROMPTS, chat_ids
from hamburger_jax.benchmarks.report import launch_lines
from hamburger_jax.benchmarks.timing import time_batches


def kept_shares(gens) -> str:
  """The share of forwards that kept 1, 2, .. tokens (drafts kept + 1), pooled over rows."""
  counts = collections.Counter(n for g in gens for n in g.groups)
  total = max(sum(counts.values()), 1)
  return " / ".join(f"{counts[n] / total:.2f}" for n in range(1, max(counts, default=1) + 1))


def bench_verify(args) -> None:
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.costs import peaks  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel

  checkpoint = pretrained.resolve_checkpoint(args.checkpoint)
  size = cli.micro_vocab_size(args.micro_vocab, checkpoint, "verify")
  model, tok = cli.load_model("both", checkpoint, args.base, untrained_ok=True,
                              micro_vocab=args.micro_vocab)
  engine = Engine(model, tok, stop_ids=(), matmul_precision=args.precision)
  k = model.max_group
  drafter = model.drafts_with
  print(f"verify mode on {pretrained.describe('base', None, args.base)}: drafts from "
        f"{checkpoint or 'an UNTRAINED graft'}'s {drafter} ({size or 'full'} micro vocab); "
        f"{peaks.cpu_model()}; greedy, {args.new_tokens} new tokens/row (EOS ignored); tok/s = "
        "tokens all rows generated / the time the batch decoded (the prefills apart), each "
        "setting timed in the same rounds as its base; kept = tokens a forward kept (the base's "
        "own and the drafts it agreed with), shares of forwards keeping 1 / 2 / ..")
  print("\n| batch | draft confidence | base tok/s | verify tok/s | ratio | tokens/forward | "
        "kept 1 / 2 / .. | same tokens | compile s (base, verify) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for b in args.batches:
    ids = chat_ids(tok, (PROMPTS * (b // len(PROMPTS) + 1))[:b])
    runs = {"base": {"mode": "base"},
            **{f"verify {c:g}": {"mode": "verify", "draft_confidence": c}
               for c in args.draft_confidences}}
    out = time_batches(engine, ids, args.new_tokens, args.repeats, runs)
    base = out["base"]
    for c in args.draft_confidences:
      t = out[f"verify {c:g}"]
      same = sum(g.token_ids == h.token_ids for g, h in zip(t.gens, base.gens))
      per = t.tokens / sum(g.macro_steps for g in t.gens)
      print(f"| {b} | {c:g} | {base.tokens_per_s:.1f} | {t.tokens_per_s:.1f} | "
            f"{t.tokens_per_s / base.tokens_per_s:.2f}x | {per:.2f} | {kept_shares(t.gens)} | "
            f"{same}/{b} | {base.compile_s:.0f}, {t.compile_s:.0f} |")
  costs = cli.phase("k-token forwards", lambda: widths.token_costs(
      engine.runner.base, list(range(1, k + 1)), args.batches, widths.KV_ENTRIES, args.repeats))
  print(f"\na forward of k new tokens in each of a batch's sequences (KV cache of "
        f"{widths.KV_ENTRIES} entries, the decoding layout, {widths.STEPS} steps per jitted "
        "call, best of the rounds) against one of 1 token: what a verify step costs in base "
        "steps\n")
  print("| batch | " + " | ".join(f"k = {i}" for i in range(1, k + 1)) + " |")
  print("|---|" + "---|" * k)
  for b in args.batches:
    one = costs[(b, 1)]
    print(f"| {b} | {1e3 * one:.1f} ms | " + " | ".join(
        f"{costs[(b, i)] / one:.2f}x" for i in range(2, k + 1)) + " |")
  print("\n".join(launch_lines(engine.runner, 1, widths.KV_ENTRIES, model,
                               tpu_fusions=not args.no_tpu_fusions)))
