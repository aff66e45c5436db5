"""What the command-line entry points share: the model and decoding flags, reading prompts,
checking settings before a model loads, loading with progress, and one-line errors.

Heavy imports (jax, the models) happen inside the functions that need them, so that `--help`
and argument errors answer at once.
"""

# pylint: disable=import-outside-toplevel

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, TypeVar

from hamburger_jax import files
from hamburger_jax.config import (DEFAULT_CONFIDENCE, DEFAULT_DRAFT_CONFIDENCE,
                                  DEFAULT_DRAFT_LOOKUP, LOOKUP_MAX_N)

T = TypeVar("T")


class ModelLoadError(RuntimeError):
  """The model a command asked for cannot load: its weights, config or assets (the message
  says which and what to do). Entry points print it as one line and exit 1."""


def add_model_flags(p: argparse.ArgumentParser, *, checkpoint_help: str | None = None,
                    micro_vocab: bool = False) -> None:
  """--checkpoint and --base: which graft and which base model to load; with `micro_vocab`,
  --micro-vocab N (the checkpoint's reduced micro-step vocabulary)."""
  p.add_argument("--checkpoint", default=None,
                 help=checkpoint_help or "HAMburger graft checkpoint directory (default: the "
                 "shipped one)")
  p.add_argument("--base", default=None, help="base model: smollm2 | file.gguf | HF directory")
  if micro_vocab:
    p.add_argument("--micro-vocab", type=int, default=None, metavar="N",
                   help="micro steps choose among the N most frequent answer tokens stored with "
                   "the checkpoint (micro_vocab.json, built by train.micro_vocab); token 0 of a "
                   "group keeps the full vocabulary. 0: the full vocabulary throughout (default: "
                   "2048 where the checkpoint stores that many, else the full vocabulary)")


def add_micro_rule_flag(p: argparse.ArgumentParser, several: bool = False) -> None:
  """--micro-rule: when a batch's next micro step runs (decode/micro_rule.py); with `several`,
  a comma-separated list (parse with parse_micro_rules)."""
  from hamburger_jax.decode.micro_rule import DEFAULT_MICRO_RULE  # pylint: disable=C0415
  p.add_argument("--micro-rule", default=DEFAULT_MICRO_RULE,
                 help=("comma-separated " if several else "") + "off | auto | a cost ratio r: "
                 "a batch's next micro step runs while the rows that go on pay for it (at least "
                 "r x the rows decoding; r = micro step / base step at the batch, auto: timed "
                 "once); off: every micro step a row goes on for (tokens do not depend on the "
                 f"batch mates; default {DEFAULT_MICRO_RULE})")


def parse_micro_rules(spec: str) -> list:
  """A comma list of micro rules (decode/micro_rule.py), deduplicated in order; ValueError (a
  GenerationError) says what is wrong."""
  from hamburger_jax.decode import micro_rule  # pylint: disable=import-outside-toplevel
  rules = [micro_rule.parse(x.strip()) for x in spec.split(",") if x.strip()]
  if not rules:
    raise ValueError(f"--micro-rule {spec!r}: give off, auto or a ratio, e.g. off,auto")
  return list(dict.fromkeys(rules))


def add_confidence_flag(p: argparse.ArgumentParser, default: float = DEFAULT_CONFIDENCE,
                        help_: str = "") -> None:
  """--confidence: one level (a decode's); add_confidences_flag takes a list."""
  p.add_argument("--confidence", type=float, default=default,
                 help=help_ or "continue a group while P(continue) >= this (docs/method.md, "
                 "section 3)")


def add_confidences_flag(p: argparse.ArgumentParser, default: str = "0.6,0.7,0.8,0.9",
                         help_: str = "") -> None:
  """--confidence as a comma-separated list (the evaluation and curve CLIs, which sweep it;
  parse with parse_confidences)."""
  p.add_argument("--confidence", default=default,
                 help=help_ or "comma-separated confidence levels in [0, 1] (docs/SPEC.md 3)")


def parse_confidences(spec: str) -> list[float]:
  """A comma list of confidences in [0, 1], sorted and deduplicated; ValueError says what is
  wrong."""
  try:
    values = [float(x) for x in spec.split(",") if x.strip()]
  except ValueError:
    raise ValueError(f"--confidence {spec!r}: give comma-separated numbers in [0, 1], e.g. "
                     "0.6,0.8") from None
  bad = [v for v in values if not 0.0 <= v <= 1.0]
  if not values or bad:
    raise ValueError(f"--confidence {spec!r}: every confidence must be in [0, 1]"
                     + (f" (got {bad[0]:g})" if bad else ""))
  return sorted(set(values))


