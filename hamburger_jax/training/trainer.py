"""The HAMburger train step: the model split into trained and frozen params, AdamW per
learning-rate group, the sharded jitted step and evaluation step of one run.

A Trainer is built on real weights (training) or abstractly (`abstract=True`: shapes and
shardings only, nothing allocated), so that the programs a run executes can be lowered and
compiled for a device mesh that is not attached: a TPU pod's topology (hamburger_jax/aot.py).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from hamburger_jax import precision, pretrained, sharding
from hamburger_jax.config import ConfigError, HamburgerConfig
from hamburger_jax.objectives.distillation import acceptance_metrics, distill_loss, micro_distill_loss
from hamburger_jax.evaluation import teacher_forced
from hamburger_jax.objectives.losses import hamburger_loss
from hamburger_jax.model.hamburger import Hamburger, MicroVocab
from hamburger_jax.model.attention import choose_attention
from hamburger_jax.model.llama import GraftParam, set_attention, set_layer_execution
from hamburger_jax.objectives.online_teacher import ONLINE_FIELDS, with_teacher
from hamburger_jax.run_config import DEFAULT_TEACHER_TOP_K, RunConfig

# The params each `train.trainable` optimises (the rest is frozen, and not checkpointed: it is
# rebuilt from the base source and train.init_from). "all" trains the base as well.
# Verify mode's drafter (graft.drafter_layers) trains alone ("drafter"): no other loss reads it.
_NOT_DRAFTER = nnx.Not(nnx.PathContains("drafter"))
TRAINED = {
    "graft": nnx.All(GraftParam, _NOT_DRAFTER), "all": nnx.All(GraftParam, _NOT_DRAFTER),
    "micro": nnx.All(GraftParam, nnx.PathContains("micro")),
    "merger": nnx.All(GraftParam, nnx.Not(nnx.PathContains("micro")), _NOT_DRAFTER),
    "stop": nnx.All(GraftParam, nnx.PathContains("stop_head"), _NOT_DRAFTER),
    "drafter": nnx.All(GraftParam, nnx.PathContains("drafter")),
}

# Batch fields and their ranks (the leading accumulation axis included).
BATCH_NDIMS = {"input_ids": 4, "input_size": 3, "positions": 3, "segment_ids": 3,
               "pred_index": 3, "target_ids": 4, "target_size": 3, "window_ids": 4,
               "window_size": 3, "teacher_topk_ids": 5, "teacher_topk_logp": 5,
               "teacher_features": 5, "tokens": 3, "token_segment": 3, "teacher_index": 4}
TEACHER_FIELDS = ("teacher_topk_ids", "teacher_topk_logp", "teacher_features")


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: dict  # {"graft": ..., "base": ...} pure dicts of arrays; "base" only when trained
  opt_state: Any


def schedules(cfg: RunConfig) -> dict[str, optax.Schedule]:
  """Cosine decay to lr_final over the run (docs/SPEC.md 2.3), after an optional linear warmup."""
  t = cfg.train

  def make(peak: float) -> optax.Schedule:
    decay = optax.cosine_decay_schedule(peak, max(t.steps - t.warmup_steps, 1),
                                        alpha=min(t.lr_final / peak, 1.0) if peak else 0.0)
    if not t.warmup_steps:
      return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, t.warmup_steps), decay],
                                [t.warmup_steps])

  return {"graft": make(t.lr_graft), "base": make(t.lr_base)}


def make_optimizer(cfg: RunConfig, host_lr: bool = False) -> optax.GradientTransformation:
  """AdamW per learning-rate group (base / graft) after a global-norm clip over all of them.

  `host_lr`: the learning rate is left out (1.0) and the step scales each group's update by a
  rate it is given (Trainer(host_lr=True)): AdamW's update times lr is AdamW at lr, and a run
  sized after its step is compiled can then fix its schedule without compiling again."""
  t = cfg.train
  groups = {name: optax.adamw(1.0 if host_lr else sched, b1=t.b1, b2=t.b2, eps=t.eps,
                              weight_decay=t.weight_decay)
            for name, sched in schedules(cfg).items()}
  return optax.chain(
      optax.clip_by_global_norm(t.clip_norm),
      optax.multi_transform(groups, lambda params: {k: jax.tree.map(lambda _: k, v)
                                                    for k, v in params.items()}))


def opt_state_shardings(opt_state: Any, param_shardings: dict, replicated: NamedSharding) -> Any:
  """Shardings of an optimiser state (abstract or not): a leaf that holds a param's moments (its
  path ends with the param's path, same shape) is split like the param; counts are replicated."""
  by_path = {tuple(k.key for k in path): s for path, s in
             jax.tree_util.tree_flatten_with_path(param_shardings)[0]}

  def one(path, leaf):
    keys = []
    for k in reversed(path):  # the trailing dict keys: the param's path inside `params`
      if not isinstance(k, jax.tree_util.DictKey):
        break
      keys.insert(0, k.key)
    s = by_path.get(tuple(keys))
    return s if s is not None and np.ndim(leaf) else replicated

  return jax.tree_util.tree_map_with_path(one, opt_state)


