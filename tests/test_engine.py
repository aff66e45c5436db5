"""The decode engine: base decode consistency, HAMburger vs a plain reference loop (docs/SPEC.md 3),
forced single-token steps == base, batch invariance, EOS, exact lengths, program reuse, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hamburger_jax.config import HamburgerConfig
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import Llama
from hamburger_jax import testing
from hamburger_jax.testing import DECODE_CFG, DECODE_STOP, tiny_decode_model
from hamburger_jax.decode import sampling as samplers
from hamburger_jax.decode.engine import Engine, GenerationError
from hamburger_jax.decode.sampling import SamplingError, SamplingParams

CFG, STOP = DECODE_CFG, DECODE_STOP
PROMPTS = [[1, 2, 3, 4, 5], [9, 8], list(range(10, 31)), [40, 41, 42]]


@pytest.fixture(scope="module")
def model() -> Hamburger:
  return tiny_decode_model()


@pytest.fixture(scope="module")
def engine(model) -> Engine:
  return Engine(model, None, stop_ids=[STOP])


# ------------------------------------------------------------------ references (no KV cache)


PAD = 64  # the references run fixed-length (jitted) uncached forwards; rows past the end are pad


@nnx.jit
def _base_logits(base: Llama, ids_bt: jax.Array) -> jax.Array:
  return base(ids_bt)


def argmax_rollout(base: Llama, prompt: list[int], n: int) -> list[int]:
  seq = list(prompt)
  for _ in range(n):
    ids = jnp.zeros((1, PAD), jnp.int32).at[0, :len(seq)].set(jnp.asarray(seq))
    seq.append(int(jnp.argmax(_base_logits(base, ids)[0, len(seq) - 1])))
    if seq[-1] == STOP:
      break
  return seq[len(prompt):]


def reference_hamburger(model: Hamburger, prompt: list[int], max_new: int, confidence: float,
                        max_group: int | None = None) -> tuple[list[int], list[int]]:
  return testing.reference_hamburger(model, prompt, max_new, confidence, STOP,
                                     max_group=max_group)


# ------------------------------------------------------------------ base decoding


def test_base_cached_decode_equals_uncached_rollout(model, engine):
  gens = engine.generate(PROMPTS, max_new_tokens=12, mode="base")
  for prompt, g in zip(PROMPTS, gens):
    assert g.token_ids == argmax_rollout(model.base, prompt, 12)
    assert g.groups == [1] * g.new_tokens and g.macro_steps == g.new_tokens
  # A row's output does not depend on its batch mates (nor on the batch bucket).
  alone = engine.generate([PROMPTS[2]], max_new_tokens=12, mode="base")[0]
  assert alone.token_ids == gens[2].token_ids


@pytest.mark.parametrize("plain_branch", [False, True])
def test_the_plain_forward_inline_or_in_its_branch_decodes_the_same(model, plain_branch):
  """The base step's forward inline (accelerators) or in a branch skipped when every row is
  done (this CPU's default, precision.DECODE_PLAIN_BRANCH): the uncached rollout's tokens, and
  the branch is in the program only when asked."""
  engine = Engine(model, None, stop_ids=[STOP], plain_branch=plain_branch)
  gens = engine.generate(PROMPTS[:2], max_new_tokens=8, mode="base")
  for prompt, g in zip(PROMPTS, gens):
    assert g.token_ids == argmax_rollout(model.base, prompt, 8)
  layout = engine.layout("base", 2, 8, max(len(p) for p in PROMPTS[:2]))
  hlo = engine.lower_decode(layout, False, False, engine.views(layout)[0]).as_text()
  assert ("stablehlo.case" in hlo or "stablehlo.if" in hlo) == plain_branch


def test_base_engine_on_plain_llama(model):
  engine = Engine(model.base, None, stop_ids=[STOP])
  g = engine.generate([PROMPTS[0]], max_new_tokens=10)[0]
  assert g.token_ids == argmax_rollout(model.base, PROMPTS[0], 10)
  with pytest.raises(GenerationError, match="needs a HAMburger model"):
    engine.generate([PROMPTS[0]], mode="hamburger")


# ------------------------------------------------------------------ HAMburger decoding


@pytest.mark.parametrize("confidence", [0.5, 0.0, 0.7])
def test_hamburger_equals_reference_loop(model, engine, confidence):
  gens = engine.generate(PROMPTS, max_new_tokens=14, mode="hamburger", confidence=confidence)
  sizes = set()
  for prompt, g in zip(PROMPTS, gens):
    tokens, groups = reference_hamburger(model, prompt, 14, confidence)
    assert (g.token_ids, g.groups) == (tokens, groups)
    assert sum(g.groups) == g.new_tokens and g.macro_steps == len(g.groups)
    assert g.kv_entries == len(prompt) + g.macro_steps - 1  # one entry per forwarded step
    sizes |= set(groups)
  if confidence == 0.5:
    assert sizes == {1, 2, 3, 4}  # the test exercises every group size


@pytest.mark.parametrize("max_group", [1, 2, 3])
def test_max_group_caps_each_macro_step(model, engine, max_group):
  # confidence 0: uncapped, every step would emit K = 4 tokens.
  gens = engine.generate(PROMPTS, max_new_tokens=14, mode="hamburger", confidence=0.0,
                         max_group=max_group)
  for prompt, g in zip(PROMPTS, gens):
    assert (g.token_ids, g.groups) == reference_hamburger(model, prompt, 14, 0.0, max_group)
    assert max(g.groups) == max_group and sum(g.groups) == g.new_tokens
  if max_group == 1:  # a cap of one token is the base, token for token
    base = engine.generate(PROMPTS, max_new_tokens=14, mode="base")
    assert [g.token_ids for g in gens] == [b.token_ids for b in base]


def test_max_group_is_per_request(engine):
  # Rows with different caps in one batch emit what each emits alone.
  from hamburger_jax.decode.requests import Request  # pylint: disable=import-outside-toplevel
  caps = [2, None, 1, 3]
  served = {g.id: g for g in engine.serve(
      [Request(p, max_new_tokens=14, confidence=0.0, max_group=c, id=i)
       for i, (p, c) in enumerate(zip(PROMPTS, caps))], slots=4, mode="hamburger")}
  for i, (prompt, c) in enumerate(zip(PROMPTS, caps)):
    alone = engine.generate([prompt], max_new_tokens=14, mode="hamburger", confidence=0.0,
                            max_group=c)[0]
    assert (served[i].token_ids, served[i].groups) == (alone.token_ids, alone.groups)
    assert max(alone.groups) == (c or engine.max_group)


def test_release_position_convention(model):
  shifted = Hamburger(dataclasses_replace_graft(model, position_offset=1), rngs=nnx.Rngs(0))
  nnx.update(shifted, nnx.state(model))
  engine = Engine(shifted, None, stop_ids=[STOP])
  g = engine.generate([PROMPTS[0]], max_new_tokens=12, mode="hamburger", confidence=0.5)[0]
  assert (g.token_ids, g.groups) == reference_hamburger(shifted, PROMPTS[0], 12, 0.5)


def dataclasses_replace_graft(model: Hamburger, **kw) -> HamburgerConfig:
  import dataclasses  # pylint: disable=import-outside-toplevel
  return HamburgerConfig(model.cfg.base, dataclasses.replace(model.cfg.graft, **kw))


def test_forced_single_token_steps_equal_base(engine):
  base = engine.generate(PROMPTS, max_new_tokens=16, mode="base")
  ham = engine.generate(PROMPTS, max_new_tokens=16, mode="hamburger", confidence=1.0)
  for b, h in zip(base, ham):
    assert h.token_ids == b.token_ids
    assert h.groups == [1] * h.new_tokens


def test_batch_invariance_mixed_lengths_and_confidences(engine):
  confs = [0.5, 0.0, 1.0, 0.7]
  batch = engine.generate(PROMPTS, max_new_tokens=14, mode="hamburger", confidence=confs)
  for prompt, c, g in zip(PROMPTS, confs, batch):
    alone = engine.generate([prompt], max_new_tokens=14, mode="hamburger", confidence=c)[0]
    assert (alone.token_ids, alone.groups) == (g.token_ids, g.groups)


def test_eos_inside_a_group_ends_the_row(model):
  free = Engine(model, None, stop_ids=[]).generate(PROMPTS, max_new_tokens=16, mode="hamburger",
                                                   confidence=0.0)
  # Pick a token emitted in the middle of a group and declare it end-of-sequence.
  for g in free:
    starts = np.cumsum([0] + g.groups[:-1])
    mids = [s + j for s, size in zip(starts, g.groups) for j in range(size - 1) if s + j > 0]
    if mids:
      cut = mids[0]
      eos = g.token_ids[cut]
      if eos not in g.token_ids[:cut]:
        break
  else:
    pytest.fail("no group with a token inside it to use as EOS")
  row = free.index(g)
  stopped = Engine(model, None, stop_ids=[eos]).generate([PROMPTS[row]], max_new_tokens=16,
                                                         mode="hamburger", confidence=0.0)[0]
  assert stopped.token_ids == g.token_ids[:cut + 1]  # nothing after EOS, EOS itself kept
  assert sum(stopped.groups) == cut + 1


@pytest.mark.parametrize("n", [1, 5, 7])
def test_max_new_tokens_is_exact(engine, n):
  for g in engine.generate(PROMPTS, max_new_tokens=n, mode="hamburger", confidence=0.0):
    assert g.new_tokens == n or g.token_ids[-1] == STOP
    assert sum(g.groups) == g.new_tokens


def test_programs_are_reused_within_a_bucket(model):
  engine = Engine(model, None, stop_ids=[STOP])
  engine.generate([[1, 2, 3]], max_new_tokens=8, mode="hamburger")
  engine.generate([[7, 6, 5, 4, 3, 2]], max_new_tokens=8, mode="hamburger", confidence=0.3)
  engine.generate([[9]], max_new_tokens=8, mode="hamburger", seed=3)
  # One prefill program (prompt bucket 16) and one decode program (slots, lengths, sampler).
  assert engine.compilations == 2
  engine.generate([[9], [8]], max_new_tokens=8, mode="hamburger")  # 2 slots: a new layout
  assert engine.compilations == 4


def test_compile_ahead_is_what_generate_runs(model):
  """`compile` builds the very programs `generate` then runs (the CLI times them apart), for any
  confidence and seed; what it validates, it validates as `generate` does."""
  engine = Engine(model, None, stop_ids=[STOP])
  assert engine.compile([[1, 2, 3], [4]], max_new_tokens=8, mode="hamburger") > 0
  assert engine.compile([[5, 6], [7]], max_new_tokens=8, mode="hamburger") == 0  # same buckets
  gens = engine.generate([[1, 2, 3], [4]], max_new_tokens=8, mode="hamburger",
                         confidence=[0.3, 1.0], seed=5)
  assert engine.compilations == 2 and all(g.compile_s == 0 for g in gens)  # prefill + decode
  with pytest.raises(GenerationError, match="max_new_tokens=0"):
    engine.compile([[1]], max_new_tokens=0)


def test_streaming_reports_every_macro_step(engine):
  seen = []
  g = engine.generate([PROMPTS[0]], max_new_tokens=12, mode="hamburger", confidence=0.5,
                      stream=lambda group, count: seen.append((group.tolist(), count.tolist())))[0]
  counts = [c[0] for _, c in seen if c[0] > 0]
  assert counts == g.groups
  assert [t for grp, c in seen for t in grp[0][:c[0]]] == g.token_ids


# ------------------------------------------------------------------ sampling


def test_sampling_is_seeded_and_filters_reduce_to_greedy(engine):
  hot = SamplingParams(temperature=1.5)
  a = engine.generate(PROMPTS, max_new_tokens=10, mode="hamburger", sampling=hot, seed=1)
  b = engine.generate(PROMPTS, max_new_tokens=10, mode="hamburger", sampling=hot, seed=1)
  c = engine.generate(PROMPTS, max_new_tokens=10, mode="hamburger", sampling=hot, seed=2)
  assert [g.token_ids for g in a] == [g.token_ids for g in b]
  assert [g.token_ids for g in a] != [g.token_ids for g in c]
  greedy = engine.generate(PROMPTS, max_new_tokens=10, mode="hamburger")
  for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0,
                                                                          top_p=1e-6)):
    out = engine.generate(PROMPTS, max_new_tokens=10, mode="hamburger", sampling=params, seed=5)
    assert [g.token_ids for g in out] == [g.token_ids for g in greedy]


def test_top_p_and_top_k_filters():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  kept = np.isfinite(np.asarray(samplers.filter_top_p(logits, jnp.float32(0.7))))
  assert kept.tolist() == [[True, True, False, False]]
  kept = np.isfinite(np.asarray(samplers.filter_top_p(logits, jnp.float32(0.81))))
  assert kept.tolist() == [[True, True, True, False]]
  kept = np.isfinite(np.asarray(samplers.filter_top_k(logits, 3)))
  assert kept.tolist() == [[True, True, True, False]]
  draws = [int(samplers.sample(logits, jax.random.key(i), SamplingParams(1.0, top_p=0.7))[0])
           for i in range(200)]
  assert set(draws) == {0, 1}


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kwargs,match", [
    ({"confidence": 1.5}, "confidence must be in"),
    ({"confidence": [0.5, -0.1]}, "confidence must be in"),
    ({"max_new_tokens": 0}, "max_new_tokens=0 must be an integer >= 1"),
    ({"max_new_tokens": 252}, "max_seq_len 256"),
    ({"mode": "fast"}, "mode='fast'"),
    ({"confidence": [0.5, 0.6, 0.7]}, "confidence has 3 values for 2 prompts"),
    ({"seed": 2 ** 70}, "seed=1180591620717411303424 must be an integer"),
    ({"max_new_tokens": True}, "max_new_tokens=True must be an integer"),
    ({"sampling": SamplingParams(1.0, top_k=98)}, "top_k=98 exceeds the vocabulary"),
    ({"max_group": 5}, r"max_group=5 must be an integer in \[1, 4\]"),
    ({"max_group": 0}, r"max_group=0 must be an integer in \[1, 4\]"),
    ({"max_group": 2.0}, "max_group=2.0 must be an integer"),
])
def test_bad_requests(engine, kwargs, match):
  with pytest.raises(GenerationError, match=match):
    engine.generate([PROMPTS[0], PROMPTS[1]], **kwargs)


def test_bad_prompts(engine):
  with pytest.raises(GenerationError, match="empty prompt"):
    engine.generate([[]])
  with pytest.raises(GenerationError, match="empty prompt"):
    engine.generate(["   "])
  with pytest.raises(GenerationError, match="non-empty list"):
    engine.generate([])
  with pytest.raises(GenerationError, match="token ids must be in"):
    engine.generate([[1, 200]])
  with pytest.raises(GenerationError, match="need a tokenizer"):
    engine.generate(["hello"])


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -1.0}, "temperature=-1.0 must be >= 0"),
    ({"top_p": 0.0}, "top_p=0.0 must be in"),
    ({"top_p": 1.5}, "top_p=1.5 must be in"),
    ({"top_k": -2}, "top_k=-2"),
    ({"top_k": 2.5}, "top_k=2.5 must be an integer"),
    ({"temperature": float("inf")}, "temperature=inf must be >= 0 and finite"),
    ({"temperature": float("nan")}, "temperature=nan must be >= 0 and finite"),
    ({"top_p": "0.9"}, "top_p='0.9' must be a number"),
])
def test_bad_sampling_params(kwargs, match):
  with pytest.raises(SamplingError, match=match):
    SamplingParams(**kwargs)


def test_base_adapters_act_only_after_merged_steps(model):
  """With merged-entry adapters at random non-zero values, HAMburger decoding equals the gated
  reference of docs/SPEC.md 3; at confidence 1.0 (nothing merged) it is the base, token for
  token; and the adapters do change the tokens once merged entries are read (the gate is really there)."""
  from hamburger_jax.model import lora  # pylint: disable=import-outside-toplevel
  cfg = dataclasses_replace_graft(model, base_lora_rank=4, base_lora_alpha=8.0)
  adapted = Hamburger(cfg, rngs=nnx.Rngs(0))
  nnx.update(adapted, nnx.state(model))  # same weights as `model`, plus adapters
  for i, lin in enumerate(lora.base_linears(adapted.base)):
    lin.lora.b.set_value(0.05 * jax.random.normal(jax.random.key(i), lin.lora.b.shape))
  engine = Engine(adapted, None, stop_ids=[STOP])
  ham = engine.generate(PROMPTS, max_new_tokens=12, mode="hamburger", confidence=0.5)
  for prompt, g in zip(PROMPTS, ham):
    assert (g.token_ids, g.groups) == reference_hamburger(adapted, prompt, 12, 0.5)
  assert any(max(g.groups) >= 2 for g in ham)
  unadapted = Engine(model, None, stop_ids=[STOP]).generate(PROMPTS, max_new_tokens=12,
                                                              mode="hamburger", confidence=0.5)
  assert [g.token_ids for g in ham] != [g.token_ids for g in unadapted]
  one = engine.generate(PROMPTS, max_new_tokens=12, mode="hamburger", confidence=1.0)
  base = engine.generate(PROMPTS, max_new_tokens=12, mode="base")
  for prompt, g, b in zip(PROMPTS, one, base):
    assert g.token_ids == b.token_ids == argmax_rollout(model.base, prompt, 12)
    assert g.groups == [1] * g.new_tokens