"""Chat templates as transformers renders them: a sandboxed jinja2 environment with its
extensions and helpers (`{% generation %}`, `raise_exception`, a plain `tojson`, `strftime_now`),
and the checks every message list passes first."""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Chat roles a message may have; anything else is a typo the template would render silently.
CHAT_ROLES = ("system", "user", "assistant", "tool", "ipython")


class TokenizerError(ValueError):
  """A tokenizer file or an input is unusable; the message says what was wrong and what to do."""


class _GenerationTag(jinja2.ext.Extension):
  """Accepts `{% generation %}...{% endgeneration %}` (training templates mark assistant spans
  with it) and renders the body unchanged, as transformers does when no mask is requested."""
  tags = {"generation"}

  def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller) -> str:
    return caller()


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
  # jinja's own tojson escapes HTML characters; chat templates want plain JSON.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  try:
    return env.from_string(source)
  except jinja2.TemplateSyntaxError as e:
    raise TokenizerError(f"the chat template does not parse (line {e.lineno}: {e.message}); "
                         "pass a valid jinja template as chat_template=") from None


def check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
  if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
    raise TokenizerError(f"messages must be a list of dicts, got {type(messages).__name__}; "
                         "e.g. [{'role': 'user', 'content': 'hi'}]")
  if not messages:
    raise TokenizerError("messages is empty; pass at least one, e.g. "
                         "[{'role': 'user', 'content': 'hi'}]")
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping):
      raise TokenizerError(f"message {i} is a {type(m).__name__}, not a dict with 'role' and "
                           "'content'")
    missing = [k for k in ("role", "content") if k not in m]
    if missing:
      raise TokenizerError(f"message {i} has no {' or '.join(map(repr, missing))} key; each "
                           "message needs both, e.g. {'role': 'user', 'content': 'hi'}")
    if not isinstance(m["role"], str):
      raise TokenizerError(f"message {i} has role {m['role']!r}; roles are strings "
                           "('system', 'user', 'assistant', ...)")
    if m["role"] not in CHAT_ROLES:
      raise TokenizerError(f"message {i} has unknown role {m['role']!r}; use one of "
                           f"{', '.join(CHAT_ROLES)}")
