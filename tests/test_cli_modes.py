"""Every mode of the bench and ablation CLIs runs end to end on tiny models (a 2-layer GGUF base
and an untrained graft on it), in seconds: what they print is checked for its tables, never for
timings. (The random-weights modes: tests/test_flops.py; infer.experiments.ablate_merged on
teacher data: tests/test_eval_cli.py.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from hamburger_jax import cache, graft_checkpoint, pretrained, testing
from hamburger_jax.config import GraftConfig
from hamburger_jax.testing import write_tiny_llama_gguf

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
  tmp = tmp_path_factory.mktemp("tiny-cli")
  base = str(tmp / "tiny.gguf")
  write_tiny_llama_gguf(base)
  graft = GraftConfig(num_features=2, micro_layers=1, merger_head_dim=16, base_lora_rank=4)
  model, _ = pretrained.load_hamburger(pretrained.UNTRAINED, base, graft=graft)
  ckpt = str(tmp / "graft")
  graft_checkpoint.save_graft(model, ckpt, base, dtype="float32")
  return {"base": base, "checkpoint": ckpt}


@pytest.fixture(autouse=True)
def _no_weight_cache(monkeypatch):
  monkeypatch.setenv(cache.NO_WEIGHT_CACHE_ENV, "1")


def _tables(out: str) -> list[list[dict[str, str]]]:
  return testing.markdown_tables(out)


def _first_column(table: list[dict[str, str]]) -> list[str]:
  return [next(iter(r.values())) for r in table]


def _bench(capsys, *argv: str) -> str:
  from infer import bench  # pylint: disable=import-outside-toplevel
  repeats = [] if "--repeats" in argv else ["--repeats", "1"]
  assert bench.main([*argv, *repeats, "--no-tpu-fusions"]) == 0
  return capsys.readouterr().out


def test_bench_base_against_transformers(tiny, capsys):
  out = _bench(capsys, "--mode", "base", "--base", tiny["base"], "--batches", "1,2",
               "--new-tokens", "4")
  rows = _tables(out)[0]
  assert _first_column(rows) == ["1", "2"]
  # identical greedy rows counted
  assert all(any(re.fullmatch(r"\d/\d", v) for v in r.values()) for r in rows)
  assert _first_column(_tables(out)[1])[0] == "base step"


def test_bench_hamburger_against_its_base(tiny, capsys, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from hamburger_jax import micro_vocab  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks.widths import KV_ENTRIES  # pylint: disable=C0415
  ckpt = str(tmp_path / "graft")  # the module's checkpoint stays without a micro vocabulary
  shutil.copytree(tiny["checkpoint"], ckpt)
  micro_vocab.save(ckpt, np.arange(64, 0, -1), 16, ["test"])  # ids 0..15
  out = _bench(capsys, "--mode", "hamburger", "--base", tiny["base"], "--checkpoint", ckpt,
               "--batches", "1,2", "--new-tokens", "4", "--confidence", "0", "--micro-vocab",
               "16", "--micro-rule", "off,auto", "--profile")
  rows = _tables(out)[0]
  assert len(rows) == 8 and all("4.00" in r.values() for r in rows)  # forced groups of K = 4
  assert [r["micro vocab"] for r in rows] == ["full", "full", "16", "16"] * 2
  assert [r["micro rule"] for r in rows] == ["off", "auto"] * 4
  # every row goes on: the rule cuts nothing, so 3 micro steps a macro step and the same tokens
  assert all(r["micro steps/step"] == "3.00" and r["last row's steps"] == "1" for r in rows)
  assert all(float(r["macro step / base step"]) > 0 for r in rows)
  # each row against the full vocabulary's first rule, whatever settings came before it
  full = [r["same tokens"] for r in rows if r["micro vocab"] == "full"]
  assert full == ["1/1"] * 2 + ["2/2"] * 2
  assert all(re.fullmatch(r"[0-2]/[12]", r["same tokens"]) for r in rows)
  assert re.search(r"batch 2, full micro vocab: r \(r1\) 1 rows \d+\.\d{3} \(\d+\.\d{3}\), "
                   r"2 rows \d+\.\d{3} \(\d+\.\d{3}\); m \d+\.\d{3}", out)
  # --profile: base and each setting of each batch, one decode traced, by kind of operation
  profiled = re.findall(r"^- batch (\d), ([\w ]+): (\d+) macro steps", out, re.M)
  assert [(b, name) for b, name, _ in profiled] == [
      (b, name) for b in "12" for name in ("base", "full off", "full auto", "reduced off",
                                           "reduced auto")]
  assert [steps for b, name, steps in profiled if name != "base"] == ["1"] * 8
  tables = _tables(out)
  assert all(t and "kind of operation" in t[0] for t in tables[1:11])
  launches = _first_column(tables[11])
  assert launches[:3] == ["base step", "merged step", "micro step"]
  # r where bytes bound a step: the micro step's weights (1 layer, stop head, LM head) over the
  # base step's, from the graft's own config
  from hamburger_jax.costs import analytic  # pylint: disable=import-outside-toplevel
  hcfg = pretrained.load_hamburger(ckpt, tiny["base"])[0].cfg
  base_bytes = analytic.decode_step_bytes(hcfg, "base", 1, KV_ENTRIES)
  r = analytic.micro_step_bytes(hcfg, 1) / base_bytes
  assert 0 < r < 1
  assert re.search(rf"full micro vocab: \d+ MB, r = {r:.3f}; forced groups of 4 at most "
                   rf"{4 / (1 + 3 * r):.2f}x", out)
  r16 = analytic.micro_step_bytes(hcfg, 1, 16) / base_bytes
  assert r16 < r and re.search(rf"16 micro vocab: \d+ MB, r = {r16:.3f};", out)


def test_bench_serve_every_part(tiny, capsys, monkeypatch):
  from hamburger_jax.benchmarks import serve_bench  # pylint: disable=import-outside-toplevel
  runs = []
  run_serve = serve_bench.run_serve
  monkeypatch.setattr(serve_bench, "run_serve",
                      lambda *a, **kw: runs.append(a[2]) or run_serve(*a, **kw))
  out = _bench(capsys, "--mode", "serve", "--base", tiny["base"], "--checkpoint",
               tiny["checkpoint"], "--requests", "4", "--slots", "2", "--new-range", "2,4",
               "--kv-blocks", "40", "--parts", "abp", "--round-steps", "2", "--micro-rule",
               "off,auto", "--repeats", "2")
  # (p) runs 4 serves, then (a) its 4 variants in 2 interleaved rounds.
  assert runs[4:12] == ["base", "hamburger", "hamburger", "hamburger"] * 2
  assert "(a) KV pool" in out and "best of 2 interleaved rounds" in out
  assert "(b) one fixed KV pool" in out and "(p) prefix cache" in out
  assert "(c) when slots are refilled" in out
  tables = _tables(out)
  assert len(tables) == 5  # a, b, p, c and the launch figures
  assert [r["variant"] for r in tables[1]] == [  # (a): HAMburger at c once per micro rule
      "base", "HAMburger c=0.8, micro rule off", "HAMburger c=0.8, micro rule auto",
      "HAMburger forced 4-token groups"]


def test_bench_widths(tiny, capsys):
  out = _bench(capsys, "--mode", "widths", "--base", tiny["base"], "--batches", "1,2")
  assert "fused projections" in out and "separate projections" in out
  assert len(_tables(out)) == 4  # fused, separate, projection variants, launches


def test_ablate_step_every_variant(tiny, capsys):
  from infer.experiments import ablate_step  # pylint: disable=import-outside-toplevel
  assert ablate_step.main(["--base", tiny["base"], "--checkpoint", tiny["checkpoint"],
                           "--new-tokens", "4", "--rounds", "1"]) == 0
  rows = _first_column(_tables(capsys.readouterr().out)[0])
  assert rows == ["base", *ablate_step.VARIANTS]


def test_accelerator_check_parts_on_tiny_models():
  """The parts an accelerator host runs, in this process on the tiny models: each returns its
  markdown; the reference part compares against tokens computed here on the CPU."""
  import argparse  # pylint: disable=import-outside-toplevel
  from infer import accelerator_check as ac  # pylint: disable=import-outside-toplevel
  args = argparse.Namespace(tiny=True)
  env = "\n".join(ac.part_environment(args))
  assert "jax" in env and "every module the parts import loads" in env
  ref = ac.part_reference(args)
  assert any(l.startswith("| base | 8/8 |") for l in ref), ref
  prec = ac.part_precision(argparse.Namespace(tiny=True, dtype="bfloat16"))
  assert prec[0].startswith("- decoding in bfloat16") and any(l.startswith("| base |") for l in prec)
  # The decode part hands on each row as it is measured (a part stopped at its cap keeps them):
  # the many-row batch first, its 7 rows and where its device time goes out before batch 1
  # starts, and batch 1's 7 rows and verify's figures before the same 7 runs with command
  # buffers (from a child process: XLA reads its flags when the backend starts), which compile
  # everything again. (The decoding dtype is float32 here: no third, float32 decode.)
  from hamburger_jax.benchmarks import accelerator_decode as ad  # pylint: disable=C0415
  from hamburger_jax.benchmarks import timing  # pylint: disable=import-outside-toplevel
  decode, measuring_after = [], []
  def spy(*a, **kw):
    measuring_after.append(len(decode))
    return real(*a, **kw)
  real = timing.time_batches
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(timing, "time_batches", spy)
    for line in ac.part_decode(args):
      decode.append(line)
  batch4 = [i for i, l in enumerate(decode) if l.startswith("| 4 |")]
  batch1 = [l for l in decode if l.startswith("| 1 |")]
  assert len(measuring_after) == 2 and measuring_after[0] <= batch4[0], measuring_after
  assert len(batch4) == 7 and batch4[-1] < measuring_after[1], decode
  # the steps each batch ran (its slowest row's) and what one cost against a base step
  table = {r["run"]: r for r in _tables("\n".join(decode))[0]}
  assert table["base"]["last row's steps"] == "32" and table["forced"]["last row's steps"] == "8"
  assert table["base"]["macro step / base step"] == "1.00"
  # verify's tokens/step is tokens a base forward: a row's tokens (the base's steps: one a
  # token) over its steps; batch 1's one row gives exactly that, batch 4's pooled rows at least
  # what its slowest row gives
  n_new = int(table["base"]["last row's steps"])
  steps = int(table["verify"]["last row's steps"])
  assert float(table["verify"]["tokens/step"]) >= n_new / steps - 0.005, table["verify"]
  cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
  verify1 = [r for r in (dict(zip(ad.DECODE_HEADER, cells(l))) for l in batch1)
             if r["run"] == "verify"]
  assert len(verify1) == 2, batch1  # the default flags, and command buffers
  for r in verify1:
    assert float(r["tokens/step"]) == pytest.approx(n_new / int(r["last row's steps"]),
                                                    abs=0.005), r
  assert all(float(r["macro step / base step"]) > 0 for r in table.values())
  # each run's rows whose tokens are the base's: verify's all of them, at either batch and
  # under either flags
  assert [table[run]["same tokens as base"] for run in ("base", "verify")] == ["4/4", "4/4"]
  assert [r["same tokens as base"] for r in verify1] == ["1/1", "1/1"]
  assert all(re.fullmatch(r"\d/4", r["same tokens as base"]) for r in table.values())
  assert all(r["compile s"].isdigit() for r in table.values())
  assert any(re.fullmatch(r"- batch 4's programs: \d+ loaded from the persistent compilation "
                          r"cache, \d+ compiled|- batch 4's no program looked up .*", l)
             for l in decode)
  # verify's exactness in both dtypes: on the CPU they are the same one
  assert "- verify's rows whose tokens are the base's: float32, the decoding dtype: batch 4 4/4, " \
         "batch 1 1/1; float32 at \"highest\": the same dtype here, not decoded again" in decode
  # the base against transformers' generate, batch 1 (one line, also when it cannot run)
  (hf_line,) = [l for l in decode if l.startswith("- batch 1, the base against transformers'")]
  if importlib.util.find_spec("transformers") and importlib.util.find_spec("torch"):
    assert re.search(r"ours float32, transformers float32 on torch's cpu\): ours [\d.]+ tok/s, "
                     r"transformers [\d.]+: [\d.]+x; identical greedy rows 1/1; ", hf_line), hf_line
  else:
    assert "not run" in hf_line, hf_line
  # one verify step's parts timed alone, against the engine's whole step
  from hamburger_jax.benchmarks.verify_bench import forward_name  # pylint: disable=C0415
  steps = next(t for t in _tables("\n".join(decode)) if "base steps" in t[0])
  assert _first_column(steps)[:-1] == [
      "base step", *map(forward_name, range(1, 5)), "LM head, K rows", "first draft",
      "later draft", "parts of a step with 3 drafts"], steps
  assert _first_column(steps)[-1].startswith("the engine's verify step, draft confidence 0 ")
  assert all(float(r["ms"]) > 0 for r in steps)
  assert any(l.startswith("- its parts compiled and timed in ") for l in decode)
  assert any(l.startswith("- batch 4, base,") for l in decode[batch4[-1]:measuring_after[1]])
  assert [ad.COMMAND_BUFFERS in l for l in batch1] == [False] * 7 + [True] * 7, batch1
  assert any("a GPU flag, no effect on cpu" in l for l in decode)
  assert any(re.fullmatch(r"- batch 1 with command buffers against the defaults: base [\d.]+x, "
                          r"c=0\.5 [\d.]+x, c=0\.8 [\d.]+x, forced [\d.]+x, "
                          r"c=0\.5 auto [\d.]+x, c=0\.8 auto [\d.]+x, verify [\d.]+x", l)
             for l in decode)
  # where the time goes: a traced decode of each batch (base, c = 0.5 with the rule off and
  # auto), and batch 1 again with command buffers, each a table of kinds of operation
  profiled = [re.fullmatch(r"- batch (\d), (base|c=0\.5|c=0\.5 auto), XLA flags (.*): \d+ macro "
                           r"steps \(k [\d.]+, micro steps/step [\d.]+\); device [\d.]+ ms a "
                           r"macro step of [\d.]+ ms wall, prefills included .*", l)
              for l in decode]
  got = [(m[1], m[2], ad.COMMAND_BUFFERS in m[3]) for m in profiled if m]
  assert got == [(b, run, cb) for b, cb in (("4", False), ("1", False), ("1", True))
                 for run in ("base", "c=0.5", "c=0.5 auto")], got
  assert sum(l.startswith("| kind of operation | count a macro step |") for l in decode) == 9
  assert any(l.startswith("- batch 1, steps in a jitted loop: r = ") for l in decode)
  assert any("r = " in l and "forced groups of 4 at most" in l for l in decode)
  assert [ac.pytest_workers(n) for n in (2, 16, 64)] == [2, 4, 4]


def test_accelerator_decode_checks_verify_in_float32_where_it_decodes_in_another_dtype():
  """A GPU decodes in bfloat16: the decode part says how many of verify's rows are the base's
  there, and decodes batch 1 again in float32 at "highest" in an engine of its own, its
  compiles reported."""
  import argparse  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks import accelerator_decode as ad  # pylint: disable=C0415
  from hamburger_jax.benchmarks import timing  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
  model, tok, prompts = ad.models(argparse.Namespace(tiny=True), default_micro_vocab=True)
  engine = Engine(model, tok, stop_ids=(), dtype="bfloat16")
  res = timing.time_batches(engine, prompts[:1], 8, 1,
                            {"base": {"mode": "base"}, "verify": {"mode": "verify"}})
  line = ad.verify_exactness(model, tok, prompts[0], 8, "bfloat16", {1: res})
  assert re.fullmatch(r"- verify's rows whose tokens are the base's: bfloat16, the decoding "
                      r"dtype: batch 1 [01]/1; float32 at \"highest\", an engine of its own: "
                      r"batch 1 1/1 \(base [\d.]+ tok/s, verify [\d.]+; compile s: base \d+, "
                      r"verify \d+; (programs: \d+ loaded .*, \d+ compiled|no program .*)\)",
                      line), line


def test_accelerator_check_part_writes_out_as_it_prints(tmp_path):
  """`--part P --out F`: the part's markdown on stdout and in F, line by line."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  out = tmp_path / "environment.md"
  res = subprocess.run([sys.executable, "-m", "infer.accelerator_check", "--tiny", "--part",
                        "environment", "--out", str(out)], cwd=REPO, capture_output=True,
                       text=True, timeout=300, check=True)
  assert "jax" in res.stdout and out.read_text() == res.stdout


