"""How closely decoding in a narrower dtype (bfloat16: precision.DECODE_DTYPES on a GPU or TPU)
follows float32, teacher-forced so that one early difference does not decide the rest.

Free-running greedy decoding compares poorly across dtypes: the first differing token changes
every later input, and in HAMburger every later merge decision. Here both dtypes read the same
sequences, made once in float32 at "highest": the base's own greedy answers (one token an entry)
and HAMburger's generations with their groups (the same merged entries for both dtypes). At every
response token each dtype's decoding layout (model/decode_layout.py) predicts a token, as
decoding would at that point (token 0 of a group from the base's head, later ones from the micro
steps); the agreement is the share of tokens where the two predictions are equal, also split by
whether the predicting entry is a merged group (where the base's adapters act) or not.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax import layout, precision
from hamburger_jax.decode.engine import Engine
from hamburger_jax.model.decode_layout import decode_layout
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import causal_segment_mask


@dataclasses.dataclass(frozen=True)
class Decoded:
  """A prompt and a response decoded from it, in the groups its decoding emitted."""
  prompt: tuple[int, ...]
  tokens: tuple[int, ...]
  groups: tuple[int, ...]


def float32_sequences(model: Hamburger, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      confidences: Sequence[float]) -> dict[str, list[Decoded]]:
  """{"base": the base's greedy answers (groups of 1), "hamburger c=C": HAMburger's at each
  confidence C with its groups}, decoded in float32 at "highest" with EOS ignored (every row
  `max_new_tokens` long)."""
  engine = Engine(model, None, stop_ids=(), dtype="float32", matmul_precision="highest")
  rows = [list(p) for p in prompts]
  base = engine.generate(rows, max_new_tokens=max_new_tokens, mode="base")
  out = {"base": [Decoded(tuple(p), tuple(g.token_ids), (1,) * len(g.token_ids))
                  for p, g in zip(prompts, base)]}
  for c in confidences:
    gens = engine.generate(rows, max_new_tokens=max_new_tokens, mode="hamburger", confidence=c)
    out[f"hamburger c={c:g}"] = [Decoded(tuple(p), tuple(g.token_ids), tuple(g.groups))
                                 for p, g in zip(prompts, gens)]
  return out


def forced_predictions(runner: Hamburger, seqs: Sequence[Decoded]
                       ) -> list[tuple[np.ndarray, np.ndarray]]:
  """Per sequence, (the token `runner` predicts at each response token [R], whether that
  token's group is predicted from a merged entry [R]), every sequence teacher-forced with its
  own groups in one batch (training layout: layout.layout_sample)."""
  k = runner.max_group
  offset = runner.cfg.graft.position_offset
  samples = [layout.layout_sample(s.prompt, s.tokens, s.groups, k, offset) for s in seqs]
  batch = layout.pack_rows([[s] for s in samples], max(s.num_entries for s in samples),
                           max(s.num_groups for s in samples), k).as_dict()
  graphdef, state = nnx.split(runner)
  predict = jax.jit(lambda state, batch: _predict(nnx.merge(graphdef, state), batch))
  tokens = np.asarray(predict(state, {n: jnp.asarray(v) for n, v in batch.items()}))
  out = []
  for r, s in enumerate(samples):
    g = s.num_groups
    valid = np.arange(k)[None, :] < s.target_size[:, None]  # [G, K]: the group's own tokens
    merged = np.broadcast_to((s.input_size[s.pred_index] >= 2)[:, None], valid.shape)
    out.append((tokens[r, :g][valid], merged[valid]))
  return out


def _predict(model: Hamburger, batch) -> jax.Array:
  """[B, G, K] token ids: at each group's step i, what decoding picks there given the group's
  tokens before i (step 0: the base's head on the features; later steps: the micro decoder's
  choice, over its reduced vocabulary where one is set)."""
  ids, size = batch["input_ids"], batch["input_size"]
  b = ids.shape[0]
  mask = causal_segment_mask(batch["segment_ids"])
  feats, _ = model.base_features(model.smash(ids, size), batch["positions"], mask,
                                 merged_bt=size >= 2)
  feats = feats[jnp.arange(b)[:, None], batch["pred_index"]]  # [B, G, F, D]
  g, f, d = feats.shape[1:]
  h = model.micro_hidden(feats.reshape(b * g, f, d), batch["target_ids"].reshape(b * g, -1))
  first = jnp.argmax(model.logits(h[:, 0]), axis=-1)
  rest = model.micro_greedy(h[:, 1:])
  return jnp.concatenate([first[:, None], rest], axis=1).reshape(b, g, -1)


def agreement(model: Hamburger, seqs: Sequence[Decoded], dtype: str = "bfloat16") -> dict:
  """`dtype`'s decoding layout against float32's (at "highest") on `seqs`: {"tokens", "agree"
  (share of equal predictions), "merged"/"unmerged" (the same over tokens predicted from a
  merged entry / from any other; None without such tokens), "forced_vs_decoded" (float32's
  predictions against the sequences themselves: 1.0 when teacher forcing reproduces
  decoding)}."""
  with precision.matmuls("highest"):
    ref = forced_predictions(decode_layout(model, dtype="float32"), seqs)
  got = forced_predictions(decode_layout(model, dtype=dtype), seqs)
  want = np.concatenate([t for t, _ in ref])
  same = np.concatenate([t for t, _ in got]) == want
  merged = np.concatenate([m for _, m in ref])
  share = lambda sel: float(np.mean(same[sel])) if sel.any() else None
  return {"tokens": int(same.size), "agree": float(np.mean(same)), "merged": share(merged),
          "merged_tokens": int(merged.sum()), "unmerged": share(~merged),
          "forced_vs_decoded": float(np.mean(want == np.concatenate([s.tokens for s in seqs])))}
