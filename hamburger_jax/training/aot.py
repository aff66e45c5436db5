"""A training run's programs compiled for a TPU slice that is not attached (hamburger_jax/aot.py):
the train step of each stage (gradient accumulation as configured) and its evaluation step on
the config's mesh over the slice, and the teacher pass of train.prepare_data (the base
replicated, rows split over one host's chips). Built abstractly: no weights, no data.
"""

from __future__ import annotations

import dataclasses

from hamburger_jax import aot, pretrained, sharding
from hamburger_jax.costs import analytic
from hamburger_jax.config import ConfigError, load_yaml
from hamburger_jax.data.teacher_pass import (DEFAULT_BATCH_TOKENS, DEFAULT_MAX_LEN,
                                             lower_teacher_pass)
from hamburger_jax.run_config import RunConfig, load_run_config, stage_names
from hamburger_jax.segmentation import TeacherSpec
from hamburger_jax.training.trainer import DEFAULT_TEACHER_TOP_K, Trainer


@dataclasses.dataclass
class StageReport:
  """One stage's (or an unstaged config's) train and evaluation steps on the slice."""
  stage: str
  cfg: RunConfig
  mesh: dict[str, int]
  params: int  # bytes per device: trained params
  opt_state: int
  frozen: int
  batch: int
  flops: float  # our count of one optimiser step's model FLOPs, all devices together
  step: aot.ProgramReport
  eval: aot.ProgramReport


@dataclasses.dataclass
class TrainCheck:
  topology: str
  devices: int
  device_kind: str
  hbm: int  # bytes per device
  headroom: float
  stages: list[StageReport]
  teacher: aot.ProgramReport | None
  teacher_setting: str

  def programs(self) -> list[tuple[str, aot.ProgramReport]]:
    out = [(f"{s.stage or 'train'}: {r.name}", r) for s in self.stages for r in (s.step, s.eval)]
    if self.teacher is not None:
      out.append(("prepare_data: teacher pass", self.teacher))
    return out

  def errors(self) -> list[str]:
    """One line per program that does not fit, saying by how much and what to turn."""
    out = []
    for s in self.stages:
      for r in (s.step, s.eval):
        state = s.params + s.opt_state + s.frozen
        knob = ("shard the state: raise mesh.fsdp" if state > r.temp else
                "halve data.rows and double data.accum (the optimiser step stays the same), "
                "or shorten data.entries")
        line = aot.fit_error(r.total, self.hbm, f"{s.stage or 'train'} {r.name}",
                             self.headroom, knob)
        if line:
          out.append(line)
    if self.teacher is not None:
      line = aot.fit_error(self.teacher.total, self.hbm, "teacher pass", self.headroom,
                           "lower train.prepare_data --batch-tokens")
      if line:
        out.append(line)
    return out


def _stage_configs(path: str, overrides: list[str], stage: str | None) -> list[RunConfig]:
  if stage is not None:
    return [load_run_config(path, overrides, stage=stage)]
  names = stage_names(load_yaml(path))
  if not names:
    return [load_run_config(path, overrides)]
  # Each stage starts from the previous one's export, which an abstract build does not read.
  return [load_run_config(path, overrides + ["train.init_from=''"], stage=n) for n in names]


@dataclasses.dataclass
class TrainLowering:
  """A run's programs lowered for a slice (StableHLO with the run's shardings, not compiled):
  what `check_train` compiles, and what `--lower-only` reports in seconds."""
  topology: str
  devices: list
  hbm: int  # bytes per device
  built: list[tuple[RunConfig, object, Trainer, dict]]  # (stage config, mesh, trainer, batch)
  lowered: dict[str, object]  # program name -> jax Lowered
  teacher_setting: str

  def state_bytes(self) -> list[tuple[str, dict[str, int], dict[str, int]]]:
    """(stage, mesh shape, bytes per device of its trained params, optimizer state, frozen
    weights and batch): what the sharded state needs before any temporary."""
    return [(cfg.stage or "train", dict(mesh.shape),
             {"params": aot.sharded_bytes(trainer.state.params),
              "opt_state": aot.sharded_bytes(trainer.state.opt_state),
              "frozen": aot.sharded_bytes(trainer.frozen), "batch": aot.sharded_bytes(batch)})
            for cfg, mesh, trainer, batch in self.built]


