"""One macro step of decoding, the engine's loop body (docs/method.md section 3): token 0 from
the base's features, the stop head and the micro steps (HAMburger mode), the group smashed
into ONE base input, the base forward of that input and its KV entry written. The engine, the
decode benches and the standalone step program (step_program.py) all run this code.

Where launches go (a small model's step on a GPU is bound by how many kernels it runs):
- the micro steps are unrolled (K is static): each takes its token and, but for the last, its
  stop head's decision inside; the next runs only if enough rows go on to pay for it (nested
  conditionals; micro_rule.pays: the batch-aware micro loop);
- the base forward reads its cache without writing it and returns the new keys and values,
  which are written for every layer at once after it: so the forward can sit in a branch (a
  branch that wrote the pool would copy it) that picks the adapters' form per step: plain
  kernels when no entry is merged, folded kernels when every live entry is, both (selected per
  row) otherwise (model/llama.py: Linear).

`StepVariant` takes parts out (infer.experiments.ablate_step) or fixes what tracing may assume
(`forced`: every group runs to K tokens, every entry merges: step_program.py's step, no
branches).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from hamburger_jax.decode.lookup import lookup_drafts, shift_in
from hamburger_jax.decode.micro_rule import cost_parts, micro_batch_sizes, pays
from hamburger_jax.decode.sampling import sample_rows, sampling_logits
from hamburger_jax.model.hamburger import Hamburger, continues
from hamburger_jax.model.llama import ALL_MERGED, Llama

PROPOSALS = ("micro", "stop_only", "token0")
# How a slot decodes: "base" one base token a forward; "hamburger" a group of up to K tokens a
# forward, smashed into one KV entry; "verify" the base's exact tokens, up to K a forward, the
# micro decoder's drafts checked by the base (`verify_step`).
MODES = ("base", "hamburger", "verify")
# Modes whose base forward hands the micro decoder its F features (base mode: the last layer's
# hidden state alone).
FEATURE_MODES = ("hamburger", "verify")
EMBEDDERS = ("graft", "token0")


@flax.struct.dataclass
class DecodeState:
  cache: Any  # the KV cache (decode/paged_kv.py: PagedKVCache; model/kv_cache.py: KVCache)
  features: jax.Array  # [B, F, D] base features at each slot's predicting position (base: F=1)
  prompt_len: jax.Array  # [B]
  tokens: jax.Array  # [B, N + K] emitted tokens
  n_tokens: jax.Array  # [B]
  groups: jax.Array  # [B, N] tokens emitted by each macro step
  n_steps: jax.Array  # [B]
  done: jax.Array  # [B] bool; empty slots are done
  max_new: jax.Array  # [B] the slot's own max_new_tokens (<= N)
  # [B] a row goes on to its next micro step while P(continue) >= this: HAMburger mode's
  # confidence c (its groups), verify mode's draft confidence (its drafts)
  continue_at: jax.Array
  max_group: jax.Array  # [B] the most tokens one macro step of the slot may emit (<= K)
  temperature: jax.Array  # [B] 0 = greedy
  top_k: jax.Array  # [B] 0 = off
  top_p: jax.Array  # [B] 1 = off
  key: jax.Array  # [B] the slot's request key; token keys fold in the step and micro index
  # [B] verify mode: token 0 of the row's next step, drawn at the end of this one from the
  # logits its check computed (without the draft the base refused: `verify_step`), so that the
  # LM head runs once a step; -1 where none is drawn yet (a slot just prefilled)
  next_token: jax.Array
  # [B, LOOKUP_WINDOW] verify mode: the row's last LOOKUP_WINDOW tokens, prompt and emitted,
  # -1 before its first (`lookup_drafts` reads them)
  context: jax.Array
  # [micro_rule.cost_size(B)] the micro steps' cost ratios (micro_rule.pays; all 0: off), laid
  # out and built by decode/micro_rule.py. A runtime operand: each value, measured or given,
  # runs the same compiled program.
  micro_cost: jax.Array


@dataclasses.dataclass(frozen=True)
class StepVariant:
  """What a macro step computes, fixed when it is traced.

  adapters: merged-entry adapters act on merged entries (False: the plain base everywhere).
  proposal: "micro" (stop head, micro steps), "stop_only" (the stop head's decision computed,
    no micro step), "token0" (token 0 alone).
  embedder: "graft" (the compositional embedder) or "token0" (a group's entry is its first
    token's embedding).
  forced: every live row's group runs to K tokens (the rows' confidence is 0 and nothing stops
    a group: the stop heads still run, their decisions all go on) and every entry is merged;
    known when tracing, so the step has no branch: all micro steps run, the folded kernels
    act."""
  adapters: bool = True
  proposal: str = "micro"
  embedder: str = "graft"
  forced: bool = False

  def __post_init__(self):
    if self.proposal not in PROPOSALS:
      raise ValueError(f"proposal={self.proposal!r}: use one of {', '.join(PROPOSALS)}")
    if self.embedder not in EMBEDDERS:
      raise ValueError(f"embedder={self.embedder!r}: use one of {', '.join(EMBEDDERS)}")


def base_of(model: Llama | Hamburger) -> Llama:
  return model.base if isinstance(model, Hamburger) else model


def has_adapters(model: Llama | Hamburger) -> bool:
  return isinstance(model, Hamburger) and model.cfg.graft.base_lora_rank > 0


def forward_features(model, mode: str, x_btd, positions_bt, cache, slots_bt, merged_bt=None,
                     write: bool = True):
  """The base forward of inputs at cache slots: features [B, T, F, D] (base mode: F = 1, the
  normed last layer) and the cache written (`write`) or the inputs' keys and values."""
  if mode in FEATURE_MODES:
    return model.base_features(x_btd, positions_bt, None, cache, slots_bt, merged_bt, write)
  out = base_of(model).forward(x_btd, positions_bt, None, cache, slots_bt, write=write)
  return out.hidden[:, :, None, :], out.cache if write else out.kv


