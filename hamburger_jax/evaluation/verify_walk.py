"""What verify mode's drafts are worth, teacher-forced on the base's own answers read as single
tokens (a plain context, as verify drafts), with no decoding:

  marginal   draft i is the base's token (`agree`[i]), over every position of the answers where
             the window has it: each draft scored as if every draft before it were right;
  chained    1 + the sum over i of the share of windows whose drafts 1..i are ALL the base's:
             the tokens a forward of greedy verify if every position started a step and every
             draft were proposed (draft confidence 0, no stop id, room left);
  walk       greedy verify replayed: from the answer's first token, a step emits token 0 and
             the drafts it proposes (the stop head at the draft confidence, stop ids, the
             tokens left) while they are the base's, and the next step starts after them.
             Its tokens a forward is what the engine gets on the same prompts (greedy), up to
             float ties: `infer.eval --tasks drafts` prints both.

A draft after a refused one is never read, and a kept draft is the base's token, so the inputs
a drafter sees on every path that counts are the teacher-forced ones (its inputs past the
verified position are token embeddings): these figures need no rollout of its own drafts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax.data.tfds_builder import from_bfloat16_bits
from hamburger_jax.model.hamburger import continues

_BUCKET = 64  # answer positions padded to a multiple (few compiled shapes)


@dataclasses.dataclass
class DraftWindows:
  """Per answer position j of one record (the window from token j): whether draft i is the
  base's token [R, K] (column 0, token 0, is the base's own), whether the drafting decoder's stop
  head goes on after token i at the draft confidence [R, K], and the window's size [R]."""
  agree: np.ndarray
  goes: np.ndarray
  size: np.ndarray
  tokens: np.ndarray  # [R] the answer


def single_token_records(model, records: Sequence[Any], bar=None) -> list[dict[str, Any]]:
  """Fidelity-set records (evaluation/fidelity_set.py) read as single tokens, with the base's
  signals at every answer position (the features that predict each token, its top-k)."""
  from hamburger_jax.evaluation.fidelity import teacher_records  # pylint: disable=C0415
  plain = [dataclasses.replace(r, groups=(1,) * len(r.response)) for r in records]
  return teacher_records(model, plain, bar=bar)