def lower_train(config: str, topology: str, *, overrides: list[str] = (),
                stage: str | None = None, num_slices: int = 1, chips: int | None = None,
                hbm_gib: float | None = None, teacher_top_k: int | None = None,
                max_len: int = DEFAULT_MAX_LEN, batch_tokens: int = DEFAULT_BATCH_TOKENS,
                teacher_pass: bool = True, progress=lambda _: None) -> TrainLowering:
  """Lowers the run's programs for `topology` (its first `chips` devices, if given): each
  stage's train and evaluation steps on the config's mesh, and the teacher pass. `hbm_gib`
  replaces the chip's HBM (a GPU checked by proxy). `teacher_top_k`: the teacher pass's top-k
  (default: DEFAULT_TEACHER_TOP_K where a stage uses the distill recipe, else none)."""
  devices = aot.tpu_devices(topology, num_slices)
  if chips is not None:
    if not 1 <= chips <= len(devices):
      raise aot.AotError(f"--chips {chips}: {topology} has {len(devices)} devices")
    devices = devices[:chips]
  hbm = int(hbm_gib * aot.GIB) if hbm_gib else aot.device_hbm_bytes(devices)
  cfgs = _stage_configs(config, list(overrides), stage)
  lowered, built = {}, []
  for cfg in cfgs:
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
    if cfg.data.rows % sharding.batch_divisor(mesh):
      raise ConfigError(f"data.rows={cfg.data.rows} does not split over the "
                        f"{sharding.batch_divisor(mesh)} data-parallel devices of {topology}: "
                        "make it a multiple")
    name = cfg.stage or "train"
    progress(f"{name}: building the abstract state and lowering its steps")
    trainer = Trainer(cfg, mesh=mesh, abstract=True)
    batch = trainer.abstract_batch(teacher_top_k=teacher_top_k or DEFAULT_TEACHER_TOP_K)
    lowered[f"{name}: train step"] = trainer.lower_step(batch)
    lowered[f"{name}: evaluation step"] = trainer.lower_eval()
    built.append((cfg, mesh, trainer, batch))
  setting = "not compiled"
  if teacher_pass:
    cfg = cfgs[0]
    distill = any(c.train.recipe == "distill" for c in cfgs)
    top_k = teacher_top_k if teacher_top_k is not None else (
        DEFAULT_TEACHER_TOP_K if distill else 0)
    # One process per host, each on its own chips (train.prepare_data --num-processes).
    host = [d for d in devices if d.process_index == devices[0].process_index]
    model = pretrained.abstract_run_model(cfg)
    spec = TeacherSpec(top_k, model.feature_layers) if top_k else None
    lowered["teacher pass"] = lower_teacher_pass(
        model.base, sharding.make_mesh(-1, 1, 1, devices=host), max_len=max_len,
        batch_tokens=batch_tokens, teacher=spec)
    setting = (f"--max-len {max_len} --batch-tokens {batch_tokens} --teacher-top-k {top_k}, "
               f"{len(host)} chips of one host")
  label = (topology + (f" x {num_slices} slices" if num_slices > 1 else "")
           + (f", {chips} chip(s)" if chips else ""))
  return TrainLowering(label, devices, hbm, built, lowered, setting)