def token_keys(state: DecodeState, micro: int) -> jax.Array:
  """Each row's key for draw `micro` of this macro step: from its request, its macro step and
  `micro` only, never from the slot, the batch mates or when the request arrived."""
  return jax.vmap(lambda k, s: jax.random.fold_in(jax.random.fold_in(k, s), micro))(
      state.key, state.n_steps)


def sample(logits_bv, state: DecodeState, micro: int, stochastic: bool,
           veto: jax.Array | None = None) -> jax.Array:
  """Each row's token (token_keys; `veto`: sampling.sample_rows)."""
  return sample_rows(logits_bv, token_keys(state, micro), state.temperature, state.top_k,
                     state.top_p, stochastic=stochastic, veto_b=veto)


def micro_branch(n_continuing: jax.Array, slots: int) -> jax.Array:
  """Which micro batch a macro step runs: 0 none (no row continues), i the i-th of
  micro_batch_sizes(slots) (the smallest that holds the continuing rows), last every slot."""
  sizes = jnp.asarray((*micro_batch_sizes(slots), slots), jnp.int32)
  return jnp.where(n_continuing == 0, 0, 1 + jnp.searchsorted(sizes, n_continuing))


def _micro_steps(model: Hamburger, rs: DecodeState, tokens, count, cont, *, stop_ids,
                 stochastic: bool, forced: bool, n_live: jax.Array, r: jax.Array,
                 drafting: bool = False):
  """Micro steps 1..K-1 for the rows of `rs` (the state's per-row fields, no cache, no
  micro_cost): unrolled, each emitting t_i where `cont`; step i + 1 runs only if the rows that
  go on pay for it (`pays`, at cost ratio `r`, `n_live` rows decoding), always if `forced`. A
  step that does not run ends every group there."""
  k = model.max_group
  base = model.base
  left = rs.max_new - rs.n_tokens

  def step(i, x, cache, tokens, count, cont):
    h, cache = model.micro_step(i, x, cache, drafting)
    ti = model.micro_token(sample(model.micro_logits(h), rs, i, stochastic))
    tokens = tokens.at[:, i].set(jnp.where(cont, ti, 0))
    count = count + cont
    if i == k - 1:  # the group is full: no decision left to take
      return tokens, count
    go_on = (cont & continues(model.stop_logits(h, drafting), rs.continue_at)
             & ~jnp.isin(ti, stop_ids)
             & (left > i + 1) & (rs.max_group > i + 1))
    x = base.embed(ti[:, None])
    rest = lambda ops: step(i + 1, *ops)
    if forced:
      return rest((x, cache, tokens, count, go_on))
    go_on = go_on & pays(jnp.sum(go_on), n_live, r)
    return jax.lax.cond(jnp.any(go_on), rest, lambda o: (o[2], o[3]),
                        (x, cache, tokens, count, go_on))

  # Micro step 1 reads the F features and e(t0) in one pass (one read of the weights).
  x = jnp.concatenate([rs.features, base.embed(tokens[:, :1])], axis=1)
  return step(1, x, model.micro_cache(tokens.shape[0], drafting), tokens, count, cont)


