"""Continuous batching over the paged KV pool (hamburger_jax/decode/serving.py): every request
served with others gives exactly what `generate` gives for it alone, in both modes; the pool
never shares a block between live rows, frees finished rows' blocks, queues or preempts when
short, and refuses a request it can never hold; programs are reused; bad requests fail alone."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from hamburger_jax.decode import shapes
from hamburger_jax.decode import step as step_lib
from hamburger_jax.decode.engine import Engine, GenerationError
from hamburger_jax.decode.paged_kv import TRASH_BLOCK, BlockAllocator
from hamburger_jax.decode.prefix_cache import CachedPrefix, PrefixCache, cacheable_prefix
from hamburger_jax.decode.sampling import SamplingParams
from hamburger_jax.decode.requests import Generation, Request, pooled_tokens_per_step
from hamburger_jax.decode.serving import ServeStats, check_tables, mean_blocks_held
from hamburger_jax.testing import DECODE_STOP, tiny_decode_model

# Mixed lengths: 1 to 40 prompt tokens (prompt buckets 16, 32 and 64), 3 to 20 new tokens.
PROMPTS = [[1, 2, 3, 4, 5], [9, 8], list(range(10, 31)), [40, 41, 42], list(range(50, 90)),
           [7], [60, 61, 62, 63, 64, 65, 66, 67], list(range(3, 20)), [33, 34], [80, 70, 60]]
MAX_NEW = [12, 20, 7, 16, 9, 20, 3, 14, 18, 11]
CONFIDENCES = [0.5, 0.0, 1.0, 0.7, 0.5, 0.3, 0.9, 0.5, 0.0, 0.6]


@pytest.fixture(scope="module")
def engine() -> Engine:
  return Engine(tiny_decode_model(), None, stop_ids=[DECODE_STOP])


@pytest.fixture(scope="module")
def alone(engine):
  """What `generate` gives each request by itself, per mode."""
  out = {}
  for mode in ("base", "hamburger"):
    out[mode] = [engine.generate([p], max_new_tokens=n, mode=mode, confidence=c)[0]
                 for p, n, c in zip(PROMPTS, MAX_NEW, CONFIDENCES)]
  return out


# Chat-like prompts (DECODE_STOP ends a turn): three share a 16-token system turn, the last
# one is a later turn of the first conversation (its history, 25 tokens, is its own prefix).
SYSTEM = list(range(20, 35)) + [DECODE_STOP]
CHAT = [SYSTEM + [5, 6, 7, DECODE_STOP, 1], SYSTEM + [8, 9, DECODE_STOP, 1],
        SYSTEM + list(range(40, 60)) + [DECODE_STOP, 1],
        SYSTEM + [5, 6, 7, DECODE_STOP, 1, 11, 12, 13, DECODE_STOP, 1, 14, 15, DECODE_STOP, 1]]
CHAT_NEW = [10, 14, 6, 12]
CHAT_CONFIDENCE = [0.5, 0.3, 0.0, 0.6]


def requests(order=None) -> list[Request]:
  order = order if order is not None else range(len(PROMPTS))
  return [Request(PROMPTS[i], max_new_tokens=MAX_NEW[i], confidence=CONFIDENCES[i], id=i)
          for i in order]


@pytest.mark.parametrize("mode", ["base", "hamburger"])
def test_served_requests_equal_generate_alone(engine, alone, mode):
  order = list(range(len(PROMPTS)))
  random.Random(3).shuffle(order)  # random arrival order
  reqs = requests(order)
  run = engine.serve(reqs, slots=3, mode=mode)
  got = {g.id: g for g in run}
  assert sorted(got) == list(range(len(PROMPTS)))
  assert all(r.ids is None for r in reqs)  # serving works on copies, not the caller's requests
  merged = False
  for i, want in enumerate(alone[mode]):
    g = got[i]
    assert g.error is None
    assert (g.token_ids, g.groups) == (want.token_ids, want.groups), f"request {i}"
    assert g.kv_entries == len(PROMPTS[i]) + g.macro_steps - 1
    merged |= max(g.groups) >= 2
  assert merged == (mode == "hamburger")
  stats = run.stats
  assert max(stats.in_flight) == 3  # the slots were refilled, not run once
  assert stats.free_blocks_at_end == stats.usable_blocks  # finished rows freed their blocks


def test_bounded_rounds_give_the_same_tokens(engine, alone):
  """round_steps=K: the host refills every K macro steps instead of at each finish."""
  run = engine.serve(requests(), slots=3, mode="hamburger", round_steps=2)
  got = {g.id: g for g in run}
  for i, want in enumerate(alone["hamburger"]):
    assert (got[i].token_ids, got[i].groups) == (want.token_ids, want.groups), f"request {i}"
  stats = run.stats
  assert stats.rounds >= max(g.macro_steps for g in got.values()) // 2
  with pytest.raises(GenerationError, match="round_steps=0 must be None"):
    list(engine.serve(requests(), round_steps=0))


@pytest.mark.parametrize("mode", ["base", "hamburger"])
def test_programs_update_the_pool_in_place(engine, mode):
  """Neither the decode nor the prefill program copies the KV pool: a copy per macro step cost
  the 16-slot base decode ~40% of its throughput (XLA copies buffers routed through a cond)."""
  layout = engine.layout(mode, 4, 32, len(CHAT[0]))
  engine.compile_programs(layout, [CHAT[0]], stochastic=False)
  pool = engine.init_state(layout).cache.k
  dtype = {"float32": "f32", "bfloat16": "bf16"}[pool.dtype.name]
  shape = f"{dtype}[{','.join(map(str, pool.shape))}]"
  programs = [p for k, ps in engine.programs.items() if k[1] == layout
              for p in (ps if isinstance(ps, tuple) else (ps,))]
  assert {k[0] for k in engine.programs if k[1] == layout} == {"prefill", "decode", "prefix"}
  for program in programs:
    copies = [line for line in program.as_text().splitlines()
              if shape in line and " copy(" in line]
    assert not copies, copies[:2]


def test_small_pool_queues_and_preempts_without_corruption(engine, alone):
  # 13 usable blocks of 4 entries: the longest request (40 + 9 entries) alone needs all 13 in
  # the worst case; together the requests need far more, so they wait in the queue and live
  # ones are preempted (and recomputed) when the pool runs dry.
  small = Engine(engine.model, None, stop_ids=[DECODE_STOP], block_size=4)
  run = small.serve(requests(), slots=6, kv_blocks=14, mode="hamburger")
  got = {g.id: g for g in run}
  for i, want in enumerate(alone["hamburger"]):
    assert (got[i].token_ids, got[i].groups) == (want.token_ids, want.groups), f"request {i}"
  stats = run.stats
  assert max(stats.blocks_used) <= 13 and stats.free_blocks_at_end == 13
  assert stats.preemptions > 0 and sum(g.preemptions for g in got.values()) == stats.preemptions
  assert max(stats.in_flight) < 6  # the pool, not the slots, bounded the batch
  assert len(stats.queued) == len(stats.round_s) == stats.rounds and stats.queued[0] > 0


def test_in_flight_while_queued_weighs_rounds_by_their_decode_time():
  stats = ServeStats(in_flight=[4, 2, 1], queued=[3, 0, 1], round_s=[1.0, 5.0, 3.0])
  # The round with no request waiting is left out; the others weigh by their seconds.
  assert stats.in_flight_while_queued == (4 * 1.0 + 1 * 3.0) / 4.0
  assert ServeStats(in_flight=[2], queued=[0], round_s=[1.0]).in_flight_while_queued == 0.0


@pytest.mark.parametrize("mode", ["base", "hamburger"])
def test_mean_blocks_held_is_what_serving_allocates_per_macro_step(engine, mode):
  """One slot, one macro step per decode call: the blocks the allocator has handed out before
  each call, averaged over the calls, are the figure computed from the results alone."""
  small = Engine(engine.model, None, stop_ids=[DECODE_STOP], block_size=4)
  run = small.serve(requests(), slots=1, mode=mode, round_steps=1)
  gens = list(run)
  stats = run.stats
  assert stats.rounds == sum(g.macro_steps for g in gens)
  assert mean_blocks_held(gens, 4) == pytest.approx(np.mean(stats.blocks_used))
  assert len(set(stats.blocks_used)) > 2  # rows took blocks as they grew


def test_mean_blocks_held_by_hand():
  gen = lambda prompt, steps: Generation([], "", [1] * steps, steps, 0, prompt, 0, 0)
  # Blocks of 16: 15 prompt tokens hold 1 block during step 1 (room for entry 16), 2 during
  # step 2; a 3-token prompt holds 1 block during each of its 4 steps.
  assert mean_blocks_held([gen(15, 2)], 16) == 1.5
  assert mean_blocks_held([gen(15, 2), gen(3, 4)], 16) == (1 + 2 + 4 * 1) / 6
  assert mean_blocks_held([], 16) == 0.0


def test_pooled_tokens_per_step_weighs_requests_by_length():
  gen = lambda groups: Generation(list(range(sum(groups))), "", groups, len(groups), 0, 1, 0, 0)
  gens = [gen([4, 4, 4, 4]), gen([1])]  # 4.0 and 1.0 tokens per step alone
  assert pooled_tokens_per_step(gens) == 17 / 5 != (4.0 + 1.0) / 2
  assert pooled_tokens_per_step([]) == 0.0


def test_pool_too_small_for_one_request_fails_it_alone(engine):
  small = Engine(engine.model, None, stop_ids=[DECODE_STOP], block_size=4)
  reqs = [Request(list(range(1, 41)), max_new_tokens=20, id="long"),  # 60 entries: 15 blocks
          Request([1, 2, 3], max_new_tokens=5)]
  got = {g.id: g for g in small.serve(reqs, slots=2, kv_blocks=8, mode="base")}
  assert "needs up to 15 KV blocks" in got["long"].error and "raise kv_blocks" in got["long"].error
  assert got[1].error is None and got[1].new_tokens == 5  # an id-less request: its index
  assert reqs[1].id is None


def test_block_tables_never_share_a_block():
  table = np.full((3, 4), TRASH_BLOCK, np.int32)
  table[0, :2] = [1, 2]
  table[1, :1] = [3]
  table[2, :2] = [2, 5]  # block 2 in slots 0 and 2
  check_tables(table, [0, 1])  # slot 2 is not live: its stale row does not count
  with pytest.raises(RuntimeError, match=r"KV blocks \[2\] are held by more than one"):
    check_tables(table, [0, 1, 2])
  pool = BlockAllocator(5)
  assert pool.take(2) == [1, 2] and pool.free == 2
  pool.give_back([1])
  with pytest.raises(RuntimeError, match="freed twice"):
    pool.give_back([1])
  with pytest.raises(RuntimeError, match="asked for 9 KV blocks, 3 free"):
    pool.take(9)


def test_long_prompts_are_prefilled_in_chunks(engine, alone, monkeypatch):
  """A prompt longer than the largest prefill bucket runs in chunks; its output is unchanged."""
  monkeypatch.setattr(shapes, "PREFILL_BUCKETS", (8,))
  chunked = Engine(engine.model, None, stop_ids=[DECODE_STOP])
  got = {g.id: g for g in chunked.serve(requests(), slots=4, mode="hamburger")}
  for i, want in enumerate(alone["hamburger"]):
    assert (got[i].token_ids, got[i].groups) == (want.token_ids, want.groups), f"request {i}"
  assert {k[2] for k in chunked.programs if k[0] == "prefill"} == {8}


def test_prefill_chunks_cover_the_prompt_with_little_padding():
  buckets, cost = shapes.PREFILL_BUCKETS, shapes.PREFILL_CHUNK_COST
  assert shapes.prefill_chunks(130) == [(0, 128, 128), (128, 2, 16)]  # not padded to 256
  assert shapes.prefill_chunks(100) == [(0, 100, 128)]  # one chunk beats 64 + 32 + 16
  assert shapes.prefill_chunks(1100) == [(0, 512, 512), (512, 512, 512), (1024, 64, 64),
                                        (1088, 12, 16)]
  for n in range(1, 1300):
    chunks = shapes.prefill_chunks(n)
    starts = [0] + [start + valid for start, valid, _ in chunks]
    assert [c[0] for c in chunks] == starts[:-1] and starts[-1] == n  # contiguous, all of n
    assert all(0 < valid <= size and size in buckets for _, valid, size in chunks)
    padded = sum(size + cost for _, _, size in chunks)
    # Never worse than the smallest bucket holding the prompt (or chunks of the largest).
    whole = sum(shapes.bucket(min(512, n - s), buckets) + cost for s in range(0, n, 512))
    assert padded <= whole


def test_fifty_requests_compile_one_program_per_prompt_bucket(engine):
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 60, size=50)
  reqs = [Request(rng.integers(0, 96, size=n).tolist(), max_new_tokens=int(rng.integers(2, 24)),
                  confidence=float(rng.choice([0.3, 0.6, 1.0])), id=i)
          for i, n in enumerate(lengths)]
  fresh = Engine(engine.model, None, stop_ids=[DECODE_STOP])
  run = fresh.serve(reqs, slots=8, mode="hamburger")
  out = list(run)
  assert len(out) == 50 and all(g.error is None for g in out)
  buckets = {size for n in lengths for _, _, size in shapes.prefill_chunks(int(n))}
  kinds = [k[0] for k in fresh.programs]
  assert kinds.count("prefill") == len(buckets) == 3  # 16, 32, 64
  # One decode program per view of the pool (here one: every slot's view fits 128 entries).
  assert kinds.count("decode") == len(set(run.stats.views)) == 1
  assert fresh.compilations == len(buckets) + 1


def test_decode_views_follow_the_live_lengths(engine, alone, monkeypatch):
  """With views of 16 entries x 2^i, slots that grow move the decode to larger views (one
  program each) and the outputs do not change."""
  monkeypatch.setattr(shapes, "VIEW_STEP", 16)
  stepped = Engine(engine.model, None, stop_ids=[DECODE_STOP])
  run = stepped.serve(requests(), slots=3, mode="hamburger")
  got = {g.id: g for g in run}
  for i, want in enumerate(alone["hamburger"]):
    assert (got[i].token_ids, got[i].groups) == (want.token_ids, want.groups), f"request {i}"
  views = run.stats.views
  assert set(views) == {1, 2, 4} and views != sorted(views)  # up as slots grow, then down
  # The layout's row: 40 + 32 (max_new bucket) + 1 entries -> 80 -> 5 blocks; views up to it.
  assert stepped.views(stepped.layout("hamburger", 3, 20, 40)) == [1, 2, 4, 5]


def test_bad_requests_fail_alone(engine, alone):
  reqs = [Request([], id="empty"), Request("   ", id="blank"),
          Request([1, 2], confidence=1.5, id="confidence"),
          Request([1, 2], max_new_tokens=0, id="max_new"),
          Request([1, 2], max_new_tokens=True, id="bool"),
          Request([1, 2], seed=2 ** 70, id="seed"),
          Request([1, 500], id="vocab"),
          Request([1, 2], sampling=SamplingParams(temperature=1.0, top_k=1000), id="top_k"),
          Request(PROMPTS[0], max_new_tokens=MAX_NEW[0], confidence=CONFIDENCES[0], id="ok")]
  got = {g.id: g for g in engine.serve(reqs, slots=2, mode="hamburger")}
  assert "empty prompt" in got["empty"].error and "empty prompt" in got["blank"].error
  assert "confidence must be in [0, 1]" in got["confidence"].error
  assert "max_new_tokens=0" in got["max_new"].error and "max_new_tokens=True" in got["bool"].error
  assert "seed=" in got["seed"].error and "token ids must be in" in got["vocab"].error
  assert "top_k=1000 exceeds the vocabulary (97 tokens)" in got["top_k"].error
  assert got["ok"].error is None
  assert got["ok"].token_ids == alone["hamburger"][0].token_ids
  with pytest.raises(GenerationError, match="slots=0"):
    list(engine.serve(reqs, slots=0))


def test_sampled_request_does_not_depend_on_batch_mates(engine):
  hot = SamplingParams(temperature=1.2, top_p=0.9)
  one = Request(PROMPTS[2], max_new_tokens=12, confidence=0.5, sampling=hot, seed=7, id=0)
  alone = list(engine.serve([one], slots=1, mode="hamburger"))[0]
  mates = [Request(p, max_new_tokens=10, id=i + 1) for i, p in enumerate(PROMPTS[:5])]
  served = {g.id: g for g in engine.serve([*mates, Request(PROMPTS[2], max_new_tokens=12,
                                                               confidence=0.5, sampling=hot,
                                                               seed=7, id=0)],
                                          slots=3, mode="hamburger")}
  assert served[0].token_ids == alone.token_ids
  other_seed = list(engine.serve([Request(PROMPTS[2], max_new_tokens=12, confidence=0.5,
                                          sampling=hot, seed=8, id=0)], slots=1,
                                 mode="hamburger"))[0]
  assert other_seed.token_ids != alone.token_ids


def test_micro_batches_hold_the_continuing_rows():
  assert [step_lib.micro_batch_sizes(n) for n in (1, 2, 3, 8, 16, 32)] == [
      (), (1,), (1,), (1, 2), (1, 4), (1, 8)]
  got = [int(step_lib.micro_branch(n, 16)) for n in range(17)]
  assert got == [0, 1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]  # none, 1 row, 4 rows, all
  assert [int(step_lib.micro_branch(n, 1)) for n in (0, 1)] == [0, 1]


def test_few_continuing_rows_emit_what_they_emit_alone(engine):
  """8 slots where one or two rows continue past token 0 (confidence 0) and the rest never do
  (1.0): their micro steps run gathered into a 1- or 2-row micro batch and scattered back."""
  confidences = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
  reqs = [Request(PROMPTS[i], max_new_tokens=MAX_NEW[i], confidence=c, id=i)
          for i, c in enumerate(confidences)]
  got = {g.id: g for g in engine.serve(reqs, slots=8, mode="hamburger")}
  for i, c in enumerate(confidences):
    want = engine.generate([PROMPTS[i]], max_new_tokens=MAX_NEW[i], mode="hamburger",
                           confidence=c)[0]
    assert (got[i].token_ids, got[i].groups) == (want.token_ids, want.groups), f"request {i}"
  assert max(got[0].groups) >= 2 and max(got[1].groups) == 1


SHARDED = """
import json, os
import jax
from hamburger_jax import cache, sharding
cache.enable_compilation_cache()  # the per-user cache, as the entry points use it
from hamburger_jax.decode.engine import Engine
from hamburger_jax.decode.requests import Request
from hamburger_jax.testing import DECODE_STOP, tiny_decode_model
m = tiny_decode_model()
one = Engine(m, None, stop_ids=[DECODE_STOP])
mesh = Engine(m, None, stop_ids=[DECODE_STOP], mesh=sharding.make_mesh(data=1, fsdp=1, tensor=8))
system = list(range(20, 35)) + [DECODE_STOP]  # two chat prompts: the prefix cache is used too
prompts = [[1, 2, 3, 4, 5], [9, 8], list(range(10, 31)), [40, 41, 42], [7],
           system + [5, 6, DECODE_STOP, 1], system + [8, 9, DECODE_STOP, 1]]
