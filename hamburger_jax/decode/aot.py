"""The engine's programs compiled for a TPU that is not attached (hamburger_jax/aot.py), as the
engine shards them: the prefill of a prompt's chunks, the decode loop in base and HAMburger
modes, the same loop serving from a shared paged pool, and one macro step alone
(decode/step_program.py) for per-step figures. Built abstractly: no weights.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from hamburger_jax import aot, graft_checkpoint, pretrained, sharding
from hamburger_jax.config import ConfigError, GraftConfig, HamburgerConfig, LlamaConfig, from_dict
from hamburger_jax.decode.engine import Engine
from hamburger_jax.decode.shapes import prefill_chunks
from hamburger_jax.decode.step_program import decode_step_program
from hamburger_jax.model.abstract import abstract
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.run_config import load_run_config

DEFAULT_PROMPT_LEN = 512
DEFAULT_MAX_NEW = 256


@dataclasses.dataclass
class EngineCheck:
  topology: str
  device_kind: str
  devices: int
  hbm: int
  model: str
  dtype: str
  reports: list[tuple[int, str, aot.ProgramReport]]  # (slots, what, report)


def abstract_model(config: str | None, checkpoint: str | None) -> tuple[Hamburger, str]:
  """(the model as shapes, what it is): a run config's, or a graft checkpoint's (default: the
  shipped one), its base's architecture from metadata; no weights are read."""
  if config is not None:
    cfg = load_run_config(config, ["train.init_from=''"], shared_only=True)
    return pretrained.abstract_run_model(cfg), config
  resolved = pretrained.resolve_checkpoint(checkpoint)
  if resolved is None:
    raise ConfigError("no graft checkpoint is given or shipped: pass --checkpoint DIR or "
                      "--config CONFIG")
  meta = graft_checkpoint.read_meta(resolved)
  hcfg = HamburgerConfig(from_dict(LlamaConfig, meta["base_config"]),
                         from_dict(GraftConfig, meta["graft"]))
  return abstract(lambda rngs: Hamburger(hcfg, rngs=rngs)), resolved


def tensor_mesh(devices: list, tensor: int) -> jax.sharding.Mesh | None:
  """The engine's mesh over the first `tensor` chips, or None where they do not form the
  rectangular block jax lays a TPU mesh on (3 chips of a 2x2, say)."""
  try:
    return sharding.make_mesh(data=1, fsdp=1, tensor=tensor, devices=devices[:tensor])
  except AssertionError:  # jax's mesh_utils asserts the chips fill their bounding box
    return None


@dataclasses.dataclass
class EngineLowering:
  """The engine's programs lowered for a slice, as the engine shards them (not compiled)."""
  topology: str
  devices: list
  model: str
  dtype: str
  lowered: dict[tuple[int, str], object]  # (slots, program) -> jax Lowered


