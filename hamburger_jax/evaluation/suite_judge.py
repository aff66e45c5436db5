"""Judging grafts by free generation on a suite (evaluation/suite.py): greedy answers of the base
and of HAMburger at each confidence, scored by the items' checkers, and a verdict between grafts.

Per confidence c a judgement reports: each task's score with its paired difference to the base
(95% paired bootstrap), the KV compression (tokens per macro step), chat ROUGE-L against the
base's answers, and the share of accepted micro tokens that are the base's: of the tokens a micro
step emitted (index >= 1 in their group), those the base itself would choose after the same
prefix (its greedy token, from one teacher-forced forward over the answer).

Between grafts judged on the same suite (a window's init and its trained graft), `merit` ranks
and `loses_to` guards:
  merit     mean over the confidences of KV compression x quality, quality the mean of the
            number tasks' pooled score relative to the base's and of chat ROUGE-L: how many
            base-quality tokens a KV entry holds
  loses_to  at the guard confidence (0.8) the pooled number-task score is below the other
            graft's beyond the paired interval (the interval's upper end < 0)
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax.decode.requests import kv_compression
from hamburger_jax.evaluation.statistics import bootstrap_ci, paired_bootstrap_ci
from hamburger_jax.evaluation.suite import (Suite, SuiteError, SuiteItem, compile_items,
                                            decode_items, progress_log, score)

CONFIDENCES = (0.5, 0.7, 0.8)
GUARD_CONFIDENCE = 0.8


@functools.partial(jax.jit, static_argnums=0)
def _base_argmax(graphdef, state, ids_bt: jax.Array, segments_bt: jax.Array) -> jax.Array:
  return jnp.argmax(nnx.merge(graphdef, state)(ids_bt, segments_bt), axis=-1)


def base_choices(base, rows: Sequence[Sequence[int]], batch: int = 8) -> list[np.ndarray]:
  """The base's greedy token after every prefix of each row: out[r][j] follows rows[r][:j + 1].
  Rows go in batches of similar length, each padded to its longest row's power of two: few
  programs, and a short answer is not run at the longest one's width."""
  graphdef, state = nnx.split(base)
  out: list[np.ndarray] = [np.zeros(0, np.int32)] * len(rows)
  order = sorted(range(len(rows)), key=lambda r: len(rows[r]))
  for s in range(0, len(order), batch):
    chunk = order[s:s + batch]
    longest = max(len(rows[r]) for r in chunk)
    width = 1 << max(int(np.ceil(np.log2(max(longest, 1)))), 4)
    ids = np.zeros((batch, width), np.int32)
    seg = np.zeros((batch, width), np.int32)
    for i, r in enumerate(chunk):
      ids[i, :len(rows[r])], seg[i, :len(rows[r])] = rows[r], 1
    choice = np.asarray(_base_argmax(graphdef, state, ids, seg))
    for i, r in enumerate(chunk):
      out[r] = choice[i, :len(rows[r])]
  return out


def micro_base_share(base, items: Sequence[SuiteItem], gens: Sequence, batch: int = 8
                     ) -> tuple[int, int]:
  """(micro tokens the base would choose too, micro tokens) over the generations."""
  rows = [list(it.prompt) + list(g.token_ids) for it, g in zip(items, gens)]
  same = total = 0
  for it, g, choice in zip(items, gens, base_choices(base, rows, batch)):
    p, j = len(it.prompt), 0
    for size in g.groups:
      for k in range(1, size):  # token j + k of the answer, emitted by micro step k
        total += 1
        same += int(choice[p + j + k - 1] == g.token_ids[j + k])
      j += size
  return same, total


@dataclasses.dataclass
class Judgement:
  """One graft's free generation on a suite: summary numbers and per-item scores."""
  name: str
  by_c: dict[float, dict[str, Any]]
  scores: dict[float, list[float]]  # per item, suite order
  tasks: list[str]
  seconds: float = 0.0  # what judging takes with its programs compiled

  def merit(self) -> float:
    return float(np.mean([v["merit"] for v in self.by_c.values()]))

  def numbers(self) -> dict[str, Any]:
    """What results files keep: each confidence's summary ("c0.5", ...) and the merit."""
    return {f"c{c:g}": v for c, v in self.by_c.items()} | {"merit": self.merit()}


@dataclasses.dataclass
class BaseRun:
  """The base's greedy answers to a suite, decoded once per judge (its dtype, its device)."""
  gens: list
  scores: list[float]
  same_as_suite: float  # share of answers equal to the suite's stored base answers


def compile_judge(engine, suite: Suite, batch: int,
                  log: Callable[[str], None] = lambda line: None,
                  modes: Sequence[str] = ("base", "hamburger")) -> float:
  """Compiles the `modes`' programs for the suite together (by default the base's and
  HAMburger's), before the first decode (the confidences, and later grafts set on the engine,
  reuse them); returns the seconds."""
  before = len(engine.programs)
  seconds = compile_items(engine, suite.items, modes, batch)
  names = " and ".join("HAMburger" if m == "hamburger" else m for m in modes)
  log(f"judge: {len(engine.programs) - before} programs compiled in {seconds:.0f} s "
      f"({names} together)")
  return seconds