def draft_windows(model, records: Sequence[Mapping[str, Any]], draft_confidence: float = 0.0
                  ) -> list[DraftWindows]:
  """Each record's windows (DraftWindows), drafted teacher-forced by the decoder verify mode
  drafts with (Hamburger.drafts_with), one jitted call a record."""
  k = model.max_group
  graphdef, state = nnx.split(model)

  @jax.jit
  def windows(state, feats_rfd, window_rk, top1_rk):
    m = nnx.merge(graphdef, state)
    h = m.micro_hidden(feats_rfd, window_rk, drafting=True)  # [R, K, D]
    # Token 0 from the base's head; drafts from the micro steps' (a reduced vocabulary's).
    t0 = jnp.argmax(m.logits(h[:, :1]), axis=-1)
    drafts = m.micro_greedy(h[:, 1:])
    argmax = jnp.concatenate([t0, drafts], axis=1)
    stop = m.stop_logits(h, drafting=True)  # [R, K]
    return argmax == top1_rk, continues(stop, draft_confidence)

  out = []
  for r in records:
    p = int(r["prompt_len"])
    answer = np.asarray(r["input_ids"])[p:]
    n = len(answer)
    rows = -(-n // _BUCKET) * _BUCKET
    feats = np.zeros((rows, *np.shape(r["teacher_features"])[1:]), np.float32)
    feats[:n] = from_bfloat16_bits(r["teacher_features"])
    top1 = np.asarray(r["teacher_topk_ids"])[:, 0]
    idx = np.arange(rows)[:, None] + np.arange(k)[None, :]
    window = np.where(idx < n, np.pad(answer, (0, rows + k))[idx], 0).astype(np.int32)
    top1_w = np.where(idx < n, np.pad(top1, (0, rows + k))[idx], -1).astype(np.int32)
    agree, goes = jax.device_get(windows(state, feats.astype(jnp.dtype(model.cfg.base.dtype)),
                                         window, top1_w))
    out.append(DraftWindows(np.asarray(agree)[:n], np.asarray(goes)[:n],
                            np.minimum(k, n - np.arange(n)), answer))
  return out


def chained(windows: Sequence[DraftWindows]) -> dict[str, Any]:
  """The marginal and chained figures (module docstring) pooled over every record's windows."""
  k = windows[0].agree.shape[1]
  agree = np.concatenate([w.agree for w in windows])
  size = np.concatenate([w.size for w in windows])
  has = np.arange(k)[None, :] < size[:, None]
  run = np.cumprod(agree[:, 1:] & has[:, 1:], axis=1)  # drafts 1..i all the base's
  marginal = {f"d{i}": float(agree[has[:, i], i].mean()) if has[:, i].any() else None
              for i in range(1, k)}
  return {"marginal": marginal, "chained": float(1 + run.sum(1).mean()),
          "windows": int(len(size))}


def walk(windows: Sequence[DraftWindows], stop_ids: Sequence[int] = ()) -> dict[str, Any]:
  """Greedy verify replayed over each answer (module docstring): the steps it takes and the
  tokens a forward, pooled (tokens over steps), with each record's step count."""
  stops = set(int(s) for s in stop_ids)
  steps_each = []
  for w in windows:
    n, k = len(w.tokens), w.agree.shape[1]
    j = steps = 0
    while j < n:
      kept = 0
      # Draft i + 1 is proposed while the stop head goes on after token i, token i is no stop
      # id and the answer has room; it is kept while it is the base's.
      while (kept + 1 < w.size[j] and w.goes[j, kept] and int(w.tokens[j + kept]) not in stops
             and w.agree[j, kept + 1]):
        kept += 1
      j += 1 + kept
      steps += 1
    steps_each.append(steps)
  tokens = sum(len(w.tokens) for w in windows)
  return {"tokens_per_forward": tokens / max(sum(steps_each), 1), "steps": steps_each,
          "tokens": tokens}


def draft_figures(model, records: Sequence[Mapping[str, Any]], draft_confidence: float = 0.0,
                  stop_ids: Sequence[int] = ()) -> dict[str, Any]:
  """Marginal, chained and walked figures of the drafts on single-token records."""
  windows = draft_windows(model, records, draft_confidence)
  out = chained(windows)
  walked = walk(windows, stop_ids)
  return {**out, "walk_tokens_per_forward": walked["tokens_per_forward"],
          "walk_steps": walked["steps"], "draft_confidence": draft_confidence,
          "drafter": model.drafts_with}


def drafts_task(model, engine, *, path: str | None = None, limit: int | None = None,
                draft_confidence: float = 0.0) -> dict[str, Any]:
  """results.json's `drafts` entry: the figures on the fidelity set (default: the committed
  one) read as single tokens, and the engine's greedy verify on the same prompts, each answer's
  length the most it may generate: its tokens a forward beside the walk's, and how many records
  take the walk's steps exactly."""
  # pylint: disable=import-outside-toplevel
  import sys
  from tqdm import tqdm
  from hamburger_jax.decode.engine import Engine
  from hamburger_jax.decode.requests import Request, pooled_tokens_per_step
  from hamburger_jax.evaluation import fidelity_set
  fset = fidelity_set.load(path)
  fidelity_set.check_fits(fset, model.base, model.max_group)
  chosen = fset.records[:limit] if limit else fset.records
  with tqdm(total=len(chosen), desc="drafts: the teacher", unit="record", file=sys.stderr) as bar:
    records = single_token_records(model, chosen, bar=bar)
  out = draft_figures(model, records, draft_confidence, engine.stop_ids)
  if engine.draft_lookup:  # the walk is the drafter's: the engine's steps without lookups
    engine = Engine(model, engine.tokenizer, stop_ids=engine.stop_ids, draft_lookup=0,
                    matmul_precision=engine.precision)
  gens = engine.generate([Request(list(r.prompt), max_new_tokens=len(r.response), id=i,
                                  draft_confidence=draft_confidence)
                          for i, r in enumerate(chosen)], mode="verify")
  steps = [g.macro_steps for g in gens]
  return {"metric": "chained", "score": out["chained"], "n": len(records),
          "set": path or fidelity_set.DEFAULT_PATH, **out,
          "engine_tokens_per_forward": pooled_tokens_per_step(gens),
          "engine_same_answers": sum(g.token_ids == list(r.response)
                                     for g, r in zip(gens, chosen)),
          "walk_equals_engine": sum(a == b for a, b in zip(out["walk_steps"], steps))}
