"""Training: the train step (trainer.py) and the run around it (loop.py: checkpoints, resume,
logging, export; checks.py: the validation, generation and fidelity checks it logs)."""

from hamburger_jax.training.loop import RunResult, export_step, read_metrics, run
from hamburger_jax.training.trainer import TRAINED, Trainer, TrainState, make_optimizer, schedules

__all__ = ["RunResult", "TRAINED", "Trainer", "TrainState", "export_step", "make_optimizer",
           "read_metrics", "run", "schedules"]
