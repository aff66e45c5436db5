"""Training curves from a run's metrics.jsonl (training/loop.py's rows), as PNGs: one run's
panels, recipes compared stage by stage, and the stop head's trade-off across confidences.
`python -m train.curves` is the command line.

Panels of one run: loss (train and validation), token accuracy per micro step (acc_s1..acc_s4:
the group's tokens 1..4; s1 comes from the base's own last hidden state, s2..s4 from the
micro-step decoder), stop-head accuracy, and the data's mean group size with the tokens per
macro step of the periodic generations."""

from __future__ import annotations

from typing import Any, Sequence


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
  pts = [(r["step"], r[key]) for r in rows if key in r]
  return [p[0] for p in pts], [p[1] for p in pts]


def _smooth(ys: Sequence[float], window: int) -> list[float]:
  out, acc = [], []
  for y in ys:
    acc = (acc + [y])[-window:]
    out.append(sum(acc) / len(acc))
  return out


def _line(ax, rows: Sequence[dict[str, Any]], key: str, style: str, smooth: int, **kw) -> None:
  """One series, if the run logged it; per-step train series smoothed, periodic ones (val_,
  gen_) drawn as they are."""
  x, y = _series(rows, key)
  if x:
    periodic = key.startswith(("val_", "gen_"))
    ax.plot(x, y if periodic else _smooth(y, smooth), style, label=key, **kw)


def write_png(fig, path: str) -> str:
  """Lays out `fig`, writes it (evaluation.plots.save_figure: never a half-written PNG under the
  final name) and closes it, also when writing fails."""
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from hamburger_jax.evaluation.plots import save_figure  # pylint: disable=C0415
  try:
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)
  finally:
    plt.close(fig)


def plot_curves(rows: Sequence[dict[str, Any]], path: str, smooth: int = 5) -> str:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  if not rows:
    raise ValueError("no metrics to plot: the run has not logged a step yet")
  fig, axes = plt.subplots(1, 4, figsize=(18, 4))
  ax = axes[0]
  for key, style in (("loss", "-"), ("lm_loss", "-"), ("val_loss", "o-"), ("val_lm_loss", "o-")):
    _line(ax, rows, key, style, smooth)
  ax.set(title="loss", xlabel="step")
  ax.legend()
  ax = axes[1]
  for i in range(1, 5):
    _line(ax, rows, f"acc_s{i}", "-", smooth, color=f"C{i - 1}")
    _line(ax, rows, f"val_acc_s{i}", "o--", smooth, color=f"C{i - 1}")
  ax.set(title="micro-step token accuracy", xlabel="step", ylim=(0, 1))
  ax.legend(fontsize=7, ncol=2)
  ax = axes[2]
  _line(ax, rows, "stop_acc", "-", smooth)
  _line(ax, rows, "val_stop_acc", "o-", smooth)
  _line(ax, rows, "gen_prefix_agreement", "s-", smooth)  # free generation vs the base's answers
  ax.set(title="stop head accuracy / free-generation agreement", xlabel="step", ylim=(0, 1))
  ax.legend()
  ax = axes[3]
  _line(ax, rows, "mean_group_size", "-", smooth)  # the paper recipe's data groups
  _line(ax, rows, "gen_tokens_per_step", "o-", smooth)
  ax.set(title="tokens per macro step / data group", xlabel="step")
  ax.legend()
  return write_png(fig, path)


def compared_panels(confidence: float = 0.8) -> list[tuple[str, str]]:
  """(metric, title) of the comparison's panels; the last two at one tracked confidence."""
  from hamburger_jax.objectives.distillation import (  # pylint: disable=import-outside-toplevel
      TRACKED_CONFIDENCES, confidence_tag)
  if confidence not in TRACKED_CONFIDENCES:
    raise ValueError(f"--confidence {confidence:g}: validation tracks only "
                     f"{', '.join(f'{c:g}' for c in TRACKED_CONFIDENCES)}")
  tag = confidence_tag(confidence)
  return [("val_agree_unmerged", "token 0 after an unmerged entry"),
          ("val_agree_merged", "token 0 after a merged entry"),
          ("val_agree_s2", "micro step 2"), ("val_agree_s3", "micro step 3"),
          (f"val_tf_tokens_per_step_{tag}",
           f"tokens per step at confidence {confidence:g}\n(teacher-forced)"),
          (f"val_tf_accepted_agree_{tag}",
           f"accepted micro tokens that are the\nbase's, at {confidence:g}")]


def accepted_any(row: dict[str, Any], key: str) -> bool:
  """False for an accepted-agreement metric of a validation where nothing was accepted: the
  share is then undefined (logged as 0), not a point to plot. From the logged count where
  there is one, else from 1.0 tokens per step."""
  if not key.startswith("val_tf_accepted_agree_"):
    return True
  count = key.replace("val_tf_accepted_agree_", "val_n_tf_accepted_")
  if count in row:
    return row[count] > 0
  return row.get(key.replace("accepted_agree", "tokens_per_step"), 0.0) > 1.0


def time_key(recipes: Sequence[Sequence[Sequence[dict[str, Any]]]]) -> str:
  """The step time every run logged: CPU seconds (all cores; comparable on a shared machine)
  where all have them, else wall seconds."""
  rows = [r for stages in recipes for stage in stages for r in stage]
  timed = [r for r in rows if "step_s" in r]
  return "step_cpu_s" if timed and all("step_cpu_s" in r for r in timed) else "step_s"