def test_accelerator_check_command_parts_stream_and_report_failures():
  """A part that runs a command hands on its lines as they come (what a part stopped at its cap
  printed is kept), then its exit code, and a failure's stderr."""
  from infer import accelerator_check as ac  # pylint: disable=import-outside-toplevel
  ok = ac.cli_part(["platform"])
  assert next(ok) == "- `python -m platform`:"  # before the command has run
  rest = list(ok)
  assert rest[-1] == "- exit 0" and any(l.strip() for l in rest[1:-2])
  bad = list(ac.cli_part(["hamburger_jax.no_such_module"]))
  assert "- exit 1" in bad and bad[bad.index("- exit 1") + 2] == "stderr:"
  assert any("No module named" in l for l in bad)


def test_accelerator_check_writes_its_report(tmp_path):
  """The parent runs parts in children, each capped, and keeps what finished when the minutes
  run out: here the whole budget goes to the environment part's share and the rest are left."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  report = tmp_path / "report.md"
  res = subprocess.run([sys.executable, "-m", "infer.accelerator_check", "--tiny",
                        "--budget-minutes", "0.5", "--out", str(report)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
  text = report.read_text()
  assert text.startswith("# Accelerator check") and "| environment | done |" in text
  assert "not run: no minutes left" in text or "stopped at its cap" in text
  assert res.returncode == 1  # not every part finished


def test_a_part_over_its_cap_is_stopped_with_its_children():
  """A part that runs over its cap is killed with the processes it started (pytest's workers
  would otherwise go on using the device under the next part), and what it printed is kept."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  from infer import accelerator_check as ac  # pylint: disable=import-outside-toplevel
  child = ("import subprocess, sys, time\n"
           "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
           "print('started', p.pid, flush=True)\n"
           "time.sleep(120)\n")
  t = time.monotonic()
  code, out, _ = ac.run_capped([sys.executable, "-c", child], 3)
  assert code is None and time.monotonic() - t < 30
  word, pid = out.split()
  assert word == "started"
  for _ in range(50):  # the orphan is reaped by init once killed
    if subprocess.run(["ps", "-p", pid, "-o", "stat="], capture_output=True,
                      text=True, check=False).stdout.strip() in ("", "Z"):
      break
    time.sleep(0.1)
  else:
    raise AssertionError(f"process {pid}, started by the stopped part, is still running")
  assert ac.run_capped([sys.executable, "-c", "print('hi')"], 30)[:2] == (0, "hi\n")


