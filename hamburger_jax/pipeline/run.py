"""The pipeline's run: the parts not finished yet, in order, each with its share of the minutes
left; a summary line per part."""

from __future__ import annotations

import gc
import time
from typing import Any

from hamburger_jax.pipeline import budget as budget_rule
from hamburger_jax.pipeline import parts
from hamburger_jax.pipeline.plan import Plan
from hamburger_jax.pipeline.state import write_state


def summary_line(part: str, status: str, minutes: float, budget: float, figure: str) -> str:
  return f"{part:<14} {status:<11} {minutes:7.2f} / {budget:7.2f} min  {figure}"


def run_pipeline(plan: Plan, state: dict[str, Any]) -> tuple[int, list[str]]:
  """Runs the parts not finished yet; returns (exit code, one summary line per part)."""
  shares, lines, code = plan.shares(), [], 0
  state["budget_minutes"] = plan.budget
  write_state(plan, state)  # claims --out for this config before any part writes there
  for part in plan.parts():
    rec = state["parts"].get(part)
    if rec is not None:
      lines.append(summary_line(part, "skipped", rec["minutes"], rec["budget"],
                                f"{rec['figure']} [{rec['status']} in an earlier run]"))
      continue
    if code:
      lines.append(summary_line(part, "not run", 0.0, 0.0, "rerun the same command"))
      continue
    used = {p: r["minutes"] for p, r in state["parts"].items() if p in shares}
    budget = budget_rule.part_budget(shares, used, plan.budget, part)
    print(f"\n== {part}: {budget:.2f} of {plan.budget:g} minutes ==", flush=True)
    start = time.monotonic()
    try:
      rec = parts.runner(plan, part)(plan, budget, state)
    except (parts.Interrupted, KeyboardInterrupt):
      code, status, figure = 130, "interrupted", "rerun the same command to resume"
    except (RuntimeError, FileNotFoundError, ValueError) as e:
      code, status, figure = 1, "failed", str(e).splitlines()[0] if str(e) else repr(e)
    finally:
      gc.collect()
    minutes = (time.monotonic() - start) / 60
    if code:
      lines.append(summary_line(part, status, minutes, budget, figure))
      continue
    rec.update(minutes=minutes, budget=budget)
    state["parts"][part] = rec
    write_state(plan, state)
    lines.append(summary_line(part, rec["status"], minutes, budget, rec["figure"]))
  return code, lines