same, hits = [], []
for mode in ("base", "hamburger"):
  a = one.generate(prompts, max_new_tokens=12, mode=mode, confidence=0.5)
  b = mesh.generate(prompts, max_new_tokens=12, mode=mode, confidence=0.5)
  same.append([(g.token_ids, g.groups) for g in a] == [(g.token_ids, g.groups) for g in b])
  run = mesh.serve([Request(p, max_new_tokens=12, confidence=0.5) for p in prompts], slots=2,
                   mode=mode)
  served = {g.id: g for g in run}
  same.append([(g.token_ids, g.groups) for g in a]
              == [(served[i].token_ids, served[i].groups) for i in range(len(prompts))])
  hits.append(run.stats.prefix_hits)
kernel = mesh.params["base"]["decoder"]["layers"][0]["mlp"]["gate_up_proj"]["kernel"].get_value()
print(json.dumps({"devices": jax.device_count(), "same": same, "hits": hits,
                  "spec": [str(s) for s in kernel.sharding.spec],
                  "merged": any(max(g.groups) > 1 for g in b)}))
"""


def test_sharded_decode_equals_single_device():
  """Decode and serving under an 8-device mesh (weights split on the tensor axis by the
  inference rules) give the single-device tokens and groups."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  res = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True,
                       timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.strip().splitlines()[-1])
  # The fused gate|up kernel [D, 2, F]: F split over the tensor axis, gate and up together.
  assert out["devices"] == 8 and out["spec"] == ["None", "None", "tensor"]
  assert out["same"] == [True] * 4 and out["merged"]
  # generate cached the system turn, so serving copies it into both chat prompts' slots.
  assert out["hits"] == [2, 2]


