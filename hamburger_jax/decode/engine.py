"""The generation engine: jitted per-request prefill into a paged KV pool, and one jitted
`lax.while_loop` decode over a fixed number of slots, for the base model and for HAMburger.
HAMburger is the base loop with a different step: each macro step emits a group of 1..K tokens
(micro steps) and writes ONE KV entry for it.

Slots advance independently: per-slot KV block tables and lengths, RoPE positions, emission
counts, done flags, max_new_tokens, confidence and sampling settings. All buffers are
static-shaped, so the same program runs on CPU, GPU and TPU. The host side (which request goes
to which slot, when, with which blocks) is `hamburger_jax/decode/serving.py`; `generate` is
serving with one slot per prompt.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np
from flax import nnx

from hamburger_jax import precision
from hamburger_jax.config import (DEFAULT_CONFIDENCE, DEFAULT_DRAFT_CONFIDENCE,
                                  DEFAULT_DRAFT_LOOKUP, DEFAULT_PREFIX_CACHE_TOKENS, LOOKUP_MAX_N,
                                  VERIFY_WIDTHS)
from hamburger_jax.decode import micro_rule as rule_lib, placement, serving, shapes, step_costs
from hamburger_jax.decode.prefix_cache import PrefixCache
from hamburger_jax.decode.programs import EnginePrograms, ProgramSettings
from hamburger_jax.decode.requests import Generation, GenerationError, Request
from hamburger_jax.decode.runner import decode_runner
from hamburger_jax.decode.sampling import SamplingParams
from hamburger_jax.decode.shapes import DEFAULT_BLOCK_SIZE, Layout, generate_slots
from hamburger_jax.decode.step import FEATURE_MODES, MODES, DecodeState, StepVariant, base_of
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import Llama


def unbuilt_options(model: Llama | Hamburger) -> list[str]:
  """The graft's options (as `name=value`) that the engine's HAMburger step does not run: a
  contextual merged entry, adapters acting past the merged entries. Both act only once an
  entry is merged, so verify and base modes, which never merge, decode such a graft as any."""
  if not isinstance(model, Hamburger):
    return []
  g = model.cfg.graft
  return [f"{name}={value!r}" for name, value, built in (
      ("adapter_scope", g.adapter_scope, "merged"),
      ("contextual_entry", g.contextual_entry, False)) if value != built]


StreamCallback = Callable[[np.ndarray, np.ndarray], None]  # (group [B, K], count [B])


class Engine(EnginePrograms):
  """Generation and serving for a `Llama` (mode "base") or a `Hamburger` (mode "hamburger" or
  "base").

  Mode "base" on a Hamburger model decodes with its base weights only (base adapters never act),
  so the two modes of one engine compare the same base in the same code. `mesh`: decode under
  a device mesh, weights placed by the inference rules (decode/placement.py).

  Users call `requests`, `compile`, `generate` and `serve`.

  Contract: a host-side scheduler (serving.py, or another) drives the device through these
  public members alone, so that they can change inside without breaking it:
    layout(mode, slots, max_new, longest_prompt, kv_blocks=None) -> Layout (static shapes)
    init_state(layout) -> DecodeState, every slot empty (done), on the engine's devices
    compile_programs(layout, prompt_ids, stochastic, stream=False) -> seconds compiling
    compile_for(layout, longest_prompt, stochastic, stream=False) -> the same, for any prompt
    compile_layouts([(layout, prompt_ids, stochastic, stream), ...]) -> the same, for several
    prefill(layout, state, request, slot) -> DecodeState, a checked request live in `slot`
    decode_program(layout, stochastic, stream, view)
        -> fn(params, state, refill, limit, sink) -> DecodeState (macro steps, then back)
    views(layout) -> [blocks], view_for(layout, blocks) -> the smallest view that holds them
    put(tree) -> the tree on the engine's devices
    encode_prompt(prompt) -> token ids; check_mode(mode) -> "base" | "hamburger"
    params (what the programs take), prefix_cache (its hits and tokens_reused count up),
    tokenizer, max_group, max_seq_len, base_cfg, block_size
  Nothing one call does stays on the engine but compiled programs and the prefix cache: a
  serve call's stats and stream callback belong to that call (serving.ServeRun,
  serving.stream_sink), so calls never see each other's.
  """

  def __init__(self, model: Llama | Hamburger, tokenizer: Any = None, *,
               max_seq_len: int | None = None, stop_ids: Sequence[int] | None = None,
               block_size: int = DEFAULT_BLOCK_SIZE, mesh: jax.sharding.Mesh | None = None,
               prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
               turn_end_ids: Sequence[int] | None = None, fused: bool | None = None,
               dtype: str | None = None, mixed: str | None = None,
               plain_branch: bool | None = None, verify_widths: str | None = None,
               draft_lookup: int = DEFAULT_DRAFT_LOOKUP,
               variant: StepVariant = StepVariant(),
               matmul_precision: str = precision.DEFAULT_PRECISION,
               micro_rule: str | float = rule_lib.DEFAULT_MICRO_RULE):
    """`fused`, `dtype`, `mixed`: the decoding layout (model/decode_layout.py; None: the
    backend's default, precision.decode_defaults); `plain_branch`: a base step's forward in a
    branch of its own (decode/step.py: advance; None: the backend's default);
    `verify_widths`: the widths a verify step's forward is compiled in (decode/step.py:
    config.VERIFY_WIDTHS; None: the backend's default). `draft_lookup`: verify mode's lookup
    drafts, the shortest match of a row's last tokens they take (decode/lookup.py; 0: off, the
    micro decoder drafts every step). `variant`: what
    each macro step computes (decode/step.py; the default is HAMburger as specified).
    `matmul_precision`: of float32 matmuls (hamburger_jax/precision.py: "highest" for the same
    greedy tokens on any backend). `micro_rule`: when a batch's next micro step runs
    (decode/micro_rule.py: "off", "auto" or a cost ratio; with "off", a row's tokens do not
    depend on its batch mates)."""
    self.tokenizer = tokenizer
    defaults = precision.decode_defaults(placement.platform(mesh))
    self.fused = defaults["fused"] if fused is None else fused
    self.dtype = defaults["dtype"] if dtype is None else dtype
    self.mixed = defaults["mixed"] if mixed is None else mixed
    plain_branch = defaults["plain_branch"] if plain_branch is None else bool(plain_branch)
    verify_widths = defaults["verify_widths"] if verify_widths is None else verify_widths
    if verify_widths not in VERIFY_WIDTHS:
      raise GenerationError(f"verify_widths={verify_widths!r}: use one of "
                            f"{', '.join(VERIFY_WIDTHS)}")
    if isinstance(draft_lookup, bool) or not isinstance(draft_lookup, (int, np.integer)) or not (
        draft_lookup == 0 or 1 <= draft_lookup <= LOOKUP_MAX_N):
      raise GenerationError(f"draft_lookup={draft_lookup!r}: use 0 (off) or a match length in "
                            f"[1, {LOOKUP_MAX_N}]")
    matmul_precision = precision.check(matmul_precision)
    self.micro_rule = rule_lib.parse(micro_rule)
    # Cost vectors (DecodeState.micro_cost) by (rule, slots): "auto" measures once per slot count.
    self._micro_costs: dict[tuple, np.ndarray] = {}
    self.max_seq_len = max_seq_len or base_of(model).cfg.max_position_embeddings
    if stop_ids is None:
      stop_ids = tokenizer.stop_ids if tokenizer is not None else ()
    stop_ids = tuple(int(i) for i in stop_ids)
    # What ends a turn in a prompt (prefix caching), also where generation ignores it (benches
    # that decode every request to its max_new_tokens pass stop_ids=()).
    if turn_end_ids is None:
      turn_end_ids = tokenizer.stop_ids if tokenizer is not None else stop_ids
    if block_size < 1:
      raise GenerationError(f"block_size={block_size} must be >= 1")
    super().__init__(ProgramSettings(
        block_size=block_size, mesh=mesh, precision=matmul_precision, stop_ids=stop_ids,
        turn_end_ids=tuple(int(i) for i in turn_end_ids), variant=variant,
        plain_branch=plain_branch, verify_widths=verify_widths, draft_lookup=int(draft_lookup)))
    try:
      self.prefix_cache = PrefixCache(prefix_cache_tokens)
    except ValueError as e:
      raise GenerationError(str(e)) from None
    self.set_model(model)

  # The settings the programs are traced with (decode/programs.py: ProgramSettings), by name.
  block_size = property(lambda self: self.settings.block_size)
  mesh = property(lambda self: self.settings.mesh)
  precision = property(lambda self: self.settings.precision)
  stop_ids = property(lambda self: self.settings.stop_ids)
  turn_end_ids = property(lambda self: self.settings.turn_end_ids)
  variant = property(lambda self: self.settings.variant)
  plain_branch = property(lambda self: self.settings.plain_branch)
  verify_widths = property(lambda self: self.settings.verify_widths)
  draft_lookup = property(lambda self: self.settings.draft_lookup)

  # ------------------------------------------------------------------ traced pieces

  def _empty_state(self, layout: Layout) -> DecodeState:
    k = self.runner.max_group if layout.mode in FEATURE_MODES else 1
    f = self.runner.num_features if layout.mode in FEATURE_MODES else 1
    return shapes.empty_state(layout, self.base_cfg, k, f)

  def init_state(self, layout: Layout) -> DecodeState:
    """A decode state of `layout`'s shapes with every slot empty (done) and every block-table
    entry the trash block, placed by `put`: what `prefill` and the decode programs take. Its
    micro steps' cost ratios are the engine's micro_rule's (`micro_costs`)."""
    state = self._empty_state(layout)
    return self.put(state.replace(micro_cost=self.micro_costs(layout)))

  def micro_costs(self, layout: Layout) -> np.ndarray:
    """The cost vector (DecodeState.micro_cost, decode/micro_rule.py) under the engine's
    micro_rule at `layout`'s slots; 0 in base mode, which has no micro steps. "auto" times the
    steps the first time a slot count asks."""
    if layout.mode != "hamburger":
      return rule_lib.rule_costs("off", layout.slots)
    key = (self.micro_rule, layout.slots)
    if key not in self._micro_costs:
      self._micro_costs[key] = rule_lib.rule_costs(
          self.micro_rule, layout.slots,
          lambda: rule_lib.measure(step_costs.Probe(self.runner), layout.slots))
    return self._micro_costs[key]

  def with_micro_rule(self, rule: str | float) -> "Engine":
    """This engine deciding micro steps by `rule` (decode/micro_rule.py): its weights,
    compiled programs, measured costs (by rule and slots) and prefix cache shared while both
    hold the same weights (the rule is a runtime operand of the same programs); `set_model` on
    either gives that one a prefix cache of its own."""
    other = copy.copy(self)
    other.micro_rule = rule_lib.parse(rule)
    return other

  @property
  def max_group(self) -> int | None:
    """The most tokens a macro step can emit: the HAMburger model's K (None for a base model,
    whose steps emit one token whatever a request's cap)."""
    return self.model.max_group if isinstance(self.model, Hamburger) else None

  @property
  def merge_layer(self) -> int:
    """Where the HAMburger model's groups become one entry (0: at the input; a base model: 0)."""
    return self.model.merge_layer if isinstance(self.model, Hamburger) else 0

  @property
  def compilations(self) -> int:
    return len(self.programs)

  # ------------------------------------------------------------------ host side

  def encode_prompt(self, prompt) -> list[int]:
    """str -> chat-templated user turn; list of messages -> chat template; list of ints -> as is."""
    if isinstance(prompt, str):
      if not prompt.strip():
        raise GenerationError("empty prompt: give at least one non-blank character")
      prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, dict) or not hasattr(prompt, "__len__"):
      raise GenerationError(f"a prompt is a string, a list of chat messages or a list of token "
                            f"ids; got {type(prompt).__name__}")
    if len(prompt) and isinstance(prompt[0], dict):
      if self.tokenizer is None:
        raise GenerationError("text prompts need a tokenizer; pass token ids or a tokenizer")
      return list(self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                     tokenize=True))
    if not len(prompt):
      raise GenerationError("empty prompt: give at least one token")
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in prompt):
      raise GenerationError("a token-id prompt must hold integers only")
    ids = [int(i) for i in prompt]
    vocab = self.base_cfg.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
      raise GenerationError(f"prompt token ids must be in [0, {vocab}); got {min(ids)}..{max(ids)}")
    return ids

  def check_mode(self, mode: str | None) -> str:
    mode = mode or ("hamburger" if isinstance(self.model, Hamburger) else "base")
    if mode not in MODES:
      raise GenerationError(f"mode={mode!r}: use one of {', '.join(MODES)}")
    if mode in FEATURE_MODES and not isinstance(self.model, Hamburger):
      raise GenerationError(f"mode {mode!r} needs a HAMburger model (its micro decoder "
                            "proposes the tokens): load a graft checkpoint")
    unbuilt = unbuilt_options(self.model)
    if mode == "hamburger" and unbuilt:
      raise GenerationError(f"this graft has {', '.join(unbuilt)}, which the engine does not "
                            "decode in HAMburger mode: verify and base modes (which never "
                            "merge) decode it; judge its merged entries teacher-forced "
                            "(infer.eval --tasks fidelity)")
    return mode

  def serve(self, requests: Iterable, *, slots: int = 8, kv_blocks: int | None = None,
            mode: str | None = None, max_new_bound: int | None = None,
            round_steps: int | None = None,
            progress: Callable[[Generation], None] | None = None,
            stream: StreamCallback | None = None) -> serving.ServeRun:
    """Continuous batching (see serving.serve): returns a ServeRun that yields each request's
    result as it finishes; its `stats` are this call's. `stream(group, count)`: called once per
    macro step, in order, with numpy arrays [slots, K] and [slots] (count 0: an empty or
    finished slot)."""
    return serving.serve(self, requests, slots=slots, kv_blocks=kv_blocks, mode=mode,
                         max_new_bound=max_new_bound, round_steps=round_steps,
                         progress=progress, stream=stream)

  def requests(self, prompts: Sequence, *, max_new_tokens: int = 128,
               sampling: SamplingParams = SamplingParams(),
               confidence: float | Sequence[float] = DEFAULT_CONFIDENCE, seed: int = 0,
               max_group: int | None = None,
               draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE) -> list[Request]:
    """Checked requests for `prompts` (texts, message lists or token-id lists), with ids 0..n-1
    and one confidence for all or one per prompt. Each prompt is encoded here, once: `compile`,
    `generate` and `serve` take these requests and use their ids as they are. Raises
    GenerationError on the first bad prompt or setting."""
    reqs = self._batch(prompts, max_new_tokens, sampling, confidence, seed, max_group,
                       draft_confidence)
    for r in reqs:
      r.check(self)
    return reqs

  def _batch(self, prompts: Sequence, max_new_tokens: int, sampling: SamplingParams,
             confidence: float | Sequence[float], seed: int, max_group: int | None,
             draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE) -> list[Request]:
    """A Request per item, unchecked: items that are Requests already are kept as they are
    (their own settings); the others take these settings and their index as id."""
    if isinstance(prompts, (str, dict)) or not len(prompts):
      raise GenerationError("prompts must be a non-empty list (wrap a single prompt in a list)")
    conf = np.asarray(confidence, np.float64)
    if conf.ndim and conf.shape != (len(prompts),):
      raise GenerationError(f"confidence has {conf.size} values for {len(prompts)} prompts: give "
                            "one value, or one per prompt")
    conf = np.broadcast_to(conf, (len(prompts),))
    return [p if isinstance(p, Request) else Request(
        p, max_new_tokens=max_new_tokens, confidence=float(c), sampling=sampling, seed=seed, id=i,
        max_group=max_group, draft_confidence=draft_confidence)
        for i, (p, c) in enumerate(zip(prompts, conf))]

  def compile(self, prompts: Sequence, *, max_new_tokens: int = 128, mode: str | None = None,
              sampling: SamplingParams = SamplingParams(), stream: bool = False) -> float:
    """Compiles the programs that `generate` with these arguments runs (confidence and seed do
    not change them), so that a caller can time compilation apart from generation. Returns the
    seconds spent: 0 when they were compiled already. `prompts` as for `generate`: Requests from
    `requests` are not encoded again (raw prompts are, here and again in `generate`)."""
    mode = self.check_mode(mode)
    reqs = []
    for r in self._batch(prompts, max_new_tokens, sampling, DEFAULT_CONFIDENCE, 0, None):
      r = dataclasses.replace(r)  # the caller's requests stay as they are
      r.check(self)
      reqs.append(r)
    layout = self.layout(mode, generate_slots(len(reqs)), max(r.max_new_tokens for r in reqs),
                         max(len(r.ids) for r in reqs))
    return self.compile_programs(layout, [r.ids for r in reqs],
                                 any(not r.sampling.greedy for r in reqs), stream)

  def generate(self, prompts: Sequence, *, max_new_tokens: int = 128, mode: str | None = None,
               sampling: SamplingParams = SamplingParams(),
               confidence: float | Sequence[float] = DEFAULT_CONFIDENCE, seed: int = 0,
               stream: StreamCallback | None = None, max_group: int | None = None,
               draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE) -> list[Generation]:
    """Generates for a batch of prompts (texts, message lists or token-id lists) or Requests
    (from `requests`: encoded once there; each carries its own settings, which the arguments
    here do not change): one slot per prompt, results in prompt order. Raises GenerationError on
    any bad prompt or setting. `mode`: decode/step.py MODES (default: hamburger for a HAMburger
    model). `max_group`: the most tokens a macro step may emit (None: the model's K).
    `draft_confidence`: verify mode's drafts go on while the stop head's P(continue) >= it.
    `stream`: as for `serve`."""
    mode = self.check_mode(mode)
    # serve checks each request; it reports the bad ones before any work, so the first error
    # stops the batch before anything compiles.
    reqs = self._batch(prompts, max_new_tokens, sampling, confidence, seed, max_group,
                       draft_confidence)
    # Results come back by id; serve gives an id-less request its index.
    ids = [i if r.id is None else r.id for i, r in enumerate(reqs)]
    try:
      order = {rid: i for i, rid in enumerate(ids)}
    except TypeError:
      order = {}
    if len(order) != len(reqs):
      raise GenerationError("generate needs a distinct, hashable id on each Request")
    out: list[Generation | None] = [None] * len(reqs)
    run = serving.serve(self, reqs, slots=generate_slots(len(reqs)), mode=mode, stream=stream)
    with contextlib.closing(run):  # an error ends the run at once (its stream sink too)
      for g in run:
        if g.error:
          raise GenerationError(g.error)
        out[order[g.id]] = g
    return out

  def set_model(self, model: Llama | Hamburger) -> None:
    """Takes new weights; compiled programs are kept when the architecture is the same.

    The engine decodes `model` in the decoding layout (model/decode_layout.py: fused
    projections, folded adapters, its dtype); base adapters act only on macro steps whose input
    is a merged entry, so mode "base" (which never marks an input merged) is the base model,
    exactly. An abstract model (nnx.eval_shape) gives an engine whose programs can be lowered
    and compiled (for a mesh of devices that are not attached) but not run."""
    runner, abstract = decode_runner(model, fused=self.fused, dtype=self.dtype,
                                     mixed=self.mixed)
    graphdef, params = nnx.split(runner)
    if getattr(self, "graphdef", graphdef) != graphdef:
      raise GenerationError("set_model needs a model of the same architecture as the engine's")
    params = placement.place_weights(params, self.mesh, abstract)
    self.model, self.runner = model, runner
    self.base_cfg = base_of(runner).cfg
    self.graphdef, self.params = graphdef, params
    # Its entries were computed with the old weights. A new cache, not a cleared one: an engine
    # made by with_micro_rule shares this one, and keeps its weights.
    self.prefix_cache = PrefixCache(self.prefix_cache.capacity_tokens)