def run_base(engine, suite: Suite, batch: int,
             log: Callable[[str], None] = lambda line: None) -> BaseRun:
  gens = decode_items(engine, suite.items, mode="base", confidence=1.0, batch=batch,
                      progress=progress_log(log, "base"))
  decode = _decoder(engine)
  scores = [score(it, g.token_ids, g.token_ids, decode) for it, g in zip(suite.items, gens)]
  same = float(np.mean([tuple(g.token_ids) == it.base for it, g in zip(suite.items, gens)]))
  return BaseRun(gens, scores, same)


def _decoder(engine) -> Callable[[Sequence[int]], str] | None:
  tok = engine.tokenizer
  return None if tok is None else (lambda ids: tok.decode(list(ids), skip_special_tokens=True))


def judge(engine, suite: Suite, base: BaseRun, name: str,
          confidences: Sequence[float] = CONFIDENCES, batch: int = 32,
          micro_share: bool = True, log: Callable[[str], None] = lambda line: None
          ) -> Judgement:
  """Free generation of `engine`'s graft on the suite at each confidence, against `base`."""
  decode = _decoder(engine)
  items = suite.items
  by_c, scores = {}, {}
  seconds = []
  for c in confidences:
    t = time.monotonic()
    gens = decode_items(engine, items, mode="hamburger", confidence=c, batch=batch,
                        progress=progress_log(log, f"{name} c={c:g}"))
    s = [score(it, g.token_ids, b.token_ids, decode)
         for it, g, b in zip(items, gens, base.gens)]
    scores[c] = s
    by_c[c] = _summary(suite, gens, s, base, engine.merge_layer, engine.base_cfg.num_layers)
    if micro_share:
      same, total = micro_base_share(engine.model.base, items, gens)
      by_c[c].update(micro_tokens=total, micro_base_share=same / total if total else float("nan"))
    seconds.append(time.monotonic() - t)
    log(f"{name} c={c:g}: " + summary_line(by_c[c]))
  # The first confidence compiled the programs (when new); the others ran them as a later judge
  # with the same engine does.
  warm = seconds[1:] or seconds
  return Judgement(name, by_c, scores, suite.tasks, len(seconds) * sum(warm) / len(warm))


def _summary(suite: Suite, gens: Sequence, s: Sequence[float], base: BaseRun,
             merge_layer: int = 0, num_layers: int = 1) -> dict[str, Any]:
  """One confidence's figures; KV compression at the graft's merge layer."""
  kv = lambda g: kv_compression(g, merge_layer, num_layers)
  out: dict[str, Any] = {"tasks": {}, "kv_compression": kv(gens)}
  number = [i for i, it in enumerate(suite.items) if it.checker != "rouge"]
  chat = suite.of_checker("rouge")
  for task in suite.tasks:
    idx = [i for i, it in enumerate(suite.items) if it.task == task]
    ham, ref = [s[i] for i in idx], [base.scores[i] for i in idx]
    out["tasks"][task] = {
        "n": len(idx), "checker": suite.items[idx[0]].checker, "score": float(np.mean(ham)),
        "ci95": list(bootstrap_ci(ham)), "base": float(np.mean(ref)),
        "delta": float(np.mean(ham) - np.mean(ref)),
        "delta_ci95": list(paired_bootstrap_ci(ham, ref)),
        "kv_compression": kv([gens[i] for i in idx])}
  quality = []
  if number:
    ham, ref = [s[i] for i in number], [base.scores[i] for i in number]
    out["number"] = {"score": float(np.mean(ham)), "base": float(np.mean(ref)),
                     "delta": float(np.mean(ham) - np.mean(ref)),
                     "delta_ci95": list(paired_bootstrap_ci(ham, ref))}
    # relative to the base; where the base scores nothing (a random model), 1 + the difference
    quality.append(float(np.mean(ham)) / float(np.mean(ref)) if np.mean(ref) > 0
                   else 1.0 + float(np.mean(ham) - np.mean(ref)))
  if chat:
    out["chat_rouge_l"] = float(np.mean([s[i] for i in chat]))
    quality.append(out["chat_rouge_l"])
  out["quality"] = float(np.mean(quality))
  out["merit"] = out["kv_compression"] * out["quality"]
  return out


def summary_line(v: dict[str, Any]) -> str:
  parts = [f"{v['kv_compression']:.2f}x KV"]
  if "number" in v:
    lo, hi = v["number"]["delta_ci95"]
    parts.append(f"tasks {v['number']['score']:.3f} (base {v['number']['base']:.3f}, "
                 f"{v['number']['delta']:+.3f} [{lo:+.3f}, {hi:+.3f}])")
  if "chat_rouge_l" in v:
    parts.append(f"chat ROUGE-L {v['chat_rouge_l']:.3f}")
  if "micro_base_share" in v:
    parts.append(f"micro tokens the base's {v['micro_base_share']:.1%} of {v['micro_tokens']:,}")
  return "; ".join(parts) + f"; merit {v['merit']:.3f}"


