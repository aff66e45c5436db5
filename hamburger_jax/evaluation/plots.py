"""Plots of an evaluation (results.json of evaluation/run.py), in the layouts of the paper's
figures (`python -m infer.eval --replot results.json` redraws them):

- quality_vs_compression.png (Figure 3): one panel per task, x = KV compression (tokens per KV
  entry), y = score with its 95% bootstrap interval as an error bar (when results.json has one);
  HAMburger points labelled by confidence, the base as a horizontal line and a point at
  compression 1.0.
- speed.png (Figure 5): decode tokens/s per task, base vs HAMburger at each confidence.
- group_sizes.png: how often each group size occurs, per confidence, over all generations.
- groups_example.png (Figure 1): one generation, each macro step's tokens on an alternating
  background (one background = one base forward = one KV entry).

Also the helpers the notebook uses to show groups: `group_pieces`, `groups_html`.
"""

from __future__ import annotations

import html
import math
import textwrap
from typing import Any, Sequence

import matplotlib
from matplotlib.figure import Figure

from hamburger_jax import files
from hamburger_jax.evaluation.report import TEACHER_FORCED_TASKS

# Figures are built with matplotlib.figure.Figure, not pyplot: they render with Agg straight to PNG
# on any machine, and importing this module leaves a notebook's own (inline) backend alone.
REDS = matplotlib.colormaps["Reds"]

# Alternating group backgrounds, as infer.generate colours groups in a terminal.
GROUP_COLOURS = ("#ffd7af", "#afd7ff")
BASE_COLOUR = "#555555"
FILES = ("quality_vs_compression.png", "speed.png", "group_sizes.png", "groups_example.png")


def save_figure(fig, path: str, dpi: int = 120) -> str:
  """Writes `fig` as a PNG at `path` through a temporary file (files.write_atomic): a reader
  never finds half a PNG under the final name."""
  files.write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
  return path


# ----------------------------------------------------------------------------- groups as text


def group_pieces(tokenizer, token_ids: Sequence[int], groups: Sequence[int]) -> list[str]:
  """The text of each macro step's group (token ids written out when there is no tokenizer)."""
  pieces, start = [], 0
  for size in groups:
    ids = list(token_ids[start:start + size])
    start += size
    pieces.append(tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None
                  else " ".join(map(str, ids)) + " ")
  return pieces


def groups_html(pieces: Sequence[str], colours: Sequence[str] = GROUP_COLOURS) -> str:
  """HTML with each group on an alternating background (for IPython.display.HTML)."""
  spans = "".join(
      f'<span style="background:{colours[i % len(colours)]};color:#000;'
      f'white-space:pre-wrap">{html.escape(p)}</span>' for i, p in enumerate(pieces))
  return f'<div style="font-family:monospace;line-height:1.6">{spans}</div>'


# ----------------------------------------------------------------------------- figures


def _confidences(results: dict[str, Any]) -> list[str]:
  return [f"{c:g}" for c in results["config"]["confidence"]]


def _generation_tasks(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
  return {n: r for n, r in results["tasks"].items() if n not in TEACHER_FORCED_TASKS}


def _yerr(summaries: Sequence[dict[str, Any]]) -> list[list[float]] | None:
  """Error-bar lengths below and above each score from its "ci95"; None when a summary has none
  (results.json written before intervals were reported)."""
  cis = [s.get("ci95") for s in summaries]
  if any(not ci or any(v is None or v != v for v in ci) for ci in cis):
    return None
  return [[max(s["score"] - ci[0], 0.0) for s, ci in zip(summaries, cis)],
          [max(ci[1] - s["score"], 0.0) for s, ci in zip(summaries, cis)]]


def _empty(path: str, message: str) -> str:
  fig = Figure(figsize=(6, 1.5))
  ax = fig.subplots()
  ax.axis("off")
  ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=11)
  return save_figure(fig, path, dpi=120)


