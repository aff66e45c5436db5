"""infer.bench's cost model (the timings themselves are never asserted)."""

from types import SimpleNamespace

import pytest

from hamburger_jax.benchmarks.timing import (BatchTiming, batch_decode_s, lockstep_cost,
                                             macro_step_cost, time_batches)
from hamburger_jax.decode.requests import Generation


def _gen(groups):
  return SimpleNamespace(groups=groups, macro_steps=len(groups))


def test_lockstep_cost_at_batch_one_is_the_spec_ceiling():
  groups = [4, 1, 2, 4, 1]  # 12 tokens, k = 2.4
  k, r = 12 / 5, 0.25
  assert 12 / lockstep_cost([_gen(groups)], r) == pytest.approx(k / (1 + (k - 1) * r))


def test_lockstep_cost_follows_the_largest_group_and_the_slowest_row():
  # step 1: max group 3 -> 1 + 2r; step 2: 1 -> 1; step 3 (row b only): 2 -> 1 + r
  gens = [_gen([3, 1]), _gen([1, 1, 2])]
  assert lockstep_cost(gens, 0.5) == pytest.approx((1 + 2 * 0.5) + 1 + (1 + 0.5))


def test_a_macro_step_costs_its_batchs_time_over_the_steps_its_slowest_row_ran():
  # The base: 64 steps in 6.4 s. HAMburger: one row finishes in 20 macro steps, the other in
  # 59, and the batch took 7.08 s: 0.12 s a macro step, 1.2 base steps, whatever the mean k
  # (128 tokens / 79 steps = 1.62) would suggest.
  timing = lambda s, steps: BatchTiming(s, 0.0, 0.0, 128, [_gen([1] * n) for n in steps])
  base, ham = timing(6.4, [64, 64]), timing(7.08, [20, 59])
  assert macro_step_cost(ham, base) == pytest.approx(1.2)
  ratio = ham.tokens_per_s / base.tokens_per_s
  assert ratio == pytest.approx(64 / 59 / macro_step_cost(ham, base))


def test_run_serve_reports_the_serving_figures():
  """The serve bench's figures on the tiny model (plumbing and counts, never timings)."""
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  from hamburger_jax.testing import tiny_decode_model  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks.serving import run_serve  # pylint: disable=C0415
  engine = Engine(tiny_decode_model(), None, stop_ids=())  # every request runs its max_new
  runs, serve = [], engine.serve  # each call's ServeRun, for its stats
  engine.serve = lambda *a, **kw: runs.append(serve(*a, **kw)) or runs[-1]
  workload = [([1, 2, 3, 4], 8), ([5, 6], 12), (list(range(10, 30)), 5), ([7], 9)]
  base = run_serve(engine, workload, "base", 2, 1.0)
  forced = run_serve(engine, workload, "hamburger", 2, 0.0)
  assert base["k"] == 1.0 and forced["k"] > 2.0
  # The last token of a request is never written back: n - 1 entries for n tokens.
  assert base["kv_per_token"] == pytest.approx(30 / 34)
  assert forced["kv_per_token"] < 0.5
  assert max(runs[-1].stats.in_flight) == 2 and forced["rounds"] == runs[-1].stats.rounds >= 2
  assert 0 < forced["queued_in_flight"] <= 2  # 4 requests, 2 slots: some waited
  assert base["tok_s"] > 0 and base["p95"] >= base["p50"] > 0
  # Rounds of 3 macro steps: more host round trips than refilling at each finish (34 tokens
  # over 2 slots take at least 17 base steps: 6 rounds), the same tokens.
  rounds = run_serve(engine, workload, "base", 2, 1.0, round_steps=3)
  assert rounds["rounds"] >= 6 and rounds["rounds"] > base["rounds"]
  assert rounds["kv_per_token"] == base["kv_per_token"]


def test_serve_prefix_cache_compares_off_and_on(capsys):
  """Part p of the serve bench: the same stream with the prefix cache off, then on."""
  import types  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  from hamburger_jax.testing import DECODE_STOP, tiny_decode_model  # pylint: disable=C0415
  from hamburger_jax.benchmarks.serve_bench import serve_prefix_cache  # pylint: disable=C0415
  engine = Engine(tiny_decode_model(), None, stop_ids=(), turn_end_ids=[DECODE_STOP])
  system = list(range(20, 36)) + [DECODE_STOP]
  workload = [(system + [i, i + 1, DECODE_STOP, 1], 6) for i in range(1, 5)]
  variants = [("base", "base", 1.0, None), ("forced", "hamburger", 0.0, None)]
  serve_prefix_cache(types.SimpleNamespace(slots=[2]), engine, workload, variants)
  rows = [r.split("|")[1:-1] for r in capsys.readouterr().out.splitlines() if r.startswith("| 2 ")]
  assert [(r[1].strip(), r[2].strip()) for r in rows] == [
      ("base", "off"), ("base", "on"), ("forced", "off"), ("forced", "on")]
  # 4 requests share the system turn: computed once, copied for the other 3 (17 tokens each).
  assert [int(r[3]) for r in rows] == [0, 51, 0, 51]


