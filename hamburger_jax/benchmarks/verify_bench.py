"""infer.bench --mode verify: verify mode against the base in one engine, on held-out prompts
with end of turn honoured (the same tokens, several a forward where the drafts are kept), at
each --draft-confidence; then where one verify step's time goes at batch 1 (its parts timed
alone, in the decoding layout, against the whole step as the engine ran it)."""

from __future__ import annotations

import collections
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax import cli
from hamburger_jax.benchmarks.prompts import heldout_prompts
from hamburger_jax.benchmarks.timing import batch_decode_s
from hamburger_jax.decode import step as decode_step
from hamburger_jax.decode.requests import Request, pooled_tokens_per_step
from hamburger_jax.decode.step_costs import KV_ENTRIES, STEPS, step_loop
from hamburger_jax.evaluation.statistics import BOOTSTRAP_RESAMPLES
from hamburger_jax.model.kv_cache import KVCache


def kept_shares(gens) -> str:
  """The share of forwards that kept 1, 2, .. tokens (drafts kept + 1), pooled over rows."""
  counts = collections.Counter(n for g in gens for n in g.groups)
  total = max(sum(counts.values()), 1)
  return " / ".join(f"{counts[n] / total:.2f}" for n in range(1, max(counts, default=1) + 1))


def ratio_ci(tokens: np.ndarray, steps: np.ndarray, seed: int = 0) -> tuple[float, float]:
  """95% percentile-bootstrap interval of sum(tokens) / sum(steps), the prompts resampled."""
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, len(tokens), (BOOTSTRAP_RESAMPLES, len(tokens)))
  r = tokens[idx].sum(1) / np.maximum(steps[idx].sum(1), 1)
  return float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))


def decode_rounds(engine, prompts, batch: int, max_new: int, repeats: int, runs: dict,
                  engines: dict | None = None):
  """Every prompt under each setting (`runs`: name -> generate's keyword arguments; `engines`:
  name -> another engine for that run), `batch` prompts at a time, the settings interleaved
  over `repeats` rounds after one untimed round (compiling). name -> (decode seconds of its
  fastest round, that round's generations)."""
  chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
  best: dict[str, tuple[float, list]] = {}
  for round_ in range(repeats + 1):
    for name, kw in runs.items():
      gens, seconds = [], 0.0
      settings = {k: v for k, v in kw.items() if k != "mode"}
      for chunk in chunks:
        reqs = [Request(ids, max_new_tokens=max_new, id=j, **settings)
                for j, ids in enumerate(chunk)]
        out = (engines or {}).get(name, engine).generate(reqs, mode=kw["mode"])
        seconds += batch_decode_s(out)
        gens += out
      if round_ and (name not in best or seconds < best[name][0]):
        best[name] = (seconds, gens)
  return best


