"""Synthetic data for tests, the tiny config and the notebook: learnable token patterns."""

from __future__ import annotations

import numpy as np

from hamburger_jax.data.tfds_builder import build_dataset


def synthetic_samples(n: int, vocab: int, max_group: int, seed: int = 0,
                      prompt_len: tuple[int, int] = (4, 12),
                      response_len: tuple[int, int] = (8, 40)) -> list[dict]:
  """Responses that count upward mod (vocab - 3) from a prompt-dependent start (so the next
  tokens are predictable and the graft has something to learn), split into random groups."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    p = int(rng.integers(*prompt_len))
    r = int(rng.integers(*response_len))
    prompt = rng.integers(3, vocab, size=p)
    start = int(prompt[-1])
    response = 3 + (start + np.arange(r)) % (vocab - 3)
    groups, left = [], r
    while left:
      g = int(min(left, rng.integers(1, max_group + 1)))
      groups.append(g)
      left -= g
    out.append({"input_ids": np.concatenate([prompt, response]).astype(np.int32),
                "prompt_len": p, "groups": groups, "source": "synthetic"})
  return out


def build_synthetic_dataset(out_dir: str, vocab: int, max_group: int, n_train: int = 256,
                            n_val: int = 32, seed: int = 0, overwrite: bool = False) -> str:
  train = synthetic_samples(n_train, vocab, max_group, seed)
  val = synthetic_samples(n_val, vocab, max_group, seed + 1)
  return build_dataset(out_dir, {"train": lambda: train, "validation": lambda: val},
                       max_group=max_group, metadata={"source": "synthetic"}, overwrite=overwrite)


def build_synthetic_teacher_dataset(out_dir: str, run_cfg, top_k: int = 8, n_train: int = 64,
                                    n_val: int = 16, seed: int = 0) -> str:
  """The synthetic samples with the teacher signals of `run_cfg`'s (random) base, stored as
  train.prepare_data --teacher-top-k stores them: data for the distill recipe's tests."""
  from hamburger_jax import pretrained, segmentation  # pylint: disable=import-outside-toplevel
  from hamburger_jax.data import prepare  # pylint: disable=import-outside-toplevel
  base, _ = pretrained.load_base_for_run(run_cfg.model, run_cfg.train.seed)
  teacher = segmentation.TeacherSpec(
      top_k, run_cfg.graft.resolved_feature_layers(base.cfg.num_layers))
  k = run_cfg.graft.max_group

  def with_signals(samples: list[dict]) -> list[dict]:
    pairs = [(s["input_ids"][:s["prompt_len"]], s["input_ids"][s["prompt_len"]:]) for s in samples]
    stats = segmentation.response_token_stats(base, pairs, teacher=teacher)
    return [{**s, **prepare.teacher_signals(st, s["groups"])} for s, st in zip(samples, stats)]

  train = with_signals(synthetic_samples(n_train, base.cfg.vocab_size, k, seed))
  val = with_signals(synthetic_samples(n_val, base.cfg.vocab_size, k, seed + 1))
  meta, shapes = prepare.teacher_metadata(base, teacher)
  return build_dataset(out_dir, {"train": lambda: train, "validation": lambda: val},
                       max_group=k, metadata={"source": "synthetic", **meta}, teacher=shapes)


def sharpen(model, scale: float = 8.0) -> None:
  """Multiplies every weight matrix by `scale` (norm weights untouched), in place.

  A random model at the usual init (std 0.02) predicts near-uniform distributions, where argmax
  is decided by rounding noise; sharper weights give decisive, varied greedy outputs, so decode
  tests compare real choices.
  """
  from flax import nnx  # pylint: disable=import-outside-toplevel
  for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if var.ndim >= 2:
      var.set_value(var[...] * scale)
