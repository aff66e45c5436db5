"""Conversations -> the ids of a token corpus's samples (hamburger_jax.data.tokens.corpus): the chat
template's rendering, the spans of its turns, and the cut into samples of at most max_len tokens."""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from hamburger_jax.data.tokens.corpus import CorpusError

# A pair longer than max_len on its own keeps a truncated response if at least this many of its
# tokens fit; a shorter stub teaches little, and the conversation ends before that pair instead.
MIN_TRUNCATED_RESPONSE = 16

_START_OF_TURN = "<|im_start|>"


def special_strings(tokenizer) -> list[str]:
  """The strings of the special (control) tokens, which encode() turns into their single ids
  when they appear in text: those that decoding with skip_special_tokens drops."""
  return [tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)
          if tokenizer.decode([i], skip_special_tokens=True) == ""]


@dataclasses.dataclass
class Rendered:
  """One conversation's ids and where its turns lie in them."""
  ids: np.ndarray
  prefix: int  # tokens of the template's system line (before the first user turn)
  # Per (user, assistant) pair: (pair start, response start, response end incl. end-of-turn,
  # pair end incl. what the template writes after the end-of-turn).
  pairs: list[tuple[int, int, int, int]]


class Renderer:
  """Conversations -> ids, as `tokenizer.apply_chat_template(messages, add_generation_prompt=
  False, tokenize=True)` writes them, and the spans of their turns.

  Conversations without a special token's string in any message are rendered as text and encoded
  in batches (the tokenizers backend, on every core); the rest go through apply_chat_template
  one by one, which encodes such strings as text. Either way the only start-of-turn and
  end-of-turn ids are the template's own, which is what finding the turns relies on.
  """

  def __init__(self, tokenizer):
    # Here, not at the top: data.prepare imports flax and tensorflow_datasets (~0.9 s).
    from hamburger_jax.data.prepare import end_of_turn_id  # pylint: disable=C0415
    self.tokenizer = tokenizer
    self.eot = end_of_turn_id(tokenizer)
    self.start = tokenizer.token_to_id(_START_OF_TURN)
    if self.start is None or _START_OF_TURN not in (tokenizer.chat_template or ""):
      raise CorpusError(f"the tokenizer's chat template does not open turns with {_START_OF_TURN}"
                        " (ChatML); token corpora are written for ChatML templates only")
    probe = [{"role": "user", "content": "x"}]
    without = list(tokenizer.apply_chat_template(probe, add_generation_prompt=False,
                                                 tokenize=True))
    self.header = np.asarray(tokenizer.apply_chat_template(
        probe, add_generation_prompt=True, tokenize=True)[len(without):], np.int64)
    starts = [i for i, t in enumerate(without) if t == self.start]
    if not starts or not len(self.header) or self.header[0] != self.start:
      raise CorpusError("the chat template's turns could not be located in its ids; token "
                        "corpora need a ChatML template")
    self.prefix_turns = len(starts) - 1  # the default system line: one turn
    self.prefix_len = starts[-1]
    specials = sorted(special_strings(tokenizer), key=len, reverse=True)
    self._special = re.compile("|".join(map(re.escape, specials))) if specials else None
    # encode_batch adds what the backend's post-processor adds (BOS/EOS) and apply_chat_template
    # adds nothing: only where the two agree is the batch path taken.
    self._batch = not tokenizer.encode_batch([""])[0]

  def ids(self, conversations: Sequence[list[dict[str, str]]]) -> list[np.ndarray]:
    """The ids of each conversation, identical to apply_chat_template(..., tokenize=True)."""
    out: list[np.ndarray | None] = [None] * len(conversations)
    texts, where = [], []
    for k, messages in enumerate(conversations):
      if self._batch and not (self._special is not None and any(
          self._special.search(m["content"]) for m in messages)):
        texts.append(self.tokenizer.apply_chat_template(messages, add_generation_prompt=False))
        where.append(k)
      else:
        out[k] = np.asarray(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=False, tokenize=True), np.int64)
    for k, ids in zip(where, self.tokenizer.encode_batch(texts)):
      out[k] = np.asarray(ids, np.int64)
    return out  # type: ignore[return-value]

  def turns(self, ids: np.ndarray, messages: list[dict[str, str]]) -> Rendered | None:
    """Locates the pairs of `messages` (user, assistant, ...) in their ids. Stops at the first
    assistant turn whose header does not tokenise apart from its content (a content that starts
    with something the header's newline merges with), where prompt and sample would disagree;
    None if the turns cannot be found at all."""
    starts = np.flatnonzero(ids == self.start)
    if len(starts) != self.prefix_turns + len(messages):
      return None
    starts = starts[self.prefix_turns:].tolist() + [len(ids)]
    eots = np.flatnonzero(ids == self.eot)
    h = len(self.header)
    pairs = []
    for j in range(0, len(messages) - 1, 2):
      user, assistant, end = starts[j], starts[j + 1], starts[j + 2]
      if not np.array_equal(ids[assistant:assistant + h], self.header):
        break
      k = np.searchsorted(eots, assistant + h)
      if k >= len(eots) or eots[k] >= end:
        break
      pairs.append((user, assistant + h, int(eots[k]) + 1, end))
    return Rendered(ids, starts[0], pairs)


@dataclasses.dataclass
class Chunk:
  """A sample cut from one conversation: prefix + ids[first:last], and its responses (absolute
  in the conversation's ids)."""
  first: int
  last: int
  responses: list[tuple[int, int]]


def chunk(rendered: Rendered, max_len: int) -> tuple[list[Chunk], int, int]:
  """Cuts a conversation into samples of at most max_len tokens at pair boundaries.

  A pair that does not fit on its own (after the system line) keeps as much of its response as
  fits, without its end-of-turn, if that is at least MIN_TRUNCATED_RESPONSE tokens (the pairs after
  it go on in new samples); otherwise the conversation ends before it. Returns (chunks, truncated
  responses, dropped pairs).
  """
  chunks: list[Chunk] = []
  cur: Chunk | None = None
  truncated = dropped = 0
  for p, (first, r0, r1, last) in enumerate(rendered.pairs):
    if cur is not None and rendered.prefix + last - cur.first <= max_len:
      cur.last = last
      cur.responses.append((r0, r1))
      continue
    if cur is not None:
      chunks.append(cur)
      cur = None
    if rendered.prefix + last - first <= max_len:
      cur = Chunk(first, last, [(r0, r1)])
      continue
    budget = max_len - rendered.prefix - (r0 - first)  # response tokens that fit
    if budget < MIN_TRUNCATED_RESPONSE:
      dropped = len(rendered.pairs) - p
      break
    end = r0 + min(budget, r1 - r0)
    truncated += end < r1
    chunks.append(Chunk(first, end, [(r0, end)]))
  if cur is not None:
    chunks.append(cur)
  return chunks, truncated, dropped
