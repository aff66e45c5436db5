"""The files a transfer carries, split greedily into folders of at most a call's room (a file
that does not fit is cut into parts), then written with their manifests."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Sequence

from train.transfers.common import CHUNK, CORPUS, GRAFT, TransferError
from train.transfers.manifest import MANIFEST, manifest_text


@dataclasses.dataclass(frozen=True)
class Item:
  """One file to transfer: its name in the manifest and where it is here."""
  name: str
  source: str
  size: int


@dataclasses.dataclass(frozen=True)
class Piece:
  """Bytes [offset, offset + size) of an item, stored in a folder."""
  item: Item
  folder: int  # 1-based
  offset: int
  size: int


def pack(items: Sequence[Item], capacity: int) -> list[list[Piece]]:
  """Greedy: each item goes into the current folder, its rest (if any) into the next ones."""
  if capacity <= 0:
    raise TransferError("no room is left in a folder for anything but the code and the margin: "
                        "raise --limit-mib or make the code tree lighter")
  folders: list[list[Piece]] = [[]]
  room = capacity
  for item in items:
    offset = 0
    while True:
      if room == 0 and item.size > offset:
        folders.append([])
        room = capacity
      n = min(room, item.size - offset)
      folders[-1].append(Piece(item, len(folders), offset, n))
      offset, room = offset + n, room - n
      if offset == item.size:
        break
  return folders


def part_names(folders: list[list[Piece]]) -> dict[Piece, str]:
  """A whole item keeps its name; the pieces of a split one are NAME.part-000, ..."""
  by_item: dict[Item, list[Piece]] = {}
  for piece in (p for f in folders for p in f):
    by_item.setdefault(piece.item, []).append(piece)
  return {p: (item.name if len(ps) == 1 else f"{item.name}.part-{i:03d}")
          for item, ps in by_item.items() for i, p in enumerate(ps)}


def manifest_table(folders: list[list[Piece]], hashes: dict[Piece, str],
                   whole: dict[Item, str]) -> dict:
  names = part_names(folders)
  files: dict[str, dict] = {}
  for piece in (p for f in folders for p in f):
    entry = files.setdefault(piece.item.name, {"size": piece.item.size,
                                               "sha256": whole[piece.item], "parts": []})
    entry["parts"].append({"folder": piece.folder, "name": names[piece], "size": piece.size,
                           "sha256": hashes[piece]})
  return files


def tree_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def graft_items(export: str) -> list[Item]:
  """The files of a graft export directory (flat: hamburger.json and its safetensors files)."""
  if not os.path.isfile(os.path.join(export, "hamburger.json")):
    raise TransferError(f"--init-from {export} is not a graft export (no hamburger.json there): "
                        "give an export directory, e.g. checkpoints/smollm2-135m-hamburger")
  return [Item(GRAFT + f, os.path.join(export, f), os.path.getsize(os.path.join(export, f)))
          for f in sorted(os.listdir(export)) if os.path.isfile(os.path.join(export, f))]


def dir_items(kind: str, directory: str, marker: str, flag: str, hint: str) -> list[Item]:
  """The files directly in `directory` (a suite, a window's answers), named `kind` + file, after
  checking that it holds `marker`."""
  if not os.path.isfile(os.path.join(directory, marker)):
    raise TransferError(f"{flag} {directory} holds no {marker}: {hint}")
  return [Item(kind + f, os.path.join(directory, f), os.path.getsize(os.path.join(directory, f)))
          for f in sorted(os.listdir(directory)) if os.path.isfile(os.path.join(directory, f))]


def corpus_items(corpus: str) -> list[Item]:
  if not os.path.isfile(os.path.join(corpus, "meta.json")):
    raise TransferError(f"{corpus} has no meta.json: give the directory that "
                        "`python -m train.token_corpus` wrote")
  out = []
  for d, dirs, files in os.walk(corpus):
    dirs.sort()
    for f in sorted(files):
      path = os.path.join(d, f)
      rel = os.path.relpath(path, corpus).replace(os.sep, "/")
      out.append(Item(CORPUS + rel, path, os.path.getsize(path)))
  return out


def pack_with_manifest(items: list, capacity: int) -> tuple[list, int]:
  """(the folders' parts, the bytes kept in each for its manifest)."""
  # The manifest travels in every folder: its room is found by packing again until it fits
  # (hashes and the build id have fixed lengths, so placeholders give its exact size).
  reserve = 0
  for _ in range(20):
    folders = pack(items, capacity - reserve)
    placeholder = {p: "0" * 64 for f in folders for p in f}
    table = manifest_table(folders, placeholder, {i: "0" * 64 for i in items})
    need = len(manifest_text(table, "0" * 16, len(folders), len(folders)).encode())
    if need <= reserve:
      break
    reserve = need
  else:
    raise TransferError("the manifest's size did not settle: raise --limit-mib")
  return folders, reserve


def write_folders(tmp: str, folders: list, items: list) -> None:
  """Copies every part into its folder under `tmp`, hashing as it goes, then the manifests."""
  names, hashes, whole = part_names(folders), {}, {}
  for item in items:
    h = hashlib.sha256()
    with open(item.source, "rb") as src:
      for piece in (p for f in folders for p in f if p.item == item):
        dest = os.path.join(tmp, str(piece.folder), names[piece])
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        ph, left = hashlib.sha256(), piece.size
        src.seek(piece.offset)
        with open(dest, "wb") as f:
          while left:
            chunk = src.read(min(CHUNK, left))
            if not chunk:
              raise TransferError(f"{item.source} shrank while it was copied: build again")
            f.write(chunk)
            ph.update(chunk)
            h.update(chunk)
            left -= len(chunk)
        hashes[piece] = ph.hexdigest()
    whole[item] = h.hexdigest()
  table = manifest_table(folders, hashes, whole)
  build_id = hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:16]
  for k in range(1, len(folders) + 1):
    os.makedirs(os.path.join(tmp, str(k)), exist_ok=True)
    with open(os.path.join(tmp, str(k), MANIFEST), "w", encoding="utf-8") as f:
      f.write(manifest_text(table, build_id, k, len(folders)))