def test_serve_fixed_pool_prints_the_streams_ceiling(capsys):
  """Part b of the serve bench: requests in flight in one small pool, beside the ceiling the
  stream allows (the base's blocks per live request over the variant's)."""
  import types  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  from hamburger_jax.testing import tiny_decode_model  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks.serve_bench import serve_fixed_pool  # pylint: disable=C0415
  engine = Engine(tiny_decode_model(), None, stop_ids=(), block_size=4)
  workload = [([1, 2, 3], 24), ([4, 5], 20), ([6, 7, 8, 9], 16), ([10], 24), ([11, 12], 20)]
  variants = [("base", "base", 1.0, None), ("forced", "hamburger", 0.0, None)]
  serve_fixed_pool(types.SimpleNamespace(slots=[4], kv_blocks=16), engine, workload, variants)
  rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
          for r in capsys.readouterr().out.splitlines() if r.startswith("| ")}
  base, forced = float(rows["base"][4]), float(rows["forced"][4])
  assert rows["base"][5] == "1.00x"
  # The printed block counts are rounded to 0.1.
  assert float(rows["forced"][5].rstrip("x")) == pytest.approx(base / forced, abs=0.05)
  assert base / forced > 1.5  # 4-token groups hold far fewer blocks than one entry a token
  assert int(rows["base"][6]) <= 15  # peak blocks: the pool bound


def _timed_gen(queue_s: float, prefill_s: float, end_s: float, tokens: int = 8) -> Generation:
  """A row admitted `queue_s` after the call, prefilled in `prefill_s`, done `end_s` after it."""
  return Generation([1] * tokens, "", [1] * tokens, tokens, 0, 4, prefill_s,
                    end_s - queue_s - prefill_s, queue_s=queue_s, latency_s=end_s)


def test_a_batch_decodes_from_its_first_admission_to_its_last_token_less_the_prefills():
  """One long prompt and three short ones, prefilled one at a time, then decoded together for
  2 s: the batch decoded 2 s. Row 0's own span counts the others' prefills (1.2 s): the tok/s
  taken from it was 37.5% low here."""
  gens = [_timed_gen(0.0, 0.1, 3.3), _timed_gen(0.1, 1.0, 3.3), _timed_gen(1.1, 0.1, 3.3),
          _timed_gen(1.2, 0.1, 3.3)]
  assert batch_decode_s(gens) == pytest.approx(2.0)
  assert gens[0].decode_s == pytest.approx(3.2)  # row 0's span: 2 s and the others' prefills
  t = time_batches(SimpleNamespace(generate=lambda ids, max_new_tokens, **kw: gens), [[1]] * 4,
                   8, 1, {"base": {}})["base"]
  assert (t.tokens, t.tokens_per_s, t.prefill_s) == (32, pytest.approx(16.0), pytest.approx(1.3))
  assert 32 / gens[0].decode_s < 0.7 * t.tokens_per_s


def test_time_batches_alternates_the_settings_and_keeps_each_ones_fastest_round():
  calls, spans = [], iter([9.0, 8.0, 3.0, 1.0, 4.0, 2.0, 5.0])

  class FakeEngine:
    def generate(self, ids, max_new_tokens, **kw):
      calls.append(kw["mode"])
      g = _timed_gen(0.5, 0.5, 1.0 + next(spans), max_new_tokens)
      g.compile_s, g.id = {1: 9.0, 2: 8.0}.get(len(calls), 0.0), len(calls)
      return [g]

  out = time_batches(FakeEngine(), [[1]], 4, 2, {"base": {"mode": "base"},
                                                 "ham": {"mode": "hamburger"}})
  # Each compiled and run once, then the rounds alternate (never all of one, then the other).
  assert calls == ["base", "hamburger", "base", "hamburger", "base", "hamburger"]
  base, ham = out["base"], out["ham"]
  assert (base.decode_s, base.compile_s, base.gens[0].id) == (3.0, 9.0, 3)  # its fastest round
  assert (ham.decode_s, ham.compile_s, ham.gens[0].id) == (1.0, 8.0, 4)
  assert (base.tokens_per_s, ham.tokens_per_s) == (pytest.approx(4 / 3), pytest.approx(4.0))


def test_the_engine_gives_what_the_batch_figure_reads():
  """On the engine: a short prompt admitted first, then a long one and two short ones. The rows
  finish together, so the batch decoded row 0's span less the later rows' prefills."""
  from hamburger_jax import testing  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  engine = Engine(testing.tiny_decode_model(), None, stop_ids=())
  prompts = [[1, 2, 3], [3 + i % 90 for i in range(200)], [4, 5], [6, 7, 8]]
  engine.generate(prompts, max_new_tokens=6, mode="base")  # compiles
  gens = engine.generate(prompts, max_new_tokens=6, mode="base")
  later = sum(g.prefill_s for g in gens[1:])
  assert later > 0 and len({g.latency_s for g in gens}) == 1
  assert batch_decode_s(gens) == pytest.approx(gens[0].decode_s - later, abs=1e-6)