def check_train(config: str, topology: str, *, headroom: float = aot.DEFAULT_HEADROOM,
                progress=lambda _: None, **lowering) -> TrainCheck:
  """Compiles the run's programs (`lower_train`'s, given `lowering`'s keywords) with the TPU
  compiler and reports them per device."""
  low = lower_train(config, topology, progress=progress, **lowering)
  reports = aot.compile_all(
      low.lowered, progress,
      knob="halve data.rows and double data.accum, or set train.scan_layers and train.remat: "
           "layers; a config for a larger chip (--hbm-gib) needs a topology whose chips hold it")
  stages = []
  for (cfg, mesh, trainer, _), (_, _, state) in zip(low.built, low.state_bytes()):
    name, d = cfg.stage or "train", cfg.data
    flops = d.accum * analytic.train_step_flops(
        trainer.model.cfg, d.rows, d.entries, d.groups, cfg.train.trainable,
        cfg.train.ce_chunk).model
    step, evaluation = reports[f"{name}: train step"], reports[f"{name}: evaluation step"]
    step.name, evaluation.name = "train step", "evaluation step"
    stages.append(StageReport(
        stage=cfg.stage, cfg=cfg, mesh=dict(mesh.shape), params=state["params"],
        opt_state=state["opt_state"], frozen=state["frozen"], batch=state["batch"], flops=flops,
        step=step, eval=evaluation))
  return TrainCheck(topology=low.topology, devices=len(low.devices),
                    device_kind=low.devices[0].device_kind, hbm=low.hbm, headroom=headroom,
                    stages=stages, teacher=reports.get("teacher pass"),
                    teacher_setting=low.teacher_setting)


def lowering_lines(low: TrainLowering) -> list[str]:
  """What a lowering shows without compiling (markdown): the programs, and per stage the
  sharded state per device against the chip's HBM (temporaries come with the compile)."""
  g = aot.gib
  out = [f"{low.topology}: {len(low.devices)} x {low.devices[0].device_kind}, {g(low.hbm)} GiB "
         f"HBM per device; lowered with the run's shardings, not compiled: "
         f"{', '.join(low.lowered)}", "",
         "| stage | mesh | trained params GiB | optimizer state GiB | frozen GiB | batch GiB | "
         "state GiB | of HBM |", "|---|---|---|---|---|---|---|---|"]
  for stage, mesh, b in low.state_bytes():
    mesh = " ".join(f"{k} {v}" for k, v in mesh.items() if v > 1) or "1 device"
    total = sum(b.values())
    out.append(f"| {stage} | {mesh} | {g(b['params'])} | {g(b['opt_state'])} | "
               f"{g(b['frozen'])} | {g(b['batch'])} | {g(total)} | {total / low.hbm:.0%} |")
  return out


def report_lines(check: TrainCheck) -> list[str]:
  """The per-device table of every compiled program (markdown)."""
  g = aot.gib
  out = [f"{check.topology}: {check.devices} x {check.device_kind}, {g(check.hbm)} GiB HBM per "
         f"device ({check.headroom:.0%} kept free: {g(check.hbm * (1 - check.headroom))} GiB "
         "usable); figures per device, from the TPU compiler",
         "",
         "| program | mesh | trained params GiB | optimizer state GiB | frozen GiB | batch GiB | "
         "temporaries GiB | total GiB | of HBM | FLOPs/step (XLA, per device) | "
         "model FLOPs/step (ours, all devices) | fusions | collectives | compile s |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for s in check.stages:
    mesh = " ".join(f"{k} {v}" for k, v in s.mesh.items() if v > 1) or "1 device"
    for r in (s.step, s.eval):
      step = r is s.step
      out.append(
          f"| {s.stage or 'train'}: {r.name} | {mesh} | {g(s.params)} | "
          f"{g(s.opt_state) if step else '-'} | {g(s.frozen)} | "
          f"{g(s.batch) if step else '-'} | {g(r.temp)} | {g(r.total)} | "
          f"{r.total / check.hbm:.0%} | {r.flops:.3g} | {f'{s.flops:.3g}' if step else '-'} | "
          f"{r.fusions} | {aot.collectives_cell(r)} | {r.compile_s:.1f} |")
  if check.teacher is not None:
    r = check.teacher
    out.append(f"| prepare_data: teacher pass ({check.teacher_setting}) | data | - | - | "
               f"{g(r.argument)} | - | {g(r.temp)} | {g(r.total)} | {r.total / check.hbm:.0%} | "
               f"{r.flops:.3g} | - | {r.fusions} | {aot.collectives_cell(r)} | "
               f"{r.compile_s:.1f} |")
  return out
