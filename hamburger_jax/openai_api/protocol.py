"""The OpenAI HTTP API's request bodies, read into engine Requests, and its error shape.

Bodies are checked here, field by field, rather than by a schema library: each wrong field gets
a message that names it and says what to send (an `ApiError`, rendered as OpenAI's
`{"error": {"message", "type", "param", "code"}}`). Fields the API defines and the engine does
not implement are refused when they would change the answer (tools, penalties, ...), and
ignored when they would not (`user`, `metadata`, ...). HAMburger's own settings (`confidence`,
`max_group`, `mode`, verify mode's `draft_confidence`) and `top_k` are extra body fields.

Log-probabilities (decode/scoring.py says what they are in each mode): chat's `logprobs: true`
with `top_logprobs` 0..20 alternatives, the completions' `logprobs: N` (0..5 alternatives) and
`echo` (the prompt's tokens scored too; `max_tokens: 0` scores the prompt alone).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from hamburger_jax.config import DEFAULT_DRAFT_CONFIDENCE
from hamburger_jax.decode.requests import GenerationError, Request, check_settings
from hamburger_jax.decode.sampling import SamplingError, SamplingParams

ROLES = ("system", "user", "assistant", "developer")  # developer: OpenAI's newer name for system
MAX_STOPS = 4  # as OpenAI
# Fields that would change the answer in a way this engine does not implement: refused unless
# they are given their neutral value.
UNSUPPORTED = {"tools": (None, []),
               "tool_choice": (None, "none"), "functions": (None, []),
               "response_format": (None, {"type": "text"}), "logit_bias": (None, {}),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "best_of": (None, 1), "suffix": (None, "")}
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI
MAX_LOGPROBS = 5  # the completions' logprobs, as OpenAI


class ApiError(Exception):
  """A request the server answers with an error: HTTP `status`, OpenAI's error object."""

  def __init__(self, status: int, message: str, param: str | None = None,
               kind: str = "invalid_request_error", code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.kind, self.code = (status, message, param,
                                                                   kind, code)

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Defaults:
  """What a request gets for a field it leaves out (the server's flags)."""
  model: str
  mode: str
  max_tokens: int
  confidence: float
  max_group: int | None = None
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE


@dataclasses.dataclass
class Call:
  """One parsed request: the engine Request, its mode, and how to answer."""
  request: Request
  mode: str
  stream: bool
  include_usage: bool
  stop: tuple[str, ...]
  chat: bool
  # Alternatives listed per token when log-probabilities are asked for (0: the chosen token's
  # alone); None when they are not.
  logprobs: int | None = None
  echo: bool = False  # completions: the prompt's tokens (and text) come first


def _bad(message: str, param: str | None = None) -> ApiError:
  return ApiError(400, message, param)


def _get(body: dict, name: str, default, check) -> Any:
  value = body.get(name)
  if value is None:
    return default
  return check(value, name)


def _int(value, name: str, low: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
    raise _bad(f"{name} must be an integer >= {low}, got {value!r}", name)
  return int(value)


def _number(value, name: str) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
    raise _bad(f"{name} must be a finite number, got {value!r}", name)
  return float(value)


def _bool(value, name: str) -> bool:
  if not isinstance(value, bool):
    raise _bad(f"{name} must be true or false, got {value!r}", name)
  return value


def _stop(value, name: str) -> tuple[str, ...]:
  stops = [value] if isinstance(value, str) else value
  if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
    raise _bad(f"{name} must be a non-empty string or a list of them, got {value!r}", name)
  if len(stops) > MAX_STOPS:
    raise _bad(f"{name} has {len(stops)} strings; at most {MAX_STOPS}", name)
  return tuple(stops)


def _content(message: dict, i: int) -> str:
  """A message's text: a string, or a list of text parts (OpenAI's content parts)."""
  content = message.get("content")
  param = f"messages[{i}].content"
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    parts = []
    for part in content:
      if not (isinstance(part, dict) and part.get("type") == "text"
              and isinstance(part.get("text"), str)):
        raise _bad(f"{param}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                   "supported", param)
      parts.append(part["text"])
    return "".join(parts)
  if content is None and message.get("role") == "assistant":
    return ""
  raise _bad(f"{param} must be a string or a list of text parts, got "
             f"{type(content).__name__}", param)


def messages_of(body: dict) -> list[dict]:
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise _bad("messages must be a non-empty list of {\"role\", \"content\"} objects",
               "messages")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise _bad(f"messages[{i}] must be an object with role and content", f"messages[{i}]")
    role = m.get("role")
    if role not in ROLES:
      raise _bad(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}",
                 f"messages[{i}].role")
    out.append({"role": "system" if role == "developer" else role, "content": _content(m, i)})
  if not any(m["content"].strip() for m in out):
    raise _bad("every message is empty: give some text", "messages")
  return out


def prompt_of(body: dict, tokenizer) -> list[int]:
  """A completion's prompt as token ids: text (encoded as is, no chat template) or ids."""
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]  # a batch of one
  if isinstance(prompt, str):
    if not prompt:
      raise _bad("prompt is empty: give some text", "prompt")
    if tokenizer is None:
      raise _bad("this model has no tokenizer: send the prompt as token ids", "prompt")
    return tokenizer.encode(prompt)
  if isinstance(prompt, list) and prompt and all(
      isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
    return [int(t) for t in prompt]
  raise _bad("prompt must be a string or a list of token ids (one prompt per request)",
             "prompt")


def _logprobs(body: dict, chat: bool) -> tuple[int | None, bool]:
  """(alternatives per token or None, echo) as the endpoint spells them."""
  if chat:
    if body.get("echo") not in (None, False):
      raise _bad("echo is a /v1/completions field; chat answers never repeat the messages",
                 "echo")
    asked = _get(body, "logprobs", False, _bool)
    top = _get(body, "top_logprobs", None, lambda v, n: _int(v, n, 0))
    if top is not None and top > MAX_TOP_LOGPROBS:
      raise _bad(f"top_logprobs={top} is over {MAX_TOP_LOGPROBS}: ask for 0..{MAX_TOP_LOGPROBS}",
                 "top_logprobs")
    if top and not asked:
      raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if asked else None, False
  if body.get("top_logprobs") is not None:
    raise _bad("top_logprobs is a chat field; on /v1/completions send logprobs: N "
               f"(0..{MAX_LOGPROBS} alternatives per token)", "top_logprobs")
  value = body.get("logprobs")
  if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                            or not 0 <= value <= MAX_LOGPROBS):
    raise _bad(f"logprobs on /v1/completions is the number of alternatives per token, an "
               f"integer in 0..{MAX_LOGPROBS}; got {value!r}", "logprobs")
  return (None if value is None else int(value)), _get(body, "echo", False, _bool)


def _refuse_unsupported(body: dict) -> None:
  for name, neutral in UNSUPPORTED.items():
    if name in body and body[name] not in neutral:
      raise _bad(f"{name} is not supported by this server; leave it out", name)
  n = body.get("n")
  if n is not None and (isinstance(n, bool) or n != 1):
    raise _bad(f"n={n!r}: this server returns one choice per request; send n = 1", "n")


def parse(body: Any, *, chat: bool, defaults: Defaults, modes: tuple[str, ...],
          tokenizer) -> Call:
  """The Call a /v1/chat/completions (`chat`) or /v1/completions body asks for."""
  if not isinstance(body, dict):
    raise _bad("the request body must be a JSON object")
  model = body.get("model", defaults.model)
  if model != defaults.model:
    raise ApiError(404, f"the model {model!r} does not exist here; use {defaults.model!r} "
                   "(GET /v1/models)", "model", code="model_not_found")
  _refuse_unsupported(body)
  logprobs, echo = _logprobs(body, chat)
  prompt = messages_of(body) if chat else prompt_of(body, tokenizer)
  count = lambda v, n: _int(v, n, 0 if echo else 1)  # 0 with echo: the prompt scored alone
  max_tokens = _get(body, "max_completion_tokens", None, count)
  if max_tokens is None:
    max_tokens = _get(body, "max_tokens", defaults.max_tokens, count)
  mode = body.get("mode", defaults.mode)
  if mode not in modes:
    raise _bad(f"mode {mode!r} is not served here; use one of {list(modes)}", "mode")
  stream = _get(body, "stream", False, _bool)
  options = body.get("stream_options") or {}
  if not isinstance(options, dict):
    raise _bad("stream_options must be an object such as {\"include_usage\": true}",
               "stream_options")
  include_usage = _get(options, "include_usage", False, _bool)
  try:
    sampling = SamplingParams(_get(body, "temperature", defaults.temperature, _number),
                              _get(body, "top_k", defaults.top_k, lambda v, n: _int(v, n, 0)),
                              _get(body, "top_p", defaults.top_p, _number))
  except SamplingError as e:
    param = next((f for f in ("temperature", "top_p", "top_k") if f"{f}=" in str(e)), None)
    raise _bad(str(e), param) from None
  confidence = _get(body, "confidence", defaults.confidence, _number)
  draft_confidence = _get(body, "draft_confidence", defaults.draft_confidence, _number)
  max_group = _get(body, "max_group", defaults.max_group, _int)
  seed = _get(body, "seed", defaults.seed, lambda v, n: _int(v, n, 0))
  try:
    check_settings(max_tokens or 1, confidence, max_group, seed,
                   draft_confidence=draft_confidence)
  except GenerationError as e:
    param = next((f for f in ("draft_confidence", "confidence", "max_group", "seed")
                  if f in str(e)), None)
    raise _bad(str(e), param) from None
  request = Request(prompt, max_new_tokens=max_tokens, confidence=confidence,
                    sampling=sampling, seed=seed, id=0, max_group=max_group,
                    draft_confidence=draft_confidence)
  return Call(request, mode, stream, include_usage, _get(body, "stop", (), _stop), chat,
              logprobs, echo)