def test_server_load_summary_counts_lost_duplicated_and_failed():
  """The server bench's tally: an answer with two ids or an id seen twice is duplicated; an
  error or an answer that never finished is failed; percentiles only over answered ones."""
  from hamburger_jax.benchmarks.server_load import Answer, summary  # pylint: disable=C0415
  answers = [Answer(0, {"a"}, "x", 4, 2, "stop", sent=0.0, first=0.5, end=1.0),
             Answer(1, {"b"}, "y", 6, 3, "length", sent=0.0, first=1.5, end=2.0),
             Answer(2, {"a", "c"}, "z", 2, 1, "stop", sent=0.5, first=1.0, end=1.5),
             Answer(3, set(), sent=0.5, end=4.0, error="HTTP 503: full"),
             Answer(4, {"d"}, "w", 1, 1, None, sent=0.5, end=3.0)]
  s = summary(answers)
  assert (s["requests"], s["answered"], s["failed"]) == (5, 3, 2)
  assert s["duplicated"] == 2  # "a" twice, and answer 2 carried two ids
  assert s["tokens"] == 12 and s["wall_s"] == 4.0 and s["tok_s"] == 3.0
  assert s["ttft_p50"] == 0.5 and s["latency_p50"] == 1.0
  assert s["errors"] == ["HTTP 503: full"]


def test_verify_bench_parts():
  """What the verify bench tables: the share of forwards keeping 1, 2, .. tokens, the interval
  of tokens a forward (prompts resampled), and every part of a verify step timed in the
  decoding layout, with the whole step's row."""
  import types  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.runner import decode_runner  # pylint: disable=C0415
  from hamburger_jax.testing import tiny_decode_model  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks import verify_bench  # pylint: disable=C0415
  gens = [types.SimpleNamespace(groups=[1, 2, 1, 4]), types.SimpleNamespace(groups=[1, 1])]
  assert verify_bench.kept_shares(gens) == "0.67 / 0.17 / 0.00 / 0.17"
  lo, hi = verify_bench.ratio_ci(np.array([8.0, 2.0, 6.0]), np.array([4.0, 2.0, 2.0]))
  assert 1.0 <= lo <= 16 / 8 <= hi <= 3.0
  runner, _ = decode_runner(tiny_decode_model())
  lines = verify_bench.step_profile_lines(runner, {0.0: (0.002, 0.001)}, repeats=1)
  rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
  for part in ("base step", "forward of 1 entry, no head", "forward of 4 entries, no head",
               "LM head, K rows", "first draft", "later draft", "parts of a step with 3 drafts"):
    assert part in rows, part
  assert rows["base step"].endswith("| 1.000 |")
  assert "2.000 of its base's" in lines[-1]


def test_server_start_mode_takes_the_servers_flags_after_the_separator(monkeypatch, capsys):
  """`infer.bench --mode server-start`: its own flags before `--`, the server's after it; a
  server flag before `--` (a bench flag of the same name) is refused, not silently unused."""
  from hamburger_jax.benchmarks import server_start  # pylint: disable=import-outside-toplevel
  from infer import bench  # pylint: disable=import-outside-toplevel
  calls = []
  row = {"start": 1, "health_s": 2.0, "answer_s": 3.0, "prepared_s": 4.0, "seconds": 1.5,
         "cache_hits": 0, "cache_misses": 7, "prepared_seconds": 0.5,
         "prepared_cache_hits": 0, "prepared_cache_misses": 3}
  monkeypatch.setattr(server_start, "time_starts",
                      lambda *a, **kw: calls.append((a, kw)) or [row])
  assert bench.main(["--mode", "server-start", "--starts", "1", "--", "--slots", "4"]) == 0
  (server_args, _, starts, _), kw = calls[0]
  assert server_args == ["--slots", "4"] and starts == 1 and kw == {"timeout_s": 1800}
  out = capsys.readouterr().out
  assert out.startswith("python -m infer.server --slots 4: 1 starts against one fresh")
  assert "| 1 | 2.0 | 3.0 | 4.0 | 1.5, 0, 7 | 0.5, 0, 3 |" in out
  for argv, message in ((["--mode", "server-start", "--slots", "4"], "go after `--`"),
                        (["--", "--slots", "4"], "add --mode server-start"),
                        (["--mode", "server-start", "--", "--port", "1"], "leave out --port"),
                        (["--mode", "server-start", "--starts", "0"], "--starts must be >= 1")):
    with pytest.raises(SystemExit):
      bench.main(argv)
    assert message in capsys.readouterr().err, argv