def add_decode_flags(p: argparse.ArgumentParser, *, max_new_tokens: int | None = 128,
                     max_new_help: str | None = None, confidence: bool = True,
                     sampling: bool = True, lookup: bool = True) -> None:
  """--max-new-tokens, --max-group, --draft-confidence, and (optionally) --confidence, the
  sampling flags and --draft-lookup (the engine's: Engine(draft_lookup=args.draft_lookup))."""
  p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=max_new_help)
  if confidence:
    add_confidence_flag(p)
  p.add_argument("--draft-confidence", type=float, default=DEFAULT_DRAFT_CONFIDENCE,
                 help="verify mode: the micro decoder drafts while the stop head's "
                 f"P(continue) >= this (default {DEFAULT_DRAFT_CONFIDENCE:g}: up to K - 1 drafts "
                 "a step; 1: none; rows whose last tokens occurred before draft what followed "
                 "them whatever it is); the output is the base's whatever it is")
  if lookup:
    p.add_argument("--draft-lookup", type=int, default=DEFAULT_DRAFT_LOOKUP,
                   choices=range(LOOKUP_MAX_N + 1), metavar="N",
                   help="verify mode: a row whose last N or more tokens occurred before in its "
                   "prompt or answer drafts what followed them, at no model cost (default "
                   f"{DEFAULT_DRAFT_LOOKUP}; 0: off, the micro decoder drafts every step; up to "
                   f"{LOOKUP_MAX_N})")
  p.add_argument("--max-group", type=int, default=None,
                 help="the most tokens one macro step may emit, 1..K (default: the model's K); "
                 "a smaller cap merges fewer tokens into each KV entry")
  if sampling:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)


def check_decode_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """The decoding flags, checked by the rules every request is checked by (Request.check), so
  that a wrong one fails before the model loads, as one line."""
  from hamburger_jax.decode.requests import GenerationError, check_settings
  from hamburger_jax.decode.sampling import SamplingError
  try:
    check_settings(1 if args.max_new_tokens is None else args.max_new_tokens,
                   getattr(args, "confidence", DEFAULT_CONFIDENCE), args.max_group,
                   getattr(args, "seed", 0), draft_confidence=args.draft_confidence)
    if hasattr(args, "temperature"):
      args.sampling = sampling_params(args.temperature, args.top_k, args.top_p)
  except (GenerationError, SamplingError) as e:
    p.exit(2, f"error: {e}\n")


def sampling_params(temperature: float, top_k: int, top_p: float):
  from hamburger_jax.decode.sampling import SamplingParams
  return SamplingParams(temperature, top_k, top_p)


def load_for_decoding(args, choose_mode: Callable[[str | None], str]
                      ) -> tuple[Any, Any, str | None, str]:
  """The decoding entry points' load sequence: the compilation cache (unless
  --no-compile-cache), the checkpoint (--checkpoint, else the shipped one if present), the mode
  to load (`choose_mode(checkpoint)`), --top-k against the vocabulary (from metadata, before the
  weights), then the weights. Returns (model, tokenizer, checkpoint, mode); a model that cannot
  load is a one-line SystemExit."""
  from hamburger_jax import cache, pretrained
  cache.enable_compilation_cache(enabled=not getattr(args, "no_compile_cache", False))
  checkpoint = pretrained.resolve_checkpoint(args.checkpoint)
  mode = choose_mode(checkpoint)
  if getattr(args, "sampling", None) is not None:
    check_top_k(args.sampling, None if mode == "base" else checkpoint, args.base)
  try:
    model, tok = load_model(mode, checkpoint, args.base, micro_vocab=args.micro_vocab)
  except ModelLoadError as e:
    raise SystemExit(f"error: {e}") from None
  if getattr(model, "drafter", None) is not None:
    print(f"verify mode drafts with the checkpoint's drafter ({model.cfg.graft.drafter_layers} "
          "layer(s) trained on plain contexts); HAMburger mode with its micro decoder",
          file=sys.stderr)
  elif mode != "base":
    print("verify mode drafts with the checkpoint's micro decoder (it has no drafter)",
          file=sys.stderr)
  return model, tok, checkpoint, mode


def check_top_k(sampling, checkpoint: str | None, base: str | None) -> None:
  """--top-k against the model's vocabulary, read from metadata before the weights load."""
  if not sampling.top_k:
    return
  from hamburger_jax import pretrained
  from hamburger_jax.convert.mapping import WeightsError
  from hamburger_jax.decode.sampling import SamplingError
  try:
    sampling.check_vocab(pretrained.vocab_size(checkpoint, base))
  except (SamplingError, WeightsError, FileNotFoundError, ValueError, RuntimeError,
          files.StorageError) as e:
    raise SystemExit(f"error: {e}") from None  # RuntimeError: assets.AssetError (not installed)