def lower_engine(topology: str, *, config: str | None = None, checkpoint: str | None = None,
                 batches: tuple[int, ...] = (1, 32), dtype: str | None = None, tensor: int = 1,
                 prompt_len: int = DEFAULT_PROMPT_LEN, max_new: int = DEFAULT_MAX_NEW,
                 progress: Callable[[str], None] = lambda _: None) -> EngineLowering:
  """Lowers the engine's programs for `tensor` chips of `topology` (weights split over the
  tensor axis by the inference rules) at each batch size (slots)."""
  devices = aot.tpu_devices(topology)
  if not 1 <= tensor <= len(devices):
    raise aot.AotError(f"--tensor {tensor}: {topology} has {len(devices)} chips")
  mesh = tensor_mesh(devices, tensor)
  if mesh is None:
    valid = [n for n in range(1, len(devices) + 1) if tensor_mesh(devices, n) is not None]
    raise aot.AotError(f"--tensor {tensor}: the first {tensor} of {topology}'s {len(devices)} "
                       "chips are not a rectangular block, which a TPU mesh needs; use one of "
                       f"{', '.join(map(str, valid))}")
  devices = devices[:tensor]
  model, what = abstract_model(config, checkpoint)
  engine = Engine(model, None, stop_ids=(), mesh=mesh, dtype=dtype)
  lowered = {}
  chunks = sorted({size for _, _, size in prefill_chunks(prompt_len)})
  for b in batches:
    progress(f"lowering the engine's programs for {b} slots")
    for mode in ("base", "hamburger"):
      layout = engine.layout(mode, b, max_new, prompt_len)
      view = engine.views(layout)[-1]  # a slot's whole row: the largest of its programs
      lowered[(b, f"decode loop, {mode}")] = engine.lower_decode(layout, False, False, view)
      # Serving from a pool half the size of every slot's whole row: requests share blocks.
      pool = engine.layout(mode, b, max_new, prompt_len,
                           kv_blocks=max(2, layout.num_blocks // 2))
      lowered[(b, f"serving loop, {mode}, pool of {pool.num_blocks} blocks")] = (
          engine.lower_decode(pool, False, False, engine.views(pool)[-1]))
    for chunk in chunks:
      layout = engine.layout("hamburger", b, max_new, prompt_len)
      lowered[(b, f"prefill of a {chunk}-token chunk")] = engine.lower_prefill(layout, chunk)
    for mode in ("base", "hamburger"):
      step, args = decode_step_program(model, mode, b, prompt_len + max_new,
                                       dtype=engine.dtype)
      lowered[(b, f"one macro step, {mode}" + (", forced K" if mode == "hamburger" else ""))] = (
          step.lower(*aot.on_device(args, devices[0])))
  label = topology + (f", {tensor} chips (tensor)" if tensor > 1 else ", 1 chip")
  return EngineLowering(label, devices, what, engine.dtype, lowered)


def check_engine(topology: str, *, progress: Callable[[str], None] = lambda _: None,
                 **lowering) -> EngineCheck:
  """Compiles `lower_engine`'s programs (given `lowering`'s keywords) with the TPU compiler."""
  low = lower_engine(topology, progress=progress, **lowering)
  progress(f"compiling {len(low.lowered)} programs")
  reports = aot.compile_all({f"{b}: {name}": lo for (b, name), lo in low.lowered.items()},
                            knob="fewer slots (--batches), or shard over more chips (--tensor)")
  out = [(b, name, reports[f"{b}: {name}"]) for (b, name) in low.lowered]
  return EngineCheck(topology=low.topology, device_kind=low.devices[0].device_kind,
                     devices=len(low.devices), hbm=aot.device_hbm_bytes(aot.tpu_devices(topology)),
                     model=low.model, dtype=low.dtype, reports=out)


def lowering_lines(low: EngineLowering) -> list[str]:
  """The programs a lowering holds, per slot count (markdown)."""
  out = [f"{low.model} on {low.topology} ({low.devices[0].device_kind}), {low.dtype}; lowered "
         "as the engine shards them, not compiled:", ""]
  for b in dict.fromkeys(b for b, _ in low.lowered):
    out.append(f"- {b} slots: " + "; ".join(name for s, name in low.lowered if s == b))
  return out


def report_lines(check: EngineCheck) -> list[str]:
  g = aot.gib
  out = [f"{check.model} on {check.topology} ({check.device_kind}, {g(check.hbm)} GiB HBM per "
         f"chip), {check.dtype}; figures per chip, from the TPU compiler", "",
         "| slots | program | arguments GiB | temporaries GiB | total GiB | of HBM | FLOPs | "
         "bytes accessed | fusions | compile s |", "|---|---|---|---|---|---|---|---|---|---|"]
  for b, name, r in check.reports:
    out.append(f"| {b} | {name} | {g(r.argument)} | {g(r.temp)} | {g(r.total)} | "
               f"{r.total / check.hbm:.0%} | {r.flops:.3g} | {r.bytes_accessed:.3g} | "
               f"{r.fusions} | {r.compile_s:.1f} |")
  out.append("\nA loop's FLOPs and bytes count its body once (one macro step; the compiler "
             "does not know trip counts); a decode loop reads a slot's whole row here (the "
             "engine also compiles shorter views of it).")
  return out
