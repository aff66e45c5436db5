"""The manifest every folder holds: the whole transfer's table (each file's size and sha256, and
each part's folder, size and sha256), read back and checked there. Standard library only."""

from __future__ import annotations

import hashlib
import json
import os

from train.transfers.common import CHUNK, TransferError

MANIFEST = "MANIFEST.json"


def manifest_text(files: dict, build_id: str, folder: int, count: int) -> str:
  return json.dumps({"build": build_id, "folder": folder, "folders": count, "files": files},
                    indent=1) + "\n"


def read_manifest(source: str) -> tuple[dict, int]:
  """The transfer's table and folder count, from the manifests of the folders under `source`
  (all of one build)."""
  if not os.path.isdir(source):
    raise TransferError(f"{source} does not exist: make the calls that carry its folders first "
                        "(`python -m train.transfers build` prints them)")
  folders = sorted((d for d in os.listdir(source) if d.isdigit()), key=int)
  found: dict[str, dict] = {}
  for d in folders:
    path = os.path.join(source, d, MANIFEST)
    try:
      with open(path, encoding="utf-8") as f:
        found[d] = json.load(f)
    except FileNotFoundError:
      raise TransferError(f"{path} is missing: send that folder again ({source}/{d})") from None
    except (OSError, ValueError) as e:
      raise TransferError(f"{path} is damaged ({e}): send that folder again "
                          f"({source}/{d})") from None
  if not found:
    raise TransferError(f"{source} holds no numbered folder: make the calls that carry them first")
  builds = {m.get("build") for m in found.values()}
  if len(builds) > 1:
    which = ", ".join(f"{source}/{d}: {m.get('build')}" for d, m in found.items())
    raise TransferError(f"the folders come from different builds ({which}): send every folder "
                        "of one build")
  first = next(iter(found.values()))
  if not isinstance(first.get("files"), dict) or not isinstance(first.get("folders"), int):
    raise TransferError(f"{source}/{next(iter(found))}/{MANIFEST} lacks its table: build the "
                        "transfer again with this train/transfers/")
  return first["files"], first["folders"]


def sha256_of(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(CHUNK):
      h.update(chunk)
  return h.hexdigest()


def is_there(path: str, entry: dict) -> bool:
  return (os.path.isfile(path) and os.path.getsize(path) == entry["size"]
          and sha256_of(path) == entry["sha256"])


def join(source: str, name: str, entry: dict, dest: str) -> None:
  """Writes the parts of `name` one after another into `dest`, each checked against the
  manifest; on failure `dest` is removed."""
  os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
  try:
    whole = hashlib.sha256()
    with open(dest, "wb") as out:
      for part in entry["parts"]:
        folder = os.path.join(source, str(part["folder"]))
        path = os.path.join(folder, part["name"])
        if not os.path.isfile(path):
          raise TransferError(f"{path} is missing: send that folder again ({folder})")
        if os.path.getsize(path) != part["size"]:
          raise TransferError(f"{path} has {os.path.getsize(path)} bytes, not {part['size']}: "
                              f"send that folder again ({folder})")
        h = hashlib.sha256()
        with open(path, "rb") as f:
          while chunk := f.read(CHUNK):
            h.update(chunk)
            whole.update(chunk)
            out.write(chunk)
        if h.hexdigest() != part["sha256"]:
          raise TransferError(f"{path} is damaged (its sha256 is not the manifest's): send that "
                              f"folder again ({folder})")
    if whole.hexdigest() != entry["sha256"]:
      raise TransferError(f"{name} joined from its parts is not the file the manifest names: "
                          "build the transfer again")
  except BaseException:
    if os.path.exists(dest):
      os.remove(dest)
    raise