def with_shardings(tree: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs of `tree`'s arrays (abstract or not) carrying `shardings`."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def mesh_processes(mesh: jax.sharding.Mesh) -> int:
  """The processes (hosts) a mesh's devices belong to: a run has one per host."""
  return len({d.process_index for d in mesh.devices.flat})


class Trainer:
  """Owns the model split, the mesh and the jitted train and eval steps of one run.

  `mesh`: the run's devices (default: every device, shaped by the config's mesh axes).
  `abstract`: build shapes and shardings only (no weights are loaded or initialised, nothing is
  allocated), for `lower_step` / `lower_eval`; such a trainer cannot `step`.
  `host_lr`: the train step takes each group's learning rate as an input (make_optimizer),
  `step(..., lr=...)`; else the config's schedule is compiled into it.
  `model`: an already built model of this config (else built from it)."""

  def __init__(self, cfg: RunConfig, *, mesh: jax.sharding.Mesh | None = None,
               abstract: bool = False, host_lr: bool = False, model: Hamburger | None = None):
    self.cfg = cfg
    self.abstract = abstract
    self.host_lr = host_lr
    self.mesh = mesh if mesh is not None else sharding.make_mesh(
        cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    self.process_index, self.process_count = jax.process_index(), mesh_processes(self.mesh)
    d = cfg.data
    div = sharding.batch_divisor(self.mesh)
    if d.rows % div or d.rows % self.process_count:
      raise ConfigError(
          f"data.rows={d.rows} is not divisible by the data-parallel size {div} (mesh data x fsdp)"
          f" and the process count {self.process_count}: make rows a multiple of both")
    self.local_rows = d.rows // self.process_count

    if model is not None:
      self.model, self.tokenizer = model, None
    elif abstract:
      self.model, self.tokenizer = pretrained.abstract_run_model(cfg), None
    else:
      self.model, self.tokenizer = pretrained.build_run_model(cfg)
    set_layer_execution(self.model, cfg.train.scan_layers, cfg.train.remat)
    # The packed rows' attention kernel; attention_note: why cuDNN's was asked for and not used.
    self.attention, self.attention_note = choose_attention(
        cfg.model.attention, self.model.cfg.base, check=not abstract,
        shape=(max(d.rows // div, 1), d.entries))
    # Every process must compile the same step: process 0's pick (its timing) for all.
    if self.process_count > 1 and not abstract:
      pick = multihost_utils.broadcast_one_to_all(np.int32(self.attention == "cudnn"))
      self.attention = "cudnn" if int(pick) else "xla"
    set_attention(self.model, self.attention)
    if self.attention_note:
      warnings.warn(f"model.attention={cfg.model.attention}: cuDNN's kernel not used "
                    f"({self.attention_note}); XLA's runs", stacklevel=2)
    # "graft" holds the trained grafted params, "base" the rest (trained only with "all").
    # The frozen part holds a micro vocabulary's head rows too (train.micro_vocab: derived from
    # the base at load, never trained).
    self.graphdef, graft, base = nnx.split(self.model, TRAINED[cfg.train.trainable],
                                           nnx.Any(nnx.Param, MicroVocab))
    self.trains_base = cfg.train.trainable == "all"
    rules = sharding.TRAIN_RULES
    shard = lambda s: nnx.to_pure_dict(sharding.state_shardings(s, self.mesh, rules))
    self.param_shardings = {"graft": shard(graft)}
    params = {"graft": nnx.to_pure_dict(graft)}
    if self.trains_base:
      self.param_shardings["base"] = shard(base)
      params["base"] = nnx.to_pure_dict(base)
      frozen, self.frozen_shardings = {}, {}
    else:
      self.frozen_shardings = {"base": shard(base)}
      frozen = {"base": nnx.to_pure_dict(base)}
    self.tx = make_optimizer(cfg, host_lr)
    self.schedules = schedules(cfg)
    replicated = NamedSharding(self.mesh, P())
    opt_shardings = opt_state_shardings(jax.eval_shape(self.tx.init, params),
                                        self.param_shardings, replicated)
    self.state_shardings = TrainState(step=replicated, params=self.param_shardings,
                                      opt_state=opt_shardings)
    if abstract:
      self.frozen = with_shardings(frozen, self.frozen_shardings)
      state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                         opt_state=jax.eval_shape(self.tx.init, params))
      self.state = with_shardings(state, self.state_shardings)
    else:
      self.frozen = jax.device_put(frozen, self.frozen_shardings)
      params = jax.device_put(params, self.param_shardings)
      opt_state = jax.jit(self.tx.init, out_shardings=opt_shardings)(params)
      self.state = TrainState(step=jax.device_put(jnp.int32(0), replicated), params=params,
                              opt_state=opt_state)
    self._step_fns: dict[tuple[str, ...], Any] = {}  # by the batch's fields
    self._eval_fns: dict[tuple[str, ...], Any] = {}

  # ---------------------------------------------------------------- programs

  @contextlib.contextmanager
  def tracing(self) -> Iterator[None]:
    """How the steps are traced: under the mesh (activations split by rows:
    sharding.constrain_rows) and at the run's float32 matmul precision (train.precision)."""
    with jax.set_mesh(self.mesh), precision.matmuls(self.cfg.train.precision):
      yield

  def batch_sharding(self, key: str, accum_axis: bool = True) -> NamedSharding:
    """How a batch field is split: rows over the data-parallel axes (after the accumulation
    axis of a train step's batch)."""
    n = BATCH_NDIMS[key] - (not accum_axis)
    lead = (None,) if accum_axis else ()
    return NamedSharding(self.mesh, P(*lead, sharding.BATCH_AXES, *([None] * (n - 1 - len(lead)))))

  @property
  def online_teacher(self) -> bool:
    return self.cfg.train.recipe == "distill" and self.cfg.distill.teacher == "online"

  def batch_fields(self, teacher: bool | None = None) -> tuple[str, ...]:
    """The fields of this run's batches: teacher signals with the distill recipe (stored), or
    the unmerged rows the teacher reads (online)."""
    teacher = self.cfg.train.recipe == "distill" if teacher is None else teacher
    extra = (ONLINE_FIELDS if self.online_teacher else TEACHER_FIELDS) if teacher else ()
    skip = set(TEACHER_FIELDS + ONLINE_FIELDS) - set(extra)
    return tuple(sorted(k for k in BATCH_NDIMS if k not in skip))

  def abstract_batch(self, accum: int | None = None,
                     teacher_top_k: int = DEFAULT_TEACHER_TOP_K) -> dict[str, jax.ShapeDtypeStruct]:
    """A global batch of this run's shapes ([accum, rows, ...]; accum=0: an evaluation batch
    [rows, ...]) as ShapeDtypeStructs with their shardings: what the pipeline feeds."""
    d, k = self.cfg.data, self.cfg.graft.max_group
    hcfg: HamburgerConfig = self.model.cfg
    f, dim = self.model.num_features, hcfg.base.hidden_size
    accum = d.accum if accum is None else accum
    lead = (accum, d.rows) if accum else (d.rows,)
    m, g, t = d.entries, d.groups, d.row_tokens
    shapes = {"tokens": (t,), "token_segment": (t,), "teacher_index": (g, k),
              "input_ids": (m, k), "input_size": (m,), "positions": (m,), "segment_ids": (m,),
              "pred_index": (g,), "target_ids": (g, k), "target_size": (g,),
              "window_ids": (g, k), "window_size": (g,), "teacher_topk_ids": (g, k, teacher_top_k),
              "teacher_topk_logp": (g, k, teacher_top_k), "teacher_features": (g, f, dim)}
    floats = ("teacher_topk_logp", "teacher_features")
    return {key: jax.ShapeDtypeStruct((*lead, *shapes[key]),
                                      jnp.float32 if key in floats else jnp.int32,
                                      sharding=self.batch_sharding(key, bool(accum)))
            for key in self.batch_fields()}

  def step_program(self, keys: tuple[str, ...]):
    """The jitted train step for batches with these fields (teacher signals or not):
    `fn(state, frozen, batch) -> (state, metrics)`, the state donated."""
    if keys not in self._step_fns:
      replicated = NamedSharding(self.mesh, P())
      lr = ({name: replicated for name in self.schedules},) if self.host_lr else ()
      self._step_fns[keys] = jax.jit(
          self.train_step,
          in_shardings=(self.state_shardings, self.frozen_shardings,
                        {k: self.batch_sharding(k) for k in keys}, *lr),
          out_shardings=(self.state_shardings, replicated), donate_argnums=(0,))
    return self._step_fns[keys]

  def eval_program(self, keys: tuple[str, ...]):
    """The jitted evaluation step: `fn(params, frozen, batch) -> totals` for one batch
    [rows, ...] (no accumulation axis)."""
    if keys not in self._eval_fns:
      self._eval_fns[keys] = jax.jit(
          self.eval_step, in_shardings=(self.param_shardings, self.frozen_shardings,
                                         {k: self.batch_sharding(k, False) for k in keys}))
    return self._eval_fns[keys]

  def lower_step(self, batch: dict | None = None) -> jax.stages.Lowered:
    """The train step lowered for this trainer's state and `batch` (default: abstract_batch()):
    `.compile()` it to see what one optimiser step costs on the mesh's devices."""
    batch = self.abstract_batch() if batch is None else batch
    lr = ({n: jax.ShapeDtypeStruct((), jnp.float32) for n in self.schedules},) if self.host_lr \
        else ()
    with self.tracing():
      return self.step_program(tuple(sorted(batch))).lower(self.state, self.frozen, batch, *lr)

  def lower_eval(self, batch: dict | None = None) -> jax.stages.Lowered:
    batch = self.abstract_batch(accum=0) if batch is None else batch
    with self.tracing():
      return self.eval_program(tuple(sorted(batch))).lower(self.state.params, self.frozen, batch)

  # ---------------------------------------------------------------- traced

  def merge(self, params: dict, frozen: dict) -> Hamburger:
    base = params.get("base", frozen.get("base"))
    return nnx.merge(self.graphdef, params["graft"], base)

  def loss(self, params, frozen, batch):
    """The recipe's loss of one micro-batch: (token-mean loss, metrics)."""
    model, t = self.merge(params, frozen), self.cfg.train
    if t.recipe == "paper":
      return hamburger_loss(model, batch, t.ce_chunk)
    if self.online_teacher:
      batch = with_teacher(model, batch, self.cfg.distill.top_k, t.ce_chunk)
    if t.trainable in ("micro", "drafter"):
      return micro_distill_loss(model, batch, self.cfg.distill, t.ce_chunk,
                                drafting=t.trainable == "drafter")
    return distill_loss(model, batch, self.cfg.distill, t.ce_chunk,
                        dense_tokens=self.cfg.data.row_tokens)

  def _sizes(self, batch: dict) -> jax.Array:
    """Tokens each predicted group is trained on: its window (distill) or the group (paper)."""
    return batch["window_size" if self.cfg.train.recipe == "distill" else "target_size"]

  def train_step(self, state: TrainState, frozen: dict, batch: dict,
                 lr: dict | None = None) -> tuple[TrainState, dict]:
    """One optimiser step over `accum` micro-batches ([accum, rows, ...]); `lr`: each group's
    learning rate (host_lr), else the compiled schedule's.

    Each micro-batch's token-mean loss is weighted by its share of the step's response tokens, so
    the accumulated gradient is that of the token mean over the whole step.
    """
    k = batch["target_ids"].shape[-1]
    tokens = jnp.sum(jnp.minimum(self._sizes(batch), k), axis=(1, 2)).astype(jnp.float32)
    weights = tokens / jnp.maximum(tokens.sum(), 1.0)
    grad_fn = jax.value_and_grad(self.loss, has_aux=True)

    skip = ("tokens", "groups")  # counts, summed over the step below instead
    # The acceptance counts (n_tf_*) are summed as they are; their ratios are taken after.
    weight = lambda m, v, w: v if m.startswith("n_tf_") else v * w

    def micro(acc, xs):
      mb, w = xs
      (_, metrics), grads = grad_fn(state.params, frozen, mb)
      # In the gradient's dtype: a float32 weight would promote bfloat16 params' gradients.
      scaled = (jax.tree.map(lambda g: g * w.astype(g.dtype), grads),
                {m: weight(m, v, w) for m, v in metrics.items() if m not in skip})
      return jax.tree.map(jnp.add, acc, scaled), None

    names = jax.eval_shape(lambda: self.loss(state.params, frozen,
                                             jax.tree.map(lambda x: x[0], batch))[1])
    init = (jax.tree.map(jnp.zeros_like, state.params),
            {m: jnp.zeros((), jnp.float32) for m in names if m not in skip})
    (grads, metrics), _ = jax.lax.scan(micro, init, (batch, weights))
    if any(m.startswith("n_tf_") for m in metrics):
      metrics.update(acceptance_metrics(metrics))
    metrics["tokens"] = tokens.sum()
    metrics["groups"] = jnp.sum(batch["target_size"] > 0).astype(jnp.float32)
    metrics["grad_norm"] = optax.tree.norm(grads)
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    if lr is not None:
      updates = {name: jax.tree.map(lambda u, r=lr[name]: u * r.astype(u.dtype), u)
                 for name, u in updates.items()}
    params = optax.apply_updates(state.params, updates)
    for name, sched in self.schedules.items():
      metrics[f"lr_{name}"] = lr[name] if lr is not None else sched(state.step)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  def eval_step(self, params, frozen, batch):
    # The recipe's own loss metrics; on teacher data also HAMburger's agreement with the base's
    # greedy tokens and the teacher-forced acceptance (one yardstick for every recipe and stage).
    return teacher_forced.batch_totals(
        self.merge(params, frozen), batch, recipe=self.cfg.train.recipe,
        loss_fn=lambda _, b: self.loss(params, frozen, b), distill=self.cfg.distill,
        ce_chunk=self.cfg.train.ce_chunk,
        # The drafter drafts in plain contexts: its own agreement, not the merged forward's.
        yardstick=self.cfg.train.trainable != "drafter")

  # ---------------------------------------------------------------- host side

  def _check_concrete(self) -> None:
    if self.abstract:
      raise RuntimeError("an abstract Trainer holds shapes only: lower and compile its programs "
                         "(lower_step, lower_eval); build Trainer(cfg) to train")

  def global_batch(self, local_batches: list[dict[str, np.ndarray]]) -> dict[str, jax.Array]:
    """Stacks `accum` local micro-batches and assembles the global arrays across processes."""
    out = {}
    for key in sorted(local_batches[0]):
      shard = self.batch_sharding(key)
      local = np.stack([b[key] for b in local_batches])
      global_shape = (local.shape[0], local.shape[1] * self.process_count, *local.shape[2:])
      out[key] = jax.make_array_from_process_local_data(shard, local, global_shape)
    return out

  def step(self, local_batches: list[dict[str, np.ndarray]],
           lr: dict[str, float] | None = None) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(self.step_async(local_batches, lr)).items()}

  def step_async(self, local_batches: list[dict[str, np.ndarray]],
                 lr: dict[str, float] | None = None) -> dict[str, jax.Array]:
    """One step dispatched, its metrics left on the device (reading them waits for it)."""
    self._check_concrete()
    if (lr is None) == self.host_lr:
      raise ValueError("a host_lr Trainer's step takes lr={group: rate}, and only such a one")
    batch = self.global_batch(local_batches)
    extra = ({n: jnp.float32(v) for n, v in lr.items()},) if lr is not None else ()
    with self.tracing():
      self.state, metrics = self.step_program(tuple(batch))(self.state, self.frozen, batch,
                                                            *extra)
    return metrics

  def evaluate(self, batches: Iterator[dict[str, np.ndarray]],
               max_batches: int) -> dict[str, float]:
    """Validation metrics over up to `max_batches` batches, pooled by the rule of
    hamburger_jax.evaluation.teacher_forced (each metric over its own items), as val_*."""
    self._check_concrete()
    pool = teacher_forced.Pool()
    for i, b in enumerate(batches):
      if i >= max_batches:
        break
      batch = {k: v[0] for k, v in self.global_batch([b]).items()}
      with self.tracing():
        pool.add(self.eval_program(tuple(batch))(self.state.params, self.frozen, batch))
    # metrics.jsonl and TensorBoard take numbers: a metric with no items is logged as 0, and its
    # count (val_n_tf_* for the acceptance shares) tells it apart, as train.curves reads it.
    return {f"val_{k}": 0.0 if v is None else v for k, v in pool.result().items()}

  def current_model(self) -> Hamburger:
    """The model with the current params (host-gathered when the run spans processes)."""
    self._check_concrete()
    params, frozen = self.state.params, self.frozen
    if self.process_count > 1:
      params, frozen = multihost_utils.process_allgather((params, frozen), tiled=True)
    return self.merge(params, frozen)