def propose(model: Llama | Hamburger, mode: str, state: DecodeState, *, stop_ids: jax.Array,
            stochastic: bool, variant: StepVariant = StepVariant(),
            lookup: int = 0) -> tuple[jax.Array, jax.Array]:
  """One macro step's group: tokens [B, K'] and how many of them each row emits [B]. In verify
  mode the group is token 0 (the base's own, drawn without last step's rejected draft) and
  the micro decoder's drafts after it, each its argmax (what the acceptance rule assumes),
  while the stop head goes on at the rows' draft confidence; with `lookup` (the shortest
  match, 0: off), a row whose last tokens occurred before drafts what followed them there
  (decode/lookup.py) and runs no micro step."""
  base = base_of(model)
  h0 = state.features[:, -1]  # skip connection: token 0 is the base's own prediction
  if mode == "verify":
    t0 = verify_token0(model, state, stochastic)
  else:
    t0 = sample(base.logits(h0), state, 0, stochastic)
  count = jnp.where(state.done, 0, 1).astype(jnp.int32)
  if mode not in FEATURE_MODES or model.max_group == 1:
    return t0[:, None], count
  k = model.max_group
  b = t0.shape[0]
  tokens = jnp.zeros((b, k), jnp.int32).at[:, 0].set(t0)
  if variant.proposal == "token0":
    return tokens, count
  remaining = state.max_new - state.n_tokens
  drafting = mode == "verify"
  may = ~state.done & ~jnp.isin(t0, stop_ids) & (remaining > 1) & (state.max_group > 1)
  cont = may & continues(model.stop_logits(h0, drafting), state.continue_at)
  if drafting and lookup:
    found, n_found = lookup_drafts(shift_in(state.context, t0[:, None], jnp.ones_like(t0)),
                                   k - 1, lookup)
    # as many as the row may emit, up to its first stop id (kept: the base may end there)
    is_stop = jnp.isin(found, stop_ids)
    n_found = jnp.minimum(n_found, jnp.sum(jnp.cumsum(is_stop, axis=1) - is_stop == 0, axis=1))
    n_found = jnp.where(may, jnp.minimum(n_found, jnp.minimum(remaining, state.max_group) - 1), 0)
    looked_up = n_found > 0
    drafted = micro_drafts(model, state, tokens, count, cont & ~looked_up, stop_ids=stop_ids,
                           stochastic=stochastic, variant=variant, drafting=True)
    return (jnp.where(looked_up[:, None], tokens.at[:, 1:].set(found), drafted[0]),
            jnp.where(looked_up, count + n_found, drafted[1]))
  return micro_drafts(model, state, tokens, count, cont, stop_ids=stop_ids,
                      stochastic=stochastic, variant=variant, drafting=drafting)


