"""Token log-probabilities in the OpenAI API's shapes; decode/scoring.py computes them and says
what they are in each mode (the distribution that chose each token, before temperature).

- chat: `choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token,
  logprob, bytes}, ...]}]}`, the alternatives by decreasing log-probability;
- completions, the legacy shape: `{tokens, token_logprobs, top_logprobs: [{token: logprob}],
  text_offset}`. With `echo` the prompt's tokens come first, the first with a null logprob and
  null alternatives (nothing precedes it). As in vLLM, a token's alternatives also hold the
  token itself, so up to N + 1 entries.

A token's `token` is its text (a piece of a multi-byte character reads as U+FFFD; `bytes` has
its bytes); a model without a tokenizer names its tokens "token_id:N". `text_offset`: where the
token's text begins in the returned text, in characters (special tokens, which the answer's text
leaves out, take no room there).

The tokens listed: every generated token, the end-of-turn token too; an answer ended by a stop
string lists its tokens up to the one that completed the stop string. An answer is scored when
its generation has ended, so a stream with log-probabilities sends its chunks then: one for the
echoed prompt, one per macro step, one for text held back until the end.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from hamburger_jax.decode.scoring import Scorer, TokenScores
from hamburger_jax.openai_api.text_stream import TextStream


@dataclasses.dataclass
class Piece:
  """A stretch of an answer: its new text and the log-probabilities of its tokens (None: the
  answer has no log-probabilities, only an echo)."""
  text: str
  logprobs: dict | None


class TokenText:
  """What a token id reads as: its text, its bytes and whether an answer's text shows it."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self._cache: dict[int, tuple[str, bytes | None, bool]] = {}

  def __call__(self, i: int) -> tuple[str, bytes | None, bool]:
    i = int(i)
    if i not in self._cache:
      tok = self.tokenizer
      if tok is None:
        self._cache[i] = (f"token_id:{i}", None, False)
      else:
        raw = tok.token_bytes(i)
        shown = tok.decode([i], skip_special_tokens=True) != ""
        self._cache[i] = (raw.decode("utf-8", errors="replace"), raw, shown)
    return self._cache[i]


def listed(decode: Callable[[Sequence[int]], str], ids: Sequence[int], groups: Sequence[int],
           stops: Sequence[str]) -> tuple[list[int], list[int]]:
  """The generated tokens an answer lists and their groups: all of them, or when a stop string
  ended the answer, those up to the one that completed it (its group cut there)."""
  ids, n = list(ids), len(ids)
  if stops and any(s in decode(ids) for s in stops):
    n = next(m for m in range(1, len(ids) + 1) if any(s in decode(ids[:m]) for s in stops))
  out, left = [], n
  for g in groups:
    if left <= 0:
      break
    out.append(min(g, left))
    left -= g
  return ids[:n], out


def _value(x: float) -> float | None:
  return None if math.isnan(x) else float(x)


def _chat_entry(text: TokenText, i: int, logprob: float) -> dict:
  token, raw, _ = text(i)
  return {"token": token, "logprob": float(logprob),
          "bytes": None if raw is None else list(raw)}


def chat_logprobs(text: TokenText, s: TokenScores, top: int, lo: int, hi: int) -> dict:
  """Chat's logprobs object of tokens lo..hi-1 of `s`."""
  content = []
  for t in range(lo, hi):
    alts = [_chat_entry(text, i, lp) for i, lp in zip(s.top_ids[t, :top], s.top_logprobs[t, :top])
            if math.isfinite(lp)]
    content.append({**_chat_entry(text, s.token_ids[t], s.logprobs[t]), "top_logprobs": alts})
  return {"content": content}


def completion_logprobs(text: TokenText, s: TokenScores, top: int, lo: int, hi: int,
                        offsets: Sequence[int]) -> dict:
  """The completions' logprobs object of tokens lo..hi-1 of `s`; `offsets`: every token's
  text_offset (text_offsets)."""
  out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
  for t in range(lo, hi):
    lp = _value(s.logprobs[t])
    alts = None
    if lp is not None:
      alts = {text(i)[0]: float(v) for i, v in zip(s.top_ids[t, :top], s.top_logprobs[t, :top])
              if math.isfinite(v)}
      alts[text(s.token_ids[t])[0]] = lp
    out["tokens"].append(text(s.token_ids[t])[0])
    out["token_logprobs"].append(lp)
    out["top_logprobs"].append(alts)
    out["text_offset"].append(offsets[t])
  return out


def text_offsets(text: TokenText, s: TokenScores) -> list[int]:
  """Where each token's text begins in the returned text, in characters: the echoed prompt
  shows every token, the generated text its non-special ones (characters counted by their
  UTF-8 lead bytes)."""
  offsets, chars = [], 0
  for t, i in enumerate(s.token_ids):
    offsets.append(chars)
    _, raw, shown = text(i)
    if raw is not None and (t < s.prompt_tokens or shown):
      chars += sum(1 for b in raw if b & 0xC0 != 0x80)
  return offsets


def answer_pieces(scorer: Scorer, tokenizer, *, mode: str, chat: bool, top: int | None,
                  echo: bool, prompt: Sequence[int], ids: Sequence[int], groups: Sequence[int],
                  stops: Sequence[str]) -> list[Piece]:
  """A finished answer as it is sent: the echoed prompt (with `echo`), one piece per macro
  step, and the text held back to the end; with log-probabilities unless `top` is None."""
  decode = ((lambda x: tokenizer.decode(x, skip_special_tokens=True)) if tokenizer
            else (lambda x: ""))
  ids, groups = listed(decode, ids, groups, stops)
  scores = scorer.score(mode, prompt, ids, groups, echo=echo) if top is not None else None
  text = TokenText(tokenizer)
  offsets = text_offsets(text, scores) if scores is not None and not chat else []
  shape = lambda lo, hi: (None if scores is None else
                          chat_logprobs(text, scores, top, lo, hi) if chat else
                          completion_logprobs(text, scores, top, lo, hi, offsets))
  pieces, at, done = [], 0, 0  # at: tokens of `scores` so far; done: of `ids`
  if echo:
    at = len(prompt)
    pieces.append(Piece(tokenizer.decode(prompt) if tokenizer else "", shape(0, at)))
  stream = TextStream(decode, stops)
  for g in groups:
    pieces.append(Piece(stream.feed(ids[done:done + g]), shape(at, at + g)))
    at, done = at + g, done + g
  pieces.append(Piece(stream.finish(), shape(at, at)))
  return [p for p in pieces if p.text or _tokens(p.logprobs)]


def _tokens(lp: dict | None) -> int:
  return 0 if lp is None else len(lp["content"] if "content" in lp else lp["tokens"])


def joined(pieces: Sequence[Piece], chat: bool, scored: bool) -> tuple[str, dict | None]:
  """A whole answer's text and logprobs object (None unless `scored`) from its pieces."""
  text = "".join(p.text for p in pieces)
  if not scored:
    return text, None
  if chat:
    return text, {"content": [c for p in pieces for c in p.logprobs["content"]]}
  keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
  return text, {k: [v for p in pieces for v in p.logprobs[k]] for k in keys}
