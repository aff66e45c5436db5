"""train.transfers: the folders fit their calls and join back to the originals, too much is
refused with the sizes, and the install there (standard library only) places everything, checks
every part and is idempotent: what is in place and matches the manifest is kept."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hamburger_jax import assets
from train.transfers import cli, common, manifest, wheels
from train.transfers import install as installlib
from train.transfers import plan as planlib

REPO = Path(__file__).resolve().parents[1]
KIB = 1 << 10


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _write(path: Path, size: int, seed: int) -> Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  block = hashlib.sha256(str(seed).encode()).digest()
  path.write_bytes((block * (size // len(block) + 1))[:size])
  return path


@pytest.fixture
def repo(tmp_path: Path) -> Path:
  """A repository whose code is one small file, ignoring the transfer folders as ours does."""
  root = tmp_path / "repo"
  root.mkdir()
  subprocess.run(["git", "init", "-q", str(root)], check=True)
  (root / ".gitignore").write_text("/transfer*/\n/runs/\n")
  _write(root / "code.py", 3 * KIB, 0)
  subprocess.run(["git", "-C", str(root), "add", "."], check=True)
  return root


def _fake_wheels(cache: Path) -> None:
  for i, pin in enumerate(wheels.WINDOW_WHEELS):
    name, version = wheels.split_pin(pin)
    _write(cache / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", 2 * KIB + i, i)


def _corpus(root: Path, sizes: list[int]) -> Path:
  corpus = root / "runs" / "corpus"
  (corpus / "meta.json").parent.mkdir(parents=True, exist_ok=True)
  (corpus / "meta.json").write_text(json.dumps({"shards": len(sizes)}))
  for i, size in enumerate(sizes):
    _write(corpus / f"tokens-{i:03d}.npy", size, 100 + i)
  return corpus


def _build(repo_root: Path, *extra: str, corpus_sizes=(300 * KIB, 200 * KIB, 5),
           limit_mib: float = 1.5) -> tuple[int, Path]:
  """`python -m train.transfers build` with fake wheels, a fake 700 KiB GGUF and a fake corpus."""
  cache = repo_root.parent / "cache"
  _fake_wheels(cache)
  gguf = _write(repo_root.parent / "base.gguf", 700 * KIB, 7)
  corpus = _corpus(repo_root, list(corpus_sizes))
  out = repo_root / "transfer"
  code = cli.main(["build", "--corpus", str(corpus), "--out", str(out), "--wheels-cache",
                         str(cache), "--no-download", "--gguf", str(gguf), "--limit-mib",
                         str(limit_mib), *extra])
  return code, out


def _joined(out: Path, entry: dict) -> bytes:
  return b"".join((out / str(p["folder"]) / p["name"]).read_bytes() for p in entry["parts"])


def test_folders_fit_their_calls_and_join_back(repo, capsys):
  code, out = _build(repo)
  printed = capsys.readouterr().out
  assert code == 0, printed
  folders = sorted((d for d in out.iterdir()), key=lambda d: int(d.name))
  code_bytes = (repo / "code.py").stat().st_size + (repo / ".gitignore").stat().st_size
  capacity = int(1.5 * common.MIB) - code_bytes - int(planlib.MARGIN_MIB * common.MIB)
  assert 2 <= len(folders) <= planlib.MAX_FOLDERS
  for d in folders:
    assert sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) <= capacity, d
  manifests = [json.loads((d / manifest.MANIFEST).read_text()) for d in folders]
  assert {m["build"] for m in manifests} == {manifests[0]["build"]}
  assert [m["folder"] for m in manifests] == list(range(1, len(folders) + 1))
  table = manifests[0]["files"]
  originals = {f"corpus/{p.name}": p for p in (repo / "runs" / "corpus").iterdir()}
  originals["base/" + common.GGUF_FILE] = repo.parent / "base.gguf"
  originals |= {f"wheels/{p.name}": p for p in (repo.parent / "cache").iterdir()}
  assert set(table) == set(originals)
  names = list(table)  # wheels, then the base, then the corpus
  assert names[0].startswith("wheels/") and names[-1].startswith("corpus/")
  assert names.index("base/" + common.GGUF_FILE) == len(wheels.WINDOW_WHEELS)
  split = [n for n, e in table.items() if len(e["parts"]) > 1]
  assert "base/" + common.GGUF_FILE in split
  for name, entry in table.items():
    data = _joined(out, entry)
    assert data == originals[name].read_bytes(), name
    assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    if len(entry["parts"]) > 1:
      assert [p["name"] for p in entry["parts"]] == [
          f"{name}.part-{i:03d}" for i in range(len(entry["parts"]))]
  # The plan: code size, each folder, and each call's carry and command.
  assert "code that travels with every call" in printed
  for k in range(1, len(folders) + 1):
    assert f'carry ["transfer/{k}"]' in printed
  last = printed.splitlines()[printed.splitlines().index(
      f'  call {len(folders)} (training): carry ["transfer/{len(folders)}"]') + 1].strip()
  assert last == ("python3 -m train.transfers install --from transfer --site /tmp/site "
                  "--corpus-out /tmp/corpus && export PYTHONPATH=/tmp/site:$PWD && "
                  + planlib.TRAIN_COMMAND)
  assert len(last) < planlib.COMMAND_MAX and "du -sh transfer/*" in printed


def test_too_much_is_refused_with_the_sizes(repo, capsys):
  code, out = _build(repo, corpus_sizes=(3 * common.MIB,))
  err = capsys.readouterr().err
  assert code == 2 and not out.exists()
  assert "folders of at most" in err and "corpus 3.0 MiB" in err and "base 0.7 MiB" in err
  assert f"at most {planlib.MAX_FOLDERS} fit" in err, err


def test_out_must_be_empty_or_overwritten(repo, capsys):
  assert _build(repo)[0] == 0
  code, out = _build(repo)
  assert code == 2 and "--overwrite" in capsys.readouterr().err
  assert _build(repo, "--overwrite")[0] == 0 and (out / "1" / manifest.MANIFEST).exists()


def test_out_must_be_ignored_by_git(repo, capsys):
  corpus = _corpus(repo, [10])
  code = cli.main(["build", "--corpus", str(corpus), "--out", str(repo / "shipped"),
                         "--no-download", "--gguf", str(corpus / "meta.json")])
  assert code == 2 and "not ignored by git" in capsys.readouterr().err


def test_a_missing_wheel_without_download_names_the_pin(repo, capsys):
  (repo.parent / "cache").mkdir()
  corpus = _corpus(repo, [10])
  code = cli.main(["build", "--corpus", str(corpus), "--out", str(repo / "transfer"),
                         "--wheels-cache", str(repo.parent / "cache"), "--no-download",
                         "--gguf", str(corpus / "meta.json")])
  err = capsys.readouterr().err
  assert code == 2 and wheels.WINDOW_WHEELS[0] in err and "--no-download" in err


def test_wheels_for_another_python_or_glibc_are_not_taken():
  assert wheels.fits_machine("dm_tree-0.1.10-cp312-cp312-manylinux_2_24_x86_64."
                                "manylinux_2_28_x86_64.whl")
  assert wheels.fits_machine("toml-0.10.2-py2.py3-none-any.whl")
  assert not wheels.fits_machine("dm_tree-0.1.10-cp311-cp311-manylinux_2_28_x86_64.whl")
  assert not wheels.fits_machine("x-1.0-cp312-cp312-manylinux_2_34_x86_64.whl")
  assert not wheels.fits_machine("x-1.0-cp312-cp312-macosx_11_0_arm64.whl")


# ----------------------------------------------------------------------------- install


def _tiny_wheel(cache: Path) -> None:
  """A real wheel of a package `tinypkg`, for pip to install."""
  cache.mkdir(parents=True, exist_ok=True)
  files = {"tinypkg/__init__.py": b"VALUE = 1\n",
           "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\n"
                                             b"Version: 1.0\n",
           "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\n"
                                          b"Root-Is-Purelib: true\nTag: py3-none-any\n"}
  record = "".join(
      f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},"
      f"{len(b)}\n" for n, b in files.items()) + "tinypkg-1.0.dist-info/RECORD,,\n"
  with zipfile.ZipFile(cache / "tinypkg-1.0-py3-none-any.whl", "w") as z:
    for n, b in files.items():
      z.writestr(n, b)
    z.writestr("tinypkg-1.0.dist-info/RECORD", record)


@pytest.fixture
def built(repo) -> Path:
  """A transfer of a real wheel, a 700 KiB GGUF and a corpus, in 3 folders or more."""
  _tiny_wheel(repo.parent / "cache")
  gguf = _write(repo.parent / "base.gguf", 700 * KIB, 7)
  corpus = _corpus(repo, [300 * KIB, 200 * KIB, 5])
  out = repo / "transfer"
  export = repo.parent / "export"
  _write(export / "hamburger.json", 100, 11)
  plan = planlib.build(str(corpus), str(out), pins=("tinypkg==1.0",),
                         cache=str(repo.parent / "cache"), download=False, gguf=str(gguf),
                         limit_mib=1.5, init_from=str(export))
  assert len(plan.folder_bytes) >= 3
  return out


def _install(out: Path, there: Path) -> int:
  return cli.main(["install", "--from", str(out), "--site", str(there / "site"),
                         "--corpus-out", str(there / "corpus"), "--graft-out",
                         str(there / "graft")])


def test_install_places_everything_and_skips_it_the_second_time(built, tmp_path, capsys,
                                                                 monkeypatch):
  there = tmp_path / "there"
  assert _install(built, there) == 0
  printed = capsys.readouterr().out
  site = there / "site"
  assert printed.splitlines()[-1] == f"export PYTHONPATH={site}:$PWD"
  assert (site / "tinypkg" / "__init__.py").read_text() == "VALUE = 1\n"
  gguf = site / common.GGUF_PACKAGE / common.GGUF_FILE
  assert gguf.read_bytes() == (built.parent.parent / "base.gguf").read_bytes()
  assert (site / common.GGUF_PACKAGE / "__init__.py").read_text() == ""
  corpus = built.parent / "runs" / "corpus"
  for f in corpus.iterdir():
    assert (there / "corpus" / f.name).read_bytes() == f.read_bytes(), f.name
  assert (there / "graft" / "hamburger.json").read_bytes() == (
      built.parent.parent / "export" / "hamburger.json").read_bytes()
  assert f"graft: 1 written, 0 already there (0.0 MiB) in {there / 'graft'}" in printed
  # assets.smollm2_gguf() finds it with the site on the path, as train.window will.
  probe = "from hamburger_jax import assets; print(assets.smollm2_gguf())"
  res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": f"{site}:{REPO}"}, cwd=REPO)
  assert res.stdout.strip() == str(gguf)

  def no_pip(*a, **k):
    raise AssertionError(f"a second install ran {a}")
  monkeypatch.setattr(installlib.subprocess, "run", no_pip)
  before = {p: p.stat().st_mtime_ns for p in there.rglob("*") if p.is_file()}
  assert _install(built, there) == 0
  printed = capsys.readouterr().out
  assert "wheels: 1 already in" in printed and "0 written" in printed
  assert {p: p.stat().st_mtime_ns for p in there.rglob("*") if p.is_file()} == before


def _gguf_parts(out: Path) -> list[dict]:
  table = json.loads((out / "1" / manifest.MANIFEST).read_text())["files"]
  return table["base/" + common.GGUF_FILE]["parts"]


def test_a_graft_travels_and_the_training_call_continues_it(repo, tmp_path, capsys):
  """--init-from: an export's files travel after the corpus, install puts them in --graft-out,
  and the training call continues that graft."""
  export = tmp_path / "export"
  (export / "hamburger.json").parent.mkdir()
  (export / "hamburger.json").write_text('{"trained_tokens": 5}')
  _write(export / "graft-00001-of-00001.safetensors", 400 * KIB, 9)
  code, out = _build(repo, "--init-from", str(export))
  printed = capsys.readouterr().out
  assert code == 0, printed
  last = [line.strip() for line in printed.splitlines() if "train.window" in line][-1]
  assert last.endswith(f"{planlib.TRAIN_COMMAND} --init-from {common.GRAFT_OUT}")
  assert f"--graft-out {common.GRAFT_OUT} " in last
  there = tmp_path / "there"
  # (the fake wheels are not real: the graft's files are joined as install joins them)
  table = json.loads((out / "1" / manifest.MANIFEST).read_text())["files"]
  assert list(table)[-1].startswith("graft/")
  for name, entry in table.items():
    if name.startswith("graft/"):
      dest = installlib.destination(name, str(there / "site"), str(there / "corpus"),
                                   str(there / "graft"))
      manifest.join(str(out), name, entry, dest)
  for f in export.iterdir():
    assert (there / "graft" / f.name).read_bytes() == f.read_bytes()
  code, _ = _build(repo, "--overwrite", "--init-from", str(tmp_path))
  assert code == 2 and "not a graft export" in capsys.readouterr().err


def test_the_suite_and_earlier_answers_travel_and_the_training_call_reads_them(repo, tmp_path,
                                                                               capsys):
  """--suite and --answers-in: their files travel, install puts them where the training call's
  --suite and --answers-in read them."""
  suite, answers = tmp_path / "suite", tmp_path / "answers"
  suite.mkdir()
  answers.mkdir()
  _write(suite / "suite.json", 30 * KIB, 3)
  _write(answers / "answers-00001.npz", 60 * KIB, 4)
  code, out = _build(repo, "--suite", str(suite), "--answers-in", str(answers))
  printed = capsys.readouterr().out
  assert code == 0, printed
  last = [line.strip() for line in printed.splitlines() if "train.window" in line][-1]
  assert last.endswith(f"--suite {common.SUITE_OUT} --answers-in {common.ANSWERS_OUT}/1")
  table = json.loads((out / "1" / manifest.MANIFEST).read_text())["files"]
  placed = {installlib.destination(name, "/s", "/c") for name in table
            if name.startswith(("suite/", "answers/"))}
  assert placed == {f"{common.SUITE_OUT}/suite.json",
                    f"{common.ANSWERS_OUT}/1/answers-00001.npz"}
  code, _ = _build(repo, "--overwrite", "--suite", str(answers))
  assert code == 2 and "holds no suite.json" in capsys.readouterr().err


def test_a_damaged_or_missing_part_is_named(built, tmp_path, capsys):
  part = _gguf_parts(built)[1]
  path = built / str(part["folder"]) / part["name"]
  data = bytearray(path.read_bytes())
  data[10] ^= 1
  path.write_bytes(bytes(data))
  there = tmp_path / "there"
  assert _install(built, there) == 2
  err = capsys.readouterr().err
  assert f"{path} is damaged" in err and "send that folder again" in err
  assert len(err.strip().splitlines()) == 1
  assert not (there / "site" / common.GGUF_PACKAGE / common.GGUF_FILE).exists()
  path.unlink()
  assert _install(built, there) == 2
  err = capsys.readouterr().err
  assert f"{path} is missing: send that folder again ({built / str(part['folder'])})" in err


def test_a_half_written_file_is_written_again(built, tmp_path, capsys):
  there = tmp_path / "there"
  assert _install(built, there) == 0
  gguf = there / "site" / common.GGUF_PACKAGE / common.GGUF_FILE
  whole = gguf.read_bytes()
  gguf.write_bytes(whole[:1000])
  assert _install(built, there) == 0
  assert gguf.read_bytes() == whole and "base: 1 written" in capsys.readouterr().out


def test_install_imports_only_the_standard_library(built, tmp_path):
  """It runs before any wheel is installed: a third-party import would fail there."""
  probe = ("import json, sys\n"
           "before = set(sys.modules)\n"
           "from train.transfers import cli\n"
           "code = cli.main(sys.argv[1:])\n"
           "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
           "print(json.dumps([code, sorted(new - set(sys.stdlib_module_names) - {'train'})]))\n")
  res = subprocess.run([sys.executable, "-c", probe, "install", "--from", str(built), "--site",
                        str(tmp_path / "site"), "--corpus-out", str(tmp_path / "corpus")],
                       cwd=REPO, capture_output=True, text=True, check=True)
  assert json.loads(res.stdout.strip().splitlines()[-1]) == [0, []], res.stderr


# ----------------------------------------------------------------------------- the pins and names


def test_window_wheels_are_the_runbook_pins_and_requirements_agree():
  doc = (REPO / "docs" / "accelerators.md").read_text(encoding="utf-8")
  section = doc[doc.index("\n## B. "):]
  pins = {(_norm(n), v) for n, v in re.findall(r"([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.]*)",
                                               section)}
  ours = {(_norm(n), v) for n, v in map(wheels.split_pin, wheels.WINDOW_WHEELS)}
  assert pins == ours
  reqs = (REPO / "requirements.txt").read_text(encoding="utf-8")
  pinned = {_norm(n): v for n, v in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", reqs, re.M)}
  assert {n: v for n, v in ours if n in pinned} == {n: pinned[n] for n, _ in ours if n in pinned}


def test_the_base_goes_where_assets_looks():
  assert (common.GGUF_PACKAGE, common.GGUF_FILE) == (assets.SMOLLM2_PACKAGE,
                                                           assets.SMOLLM2_FILE)


def test_help(capsys):
  for argv in (["--help"], ["build", "--help"], ["install", "--help"]):
    with pytest.raises(SystemExit) as e:
      cli.main(argv)
    assert e.value.code == 0 and "python -m train.transfers" in capsys.readouterr().out
  res = subprocess.run([sys.executable, "-m", "train.transfers", "--help"], cwd=REPO,
                       capture_output=True, text=True, check=True)
  assert "install" in res.stdout and "build" in res.stdout