def micro_drafts(model: Hamburger, state: DecodeState, tokens, count, cont, *,
                 stop_ids: jax.Array, stochastic: bool, variant: StepVariant,
                 drafting: bool) -> tuple[jax.Array, jax.Array]:
  """`propose`'s micro steps for the rows that go on (`cont`): the group's tokens after t0
  (HAMburger mode) or the drafts (verify mode), and each row's count."""
  b = tokens.shape[0]
  if variant.proposal == "stop_only":  # the decision computed and kept, never acted on
    return tokens, count + (cont & (count > 9)).astype(count.dtype)
  rows_state = state.replace(cache=None, micro_cost=None)  # the per-row fields
  n_live = jnp.sum(~state.done)
  micro = lambda rs, *ops, r: _micro_steps(model, rs, *ops, stop_ids=stop_ids,
                                           stochastic=stochastic and not drafting,
                                           forced=variant.forced, n_live=n_live, r=r,
                                           drafting=drafting)
  if variant.forced:
    return micro(rows_state, tokens, count, cont, r=jnp.float32(0))

  def compact(size: int, r: jax.Array):
    def run(operands):
      """Only the rows that continue, gathered into a micro batch of `size` rows: a micro
      step's LM head then reads `size` rows, not every slot (padding rows emit nothing)."""
      tokens, count, cont = operands
      idx = jnp.nonzero(cont, size=size, fill_value=b)[0]  # b: a padding row
      take = lambda x: x[jnp.minimum(idx, b - 1)]
      sub_tokens, sub_count = micro(jax.tree.map(take, rows_state), take(tokens), take(count),
                                    idx < b, r=r)
      return (tokens.at[idx].set(sub_tokens, mode="drop"),
              count.at[idx].set(sub_count, mode="drop"))
    return run

  # Rows whose stop head fired after token 0 need no micro decoder work at all; when few rows
  # go on, the smallest micro batch that holds them runs the micro steps, at that batch's cost
  # ratios; when too few go on to pay for micro step 1 (and for the mixed base step it makes
  # when others stop), every group ends at token 0.
  n_cont = jnp.sum(cont)
  branch = micro_branch(n_cont, b)
  later, first, m = cost_parts(state.micro_cost, b)
  merge = jnp.where(n_cont < n_live, m, 0.0)
  branch = jnp.where(pays(n_cont, n_live, first[jnp.maximum(branch, 1) - 1] + merge), branch, 0)
  sizes = micro_batch_sizes(b)
  return jax.lax.switch(branch,
                        [lambda o: o[:2], *(compact(n, later[j]) for j, n in enumerate(sizes)),
                         lambda o: micro(rows_state, *o, r=later[len(sizes)])],
                        (tokens, count, cont))


def advance(model: Llama | Hamburger, mode: str, state: DecodeState, group: jax.Array,
            count: jax.Array, *, offset: int, variant: StepVariant = StepVariant(),
            plain_branch: bool = False) -> DecodeState:
  """The emitted group becomes ONE base input at the position of its last token; the base
  forward of it gives the next features and its KV entry. `plain_branch`: a forward without
  adapters runs in a branch, skipped when every row is done (precision.DECODE_PLAIN_BRANCH).
  A graft that merges at layer L > 0: `advance_at_layer`."""
  if mode == "hamburger" and merges_at_layer(model):
    return advance_at_layer(model, state, group, count, offset=offset, variant=variant)
  if mode == "hamburger" and variant.embedder == "graft":
    x = model.smash(group, jnp.maximum(count, 1))
  else:
    x = base_of(model).embed(group[:, 0])
  pos = (state.prompt_len - 1 + state.n_tokens + offset)[:, None]
  slot = state.cache.length[:, None]
  view = state.cache.view()  # read before the branch, written after it
  run = lambda merged: forward_features(model, mode, x[:, None], pos, view, slot, merged,
                                        write=False)
  if mode != "hamburger" or not has_adapters(model) or not variant.adapters:
    if plain_branch:
      idle = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                  jax.eval_shape(lambda: run(None)))
      feats, kv = jax.lax.cond(jnp.all(state.done), idle, lambda: run(None))
    else:
      feats, kv = run(None)
  else:
    feats, kv = _adapted(run, count, variant)
  cache = state.cache.write_layers(slot, *kv)
  cache = cache.replace(length=cache.length + (~state.done).astype(jnp.int32))
  return state.replace(cache=cache, features=feats[:, 0])


def _adapted(run: Callable[[Any], Any], count: jax.Array, variant: StepVariant):
  """`run(merged)` with the merged-entry adapters in the form the step's rows need."""
  if variant.forced:
    return run(ALL_MERGED)
  # Base adapters act only on a merged entry (a group of >= 2 tokens): after a single token
  # the base runs its exact weights, so confidence 1.0 is the base, token for token.
  merged = count >= 2  # empty and finished rows emit nothing: they agree with either form
  every = jnp.all(merged | (count == 0))
  branches = [lambda: run(None), lambda: run(ALL_MERGED)]
  if merged.shape[0] > 1:  # one row always agrees with itself
    branches.append(lambda: run(merged[:, None]))
  index = jnp.where(~jnp.any(merged), 0, jnp.where(every, 1, len(branches) - 1))
  return jax.lax.switch(index, branches)


