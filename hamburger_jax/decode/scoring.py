"""Token log-probabilities of a prompt and of a generation (the OpenAI API's `logprobs` and
`echo`), recomputed after the generation by one teacher-forced forward of the engine's model
over the prompt and the emitted tokens, in the groups they were emitted in.

What a token's log-probability is: its log-probability under the distribution that chose it,
BEFORE temperature, top-k and top-p (the model's own distribution, as vLLM reports by default;
a greedy token is that distribution's argmax):
- mode "base": the base's next-token distribution at the token before;
- mode "hamburger": token 0 of a group from the base's head at that macro step (the features of
  the previous group's merged entry; for the first group, of the last prompt token), tokens
  1..K-1 from the micro-step decoder's head at their micro step (with a reduced micro
  vocabulary, over that vocabulary: every other token has probability 0);
- prompt tokens (echo) from the base in both modes: a prompt is never merged. The first prompt
  token has none (None in the API).

Recomputing, rather than recording probabilities inside the decode loop, leaves the loop as it
is and costs nothing to requests that do not ask. The forward is the training forward
(losses.hamburger_loss: smash each group, the base over prompt and merged entries at their
positions, the micro decoder teacher-forced) run on the engine's own model (its decoding
layout, dtype and matmul precision), so the numbers are the decode's up to the rounding that
separates one forward over the whole sequence from step-by-step decoding.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax import layout, precision
from hamburger_jax.decode.shapes import LENGTH_BUCKETS, bucket
from hamburger_jax.decode.step import base_of
from hamburger_jax.model.llama import causal_segment_mask

# The most alternatives a token reports (OpenAI's limit for top_logprobs); every program
# computes this many, so one program serves any request.
MAX_TOP = 20
# Rows whose full-vocabulary logits are held at once ([rows, V] float32).
CHUNK_ROWS = 64


@dataclasses.dataclass(frozen=True)
class TokenScores:
  """Log-probabilities of `token_ids`: the prompt's first (`prompt_tokens` of them, with echo),
  then the generated ones."""
  token_ids: list[int]
  logprobs: np.ndarray  # [T] float32; NaN where there is none (the first prompt token)
  top_ids: np.ndarray  # [T, n] int32, the most likely tokens by decreasing log-probability
  top_logprobs: np.ndarray  # [T, n] float32; -inf past a reduced micro vocabulary's size
  prompt_tokens: int


def _scores(model, h_nd: jax.Array, targets_n: jax.Array, micro_n: jax.Array | None,
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each row's log-probability of its target and its top MAX_TOP (log-probabilities, ids):
  the base's head, or where `micro_n` the micro steps' choice (Hamburger.micro_logits: with a
  reduced vocabulary, the others' logits at -inf), CHUNK_ROWS rows at a time."""
  base = base_of(model)
  vocab = base.cfg.vocab_size
  allowed = None
  if micro_n is not None and model.micro_ids is not None:
    allowed = jnp.zeros((vocab,), bool).at[model.micro_ids[...]].set(True)
  n, d = h_nd.shape
  c = min(CHUNK_ROWS, n)
  pad = -n % c
  micro = jnp.zeros((n,), bool) if micro_n is None else micro_n
  chunks = lambda x: jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(-1, c,
                                                                                 *x.shape[1:])

  def one(args):
    h, t, m = args
    logits = base.logits(h)  # [c, V] float32
    if allowed is not None:
      logits = jnp.where(m[:, None] & ~allowed[None, :], -jnp.inf, logits)
    logp = jax.nn.log_softmax(logits, axis=-1)
    top, ids = jax.lax.top_k(logp, min(MAX_TOP, vocab))
    return jnp.take_along_axis(logp, t[:, None], axis=-1)[:, 0], top, ids.astype(jnp.int32)

  out = jax.lax.map(one, (chunks(h_nd), chunks(targets_n), chunks(micro)))
  return tuple(x.reshape(-1, *x.shape[2:])[:n] for x in out)


def _base_program(graphdef, params, ids_t: jax.Array, length: jax.Array):
  """Row t: token t's log-probability given the tokens before it (row 0: nothing)."""
  model = nnx.merge(graphdef, params)
  base = base_of(model)
  t = ids_t.shape[0]
  segments = (jnp.arange(t) < length).astype(jnp.int32)[None]
  hidden = base.forward(base.embed(ids_t[None]), jnp.arange(t)[None],
                        causal_segment_mask(segments)).hidden[0]
  # Position t - 1 predicts token t.
  lp, top, ids = _scores(model, hidden[:-1], ids_t[1:], None)
  shift = lambda x, fill: jnp.concatenate([jnp.full((1, *x.shape[1:]), fill, x.dtype), x])
  return shift(lp, jnp.nan), shift(top, -jnp.inf), shift(ids, 0)


