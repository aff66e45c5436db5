"""Token ids to streamed text, with stop strings.

A macro step hands out up to K token ids at once; a client wants text. The text of all ids so
far is decoded again at each step (byte-level BPE can split one character over several tokens,
so a token's text is known only with its neighbours); what was already sent is a prefix of it.
Held back: a trailing incomplete character, and a tail that could still become a stop string
(the stop string itself is never sent).
"""

from __future__ import annotations

from typing import Callable, Sequence

_INCOMPLETE = "\ufffd"  # what decoding gives for a character whose bytes have not all come


class TextStream:
  """Feed token ids with `feed`; it returns the text that is safe to send. `stopped` turns true
  when a stop string appears (the text ends before it)."""

  def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()):
    self._decode = decode
    self.stops = tuple(stops)
    self.ids: list[int] = []
    self.sent = ""
    self.stopped = False

  def _held(self, text: str) -> int:
    """Characters at the end of `text` that begin some stop string."""
    for n in range(min(max((len(s) for s in self.stops), default=1) - 1, len(text)), 0, -1):
      if any(s.startswith(text[-n:]) for s in self.stops):
        return n
    return 0

  def feed(self, ids: Sequence[int], final: bool = False) -> str:
    """The new text that `ids` (the next tokens) make safe to send; `final`: nothing follows,
    so nothing is held back."""
    if self.stopped:
      return ""
    self.ids.extend(int(i) for i in ids)
    text = self._decode(self.ids)
    cut = len(text)
    for s in self.stops:
      at = text.find(s, max(len(self.sent) - len(s) + 1, 0))
      if at != -1 and at < cut:
        cut, self.stopped = at, True
    if not self.stopped and not final:
      while cut and text[cut - 1] == _INCOMPLETE:
        cut -= 1
      cut -= self._held(text[:cut])
    if not text.startswith(self.sent) or cut < len(self.sent):
      return ""  # an earlier character changed with later bytes: wait for more
    delta = text[len(self.sent):cut]
    self.sent += delta
    return delta

  def finish(self) -> str:
    """What remains to send once no token follows."""
    return self.feed((), final=True)