def merges_at_layer(model) -> bool:
  """A HAMburger graft whose groups become one entry at a layer L > 0 (model/layer_merge.py)."""
  return isinstance(model, Hamburger) and model.merge_layer > 0


def advance_at_layer(model: Hamburger, state: DecodeState, group: jax.Array, count: jax.Array,
                     *, offset: int, variant: StepVariant = StepVariant()) -> DecodeState:
  """`advance` for a graft that merges at layer L > 0: the group's K tokens run layers 0..L-1
  as plain inputs at their own positions, one entry each (the cache's `length` counts tokens:
  a macro step writes up to K entries past it, Layout.step_entries); its pooled layer-L state
  runs layers L..N-1 as ONE input at the position of its last token, in the upper layers'
  entry (group) slot, prompt_len + macro steps (a prompt token is an entry in every layer).
  The pool keeps both in one table: the upper layers use the first of a row's slots only.
  Entries past a row's count are written but never read (overwritten by its next group)."""
  base, l, n = model.base, model.merge_layer, model.cfg.base.num_layers
  k = group.shape[1]
  at = jnp.arange(k)[None, :]
  size = jnp.maximum(count, 1)
  before = state.n_tokens - count  # `emit` has counted the group already
  view = state.cache.view()  # read before the branch, written after it
  below = tuple(i for i in model.feature_layers if i < l - 1)
  low = base.forward(base.embed(group), (state.prompt_len + before)[:, None] + at,
                     None, view.layers(0, l), state.cache.length[:, None] + at, collect=below,
                     write=False, span=(0, l), norm=False)
  last = lambda h: jnp.take_along_axis(h, (size - 1)[:, None, None], axis=1)[:, 0]
  lower = {i: last(h)[:, None] for i, h in zip((*below, l - 1), (*low.collected, low.hidden))}
  x = model.pool_group(low.hidden, size)[:, None]
  pos = (state.prompt_len - 1 + state.n_tokens + offset)[:, None]
  # A row that emitted nothing writes past its entries (its token length), where nothing reads.
  slot = jnp.where(count > 0, state.prompt_len + state.n_steps - 1, state.cache.length)[:, None]
  run = lambda merged: model.base_features(x, pos, None, view.layers(l, n), slot, merged,
                                           write=False, span=(l, n), lower=lower)
  if not has_adapters(model) or not variant.adapters:
    feats, kv = run(None)
  else:
    feats, kv = _adapted(run, count, variant)
  cache = state.cache.write_layers(state.cache.length[:, None] + at, *low.kv)
  cache = cache.write_layers(slot, *kv, start=l)
  # As `advance`: a row that has just finished keeps its length (its last group is never read).
  cache = cache.replace(length=cache.length + jnp.where(state.done, 0, count))
  return state.replace(cache=cache, features=feats[:, 0])


def macro_step(model: Llama | Hamburger, mode: str, state: DecodeState, *, stop_ids: jax.Array,
               stochastic: bool, offset: int = 0, variant: StepVariant = StepVariant(),
               report: Callable[[jax.Array, jax.Array], None] | None = None,
               plain_branch: bool = False, verify_widths: str = "two",
               verify_lookup: int = 0) -> DecodeState:
  """One macro step of every slot: the group proposed, emitted into the state's buffers
  (`report(group, count)` sees it), then the base step that reads it (`plain_branch`: see
  advance). Done slots emit nothing and write only where nothing is read (their own unused
  entries, or a pool's trash block). Verify mode: `verify_step` (`verify_widths`: the widths
  its forward is compiled in, config.VERIFY_WIDTHS; `verify_lookup`: its lookup drafts' shortest
  match, 0 off)."""
  if mode == "verify":
    return verify_step(model, state, stop_ids=stop_ids, stochastic=stochastic, report=report,
                       widths=verify_widths, lookup=verify_lookup)
  group, count = propose(model, mode, state, stop_ids=stop_ids, stochastic=stochastic,
                         variant=variant)
  state = emit(state, group, count, stop_ids, report)
  return advance(model, mode, state, group, count, offset=offset, variant=variant,
                 plain_branch=plain_branch)