def test_stopped_tests_part_says_how_far_it_got(monkeypatch):
  """pytest stopped at the tests part's cap: the report counts its progress marks."""
  import argparse  # pylint: disable=import-outside-toplevel
  from infer import accelerator_check as ac  # pylint: disable=import-outside-toplevel
  out = "bringing up nodes...\n" + "." * 72 + " [ 40%]\n" + "..F.s.E.." + "\n"
  monkeypatch.setattr(ac, "run_capped", lambda cmd, seconds, env=None: (None, out, ""))
  (line,) = ac.part_tests(argparse.Namespace(tiny=False, seconds=100))
  assert line.endswith("stopped at 80 s, 78 passed and 2 failed or errored so far"), line


@pytest.mark.slow
def test_stored_greedy_reference_is_what_the_cpu_decodes():
  """The shipped graft's reference tokens (the accelerator check's) are what this code decodes
  on a CPU at the stated precision: base, and HAMburger at 0.5 and 0.8."""
  import argparse  # pylint: disable=import-outside-toplevel
  from hamburger_jax import assets  # pylint: disable=import-outside-toplevel
  from infer import accelerator_check as ac  # pylint: disable=import-outside-toplevel
  try:
    assets.smollm2_gguf()
  except assets.AssetError as e:
    pytest.skip(str(e))
  lines = ac.part_reference(argparse.Namespace(tiny=False))
  rows = [l for l in lines if l.startswith("| base") or l.startswith("| hamburger")]
  assert len(rows) == 3 and all("| 8/8 | - |" in r for r in rows), lines
