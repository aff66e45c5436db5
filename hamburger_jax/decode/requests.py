"""What a request to the engine is (`Request`), what it gives back (`Generation`), and the error
a request that cannot be served raises or carries (`GenerationError`)."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import jax
import numpy as np

from hamburger_jax.config import DEFAULT_CONFIDENCE, DEFAULT_DRAFT_CONFIDENCE
from hamburger_jax.decode.sampling import SamplingError, SamplingParams


class GenerationError(ValueError):
  """A request cannot be served as given; the message says what to change."""


@dataclasses.dataclass
class Generation:
  """One request's result (`error` set, and no tokens, when it could not be served), with the
  request's settings (as the request gave them) so that a caller needs no table of its own."""
  token_ids: list[int]
  text: str
  groups: list[int]  # tokens per macro step (sums to len(token_ids))
  macro_steps: int
  # KV cache entries the row holds at the end (prompt included); a graft that merges at layer
  # L > 0: those of its upper layers (its lower layers hold one a token)
  kv_entries: int
  prompt_tokens: int
  prefill_s: float
  decode_s: float  # from the end of its prefill to its last token
  compile_s: float = 0.0  # spent compiling programs for this call (0 when all were reused)
  id: Any = None
  error: str | None = None
  queue_s: float = 0.0  # from the call (arrival) to its admission into a slot
  latency_s: float = 0.0  # from the call (arrival) to its result
  preemptions: int = 0  # times it was evicted for KV blocks and recomputed
  mode: str = ""  # "base", "hamburger" or "verify" (decode/step.py: MODES)
  confidence: float = DEFAULT_CONFIDENCE
  max_group: int | None = None  # None: the model's K
  seed: int = 0
  sampling: SamplingParams = SamplingParams()
  draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE

  @property
  def new_tokens(self) -> int:
    return len(self.token_ids)

  @property
  def decode_tokens_per_s(self) -> float:
    return self.new_tokens / self.decode_s if self.decode_s > 0 else float("nan")

  @property
  def tokens_per_step(self) -> float:
    return self.new_tokens / max(self.macro_steps, 1)

  def record(self) -> dict:
    """The JSON fields the CLIs print for one result."""
    if self.error:
      return {"id": self.id, "error": self.error}
    r = lambda x: round(x, 3)
    return {"text": self.text, "token_ids": self.token_ids, "new_tokens": self.new_tokens,
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2), "groups": self.groups,
            "macro_steps": self.macro_steps, "kv_entries": self.kv_entries,
            "prompt_tokens": self.prompt_tokens, "prefill_s": r(self.prefill_s),
            "decode_s": r(self.decode_s)}

  def settings(self) -> dict:
    """The mode's settings the CLIs print after `record()` ({} in mode "base", where none
    changes anything)."""
    if self.mode == "verify":
      return {"draft_confidence": self.draft_confidence, "max_group": self.max_group}
    if self.mode != "hamburger":
      return {}
    return {"confidence": self.confidence, "max_group": self.max_group}


def check_settings(max_new_tokens: Any = 1, confidence: Any = DEFAULT_CONFIDENCE,
                   max_group: Any = None, seed: Any = 0, group_limit: int | None = None,
                   draft_confidence: Any = DEFAULT_DRAFT_CONFIDENCE) -> None:
  """A request's settings, checked in the one place every entry point uses (CLIs call it before
  a model loads, with `group_limit` None when the model's K is not known yet); raises
  GenerationError saying what to change."""
  m = max_new_tokens
  if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
    raise GenerationError(f"max_new_tokens={m!r} must be an integer >= 1")
  for name, c in (("confidence", confidence), ("draft_confidence", draft_confidence)):
    if isinstance(c, bool) or not isinstance(c, (int, float, np.floating, np.integer)) or not (
        0 <= c <= 1):
      raise GenerationError(f"{name} must be in [0, 1], got {c!r}")
  g, k = max_group, group_limit
  if g is not None and (isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1
                        or (k is not None and g > k)):
    raise GenerationError(f"max_group={g!r} must be an integer in [1, {k or 'K'}] (the "
                          "model's largest group), or None for the model's")
  s = seed
  if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < 2 ** 63:
    raise GenerationError(f"seed={s!r} must be an integer in [0, 2**63)")