def test_cacheable_prefix_is_the_turns_before_the_last():
  stop = DECODE_STOP
  assert cacheable_prefix(CHAT[0], [stop]) == 16  # the system turn
  assert cacheable_prefix(CHAT[3], [stop]) == 25  # the whole history before the last user turn
  assert cacheable_prefix(PROMPTS[4], [stop]) == 0  # no turns
  assert cacheable_prefix([1, stop, 2, stop, 3], [stop]) == 0  # too short to be worth a copy
  eng = Engine(tiny_decode_model(), None, stop_ids=[stop], prefix_cache_tokens=0)
  assert eng.prompt_plan(CHAT[3]) == (0, shapes.prefill_chunks(len(CHAT[3])))
  on = Engine(tiny_decode_model(), None, stop_ids=[stop])
  p0, chunks = on.prompt_plan(CHAT[3])
  assert p0 == 25 and chunks[-1][0] + chunks[-1][1] == len(CHAT[3])
  assert [c for c in chunks if c[0] < p0] == shapes.prefill_chunks(p0)  # ends at the prefix
  with pytest.raises(GenerationError, match="prefix cache capacity"):
    Engine(tiny_decode_model(), None, stop_ids=[stop], prefix_cache_tokens=-1)


def test_prefix_cache_evicts_the_least_recently_used():
  kv = lambda n: np.zeros((2, n, 1, 4), np.float32)
  cache = PrefixCache(64)
  for i in range(3):
    cache.put("base", [i], CachedPrefix(kv(32), kv(32), 20))
  assert len(cache) == 2 and cache.get("base", [0]) is None  # the oldest went
  assert cache.get("base", [1]) is not None and cache.get("hamburger", [1]) is None
  cache.put("base", [3], CachedPrefix(kv(32), kv(32), 20))
  assert cache.get("base", [2]) is None and cache.get("base", [1]) is not None  # 1 was used
  assert (cache.hits, cache.misses, cache.tokens_reused) == (2, 3, 40)


