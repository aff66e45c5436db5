"""HAMburger = the base Llama + compositional embedder (before) + micro-step decoder (after)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hamburger_jax.config import HamburgerConfig
from hamburger_jax.model import lora
from hamburger_jax.model.abstract import abstract
from hamburger_jax.model.compositional_embedder import CompositionalEmbedder
from hamburger_jax.model.kv_cache import KVCache
from hamburger_jax.model.layer_merge import GroupPooling, last_of_group
from hamburger_jax.model.llama import Linear, Llama, causal_segment_mask, dtype_of
from hamburger_jax.model.micro_step_decoder import MicroStepDecoder


def continues(stop_logit: jax.Array, confidence: jax.Array | float) -> jax.Array:
  """The decoding rule: go on to the next micro step while P(continue) = 1 - sigmoid(stop) >=
  the confidence c; c = 1 always stops after one token (exactly the base)."""
  confidence = jnp.asarray(confidence)
  return (confidence < 1.0) & (jax.nn.sigmoid(-stop_logit) >= confidence)


class MicroVocab(nnx.Variable):
  """The reduced micro-step vocabulary (hamburger_jax/micro_vocab.py): its token ids and their
  LM-head rows, copied from the base's head. Derived at load time: never trained nor exported."""


class Hamburger(nnx.Module):

  def __init__(self, cfg: HamburgerConfig, *, rngs: nnx.Rngs, base: Llama | None = None,
               folded_adapters: str | None = None):
    """`base`: an already loaded base model to graft onto (else a randomly initialised one);
    with graft.base_lora_rank > 0 it gets merged-entry adapters attached in place (LoRA, or
    with `folded_adapters` their decoding form, whose mixed steps run in that form
    (lora.MIXED_FORMS): model/decode_layout.py)."""
    self.cfg = cfg
    b, g = cfg.base, cfg.graft
    if base is not None and base.cfg != b:
      raise ValueError(f"the base model's config {base.cfg} differs from the HAMburger config {b}")
    self.base = base if base is not None else Llama(b, rngs=rngs)
    if g.base_lora_rank:
      lora.attach(self.base, g.base_lora_rank, g.base_lora_alpha, rngs, folded_adapters)
    self.embedder = CompositionalEmbedder(b.hidden_size, g.max_group, g.merger_head_dim, rngs=rngs,
                                          param_dtype=dtype_of(b.param_dtype),
                                          dtype=dtype_of(b.dtype),
                                          contextual=g.contextual_entry, eps=b.rms_norm_eps)
    g.check_merge_layer(b.num_layers)
    # Merge at layer L > 0 (model/layer_merge.py): the group's layer-L states pooled to one entry.
    self.pooling = (GroupPooling(b.hidden_size, g.max_group, g.merger_head_dim, rngs=rngs,
                                 param_dtype=dtype_of(b.param_dtype), dtype=dtype_of(b.dtype),
                                 eps=b.rms_norm_eps)
                    if g.merge_pooling == "attention" else nnx.data(None))
    self.micro = MicroStepDecoder(b, g, rngs=rngs)
    # Verify mode's drafter (graft.drafter_layers), else its drafts come from `micro`.
    self.drafter = (MicroStepDecoder(b, g, rngs=rngs, layers=g.drafter_layers)
                    if g.drafter_layers else nnx.data(None))
    self.feature_layers = g.resolved_feature_layers(b.num_layers)
    self.micro_ids = nnx.data(None)  # [N] token ids, when micro steps use a reduced vocabulary
    self.micro_head = nnx.data(None)  # [N, D]: the head's rows for those ids
    self.merged_entry = "graft"  # how a merged entry is made (MERGED_ENTRIES; with_merged_entry)

  @property
  def max_group(self) -> int:
    return self.cfg.graft.max_group

  @property
  def num_features(self) -> int:
    return len(self.feature_layers)

  @property
  def merge_layer(self) -> int:
    """L: where a group becomes one entry (0: at the input, the compositional embedder)."""
    return self.cfg.graft.merge_layer

  def pool_group(self, states_nkd: jax.Array, size_n: jax.Array) -> jax.Array:
    """A group's entry at layer L from its tokens' layer-L states [..., K, D] (graft.merge_pooling;
    a single token's state unchanged)."""
    if self.pooling is None or self.merged_entry == "last_token":
      return last_of_group(states_nkd, size_n)
    return self.pooling(states_nkd, size_n)

  def smash(self, ids_nk: jax.Array, size_n: jax.Array,
            context_nkd: jax.Array | None = None) -> jax.Array:
    """Token ids of groups [..., K] and sizes [...] -> one base-input embedding each [..., D].
    A contextual embedder (graft.contextual_entry) also reads the tokens' micro-decoder hidden
    states [..., K, D] (`group_context`)."""
    e = self.base.embed(ids_nk)
    if self.merged_entry == "last_token":
      last = jnp.clip(size_n - 1, 0, ids_nk.shape[-1] - 1)
      return jnp.take_along_axis(e, last[..., None, None], axis=-2)[..., 0, :]
    return self.embedder(e, size_n, context_nkd)

  def group_context(self, features_nfd: jax.Array, ids_nk: jax.Array) -> jax.Array:
    """What a contextual embedder reads of a group: the micro decoder's hidden state at each of
    its tokens [N, K, D] (h_i, the state token i was chosen from), teacher-forced from the
    features that predicted the group [N, F, D]; no gradient (the micro decoder learns from its
    own losses)."""
    return jax.lax.stop_gradient(self.micro_hidden(features_nfd, ids_nk))

  def adapted_entries(self, size_bt: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
    """Where the merged-entry adapters act in a packed row of entries [B, T] (group sizes, and
    the sample each entry belongs to): the merged entries, and with graft.adapter_scope
    "after_merge" every later entry of the same sample."""
    merged = size_bt >= 2
    if self.cfg.graft.adapter_scope == "merged":
      return merged
    t = size_bt.shape[1]
    count = jnp.cumsum(merged.astype(jnp.int32), axis=1)
    starts = jnp.concatenate([jnp.ones_like(segment_ids_bt[:, :1], bool),
                              segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(starts, jnp.arange(t), 0), axis=1)  # the sample's start
    before = jnp.take_along_axis(count - merged.astype(jnp.int32), first, axis=1)
    return count - before > 0

  def base_features(self, x_btd: jax.Array, positions_bt: jax.Array,
                    mask_bts: jax.Array | None = None, cache=None,
                    slots_bt: jax.Array | None = None, merged_bt=None,
                    write: bool = True, span: tuple[int, int] | None = None,
                    lower: dict[int, jax.Array] | None = None) -> tuple[jax.Array, Any]:
    """Base forward -> micro-decoder features [B, T, F, D] (raw residuals, then the normed
    last), and the cache with the inputs' entries written (`write`; without a cache: None), or
    their keys and values (write=False: Llama.forward).

    `merged_bt`: inputs that are merged groups (size >= 2), where base adapters act (Linear:
    [B, T] bool, or ALL_MERGED); prompt tokens and single-token entries run the exact base
    weights. `span` (L, N): the upper layers of a merge at layer L alone, from their input x;
    the features of layers below L come from `lower` ({layer: [B, T, D]}, layer_merge)."""
    if self.merged_entry != "graft":
      merged_bt = None  # an ablation (with_merged_entry): the exact base reads every entry
    start = 0 if span is None else span[0]
    collect = tuple(i for i in self.feature_layers[:-1] if i >= start)
    out = self.base.forward(x_btd, positions_bt, mask_bts, cache, slots_bt, collect=collect,
                            merged_bt=merged_bt, write=write, span=span)
    upper = dict(zip(collect, out.collected))
    feats = [upper[i] if i >= start else lower[i] for i in self.feature_layers[:-1]]
    return jnp.stack([*feats, out.hidden], axis=-2), out.cache if write else out.kv

  def micro_decoder(self, drafting: bool = False) -> MicroStepDecoder:
    """The micro decoder of a step: verify mode's drafts (`drafting`) come from the drafter
    where the graft has one."""
    return self.drafter if drafting and self.drafter is not None else self.micro

  @property
  def drafts_with(self) -> str:
    """What verify mode drafts with, by name: "drafter" or "micro decoder" (`micro_decoder`)."""
    return "drafter" if self.drafter is not None else "micro decoder"

  def micro_hidden(self, features_nfd: jax.Array, teacher_nk: jax.Array,
                   drafting: bool = False) -> jax.Array:
    """Teacher-forced micro steps: features [N, F, D], group tokens [N, K] -> h [N, K, D].

    h_0 is the skip connection (the base's normed last hidden state, so token 0 of a step is the
    base's own prediction); h_i (i >= 1) is the decoder output at the row whose input is t_{i-1}.
    """
    n, f, _ = features_nfd.shape
    k = self.max_group
    if k == 1:
      return features_nfd[:, -1:]
    x = jnp.concatenate([features_nfd, self.base.embed(teacher_nk[:, :k - 1])], axis=1)
    t = f + k - 1
    positions = jnp.broadcast_to(jnp.arange(t), (n, t))
    h, _ = self.micro_decoder(drafting)(x, positions,
                                         causal_segment_mask(jnp.ones((n, t), jnp.int32)))
    return jnp.concatenate([features_nfd[:, -1:], h[:, f:]], axis=1)

  def micro_cache(self, batch: int, drafting: bool) -> KVCache:
    """The cache of one macro step's micro steps (F + K - 1 entries, reset every step), one
    layer per layer of the decoder that runs them (`micro_decoder(drafting)`: a drafter's
    depth is its own)."""
    b = self.cfg.base
    slots = self.num_features + self.max_group - 1
    depth = len(self.micro_decoder(drafting).decoder.layers)
    return KVCache.init(depth, batch, slots, b.num_kv_heads, b.head_dim, dtype_of(b.dtype))

  def micro_step(self, i: int | jax.Array, x_btd: jax.Array, cache: KVCache,
                 drafting: bool = False) -> tuple[jax.Array, KVCache]:
    """Micro step i >= 1 at decode time: the T new inputs end with e(t_{i-1}), at micro-cache
    slots (== RoPE positions) F-1+i-T+1 .. F-1+i. Returns h_i [B, D] and the cache. The
    engine runs step 1 with T = F + 1 (the features and e(t0) in one pass), later steps T = 1."""
    b, t, _ = x_btd.shape
    slots = jnp.broadcast_to(self.num_features + i - t + jnp.arange(t), (b, t))
    h, cache = self.micro_decoder(drafting)(x_btd, slots, None, cache, slots)
    return h[:, -1], cache

  def logits(self, h: jax.Array) -> jax.Array:
    return self.base.logits(h)

  def set_micro_vocab(self, ids) -> None:
    """Micro steps 1..K-1 choose among `ids` only (None: the whole vocabulary again); token 0
    of a group always uses the base's full head."""
    if ids is None:
      self.micro_ids, self.micro_head = nnx.data(None), nnx.data(None)
      return
    ids = jnp.asarray(ids, jnp.int32)
    self.micro_ids = MicroVocab(ids, logical_axes=(None,))
    self.micro_head = MicroVocab(jnp.take(self.base.head_dv(), ids, axis=1).T,
                                 logical_axes=("vocab", "embed"))

  @property
  def micro_vocab_size(self) -> int | None:
    """How many ids micro steps choose among (None: the whole vocabulary)."""
    return None if self.micro_ids is None else int(self.micro_ids[...].shape[0])

  def micro_logits(self, h: jax.Array) -> jax.Array:
    """fp32 logits of a micro step's choice [..., N]: over the reduced vocabulary if one is
    set (index j means token micro_ids[j]), else the base's full head."""
    if self.micro_head is None:
      return self.base.logits(h)
    dt = dtype_of(self.cfg.base.dtype)
    return jnp.einsum("...d,nd->...n", h.astype(dt), self.micro_head[...].astype(dt),
                      preferred_element_type=jnp.float32)

  def micro_token(self, index: jax.Array) -> jax.Array:
    """The token id of a choice among micro_logits' entries."""
    return index if self.micro_ids is None else jnp.take(self.micro_ids[...], index)

  def micro_greedy(self, h: jax.Array) -> jax.Array:
    """The token id a micro step at h [..., D] chooses greedily (its head's argmax)."""
    return self.micro_token(jnp.argmax(self.micro_logits(h), axis=-1))

  def stop_logits(self, h: jax.Array, drafting: bool = False) -> jax.Array:
    return self.micro_decoder(drafting).stop_head(h)


def sharing_weights(model: Hamburger, micro_vocab=None) -> Hamburger:
  """A second model on `model`'s arrays (nothing copied) whose micro steps choose among
  `micro_vocab` (Hamburger.set_micro_vocab; None: the whole vocabulary): to decode one graft with
  and without a reduced vocabulary side by side."""
  out = nnx.merge(*nnx.split(model))
  out.set_micro_vocab(micro_vocab)
  return out


# How a merged entry is made: "graft" (the compositional embedder, read by the base with its
# merged-entry adapters), "no_adapters" (the embedder's output read by the exact base),
# "last_token" (the group's last token alone, through the exact base: what one KV entry per
# group keeps with no learned merging). The last two are ablations
# (infer.experiments.ablate_merged).
MERGED_ENTRIES = ("graft", "no_adapters", "last_token")


def with_merged_entry(model: Hamburger, kind: str) -> Hamburger:
  """A second model on `model`'s arrays (nothing copied) whose merged entries are made as
  `kind` (MERGED_ENTRIES) in every program traced with it."""
  if kind not in MERGED_ENTRIES:
    raise ValueError(f"merged entry {kind!r}: use one of {', '.join(MERGED_ENTRIES)}")
  out = nnx.merge(*nnx.split(model))
  out.merged_entry = kind
  return out


def with_merge_layer(model: Hamburger, merge_layer: int) -> Hamburger:
  """A second model on `model`'s arrays (nothing copied) that merges at layer `merge_layer`
  (model/layer_merge.py) in every program traced with it: with with_merged_entry "last_token",
  the untrained merge at that layer (the last token's state, the exact base reading it)."""
  graft = dataclasses.replace(model.cfg.graft, merge_layer=merge_layer,
                              merge_pooling=model.cfg.graft.merge_pooling if merge_layer else
                              "last")
  out = nnx.merge(*nnx.split(model))
  out.cfg = dataclasses.replace(model.cfg, graft=graft)
  out.cfg.graft.check_merge_layer(model.cfg.base.num_layers)
  if not merge_layer:
    out.pooling = nnx.data(None)
  return out


def copy_top_layers_into_micro(model: Hamburger, decoder: MicroStepDecoder | None = None
                               ) -> None:
  """Initialises the micro decoder (or `decoder`: the drafter) from the base's top layers (an
  alternative to fresh init)."""
  base_layers = model.base.decoder.layers
  micro_layers = (decoder or model.micro).decoder.layers
  top = base_layers[len(base_layers) - len(micro_layers):]
  for src, dst in zip(top, micro_layers):
    src_params = nnx.to_flat_state(nnx.state(src, nnx.Param))
    dst_params = dict(nnx.to_flat_state(nnx.state(dst, nnx.Param)))
    for path, var in src_params:
      if path in dst_params:  # a base layer's merged-entry adapters stay behind: plain W
        dst_params[path].set_value(jnp.array(var[...], dtype=dst_params[path].dtype))


def without_adapters(model: Hamburger, merge: bool) -> Hamburger:
  """A copy of a HAMburger model with no merged-entry adapters (hamburger_jax.model.lora): their
  deltas folded into the base kernels (`merge`, for fast decoding) or dropped (the original
  base). Unchanged arrays are shared."""
  cfg = model.cfg
  plain = dataclasses.replace(cfg, graft=dataclasses.replace(cfg.graft, base_lora_rank=0))
  out = abstract(lambda rngs: Hamburger(plain, rngs=rngs))
  deltas = {(*path, "kernel"): node.lora.delta() for path, node in nnx.iter_graph(model)
            if merge and isinstance(node, Linear) and node.lora is not None}
  src = dict(nnx.to_flat_state(nnx.state(model)))
  for path, var in nnx.to_flat_state(nnx.state(out)):
    value = src[path][...]
    if path in deltas:
      value = value + deltas[path].astype(value.dtype)
    var.set_value(value)
  return out
