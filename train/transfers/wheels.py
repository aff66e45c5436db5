"""The wheels the machine's image lacks, fetched here for its CPython 3.12 on x86-64 Linux."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Sequence

from train.transfers.common import TransferError

# What `python -m train.window` and the library modules it imports need beyond the image's
# packages (docs/accelerators.md section B names the same pins; tests/test_transfers.py checks).
# promise exists only as source; tensorflow-datasets imports it, and `pip wheel` builds it pure.
WINDOW_WHEELS = (
    "grain==0.2.18", "array-record==0.8.6", "tensorflow-datasets==4.9.10",
    "tensorflow-metadata==1.21.0", "googleapis-common-protos==1.76.0", "dm-tree==0.1.10",
    "immutabledict==4.3.1", "simple-parsing==0.1.9", "docstring-parser==0.18.0",
    "termcolor==3.3.0", "toml==0.10.2", "importlib-resources==7.1.0", "gguf==0.19.0",
    "tensorboardx==2.6.4", "portpicker==1.6.0", "promise==2.3",
)
# The machine: CPython 3.12 on x86-64 Linux; pip download takes wheels of any of these.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
GLIBC_MAX = (2, 28)  # newest manylinux of PLATFORMS: a wheel needing a newer glibc is refused
WHEELS_CACHE = os.path.join("transfer-cache", "wheels")


def norm_name(name: str) -> str:
  return re.sub(r"[-_.]+", "_", name).lower()


def split_pin(pin: str) -> tuple[str, str]:
  name, sep, version = pin.partition("==")
  if not sep or not name or not version:
    raise TransferError(f"{pin!r} is not a pin: write NAME==VERSION")
  return name, version


def fits_machine(wheel: str) -> bool:
  """Whether the wheel file installs on CPython 3.12, x86-64 Linux of glibc GLIBC_MAX."""
  parts = os.path.basename(wheel)[:-len(".whl")].split("-")
  if len(parts) < 5:
    return False
  pys, abi, plats = parts[-3].split("."), parts[-2], parts[-1].split(".")
  py_ok = any(p in ("py3", "py312", "cp312") or (abi == "abi3" and re.fullmatch(r"cp3\d+", p)
                                                and int(p[3:]) <= 12) for p in pys)

  def plat_ok(p: str) -> bool:
    if p == "any" or p in ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"):
      return True
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", p)
    return bool(m) and (int(m.group(1)), int(m.group(2))) <= GLIBC_MAX
  return py_ok and abi in ("none", "abi3", "cp312") and any(plat_ok(p) for p in plats)


def cached_wheel(cache: str, pin: str) -> str | None:
  """The wheel of `pin` in `cache` that installs on the machine (the first by name), or None."""
  name, version = split_pin(pin)
  if not os.path.isdir(cache):
    return None
  for f in sorted(os.listdir(cache)):
    parts = f[:-len(".whl")].split("-") if f.endswith(".whl") else []
    if (len(parts) >= 5 and norm_name(parts[0]) == norm_name(name) and parts[1] == version
        and fits_machine(f)):
      return os.path.join(cache, f)
  return None


def fetch_wheel(cache: str, pin: str) -> str:
  """Downloads `pin`'s wheel for the machine into `cache`; a pin that PyPI has only as source
  is built with `pip wheel`, and kept only if pure Python (a compiled one would be this
  Python's, not 3.12's)."""
  os.makedirs(cache, exist_ok=True)
  download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
              "--python-version", "3.12", "--implementation", "cp",
              *[a for p in PLATFORMS for a in ("--platform", p)], "-d", cache, pin]
  res = subprocess.run(download, capture_output=True, text=True, check=False)
  if (found := cached_wheel(cache, pin)):
    return found
  build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", cache, pin]
  res2 = subprocess.run(build, capture_output=True, text=True, check=False)
  if (found := cached_wheel(cache, pin)):
    return found
  why = (res.stderr.strip().splitlines() or res2.stderr.strip().splitlines() or ["no output"])[-1]
  raise TransferError(f"PyPI has no wheel of {pin} for CPython 3.12 on x86-64 and `pip wheel` "
                      f"built no pure-Python one ({why}): pin a version that has one, in "
                      "WINDOW_WHEELS and docs/accelerators.md section B alike")


def wheels_for(pins: Sequence[str], cache: str, download: bool) -> list[str]:
  out = []
  for pin in pins:
    found = cached_wheel(cache, pin)
    if found is None and not download:
      raise TransferError(f"no wheel of {pin} for CPython 3.12 on x86-64 in {cache}: run "
                          "without --no-download (it fetches it from PyPI) or put one there")
    out.append(found or fetch_wheel(cache, pin))
  return out
