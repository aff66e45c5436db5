"""The documentation a user reads: the README's Python examples run as written, every command a
document names exists in this tree, and the docs describe the product, not a work log."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re

import pytest

from hamburger_jax import assets

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
RESULTS = sorted(glob.glob(os.path.join(REPO, "docs", "results", "*.md")))
DOCS = [README, *sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))]

# Words of a work log: what a reader of the product cannot resolve (which tracker item, which
# sitting of whom). Checked over everything a user or contributor reads.
WORK_LOG = re.compile(r"session|\blent\b|issue [0-9]", re.IGNORECASE)
WORK_LOG_TREES = ("hamburger_jax", "infer", "train", "tests", "configs", "notebooks", "docs")
# The legitimate uses: pytest's session scope, and a process's session (setsid / a login
# session) in the sandbox that runs model-written code.
ALLOWED = (
    re.compile(r'scope="session"'),
    re.compile(r"session fixtures", re.IGNORECASE),
    re.compile(r"tmp_path_factory|pytest\.Session|session-scoped", re.IGNORECASE),
    re.compile(r"setsid|new session|start_new_session|session leader|process session"
               r"|Restart session",
               re.IGNORECASE),
)
THIS_FILE = os.path.abspath(__file__)


def _text_files():
  yield README
  for tree in WORK_LOG_TREES:
    for path in glob.glob(os.path.join(REPO, tree, "**", "*"), recursive=True):
      if os.path.isfile(path) and path.endswith((".py", ".md", ".yaml", ".ipynb", ".sh", ".txt")):
        yield path


def test_no_work_log_words():
  hits = []
  for path in _text_files():
    if os.path.abspath(path) == THIS_FILE:
      continue
    with open(path, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        if WORK_LOG.search(line) and not any(a.search(line) for a in ALLOWED):
          hits.append(f"{os.path.relpath(path, REPO)}:{n}: {line.strip()[:100]}")
  assert not hits, "work-log words in the product's files:\n" + "\n".join(hits)


def test_work_log_check_catches_a_diary_line():
  for line in ("as the twelfth session measured", "no accelerator was lent", "see issue 12"):
    assert WORK_LOG.search(line) and not any(a.search(line) for a in ALLOWED)
  assert not any(WORK_LOG.search(x) and not any(a.search(x) for a in ALLOWED)
                 for x in ('@pytest.fixture(scope="session")', "start_new_session=True"))


def test_sizes():
  with open(README, encoding="utf-8") as f:
    assert len(f.read().splitlines()) < 250, "README.md is a user's guide: under 250 lines"
  assert RESULTS, "docs/results/ holds the measurements, one file per topic"
  total = 0
  for path in RESULTS:
    with open(path, encoding="utf-8") as f:
      lines = len(f.read().splitlines())
    assert lines <= 600, f"{path}: split it by topic"
    total += lines
  # With the README, a quarter of an hour's reading: current figures only, history in git.
  assert total <= 1000, f"docs/results holds {total} lines: keep the current figures only"


def _commands(text: str) -> list[str]:
  return re.findall(r"python3? -m ([A-Za-z_][\w.]*)", text)


def test_every_named_command_and_script_exists():
  missing = []
  for path in DOCS:
    with open(path, encoding="utf-8") as f:
      text = f.read()
    for module in _commands(text):
      if module in ("venv", "pytest", "pip"):
        continue
      if not (os.path.isfile(os.path.join(REPO, *module.split(".")) + ".py")
              or os.path.isdir(os.path.join(REPO, *module.split(".")))):
        missing.append(f"{os.path.relpath(path, REPO)}: python -m {module}")
    for script in re.findall(r"(?<![\w/.])((?:benchmarks|tools|train|infer)/[\w/]+\.(?:py|sh))",
                             text):
      if not os.path.isfile(os.path.join(REPO, script)):
        missing.append(f"{os.path.relpath(path, REPO)}: {script}")
    if "runs/scripts" in text:
      missing.append(f"{os.path.relpath(path, REPO)}: cites runs/scripts (not in the tree)")
    for link in re.findall(r"\]\(([^)#]+)\)", text):
      if "://" not in link and not os.path.exists(os.path.join(os.path.dirname(path), link)):
        missing.append(f"{os.path.relpath(path, REPO)}: link {link}")
  assert not missing, "documents name what this tree lacks:\n" + "\n".join(missing)


def readme_examples() -> list[str]:
  with open(README, encoding="utf-8") as f:
    return re.findall(r"```python\n(.*?)```", f.read(), re.DOTALL)


def test_readme_has_examples():
  examples = readme_examples()
  assert len(examples) >= 2 and all("import hamburger_jax as hj" in e for e in examples)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(readme_examples())))
def test_readme_example_runs(index):
  """Each example, exactly as written, on the shipped checkpoint."""
  try:
    assets.smollm2_gguf()
  except assets.AssetError as e:
    pytest.skip(str(e))
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(readme_examples()[index], f"README.md example {index + 1}", "exec"), {})  # pylint: disable=exec-used
  printed = out.getvalue()
  assert "tokens from" in printed or "requests in flight" in printed, printed
