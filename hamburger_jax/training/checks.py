"""The checks a training run logs beside its steps (training/loop.py runs them): the validation
split's metrics (val_*), free generation on held-out prompts (gen_*) and the fidelity set's
teacher-forced figures (fid_*; a drafter's: its drafts'), each every train.eval_every, generate_every and fidelity_every
steps, before the first step (where the curves start: the initial graft) and at the last.
"""

from __future__ import annotations

import numpy as np

from hamburger_jax.config import ConfigError
from hamburger_jax.data import pipeline
from hamburger_jax.decode.requests import pooled_tokens_per_step
from hamburger_jax.evaluation.agreement import token_agreement
from hamburger_jax.run_config import RunConfig, TrainConfig
from hamburger_jax.training.trainer import Trainer


def held_out_prompts(data_dir: str, n: int) -> list[list[int]]:
  """Prompt ids of the first validation samples (held out from training)."""
  source = pipeline.open_split(data_dir, "validation")
  prompts = []
  for i in range(min(n, len(source))):
    rec = source[i]
    prompts.append([int(t) for t in np.asarray(rec["input_ids"])[:int(rec["prompt_len"])]])
  return prompts


class GenerationCheck:
  """Free generation on held-out prompts at train.generate_confidence: tokens per macro step
  and, with the base frozen, agreement with the base's greedy answers. The engine is built (and
  the base's answers generated) at the first call; later calls only swap in the current params."""

  def __init__(self, trainer: Trainer, data_dir: str, t: TrainConfig):
    self.trainer, self.data_dir, self.t = trainer, data_dir, t
    self.engine = self.prompts = self.reference = None

  def __call__(self) -> dict[str, float]:
    t, model = self.t, self.trainer.current_model()
    if self.engine is None:
      from hamburger_jax.decode.engine import Engine  # pylint: disable=import-outside-toplevel
      tok = self.trainer.tokenizer
      self.prompts = held_out_prompts(self.data_dir, t.generate_prompts)
      self.engine = Engine(model, tok, stop_ids=tok.stop_ids if tok else ())
      # With the base frozen, base mode is the original base whatever the graft: its greedy
      # answers, generated once, are what free generation should reproduce.
      if not self.trainer.trains_base:
        self.reference = [g.token_ids for g in self.engine.generate(
            self.prompts, max_new_tokens=t.generate_tokens, mode="base")]
    else:
      self.engine.set_model(model)
    gens = self.engine.generate(self.prompts, max_new_tokens=t.generate_tokens,
                                mode="hamburger", confidence=t.generate_confidence)
    out = {"gen_tokens_per_step": pooled_tokens_per_step(gens)}
    if self.reference is not None:
      agree = token_agreement(self.reference, [g.token_ids for g in gens])
      out.update(gen_identical=agree["identical"], gen_prefix_agreement=agree["prefix_agreement"])
    return out


class FidelityCheck:
  """The fidelity figures of the current graft on a fidelity set (train.fidelity_every): the
  teacher's signals are computed once, at the first call; each call then runs the graft's
  teacher-forced forwards (evaluation/fidelity.py). Metrics fid_<figure>. A drafter's run
  (train.trainable drafter) logs what its drafts are worth instead, on the set's answers read
  as single tokens (evaluation/verify_walk.py): fid_d1.. (each draft the base's), fid_chained
  and fid_walk (greedy verify's tokens a forward, draft confidence 0)."""

  FIGURES = ("agree_merged", "agree_single", "agree_one_merge", "agree_s2", "agree_s3",
             "agree_s4", "kl_merged", "kl_single", "kl_one_merge")

  def __init__(self, trainer: Trainer, t: TrainConfig):
    self.trainer, self.path = trainer, t.fidelity_set or None
    self.drafts = t.trainable == "drafter"
    self.records = None

  def __call__(self) -> dict[str, float]:
    # pylint: disable=import-outside-toplevel
    from hamburger_jax.evaluation import fidelity, fidelity_set, verify_walk
    model = self.trainer.current_model()
    if self.records is None:
      fset = fidelity_set.load(self.path)
      try:
        fidelity_set.check_fits(fset, model.base, model.max_group)
      except fidelity_set.FidelitySetError as e:
        raise ConfigError(f"train.fidelity_every: {e}") from None
      self.records = (verify_walk.single_token_records(model, fset.records) if self.drafts
                      else fidelity.teacher_records(model, fset.records))
    if self.drafts:
      tok = self.trainer.tokenizer
      out = verify_walk.draft_figures(model, self.records, 0.0, tok.stop_ids if tok else ())
      return {**{f"fid_{n}": v for n, v in out["marginal"].items() if v is not None},
              "fid_chained": out["chained"], "fid_walk": out["walk_tokens_per_forward"]}
    out = fidelity.fidelity_figures(model, self.records, progress=False)
    return {f"fid_{name}": out[name] for name in self.FIGURES if out.get(name) is not None}


def validation(trainer: Trainer, cfg: RunConfig) -> dict[str, float]:
  """The validation split's metrics (val_*) of the current graft."""
  d = cfg.data
  return trainer.evaluate(pipeline.validation_batches(
      d.dir, batch_rows=trainer.local_rows, entries=d.entries, groups=d.groups,
      max_group=cfg.graft.max_group, shard_index=trainer.process_index,
      shard_count=trainer.process_count, position_offset=cfg.graft.position_offset),
      max(d.validation_rows // d.rows, 1))


class RunChecks:
  """A run's validation, generation check and fidelity check; each keeps what it computed once
  (the engine, the base's answers, the teacher's signals) from one call to the next."""

  def __init__(self, trainer: Trainer, cfg: RunConfig):
    self.trainer, self.cfg = trainer, cfg
    self.generation = GenerationCheck(trainer, cfg.data.dir, cfg.train)
    self.fidelity = FidelityCheck(trainer, cfg.train)

  def due(self, done: int, last_step: bool = False) -> dict[str, float]:
    """The metrics of the checks that fall after step `done`: every check on at step 0 and at
    the last step, else those whose period divides `done`."""
    t, out = self.cfg.train, {}
    for every, check in ((t.eval_every, lambda: validation(self.trainer, self.cfg)),
                         (t.generate_every, self.generation), (t.fidelity_every, self.fidelity)):
      if every and (done % every == 0 or last_step):
        out.update(check())
    return out