def read_prompts_file(path: str) -> list[str]:
  """One prompt per non-blank line of a UTF-8 text file; SystemExit saying what is wrong."""
  if not os.path.isfile(path):
    raise SystemExit(f"error: --prompts-file {path} does not exist (or is not a file)")
  try:
    with open(path, encoding="utf-8") as f:
      prompts = [line.rstrip("\n") for line in f if line.strip()]
  except UnicodeDecodeError as e:
    raise SystemExit(f"error: --prompts-file {path} is not UTF-8 text ({e.reason} at byte "
                     f"{e.start}): save it as UTF-8") from None
  if not prompts:
    raise SystemExit(f"error: --prompts-file {path} has no prompts (it is empty or blank): "
                     "write one prompt per line")
  return prompts


def phase(what: str, fn: Callable[[], T]) -> T:
  """Runs one phase of the run and says on stderr what it was and how long it took."""
  print(f"{what} ...", end="", file=sys.stderr, flush=True)
  t = time.perf_counter()
  try:
    out = fn()
  except BaseException:
    print(f" failed after {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    raise
  print(f" {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
  return out


def micro_vocab_size(flag: int | None, checkpoint: str | None, mode: str,
                     shipped: bool = True) -> int | None:
  """The micro vocabulary a model is loaded with for --micro-vocab `flag` (None: the flag left
  out): micro_vocab.DEFAULT_SIZE where the checkpoint (for None: the shipped one, unless not
  `shipped`, as for a run config's model) stores that many ids, 0 or a base model the full
  vocabulary (None), else `flag`."""
  from hamburger_jax import micro_vocab, pretrained  # pylint: disable=import-outside-toplevel
  if mode == "base" or flag == 0:
    return None
  if flag is not None:
    return flag
  resolved = pretrained.resolve_checkpoint(checkpoint) if shipped else checkpoint
  if resolved is None or micro_vocab.stored_size(resolved) < micro_vocab.DEFAULT_SIZE:
    return None
  return micro_vocab.DEFAULT_SIZE


def load_model(mode: str, checkpoint: str | None, base: str | None, *,
               untrained_ok: bool = False, config: str | None = None, **overrides: Any):
  """pretrained.load (or, with `config`, pretrained.load_run: a run config's model) with a
  progress line. A model that cannot load raises ModelLoadError, whatever the cause, so that
  an entry point catches one error and prints its message as one line."""
  from hamburger_jax import pretrained
  if "micro_vocab" in overrides:
    overrides["micro_vocab"] = micro_vocab_size(overrides["micro_vocab"], checkpoint, mode,
                                                shipped=config is None)
  if config is not None:
    what, load = f"the model of {config}", lambda: pretrained.load_run(
        config, checkpoint, overrides.get("micro_vocab"))
  else:
    what = pretrained.describe(mode, checkpoint, base)
    load = lambda: pretrained.load(mode, checkpoint, base, untrained_ok=untrained_ok,
                                   **overrides)
  try:
    return phase(f"loading weights ({what})", load)
  except (ValueError, RuntimeError, FileNotFoundError, files.StorageError) as e:  # weights, config,
    raise ModelLoadError(str(e)) from e  # assets, or a bucket that cannot be read


def add_precision_flag(p: argparse.ArgumentParser) -> None:
  """--precision: of float32 matmuls (hamburger_jax/precision.py states the policy)."""
  from hamburger_jax.config import PRECISIONS
  p.add_argument("--precision", choices=PRECISIONS, default="default",
                 help="float32 matmuls: the backend's default (bf16 passes on a TPU, TF32 on a "
                 "GPU) or highest (full float32 everywhere)")


def add_peak_flags(p: argparse.ArgumentParser, when: str = "") -> None:
  """--peak-tflops and --peak-gb-s: the device's peaks for MFU and the roofline, where the
  known-accelerator table or a CPU's measurement is not what the user wants. `when` prefixes
  their help (e.g. "--random-weights: ")."""
  p.add_argument("--peak-tflops", type=float, default=None,
                 help=f"{when}the device's peak TFLOP/s for MFU (default: the known "
                 "accelerator's dense bf16 figure; a CPU's is measured)")
  p.add_argument("--peak-gb-s", type=float, default=None,
                 help=f"{when}the device's memory bandwidth, GB/s (default: as above)")


def check_peak_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  for flag, v in (("--peak-tflops", args.peak_tflops), ("--peak-gb-s", args.peak_gb_s)):
    if v is not None and not v > 0:
      p.error(f"{flag} {v} must be > 0")


def device_peak(args: argparse.Namespace, dtype: str):
  """The device's peaks (peaks.device_peak: a CPU's measured now), or --peak-tflops and
  --peak-gb-s."""
  from hamburger_jax.costs import peaks
  try:
    return phase("the device's peaks", lambda: peaks.device_peak(
        dtype, tflops=args.peak_tflops, gb_s=args.peak_gb_s))
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