@dataclasses.dataclass
class Request:
  """One generation request. `prompt`: text (a user turn), chat messages or token ids."""
  prompt: Any
  max_new_tokens: int = 128
  confidence: float = DEFAULT_CONFIDENCE
  sampling: SamplingParams = SamplingParams()
  seed: int = 0
  id: Any = None
  # The most tokens one macro step may emit (HAMburger and verify modes; None: the model's K). A
  # smaller cap bounds a step's micro-step work and merges fewer tokens into each KV entry (less
  # compression; docs/results/quality.md: no better quality at equal compression).
  max_group: int | None = None
  # Verify mode: drafts go on while the stop head's P(continue) >= this (`confidence` is
  # HAMburger mode's; verify's output is the base's whatever either is)
  draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE
  # The encoded prompt: set once, by the first check(), and reused by every later one (a
  # request checked by one engine is for that engine's tokenizer).
  ids: list[int] | None = dataclasses.field(default=None, repr=False)

  def check(self, engine) -> None:
    """Validates, and encodes the prompt unless `ids` holds it already; raises GenerationError
    saying what to change."""
    check_settings(self.max_new_tokens, self.confidence, self.max_group, self.seed,
                   engine.max_group, self.draft_confidence)
    if not isinstance(self.sampling, SamplingParams):
      raise GenerationError("sampling must be a SamplingParams(temperature, top_k, top_p)")
    try:
      self.sampling.check_vocab(engine.base_cfg.vocab_size)
    except SamplingError as e:
      raise GenerationError(str(e)) from None
    m = self.max_new_tokens
    # Token ids pass through encode_prompt's range check only: no chat template, no tokenizer.
    self.ids = engine.encode_prompt(self.prompt if self.ids is None else self.ids)
    if len(self.ids) + m > engine.max_seq_len:
      raise GenerationError(
          f"prompt has {len(self.ids)} tokens + max_new_tokens {m} > max_seq_len "
          f"{engine.max_seq_len}: shorten the prompt or lower max_new_tokens")

  def key(self) -> jax.Array:
    """The request's sampling key: from (seed, id) only, never from its slot or batch mates."""
    rid = self.id
    if isinstance(rid, (int, np.integer)) and not isinstance(rid, bool) and 0 <= rid < 2 ** 31:
      salt = int(rid)
    else:  # another id by a stable hash
      salt = zlib.crc32(repr(rid).encode()) & 0x7FFFFFFF
    return jax.random.fold_in(jax.random.key(self.seed), salt)


def kv_compression(gens, merge_layer: int = 0, num_layers: int = 1) -> float:
  """HAMburger mode's KV compression over many generations: their tokens over their macro steps
  where groups merge at the input (docs/SPEC.md 3); where they merge at layer L > 0, the layer
  entries the tokens would keep unmerged over those they keep (layer_merge.kv_compression)."""
  from hamburger_jax.model.layer_merge import kv_compression as at_layer  # pylint: disable=C0415
  tokens = sum(g.new_tokens for g in gens)
  steps = max(sum(g.macro_steps for g in gens), 1)
  return at_layer(tokens, steps, merge_layer, num_layers) if merge_layer else tokens / steps


def pooled_tokens_per_step(gens) -> float:
  """Tokens per macro step over many generations, each weighted by its length: in mode
  hamburger their KV compression (tokens per decode entry), in verify mode the tokens a base
  forward produced (its own and the drafts it kept)."""
  return sum(g.new_tokens for g in gens) / max(sum(g.macro_steps for g in gens), 1)
