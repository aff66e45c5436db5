"""Paths of the library and its entry points: a local path, or a bucket URL (`gs://bucket/dir`)
read and written through etils.epath (the path type orbax and tfds use; gcsfs serves `gs://`).
Functions here take either as a string; a local path behaves as `os` and `open` treat it.

Writing a file so that a reader, or a run killed mid-write, finds the old one or the new one,
never half of one: locally, a temporary file then a rename; on a bucket an object appears whole
when its upload ends. A directory written whole (an export) is renamed into place
locally; an object store renames nothing atomically, so there the directory is finished by a
marker written last (COMMIT_MARKER, orbax's own rule) and readers check for it (`is_complete`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from typing import IO, Any, Callable, Iterator

# Written last into a directory finished on a bucket; the same name orbax gives its own marker.
COMMIT_MARKER = "commit_success.txt"
COPY_BLOCK = 1 << 24


class StorageError(OSError):
  """A bucket path that cannot be read or written: the message names the path and the cause."""


class MissingError(StorageError, FileNotFoundError):
  """A bucket, or an object in it, that is not there (a FileNotFoundError, as a local one)."""


def is_remote(path: str | os.PathLike) -> bool:
  """A URL with a scheme (gs://, s3://, ...), which epath serves; anything else is local."""
  return "://" in os.fspath(path)


def _epath(path: str):
  import fsspec  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel
  # Every host of a run writes into the same bucket: a listing cached by this process would hide
  # what another wrote since (a finished step, a shard, a marker). Set before etils makes its
  # (cached) filesystem; a filesystem made before keeps its own setting.
  fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache", False)
  return epath.Path(path)


def absolute(path: str) -> str:
  """`path` made absolute: a bucket URL already is (os.path.abspath would make gs://b/x into
  ./gs:/b/x)."""
  return path if is_remote(path) else os.path.abspath(path)


def join(path: str, *parts: str) -> str:
  return os.path.join(path, *parts)  # a bucket URL joins as a POSIX path does


def cause(e: BaseException) -> str:
  """Why a bucket call failed, in words a user can act on."""
  text = f"{type(e).__name__}: {e}".splitlines()[0][:300]
  name, code = type(e).__name__, getattr(e, "code", None)  # gcsfs's HttpError has the status
  if "DefaultCredentialsError" in name or "RefreshError" in name or code == 401:
    return ("no credentials (on a Cloud VM, give the VM's service account the storage scope; "
            f"elsewhere run gcloud auth application-default login) [{text}]")
  if isinstance(e, PermissionError) or code == 403:
    return f"permission denied (grant this account access to the bucket) [{text}]"
  if isinstance(e, FileNotFoundError):
    return f"no such bucket or object [{text}]"
  return text


def _remote(what: str, path: str, call: Callable[[], Any]) -> Any:
  """`call()`, with a failure of the storage underneath turned into a one-line StorageError."""
  try:
    return call()
  except StorageError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # gcsfs, aiohttp, google-auth errors
    error = MissingError if isinstance(e, FileNotFoundError) else StorageError
    raise error(f"{what} {path}: {cause(e)}") from e


def exists(path: str) -> bool:
  if not is_remote(path):
    return os.path.exists(path)
  return _remote("cannot read", path, lambda: _epath(path).exists())


def isdir(path: str) -> bool:
  if not is_remote(path):
    return os.path.isdir(path)
  return _remote("cannot read", path, lambda: _epath(path).is_dir())


def isfile(path: str) -> bool:
  if not is_remote(path):
    return os.path.isfile(path)
  return _remote("cannot read", path, lambda: _epath(path).is_file())


def getsize(path: str) -> int:
  if not is_remote(path):
    return os.path.getsize(path)
  return _remote("cannot read", path, lambda: _epath(path).stat().length)


def listdir(path: str) -> list[str]:
  """The names in directory `path` (sorted)."""
  if not is_remote(path):
    return sorted(os.listdir(path))
  return _remote("cannot list", path, lambda: sorted(p.name for p in _epath(path).iterdir()))


def makedirs(path: str) -> None:
  """A directory at `path` and its parents (on a bucket: nothing to make, directories are
  prefixes of object names)."""
  if not is_remote(path):
    os.makedirs(path, exist_ok=True)


def open_file(path: str, mode: str = "r", encoding: str | None = None) -> IO:
  """`open(path, mode)`, or the bucket object's file; a bucket file opened for writing is
  uploaded whole when it closes."""
  if not is_remote(path):
    return open(path, mode, encoding=encoding)  # pylint: disable=consider-using-with
  return _remote("cannot open", path, lambda: _epath(path).open(
      mode, encoding=None if "b" in mode else encoding or "utf-8"))


def read_bytes(path: str) -> bytes:
  if not is_remote(path):
    with open(path, "rb") as f:
      return f.read()
  return _remote("cannot read", path, lambda: _epath(path).read_bytes())


def read_text(path: str) -> str:
  return read_bytes(path).decode("utf-8")


def remove(path: str) -> None:
  """Removes file `path` if it is there."""
  if not is_remote(path):
    if os.path.exists(path):
      os.remove(path)
    return
  _remote("cannot remove", path, lambda: _epath(path).unlink(missing_ok=True))


def remove_tree(path: str) -> None:
  """Removes directory `path` and everything in it, if it is there."""
  if not is_remote(path):
    shutil.rmtree(path, ignore_errors=True)
    return
  p = _epath(path)
  if _remote("cannot read", path, p.exists):
    _remote("cannot remove", path, p.rmtree)


def sha256(path: str) -> str:
  h = hashlib.sha256()
  with open_file(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return h.hexdigest()


def download(path: str, local: str) -> None:
  """Copies file `path` (local or on a bucket) to local file `local`."""
  if not is_remote(path):
    shutil.copy2(path, local)
    return
  with open_file(path, "rb") as src, open(local, "wb") as dst:
    shutil.copyfileobj(src, dst, COPY_BLOCK)


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
  """A local file with `path`'s content while the context lasts, for readers that need a file
  name (safetensors, memory maps): `path` itself when local, else a download into a temporary
  directory."""
  if not is_remote(path):
    yield path
    return
  with tempfile.TemporaryDirectory(prefix="hamburger-") as d:
    local = os.path.join(d, os.path.basename(path.rstrip("/")) or "file")
    download(path, local)
    yield local


def mirror(path: str, root: str) -> str:
  """A local copy of bucket file `path`, or of the files directly in bucket directory `path` (an
  HF model directory: config.json, weights, tokenizer), under local directory `root` (at
  root/BUCKET/OBJECT-PATH), for readers that need files (a GGUF, memory-mapped safetensors);
  returns its path. Downloaded once per machine: a file already there with the object's size and
  modification time is kept; each file is written whole (write_atomic). A local `path` is
  returned as it is."""
  if not is_remote(path):
    return path
  path = path.rstrip("/")
  local = os.path.join(root, *path.split("://", 1)[1].split("/"))
  if isfile(path):
    _fetch(path, local)
    return local
  if not isdir(path):
    raise MissingError(f"cannot read {path}: {missing_bucket(path) or 'no such object'}")
  for name in listdir(path):
    if isfile(join(path, name)):
      _fetch(join(path, name), os.path.join(local, name))
  return local


def _fetch(path: str, local: str) -> None:
  stat = _remote("cannot read", path, lambda: _epath(path).stat())
  mtime = float(stat.mtime)
  if (os.path.isfile(local) and os.path.getsize(local) == stat.length
      and os.path.getmtime(local) == mtime):
    return
  os.makedirs(os.path.dirname(local), exist_ok=True)

  def write(tmp: str) -> None:
    download(path, tmp)
    os.utime(tmp, (mtime, mtime))

  write_atomic(local, write)


def upload(local: str, path: str) -> None:
  """Copies local file `local` to `path` (a bucket object appears whole when the copy ends)."""
  def copy() -> None:
    with open(local, "rb") as src, _epath(path).open("wb") as dst:
      shutil.copyfileobj(src, dst, COPY_BLOCK)
  _remote("cannot write", path, copy)


def write_atomic(path: str, write: Callable[[str], None]) -> None:
  """`write(tmp)` writes the file's content to the temporary local path `tmp` (of this
  process); it then replaces `path` whole: locally synced and renamed, on a bucket uploaded as
  one object. A failure leaves `path` as it was and no temporary file behind."""
  if is_remote(path):
    with tempfile.TemporaryDirectory(prefix="hamburger-") as d:
      tmp = os.path.join(d, os.path.basename(path) or "file")
      write(tmp)
      upload(tmp, path)
    return
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    write(tmp)
    with open(tmp, "rb+") as f:
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_bytes_atomic(path: str, data: bytes) -> None:
  def write(tmp: str) -> None:
    with open(tmp, "wb") as f:
      f.write(data)
  write_atomic(path, write)


def write_text_atomic(path: str, text: str) -> None:
  write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str, obj: Any, **dump_kwargs: Any) -> None:
  """json.dump(obj) to `path`, replacing it whole (write_atomic)."""
  write_text_atomic(path, json.dumps(obj, **dump_kwargs))


def _local_files(root: str) -> Iterator[str]:
  """Paths relative to `root` of every file below it."""
  for d, _, names in os.walk(root):
    for name in sorted(names):
      yield os.path.relpath(os.path.join(d, name), root)


def write_dir_atomic(path: str, write: Callable[[str], None]) -> None:
  """`write(tmp)` fills a fresh local directory `tmp`, which then takes `path`'s place.

  Locally, `tmp` lies beside `path`; a directory already at `path` moves aside first and is
  removed after, so that `path` is missing only between two renames; a failure leaves `path` as
  it was. Work directories left by a killed writer (`path`.tmp, `path`.old) are removed first:
  one writer per directory.

  On a bucket, `tmp` is a local temporary directory; once it is full, the old directory at
  `path` loses its COMMIT_MARKER, then its files, the new files are uploaded, and the marker is
  written last: a reader that checks `is_complete` finds the new directory or an unfinished
  one, never a mix presented as finished."""
  path = path.rstrip("/") or path
  if is_remote(path):
    with tempfile.TemporaryDirectory(prefix="hamburger-") as tmp:
      write(tmp)
      remove(join(path, COMMIT_MARKER))
      remove_tree(path)
      for rel in _local_files(tmp):
        upload(os.path.join(tmp, rel), join(path, *rel.split(os.sep)))
      mark_complete(path)
    return
  tmp, old = path + ".tmp", path + ".old"
  for stale in (tmp, old):
    if os.path.exists(stale):
      shutil.rmtree(stale)
  os.makedirs(tmp)
  try:
    write(tmp)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  if os.path.exists(path):
    os.replace(path, old)
  os.replace(tmp, path)
  if os.path.exists(old):
    shutil.rmtree(old)


def mark_complete(path: str) -> None:
  """Finishes directory `path` on a bucket (every file of it written before); locally nothing:
  a local directory is finished by its rename into place."""
  if is_remote(path):
    write_text_atomic(join(path, COMMIT_MARKER), "finished\n")


def is_complete(path: str) -> bool:
  """Whether directory `path` was finished: on a bucket, its COMMIT_MARKER is there; locally
  always (a local directory is renamed into place whole)."""
  return not is_remote(path) or isfile(join(path, COMMIT_MARKER))


def check_writable(path: str, what: str) -> None:
  """Fails now, in one line naming `what`, the path and the cause (no credentials, no bucket,
  no permission), where bucket path `path` cannot be written: a cheap probe object written and
  removed, before a run spends anything. A local path is left to the run (its directories are
  made as it writes)."""
  if not is_remote(path):
    return
  probe = join(path, f".write-probe-{uuid.uuid4().hex}")
  try:
    write_bytes_atomic(probe, b"")
    remove(probe)
  except StorageError as e:
    raise StorageError(f"{what} {path} cannot be written: {cause(e.__cause__ or e)}") from None


def missing_bucket(path: str) -> str:
  """For a message about `path` not being there: "no bucket gs://B (...)" when it is on a bucket
  that does not exist (or that this account cannot list), else ""."""
  if not is_remote(path):
    return ""
  scheme, rest = path.split("://", 1)
  bucket = f"{scheme}://{rest.split('/', 1)[0]}"
  return "" if exists(bucket) else f"no bucket {bucket} (or this account cannot list it)"


def check_local(path: str, what: str, reader: str) -> None:
  """Refuses a bucket path where `reader` opens local files only, and says what to do."""
  if is_remote(path):
    raise StorageError(f"{what} {path} is on a bucket, but {reader} opens local files only: "
                       "mount the bucket (gcsfuse) at the same path on every host and give the "
                       "mounted path")
