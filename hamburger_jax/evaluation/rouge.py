"""ROUGE-L F1: longest-common-subsequence overlap of two texts' lowercase word sequences."""

from __future__ import annotations

import re

# Letters and digits of any script; punctuation, whitespace and underscores separate tokens.
_WORD = re.compile(r"[^\W_]+")


def tokenize(text: str) -> list[str]:
  return _WORD.findall(text.lower())


def lcs_length(a: list[str], b: list[str]) -> int:
  """Length of the longest common subsequence, O(len(a) * len(b)) time, O(len(b)) memory."""
  if len(a) < len(b):
    a, b = b, a
  prev = [0] * (len(b) + 1)
  for x in a:
    cur = [0]
    for j, y in enumerate(b):
      cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
    prev = cur
  return prev[-1]


def rouge_l(candidate: str, reference: str) -> float:
  """ROUGE-L F1 (beta = 1, as rouge-score's default) in [0, 1]; two empty texts agree fully."""
  cand, ref = tokenize(candidate), tokenize(reference)
  if not cand or not ref:
    return float(not cand and not ref)
  lcs = lcs_length(cand, ref)
  if lcs == 0:
    return 0.0
  precision, recall = lcs / len(cand), lcs / len(ref)
  return 2 * precision * recall / (precision + recall)