def loses_to(a: Judgement, b: Judgement, suite: Suite, c: float = GUARD_CONFIDENCE
             ) -> tuple[bool, float, tuple[float, float]]:
  """Whether `a` loses to `b` at confidence c on the pooled number tasks beyond the paired
  interval: (loses, delta, interval)."""
  idx = [i for i, it in enumerate(suite.items) if it.checker != "rouge"] or \
      list(range(len(suite.items)))
  x, y = [a.scores[c][i] for i in idx], [b.scores[c][i] for i in idx]
  lo, hi = paired_bootstrap_ci(x, y)
  return hi < 0, float(np.mean(x) - np.mean(y)), (lo, hi)


def table(judgements: Sequence[Judgement]) -> list[str]:
  """Markdown rows: each graft at each confidence, each task's score and delta."""
  tasks = judgements[0].tasks
  lines = ["| graft | c | KV | " + " | ".join(tasks) + " | micro tokens the base's | merit |",
           "|---|---|---|" + "---|" * len(tasks) + "---|---|"]
  for j in judgements:
    for c, v in j.by_c.items():
      cells = []
      for t in tasks:
        r = v["tasks"][t]
        cells.append(f"{r['score']:.3f} ({r['delta']:+.3f}, base {r['base']:.3f})")
      share = v.get("micro_base_share")
      lines.append(f"| {j.name} | {c:g} | {v['kv_compression']:.2f}x | " + " | ".join(cells) +
                   f" | {'-' if share is None else f'{share:.1%}'} | {v['merit']:.3f} |")
  return lines


def describe_micro_vocab(size: int | None) -> str:
  return "the full vocabulary" if size is None else \
      f"the first {size:,} ids of the micro vocabulary (micro_vocab.json)"


def same_micro_vocab(sizes: dict[str, int | None]) -> int | None:
  """The micro vocabulary size every graft decodes with (None: the full vocabulary). Grafts
  judged together share one engine's programs, and their scores compare only where they decode
  alike: grafts that differ are a SuiteError that names each one's."""
  if len(set(sizes.values())) > 1:
    raise SuiteError("grafts judged together must decode with the same micro vocabulary, but " +
                     "; ".join(f"{name} has {describe_micro_vocab(n)}"
                               for name, n in sizes.items()) +
                     ": load them alike (infer.eval --micro-vocab 0 for the full vocabulary)")
  return next(iter(sizes.values()), None)


def judge_grafts(models: dict[str, Any], tokenizer, suite: Suite,
                 confidences: Sequence[float] = CONFIDENCES, batch: int = 32,
                 micro_share: bool = True, log: Callable[[str], None] = lambda line: None
                 ) -> dict[str, Any]:
  """Each graft of `models` (name -> Hamburger on the same base, the first the reference; grafts
  of different layouts, e.g. merging at different layers, alike) judged on the suite against
  the base, decoded once; with two or more, each later graft against the
  first at GUARD_CONFIDENCE. Every graft must decode with the same micro vocabulary
  (same_micro_vocab). Returns the numbers and the report's lines."""
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.requests import GenerationError  # pylint: disable=C0415
  names = list(models)
  vocab = same_micro_vocab({name: m.micro_vocab_size for name, m in models.items()})
  stop_ids = tokenizer.stop_ids if tokenizer is not None else ()
  engine = Engine(models[names[0]], tokenizer, stop_ids=stop_ids)
  compile_judge(engine, suite, batch, log)
  base = run_base(engine, suite, batch, log)
  log(f"base: {base.same_as_suite:.0%} of its answers equal the suite's stored ones")
  judgements = []
  for name in names:
    try:
      engine.set_model(models[name])
    except GenerationError:  # another layout (a merge at another layer): its own programs
      engine = Engine(models[name], tokenizer, stop_ids=stop_ids)
      compile_judge(engine, suite, batch, log, modes=("hamburger",))  # the base's answers: done
    judgements.append(judge(engine, suite, base, name, confidences, batch, micro_share, log))
  out: dict[str, Any] = {"base_same_as_suite": base.same_as_suite, "micro_vocab": vocab,
                         "grafts": {j.name: j.numbers() for j in judgements}}
  lines = [f"micro steps on {describe_micro_vocab(vocab)}, every graft alike", "",
           *table(judgements)]
  if GUARD_CONFIDENCE in confidences:
    for j in judgements[1:]:
      loses, delta, (lo, hi) = loses_to(j, judgements[0], suite)
      out["grafts"][j.name]["vs_" + names[0]] = {"delta": delta, "delta_ci95": [lo, hi],
                                                 "loses": loses}
      lines.append(f"\n{j.name} against {names[0]} at c = {GUARD_CONFIDENCE:g}, number tasks: "
                   f"{delta:+.3f} [{lo:+.3f}, {hi:+.3f}]" +
                   (": loses beyond the paired interval" if loses else ""))
  out["lines"] = lines
  return out