def bench_verify(args) -> None:
  # pylint: disable=import-outside-toplevel
  from hamburger_jax import pretrained
  from hamburger_jax.costs import peaks
  from hamburger_jax.decode.engine import Engine

  checkpoint = pretrained.resolve_checkpoint(args.checkpoint)
  size = cli.micro_vocab_size(args.micro_vocab, checkpoint, "verify")
  model, tok = cli.load_model("both", checkpoint, args.base, untrained_ok=True,
                              micro_vocab=args.micro_vocab)
  engine = Engine(model, tok, matmul_precision=args.precision)
  # One engine a forward layout (decode/step.py: VERIFY_WIDTHS) and lookup drafts' shortest
  # match (decode/lookup.py), sharing the weights' programs.
  widths = [w or engine.verify_widths for w in args.verify_widths]
  lookups = [engine.draft_lookup if n is None else n for n in args.draft_lookups]
  kinds_of = [(w, n) for w in widths for n in lookups]
  by_kind = {(w, n): engine if (w, n) == (engine.verify_widths, engine.draft_lookup) else
             Engine(model, tok, matmul_precision=args.precision, verify_widths=w,
                    draft_lookup=n)
             for w, n in kinds_of}
  prompts = heldout_prompts(tok, args.requests)
  kinds = collections.Counter(name for name, _ in prompts)
  ids = [p for _, p in prompts]
  print(f"verify mode on {pretrained.describe('base', None, args.base)}: drafts from "
        f"{checkpoint or 'an UNTRAINED graft'}'s {model.drafts_with} ({size or 'full'} micro "
        f"vocab); {peaks.cpu_model()}; greedy; {len(ids)} held-out prompts "
        f"({', '.join(f'{n} {k}' for k, n in kinds.items())}), end of turn honoured, at most "
        f"{args.new_tokens} new tokens; base and verify interleaved over {args.repeats} rounds "
        "(the fastest kept); tok/s = the tokens all prompts generated / the time their batches "
        "decoded (prefills apart); tokens/forward pooled over the prompts, with its 95% "
        "bootstrap interval; kept = shares of forwards keeping 1 / 2 / .. tokens; lookup = "
        "lookup drafts' shortest match (0: none)")
  print("\n| batch | draft confidence | forward widths | lookup | base tok/s | verify tok/s | "
        "ratio | tokens/forward [95%] | kept 1 / 2 / .. | same answers |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  whole = {}
  for b in args.batches:
    runs = {"base": {"mode": "base"}}
    engines = {}
    for w, n in kinds_of:
      for c in args.draft_confidences:
        runs[f"verify {c:g} {w} {n}"] = {"mode": "verify", "draft_confidence": c}
        engines[f"verify {c:g} {w} {n}"] = by_kind[w, n]
    out = decode_rounds(engine, ids, b, args.new_tokens, args.repeats, runs, engines)
    base_s, base = out["base"]
    tokens = sum(g.new_tokens for g in base)
    for w, n in kinds_of:
      for c in args.draft_confidences:
        seconds, gens = out[f"verify {c:g} {w} {n}"]
        same = sum(g.token_ids == h.token_ids for g, h in zip(gens, base))
        per = pooled_tokens_per_step(gens)
        lo, hi = ratio_ci(np.array([g.new_tokens for g in gens], float),
                          np.array([g.macro_steps for g in gens], float))
        print(f"| {b} | {c:g} | {w} | {n} | {tokens / base_s:.1f} | {tokens / seconds:.1f} | "
              f"{base_s / seconds:.2f}x | {per:.2f} [{lo:.2f}, {hi:.2f}] | "
              f"{kept_shares(gens)} | {same}/{len(ids)} |")
        if b == 1 and (w, n) == (engine.verify_widths, engine.draft_lookup):
          steps = sum(g.macro_steps for g in gens)
          whole[c] = (seconds / steps, base_s / sum(g.macro_steps for g in base))
  if 1 in args.batches:
    print()
    print("\n".join(step_profile_lines(engine.runner, whole, args.repeats)))


def _timed_loop(runner, step, x, cache, repeats: int) -> float:
  """Seconds of one `step` (model, x, cache) -> (token, cache), run STEPS at a time in a jitted
  loop (decode/step_costs.py: step_loop), the fastest of the rounds."""
  graphdef, params = nnx.split(runner)
  loop = step_loop(graphdef, step)
  box = {"cache": jax.tree.map(jnp.copy, cache)}

  def call():
    t = time.perf_counter()
    token, box["cache"] = loop(params, box["cache"], x)
    jax.block_until_ready(token)
    return time.perf_counter() - t

  call()
  return min(call() for _ in range(max(3, repeats))) / STEPS


def verify_parts(runner, repeats: int) -> dict[str, float]:
  """Seconds of each part of a verify step at batch 1, in the decoding layout (`runner`): the
  base's step (one entry and its LM head: the unit), a forward of 1..K entries without its head
  (a verify step's forward is K wide where any row drafts), the LM head over K rows, the first draft (the drafting decoder on the F features and e(t0)) and
  a later draft (one input), each with its micro head and stop head."""
  k, f = runner.max_group, runner.num_features
  cfg = runner.cfg.base
  dt = jnp.dtype(cfg.dtype)

  def base_cache(entries):
    cache = KVCache.init(cfg.num_layers, 1, KV_ENTRIES, cfg.num_kv_heads, cfg.head_dim, dt)
    return cache.replace(length=jnp.full((1,), KV_ENTRIES - entries, jnp.int32))

  def forward(with_head):
    def run(m, x, cache):
      pos = cache.length[:, None] + jnp.arange(x.shape[1])[None]
      out = m.base.forward(x, pos, None, cache, pos, collect=m.feature_layers[:-1])
      hidden = out.hidden if with_head else out.hidden[:, -1:]
      token = jnp.argmax(m.logits(hidden)[:, -1], axis=-1) if with_head else \
          jnp.argmax(hidden[:, -1, :8], axis=-1)
      return token.astype(jnp.int32), out.cache
    return run

  def head(m, x, cache):
    return jnp.argmax(m.logits(x)[:, -1], axis=-1).astype(jnp.int32), cache

  def draft(i):
    def run(m, x, cache):
      h, cache = m.micro_step(i, x, cache, drafting=True)
      token = m.micro_greedy(h).astype(jnp.int32)
      return token + (m.stop_logits(h, drafting=True) > 1e9).astype(jnp.int32), cache
    return run

  x = lambda n: jnp.zeros((1, n, cfg.hidden_size), dt)
  micro = lambda: runner.micro_cache(1, drafting=True)
  out = {"base step": _timed_loop(runner, forward(True), x(1), base_cache(1), repeats)}
  for w in range(1, k + 1):  # what a forward's width costs without its head
    out[forward_name(w)] = _timed_loop(runner, forward(False), x(w), base_cache(w), repeats)
  out.update({"LM head, K rows": _timed_loop(runner, head, x(k), base_cache(1), repeats),
              "first draft": _timed_loop(runner, draft(1), x(f + 1), micro(), repeats),
              "later draft": _timed_loop(runner, draft(2), x(1), micro(), repeats)})
  return out


def forward_name(width: int) -> str:
  return f"forward of {width} entr{'y' if width == 1 else 'ies'}, no head"


def step_profile_lines(runner, whole: dict[float, tuple[float, float]],
                       repeats: int) -> list[str]:
  """Where one verify step's time goes at batch 1: each part (verify_parts) in ms and in base
  steps, their sum for a step with K - 1 drafts, and the whole step as the engine ran it (the
  decode time over its forwards, at each draft confidence; the base's step likewise); the
  difference is the loop's own work (control flow, the pool's view, sampling, bookkeeping)."""
  parts = verify_parts(runner, repeats)
  unit = parts["base step"]
  k = runner.max_group
  drafts = parts["first draft"] + (k - 2) * parts["later draft"]
  total = parts[forward_name(k)] + parts["LM head, K rows"] + drafts
  lines = [f"One verify step at batch 1, its parts timed alone ({STEPS} in a jitted loop, a "
           f"{KV_ENTRIES}-entry cache, the decoding layout, fastest of the rounds), in base "
           "steps (the base's step timed the same way):", "",
           "| part | ms | base steps |", "|---|---|---|"]
  for name, s in parts.items():
    lines.append(f"| {name} | {1e3 * s:.2f} | {s / unit:.3f} |")
  lines.append(f"| parts of a step with {k - 1} drafts | {1e3 * total:.2f} | "
               f"{total / unit:.3f} |")
  for c, (step_s, base_s) in whole.items():
    lines.append(f"| the engine's verify step, draft confidence {c:g} (its base's step "
                 f"{1e3 * base_s:.2f} ms) | {1e3 * step_s:.2f} | {step_s / base_s:.3f} of its "
                 "base's |")
  return lines