@pytest.mark.parametrize("mode", ["base", "hamburger"])
def test_shared_turns_are_prefilled_once_and_change_no_token(mode):
  """Requests that share earlier turns copy them from the prefix cache and emit exactly what
  they emit alone, prefix not cached; a corrupted entry would change them (so it is read)."""
  eng = Engine(tiny_decode_model(), None, stop_ids=[DECODE_STOP])
  reqs = lambda order: [Request(CHAT[i], max_new_tokens=CHAT_NEW[i],
                                confidence=CHAT_CONFIDENCE[i], id=i) for i in order]
  alone = []
  for r in reqs(range(len(CHAT))):
    eng.prefix_cache.clear()
    run = eng.serve([r], slots=1, mode=mode)
    alone.append(next(run))
    assert run.stats.prefix_hits == 0
  eng.prefix_cache.clear()
  run = eng.serve(reqs([2, 3, 0, 1]), slots=2, mode=mode)
  got = {g.id: g for g in run}
  for i, want in enumerate(alone):
    assert (got[i].token_ids, got[i].groups) == (want.token_ids, want.groups), f"request {i}"
  # The system turn is computed for request 2 and copied for 0 and 1; 3 has its own history.
  assert (run.stats.prefix_hits, run.stats.prefix_tokens) == (2, 32)
  assert len(eng.prefix_cache) == 2
  assert sorted(k[2] for k in eng.programs if k[0] == "prefix" and k[1].slots == 2) == [16, 32]
  (key, entry), = [(k, e) for k, e in eng.prefix_cache._entries.items()  # pylint: disable=W0212
                   if len(k[1]) == 16]
  noise = np.random.default_rng(0).normal(size=entry.k.shape).astype(np.float32)
  eng.prefix_cache.put(*key, CachedPrefix(entry.k + noise, entry.v - noise, entry.length))
  run = eng.serve(reqs([1]), slots=1, mode=mode)
  corrupted = next(run)
  assert run.stats.prefix_hits == 1
  assert corrupted.token_ids != alone[1].token_ids


def test_new_weights_empty_the_prefix_cache():
  eng = Engine(tiny_decode_model(), None, stop_ids=[DECODE_STOP])
  eng.generate([CHAT[0]], max_new_tokens=4)
  assert len(eng.prefix_cache) == 1
  eng.set_model(eng.model)
  assert len(eng.prefix_cache) == 0