def emit(state: DecodeState, group: jax.Array, count: jax.Array, stop_ids: jax.Array,
         report: Callable[[jax.Array, jax.Array], None] | None) -> DecodeState:
  """Each row's first `count` tokens of `group` [B, K] into its buffers (`report` sees them):
  one macro step's output. A row is done at a stop id or its max_new tokens."""
  k = group.shape[1]
  n_max = state.groups.shape[1]
  rows = jnp.arange(state.done.shape[0])[:, None]
  emitted = jnp.arange(k)[None, :] < count[:, None]
  idx = jnp.where(emitted, state.n_tokens[:, None] + jnp.arange(k)[None, :], n_max + k)
  tokens = state.tokens.at[rows, idx].set(group, mode="drop")
  gidx = jnp.where(count > 0, state.n_steps, n_max)[:, None]
  groups = state.groups.at[rows, gidx].set(count[:, None], mode="drop")
  n_tokens = state.n_tokens + count
  done = state.done | jnp.any(emitted & jnp.isin(group, stop_ids), axis=1) | (
      n_tokens >= state.max_new)
  if report is not None:
    report(group, count)
  return state.replace(tokens=tokens, groups=groups, n_tokens=n_tokens,
                       n_steps=state.n_steps + (count > 0), done=done)


# Verify mode's acceptance draws: micro index ACCEPT_DRAW + i for draft i (token keys 0..K-1
# are the proposal's).
ACCEPT_DRAW = 1 << 16


def accepted_drafts(logits_bkv: jax.Array, drafts_bk: jax.Array, n_drafts: jax.Array,
                    state: DecodeState, stochastic: bool) -> tuple[jax.Array, jax.Array]:
  """How many of each row's drafts the base keeps [B], and the first draft it refused [B] (-1:
  none). Draft i is checked against the base's distribution after the tokens before it
  (logits [B, K', V], row i): greedy, kept while it is the argmax; sampling (speculative
  sampling with a drafter that proposes its argmax), kept with probability p(d), p the row's
  sampling distribution, so that a kept draft, or the residual drawn after a refusal
  (sample_rows' veto), has exactly the base's distribution."""
  k = drafts_bk.shape[1]
  exists = jnp.arange(k)[None, :] < n_drafts[:, None]
  argmax = jnp.argmax(logits_bkv, axis=-1)
  ok = argmax == drafts_bk
  if stochastic:
    b, _, v = logits_bkv.shape
    flat = lambda a: jnp.repeat(a, k, axis=0)
    probs = jax.nn.softmax(sampling_logits(logits_bkv.reshape(b * k, v), flat(state.temperature),
                                           flat(state.top_k), flat(state.top_p)), axis=-1)
    p_draft = jnp.take_along_axis(probs, drafts_bk.reshape(-1, 1), axis=-1).reshape(b, k)
    u = jnp.stack([jax.vmap(jax.random.uniform)(token_keys(state, ACCEPT_DRAW + i))
                   for i in range(k)], axis=1)
    ok = jnp.where(state.temperature[:, None] > 0, u < p_draft, ok)
  run = jnp.cumprod((ok & exists).astype(jnp.int32), axis=1)
  kept = jnp.sum(run, axis=1)
  refused = jnp.where(kept < n_drafts,
                      jnp.take_along_axis(drafts_bk, jnp.minimum(kept, k - 1)[:, None],
                                          axis=1)[:, 0], -1)
  return kept, refused


def verify_token0(model: Hamburger, state: DecodeState, stochastic: bool) -> jax.Array:
  """Token 0 of each row's verify step: the one its last step drew (DecodeState.next_token);
  a row just prefilled has none, and the LM head runs for the batch only in a step that has
  such a row."""
  pending = state.next_token
  fresh = lambda: sample(model.base.logits(state.features[:, -1]), state, 0, stochastic)
  need = jnp.any(~state.done & (pending < 0))
  drawn = jax.lax.cond(need, fresh, lambda: jnp.zeros_like(pending))
  return jnp.where(pending >= 0, pending, drawn)