def minutes_axis(stages: Sequence[Sequence[dict[str, Any]]],
                 key: str = "step_s") -> list[tuple[float, dict]]:
  """(training minutes, row) for the rows of consecutive stages of one recipe: each stage's
  steps at its median logged step time (`key`), after the minutes of the stages before it."""
  out, offset = [], 0.0
  for rows in stages:
    step_s = sorted(r[key] for r in rows if key in r)
    if not step_s:
      raise ValueError(f"a run has no {key} in its metrics: not a train.main run")
    per_step = step_s[len(step_s) // 2] / 60
    out += [(offset + r["step"] * per_step, r) for r in rows]
    offset += max(r["step"] for r in rows) * per_step
  return out


def plot_comparison(recipes: dict[str, list[list[dict[str, Any]]]], path: str,
                    confidence: float = 0.8) -> str:
  """Teacher-forced agreement with the base (validation) against training minutes, per recipe;
  the acceptance panels at `confidence`."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  clock = time_key(list(recipes.values()))
  xlabel = "CPU minutes (all cores)" if clock == "step_cpu_s" else "training minutes (wall)"
  panels = compared_panels(confidence)
  cols = 3
  rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.8 * rows))
  for ax, (key, title) in zip(axes.ravel(), panels):
    for i, (name, stages) in enumerate(recipes.items()):
      pts = [(m, r[key]) for m, r in minutes_axis(stages, clock)
             if key in r and accepted_any(r, key)]
      if pts:
        ax.plot(*zip(*pts), "o-", color=f"C{i}", label=name)
    per_step = "tokens_per_step" in key
    ax.set(title=title if per_step else f"agreement with the base:\n{title}", xlabel=xlabel)
    if not ax.lines:  # no run logged this metric
      continue
    if per_step:
      ax.set_ylim(bottom=1)
    else:
      ax.set_ylim(0, 1)
    ax.legend()
  return write_png(fig, path)


def tradeoff_points(rows: Sequence[dict[str, Any]]) -> list[tuple[float, float, float | None]]:
  """(confidence, tokens per step, accepted micro tokens that are the base's) from a run's last
  validation, for every confidence it tracked (distillation.acceptance); the share is None
  where nothing was accepted."""
  last = next((r for r in reversed(rows)
               if any(k.startswith("val_tf_tokens_per_step_c") for k in r)), None)
  if last is None:
    raise ValueError("a run has no val_tf_* metrics: validate it with teacher data")
  out = []
  for key in last:
    if key.startswith("val_tf_tokens_per_step_c"):
      tag = key.rsplit("_", 1)[1]
      agree = f"val_tf_accepted_agree_{tag}"
      out.append((int(tag[1:]) / 100, last[key],
                  last[agree] if accepted_any(last, agree) else None))
  return sorted(out)


def plot_tradeoff(runs: dict[str, list[dict[str, Any]]], path: str) -> str:
  """Tokens per macro step against the share of accepted micro tokens that are the base's,
  across confidences, per run (teacher-forced, validation): the stop head's trade-off."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, ax = plt.subplots(figsize=(6, 4.5))
  for i, (name, rows) in enumerate(runs.items()):
    pts = [p for p in tradeoff_points(rows) if p[2] is not None]
    ax.plot([p[1] for p in pts], [p[2] for p in pts], "o-", color=f"C{i}", label=name)
    for c, x, y in pts:
      ax.annotate(f"{c:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
  ax.set(xlabel="tokens per macro step (teacher-forced)",
         ylabel="accepted micro tokens = the base's greedy token", ylim=(0, 1),
         title="stop head trade-off across confidences")
  ax.legend()
  return write_png(fig, path)


# The fidelity set's figures a run logs (train.fidelity_every), one panel each.
FIDELITY_PANELS = (("fid_agree_merged", "agreement after a merged entry"),
                   ("fid_agree_one_merge", "after one merge in a plain context"),
                   ("fid_agree_single", "after a single-token entry"),
                   ("fid_kl_merged", "KL after a merged entry"))


# A drafter's runs log its drafts' figures on the set read as single tokens instead.
DRAFT_PANELS = (("fid_d1", "draft 1 the base's token"),
                ("fid_chained", "chained tokens a forward (teacher-forced)"),
                ("fid_walk", "greedy verify's tokens a forward (walked)"))


def plot_fidelity(runs: dict[str, Sequence[dict[str, Any]]], path: str) -> str:
  """Learning curves of several runs (the fidelity arms, or drafter arms) on the fidelity set:
  each panel one figure (FIDELITY_PANELS, or DRAFT_PANELS where the runs logged those) against
  the step, one line a run."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  logged = lambda panels: any(any(k in r for r in rows for k, _ in panels)
                              for rows in runs.values())
  panels = DRAFT_PANELS if logged(DRAFT_PANELS) else FIDELITY_PANELS
  if not logged(panels):
    raise ValueError("no fid_* metrics in these runs: train them with train.fidelity_every")
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
  for ax, (key, title) in zip(axes, panels):
    for name, rows in runs.items():
      x, y = _series(rows, key)
      if x:
        ax.plot(x, y, "o-", label=name)
    ax.set(title=title, xlabel="step")
    ax.legend(fontsize=8)
  return write_png(fig, path)