def _hamburger_program(graphdef, params, batch: dict, *, with_prompt: bool):
  """The groups' tokens [G, K] (token 0 from the base's head, the others from the micro
  decoder's), and with `with_prompt` each entry's next prompt token [M] (the base's head)."""
  model = nnx.merge(graphdef, params)
  ids, size = batch["input_ids"], batch["input_size"]  # [1, M, K], [1, M]
  x = model.smash(ids, size)
  mask = causal_segment_mask(batch["segment_ids"])
  feats, _ = model.base_features(x, batch["positions"], mask, merged_bt=size >= 2)
  g_feats = feats[0, batch["pred_index"][0]]  # [G, F, D]
  g, k = batch["target_ids"].shape[1:]
  h = model.micro_hidden(g_feats, batch["target_ids"][0])  # [G, K, D]
  micro = jnp.broadcast_to(jnp.arange(k) > 0, (g, k)).reshape(-1)
  groups = _scores(model, h.reshape(g * k, -1), batch["target_ids"][0].reshape(-1), micro)
  groups = tuple(x.reshape(g, k, *x.shape[1:]) for x in groups)
  if not with_prompt:
    return groups, None
  prompt = _scores(model, feats[0, :-1, -1], ids[0, 1:, 0], None)  # entry t predicts t + 1
  return groups, prompt


class Scorer:
  """Scores prompts and generations on an engine's model (the module docstring). Programs are
  compiled on first use, one per mode and bucketed length. Safe to call from several threads."""

  def __init__(self, engine):
    self.engine = engine
    self._base = jax.jit(_base_program, static_argnums=0)
    self._hamburger = jax.jit(_hamburger_program, static_argnums=0,
                              static_argnames=("with_prompt",))

  def _run(self, fn, *args, **kw):
    e = self.engine
    with precision.matmuls(e.precision):
      return jax.device_get(fn(e.graphdef, e.params, *args, **kw))

  def score(self, mode: str, prompt_ids: Sequence[int], token_ids: Sequence[int] = (),
            groups: Sequence[int] = (), *, echo: bool = False) -> TokenScores:
    """Log-probabilities of `token_ids`, generated after `prompt_ids` in `mode` in groups of
    `groups` tokens (mode "base": ones), and with `echo` of the prompt's tokens first."""
    prompt, tokens = [int(i) for i in prompt_ids], [int(i) for i in token_ids]
    if not prompt:
      raise ValueError("the prompt is empty: a token needs one before it to be scored")
    mode = self.engine.check_mode(mode)
    if mode == "hamburger" and tokens:
      lp, top, ids = self._hamburger_scores(prompt, tokens, list(groups), echo)
    else:
      lp, top, ids = self._base_scores(prompt, tokens, echo)
    return TokenScores((prompt if echo else []) + tokens, lp, ids, top,
                       len(prompt) if echo else 0)

  def _base_scores(self, prompt: list[int], tokens: list[int], echo: bool):
    seq = prompt + tokens
    t = bucket(len(seq), LENGTH_BUCKETS)
    ids = np.zeros((t,), np.int32)
    ids[:len(seq)] = seq
    lp, top, top_ids = self._run(self._base, ids, np.int32(len(seq)))
    start = 0 if echo else len(prompt)
    return lp[start:len(seq)], top[start:len(seq)], top_ids[start:len(seq)]

  def _hamburger_scores(self, prompt: list[int], tokens: list[int], groups: list[int],
                        echo: bool):
    model = self.engine.runner
    k = model.max_group
    try:
      sample = layout.layout_sample(prompt, tokens, groups, k,
                                    model.cfg.graft.position_offset)
    except layout.LayoutError as e:
      raise ValueError(f"cannot score these tokens in these groups: {e}") from None
    batch = layout.pack_rows([[sample]], bucket(sample.num_entries, LENGTH_BUCKETS),
                             bucket(sample.num_groups, LENGTH_BUCKETS), k).as_dict()
    batch = {n: batch[n] for n in ("input_ids", "input_size", "positions", "segment_ids",
                                   "pred_index", "target_ids")}
    (g_lp, g_top, g_ids), prompt_out = self._run(self._hamburger, batch, with_prompt=echo)
    emitted = np.arange(k)[None, :] < np.asarray(groups)[:, None]  # [G, K] in token order
    n = len(groups)
    lp, top, top_ids = g_lp[:n][emitted], g_top[:n][emitted], g_ids[:n][emitted]
    if not echo:
      return lp, top, top_ids
    p_lp, p_top, p_ids = (x[:len(prompt) - 1] for x in prompt_out)
    first = lambda x, fill: np.full((1, *x.shape[1:]), fill, x.dtype)
    return (np.concatenate([first(p_lp, np.nan), p_lp, lp]),
            np.concatenate([first(p_top, -np.inf), p_top, top]),
            np.concatenate([first(p_ids, 0), p_ids, top_ids]))