def plot_quality_vs_compression(results: dict[str, Any], path: str) -> str:
  tasks = _generation_tasks(results)
  if not tasks:
    return _empty(path, "no generation tasks in this evaluation")
  cs = _confidences(results)
  cols = min(len(tasks), 3)
  rows = math.ceil(len(tasks) / cols)
  fig = Figure(figsize=(4.6 * cols, 3.8 * rows))
  axes = fig.subplots(rows, cols, squeeze=False)
  for ax, (name, r) in zip(axes.flat, tasks.items()):
    xs = [r["hamburger"][c]["kv_compression"] for c in cs]
    ys = [r["hamburger"][c]["score"] for c in cs]
    ax.axhline(r["base"]["score"], color=BASE_COLOUR, ls="--", lw=1, label="base")
    ax.errorbar([1.0], [r["base"]["score"]], yerr=_yerr([r["base"]]), fmt="s",
                color=BASE_COLOUR, capsize=3)
    ax.errorbar(xs, ys, yerr=_yerr([r["hamburger"][c] for c in cs]), fmt="o-",
                color="tab:red", capsize=3, label="HAMburger")
    for c, x, y in zip(cs, xs, ys):
      ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(5, 5), fontsize=9)
    ax.set_title(f"{name} (n={r['n']})")
    ax.set_xlabel("KV compression (tokens per KV entry)")
    ax.set_ylabel(r["metric"].replace("_", " "))
    right = max(xs + [1.0])
    ax.set_xlim(0.9, right + 0.15 * max(right - 0.9, 1.0))
    ax.margins(y=0.2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
  for ax in list(axes.flat)[len(tasks):]:
    ax.axis("off")
  fig.suptitle("Quality vs KV compression (base at 1.0x)")
  fig.tight_layout()
  return save_figure(fig, path, dpi=120)


def plot_speed(results: dict[str, Any], path: str) -> str:
  tasks = _generation_tasks(results)
  if not tasks:
    return _empty(path, "no generation tasks in this evaluation")
  cs = _confidences(results)
  names = list(tasks)
  width = 0.8 / (1 + len(cs))
  fig = Figure(figsize=(max(5.0, 1.2 + 1.6 * len(names) * (1 + len(cs)) * width), 4))
  ax = fig.subplots()
  series = [("base", [tasks[n]["base"]["tokens_per_s"] for n in names], BASE_COLOUR, None)]
  for i, c in enumerate(cs):
    series.append((f"HAMburger c={c}", [tasks[n]["hamburger"][c]["tokens_per_s"] for n in names],
                   REDS(0.4 + 0.5 * i / max(len(cs) - 1, 1)),
                   [tasks[n]["hamburger"][c]["speed_ratio"] for n in names]))
  for i, (label, values, colour, ratios) in enumerate(series):
    xs = [j + (i - len(cs) / 2) * width for j in range(len(names))]
    bars = ax.bar(xs, values, width, label=label, color=colour)
    if ratios is not None:
      ax.bar_label(bars, [f"{r:.2f}x" for r in ratios], fontsize=8, padding=2)
  ax.set_xticks(range(len(names)), names)
  ax.set_ylabel("decode tokens/s (batch, compile excluded)")
  ax.set_title(f"Decode speed, batches of up to {results['config']['batch']} prompts\n"
               "(bar labels: HAMburger / base)")
  ax.margins(y=0.15)
  ax.legend(fontsize=8)
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  return save_figure(fig, path, dpi=120)


def plot_group_sizes(results: dict[str, Any], path: str) -> str:
  hists = {c: {int(k): v for k, v in h.items()} for c, h in results.get("group_sizes", {}).items()}
  if not hists:
    return _empty(path, "no HAMburger generations in this evaluation")
  sizes = list(range(1, max(s for h in hists.values() for s in h) + 1))
  width = 0.8 / len(hists)
  fig = Figure(figsize=(max(5.0, 1.5 * len(sizes) + 2), 3.8))
  ax = fig.subplots()
  for i, (c, h) in enumerate(hists.items()):
    total = sum(h.values())
    mean = sum(s * n for s, n in h.items()) / max(total, 1)
    xs = [s + (i - (len(hists) - 1) / 2) * width for s in sizes]
    ax.bar(xs, [h.get(s, 0) / max(total, 1) for s in sizes], width,
           color=REDS(0.4 + 0.5 * i / max(len(hists) - 1, 1)),
           label=f"c={c}: {total} groups, {mean:.2f} tokens/step")
  ax.set_xticks(sizes)
  ax.set_xlabel("tokens per macro step (group size)")
  ax.set_ylabel("fraction of groups")
  ax.set_title("HAMburger group sizes, all generations")
  ax.legend(fontsize=8)
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  return save_figure(fig, path, dpi=120)


def _layout(pieces: Sequence[str], cols: int, max_lines: int) -> list[tuple[int, int, int, str]]:
  """(line, column, group index, text) runs of the pieces wrapped at `cols` monospace cells."""
  runs, line, col = [], 0, 0
  for i, piece in enumerate(pieces):
    for j, part in enumerate(piece.replace("\t", "  ").split("\n")):
      if j:
        line, col = line + 1, 0
      while part:
        if col + len(part) > cols and col > 0 and len(part) <= cols:
          line, col = line + 1, 0  # a group stays on one line when it fits on one
        take = part[:cols - col]
        runs.append((line, col, i, take))
        col += len(take)
        part = part[len(take):]
        if part:
          line, col = line + 1, 0
      if line >= max_lines:
        return [r for r in runs if r[0] < max_lines]
  return runs


def plot_groups_example(example: dict[str, Any] | None, path: str, cols: int = 88,
                        max_lines: int = 24) -> str:
  if not example:
    return _empty(path, "no HAMburger generation to show")
  runs = _layout(example["pieces"], cols, max_lines)
  prompt = textwrap.wrap(" ".join(example["prompt"].split()), cols)[:3] or [""]
  n_lines = (runs[-1][0] + 1 if runs else 1) + len(prompt) + 4
  font = 10.0
  cell_w, cell_h = font * 0.602 / 72, font * 1.6 / 72  # DejaVu Sans Mono advance, line pitch
  fig = Figure(figsize=(cols * cell_w + 0.6, n_lines * cell_h + 0.4))
  ax = fig.add_axes([0.3 / (cols * cell_w + 0.6), 0.02, cols * cell_w / (cols * cell_w + 0.6),
                     0.96])
  ax.set_xlim(0, cols)
  ax.set_ylim(n_lines, 0)
  ax.axis("off")
  ax.text(0, 0.5, f"{example['id']}: HAMburger at confidence {example['confidence']:g}, "
          f"{len(example['pieces'])} macro steps", fontsize=font + 1, fontweight="bold",
          va="center", parse_math=False)
  ax.text(0, 1.5, "each background = one macro step = one base forward = one KV entry",
          fontsize=font, va="center", color="#333333", parse_math=False)
  for k, line in enumerate(prompt):
    ax.text(0, 2.5 + k, ("prompt: " if k == 0 else "        ") + line, fontsize=font,
            family="monospace", color="#666666", va="center", parse_math=False)
  top = len(prompt) + 3.5
  for line, col, i, text in runs:
    ax.text(col, top + line, text, fontsize=font, family="monospace", va="center",
            parse_math=False,
            bbox={"boxstyle": "square,pad=0.15", "fc": GROUP_COLOURS[i % 2], "ec": "none"})
  return save_figure(fig, path, dpi=130)


def plot_all(results: dict[str, Any], out_dir: str) -> list[str]:
  """Writes the four PNGs (FILES) into out_dir; returns their paths."""
  files.makedirs(out_dir)
  q, s, g, e = (files.join(out_dir, f) for f in FILES)
  return [plot_quality_vs_compression(results, q), plot_speed(results, s),
          plot_group_sizes(results, g), plot_groups_example(results.get("example"), e)]