def verify_step(model: Hamburger, state: DecodeState, *, stop_ids: jax.Array, stochastic: bool,
                report: Callable[[jax.Array, jax.Array], None] | None = None,
                widths: str = "two", lookup: int = 0) -> DecodeState:
  """One macro step of verify mode: the base's exact output, several tokens a forward where
  the micro decoder guesses them.

  The group [t0, d1, ..] (`propose`): t0 the base's own next token, d_i the drafts (with
  `lookup`, what followed the row's last tokens where they occurred before, else the micro
  decoder's). One base forward reads all K as plain entries at the row's next K slots (the exact
  weights: no adapters) and writes their keys and values; the base's output after t0 and
  each kept draft checks the next draft (`accepted_drafts`). The row emits t0 and the drafts
  it keeps, its slot counter moves by as many (entries past it are overwritten later, never
  read), and the features after its last kept token predict the next step's t0: drawn here,
  without a refused draft, from the logits the check computed (one LM-head pass a step:
  DecodeState.next_token), with the next step's token key."""
  base = model.base
  group, count = propose(model, "verify", state, stop_ids=stop_ids, stochastic=stochastic,
                         lookup=lookup)
  b, k = group.shape
  live = ~state.done
  at = jnp.arange(k)[None, :]
  positions = (state.prompt_len + state.n_tokens)[:, None] + at
  slots = state.cache.length[:, None] + at
  view = state.cache.view()  # read before the branch, written after it (a branch that wrote
  # the pool would copy it)
  n_drafts = jnp.maximum(count - 1, 0)

  def checked(width: int):
    """The forward of each row's first `width` inputs, the drafts it keeps, and the logits
    after its last kept token [B, V] (one LM-head pass over the `width` rows: the base after
    t0, d1, .. checks d1, d2, .., and the one after the last kept predicts the next t0); its
    features and keys and values padded to K (entries past the kept ones are never read)."""
    def run():
      feats, kv = forward_features(model, "verify", base.embed(group[:, :width]),
                                   positions[:, :width], view, slots[:, :width], None,
                                   write=False)
      logits = base.logits(feats[:, :, -1])  # [B, width, V]
      if width == 1:
        kept, refused = jnp.zeros((b,), jnp.int32), jnp.full((b,), -1, jnp.int32)
      else:
        # A step of this width has no row with more drafts than it checks.
        kept, refused = accepted_drafts(logits[:, :-1], group[:, 1:width],
                                        jnp.minimum(n_drafts, width - 1), state, stochastic)
      after = jnp.take_along_axis(logits, kept[:, None, None], axis=1)[:, 0]
      pad = lambda a, axis: jnp.pad(a, [(0, k - width if i == axis else 0)
                                        for i in range(a.ndim)])
      return pad(feats, 1), tuple(pad(a, 2) for a in kv), kept, refused, after
    return run

  # A step where no row drafted reads one input a row, as the base's step does; else every
  # row's K inputs, or (widths "each") as many as the most drafts of a live row need.
  most = jnp.max(jnp.where(live, n_drafts, 0))
  if widths == "each":
    feats, kv, kept, refused, after = jax.lax.switch(most, [checked(w) for w in range(1, k + 1)])
  else:
    feats, kv, kept, refused, after = jax.lax.cond(most > 0, checked(k), checked(1))
  count = jnp.where(live, 1 + kept, 0)
  cache = state.cache.write_layers(slots, *kv)
  cache = cache.replace(length=cache.length + count)
  last = jnp.maximum(count - 1, 0)
  state = state.replace(cache=cache, features=jnp.take_along_axis(
      feats, last[:, None, None, None], axis=1)[:, 0])
  state = emit(state, group, count, stop_ids, report)
  if lookup:  # the window the next step's lookup reads
    state = state.replace(context=shift_in(state.context, group, count))
  # The next step's token 0, with its key (emit has moved the step counter).
  t0 = sample(after, state, 0, stochastic, refused)
  return state.replace(next_token=jnp.where(state.done, -1, t0))
