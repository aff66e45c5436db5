"""results.md: the evaluation's numbers (results.json's content) as markdown tables."""

from __future__ import annotations

from typing import Any, Sequence

from hamburger_jax.evaluation.agreement import DIVERGENCE_KINDS
from hamburger_jax.evaluation.scoring import ckey

# Teacher-forced tasks (infer.eval): no decoding and no score against the base; tabled apart.
TEACHER_FORCED_TASKS = ("nll", "fidelity", "drafts")


def fmt(x: float | None, digits: int = 3) -> str:
  return "-" if x is None or x != x else f"{x:.{digits}f}"


def fmt_ci(x: float | None, ci: Sequence[float] | None, digits: int = 3) -> str:
  """0.525 [0.46, 0.59]: a value and its interval (one digit fewer: it is rougher)."""
  if not ci or any(v is None or v != v for v in ci):
    return fmt(x, digits)
  d = max(digits - 1, 1)
  return f"{fmt(x, digits)} [{ci[0]:.{d}f}, {ci[1]:.{d}f}]"


def markdown(results: dict[str, Any]) -> str:
  """results.md: the run's header, the generation tasks' tables, then the nll task's."""
  cs = results["config"]["confidence"]
  gen_tasks = {n: r for n, r in results["tasks"].items() if n not in TEACHER_FORCED_TASKS}
  lines = _header(results)
  if gen_tasks:
    lines += _scores_table(gen_tasks, cs)
    lines += _paired_table(gen_tasks, cs)
    lines += _divergence_table(gen_tasks, cs)
    lines += _speed_table(gen_tasks, cs)
    lines += _verify_table(gen_tasks)
  if "nll" in results["tasks"]:
    r = results["tasks"]["nll"]
    lines += _nll_table(r)
    lines += _teacher_agreement_table(r.get("teacher_agreement"))
    lines += _teacher_acceptance_table(r.get("teacher_acceptance"))
    lines += _verify_drafts_table(r.get("verify_drafts"))
  if "fidelity" in results["tasks"]:
    lines += fidelity_table(results["tasks"]["fidelity"])
  if "drafts" in results["tasks"]:
    lines += drafts_table(results["tasks"]["drafts"])
  return "\n".join(lines) + "\n"


FIDELITY_COLUMNS = ("agree_merged", "agree_single", "agree_one_merge", "agree_s2", "agree_s3",
                    "agree_s4", "kl_merged", "kl_single", "kl_one_merge")


def drafts_table(r: dict[str, Any]) -> list[str]:
  """The drafts task: verify mode's drafts teacher-forced on single-token answers, and the
  engine's greedy verify on the same prompts."""
  marg = r["marginal"]
  cols = [f"draft {i[1:]} the base's" for i in marg]
  return ["", f"Verify mode's drafts ({r['drafter']}, draft confidence {r['draft_confidence']:g}), "
          f"teacher-forced on the fidelity set read as single tokens ({r['n']} records, "
          f"{r['windows']} positions); chained = 1 + the share of windows whose drafts 1..i are "
          "all the base's, summed over i; walk = greedy verify replayed over the answers; "
          "engine = greedy verify decoding the same prompts.", "",
          "| " + " | ".join(cols) + " | chained | walk | engine | walk's steps = engine's |",
          "|" + "---|" * (len(cols) + 4),
          "| " + " | ".join(fmt(v) for v in marg.values()) +
          f" | {r['chained']:.3f} | {r['walk_tokens_per_forward']:.3f} | "
          f"{r['engine_tokens_per_forward']:.3f} | {r['walk_equals_engine']} of {r['n']} |"]


def fidelity_table(r: dict[str, Any]) -> list[str]:
  """The fidelity task: each figure with its items, then the after-merged ones by group size."""
  where = (f"{r['data']} ({r['split']})" if "data" in r else f"the fidelity set {r['set']}")
  cols = [c for c in FIDELITY_COLUMNS if c in r]
  sizes = sorted({s for c in ("agree_merged", "agree_one_merge")
                  for s in r["by_size"].get(c, {})}, key=int)
  lines = ["", f"Fidelity, teacher-forced on {where}, {r['n']} records: the share of tokens that "
           "are the base's own greedy token (agree_*) and the KL from its top-k (kl_*); merged "
           "/ single = token 0 after a merged / a single-token entry, one_merge = after a "
           "merged entry in an otherwise plain context, s_i = micro step i (items in "
           "parentheses).", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
           "| " + " | ".join(f"{fmt(r[c])} ({r['items'][c]})" for c in cols) + " |"]
  if "kv_compression" in r:
    lines += ["", f"Merged at layer {r['merge_layer']}: KV compression "
              f"{r['kv_compression']:.2f}x on these answers' groups."]
  if sizes:
    lines += ["", "By the merged entry's group size:", "",
              "| figure | " + " | ".join(sizes) + " |", "|---|" + "---|" * len(sizes)]
    for c in ("agree_merged", "agree_one_merge", "kl_merged", "kl_one_merge"):
      if c in r:
        lines.append(f"| {c} | " + " | ".join(fmt(r["by_size"][c].get(s)) for s in sizes) + " |")
  if r.get("merge_layer_sweep"):
    lines += ["", "Untrained merge at layer L (the group's last token's layer-L state read by the "
              "exact base; L = 0: its embedding), the same records:", "",
              "| L | agree merged | agree single | agree one merge | KL merged | KV compression |",
              "|---|---|---|---|---|---|"]
    for row in r["merge_layer_sweep"]:
      lines.append(f"| {row['merge_layer']} | {fmt(row['agree_merged'])} | "
                   f"{fmt(row['agree_single'])} | {fmt(row['agree_one_merge'])} | "
                   f"{fmt(row['kl_merged'])} | {row['kv_compression']:.2f}x |")
  return lines


def _header(results: dict[str, Any]) -> list[str]:
  return ["# HAMburger evaluation", "",
          f"Model: base {results['model']['base']}, checkpoint "
          f"{results['model']['checkpoint'] or 'NONE (untrained graft)'}; greedy; "
          f"batches of up to {results['config']['batch']} prompts"
          + (f"; HAMburger groups of at most {results['config']['max_group']} tokens"
             if results["config"].get("max_group") else "")
          + f"; {results['created']}.", "",
          f"`{results['command']}`", ""]


def _scores_table(gen_tasks: dict[str, Any], cs: Sequence[float]) -> list[str]:
  head = (["task", "base"] + [f"HAMburger @ {c:g}" for c in cs] +
          [f"KV compression @ {c:g}" for c in cs] + [f"speed ratio @ {c:g}" for c in cs])
  lines = ["Scores: exact match / pass@1 / token match; mt_bench and sharegpt_heldout: ROUGE-L "
           "against the base's own answers (so the base scores 1 by definition); in brackets "
           "the 95% bootstrap interval over the examples. KV compression = generated "
           "tokens / macro steps; speed ratio = HAMburger / base decode tokens/s "
           "(compilation excluded).", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name, r in gen_tasks.items():
    ham = [r["hamburger"][ckey(c)] for c in cs]
    row = ([f"{name} ({r['metric']}, n={r['n']})",
            fmt_ci(r["base"]["score"], r["base"].get("ci95"))] +
           [fmt_ci(h["score"], h.get("ci95")) for h in ham] +
           [f"{h['kv_compression']:.2f}x" for h in ham] +
           [f"{h['speed_ratio']:.2f}x" for h in ham])
    lines.append("| " + " | ".join(row) + " |")
  return lines


def _paired_table(gen_tasks: dict[str, Any], cs: Sequence[float]) -> list[str]:
  head = ([f"delta @ {c:g}" for c in cs] + [f"identical @ {c:g}" for c in cs] +
          [f"prefix agreement @ {c:g}" for c in cs])
  lines = ["", "HAMburger against the base on the same examples: delta = HAMburger's score "
           "minus the base's [paired 95% bootstrap interval]; identical = fraction of examples "
           "where HAMburger emits exactly the base's greedy tokens; prefix agreement = mean "
           "share of the base's tokens HAMburger reproduces before its first different one.",
           "", "| task | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
  for name, r in gen_tasks.items():
    ham = [r["hamburger"][ckey(c)] for c in cs]
    row = ([fmt_ci(h.get("delta"), h.get("delta_ci95")) for h in ham] +
           [fmt(h.get("identical")) for h in ham] + [fmt(h.get("prefix_agreement")) for h in ham])
    lines.append(f"| {name} | " + " | ".join(row) + " |")
  return lines


def _divergence_table(gen_tasks: dict[str, Any], cs: Sequence[float]) -> list[str]:
  head = [f"{k.replace('_', ' ')} @ {c:g}" for c in cs for k in DIVERGENCE_KINDS]
  lines = ["", "Where HAMburger's answer first leaves the base's (fraction of the examples): at "
           "a micro token (chosen by the micro decoder, accepted by the stop head), or at a "
           "group's first token right after a merged entry, or after a single-token entry "
           "(with merged entries further back).", "",
           "| task | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
  for name, r in gen_tasks.items():
    row = [fmt(r["hamburger"][ckey(c)].get(f"diverge_{k}")) for c in cs
           for k in DIVERGENCE_KINDS]
    lines.append(f"| {name} | " + " | ".join(row) + " |")
  return lines


def _speed_table(gen_tasks: dict[str, Any], cs: Sequence[float]) -> list[str]:
  lines = ["", "Decode tokens/s (whole batches):", "",
           "| task | base | " + " | ".join(f"HAMburger @ {c:g}" for c in cs) + " |",
           "|---|---|" + "---|" * len(cs)]
  for name, r in gen_tasks.items():
    lines.append(f"| {name} | {r['base']['tokens_per_s']:.1f} | " + " | ".join(
        f"{r['hamburger'][ckey(c)]['tokens_per_s']:.1f}" for c in cs) + " |")
  return lines


def _verify_table(gen_tasks: dict[str, Any]) -> list[str]:
  """Verify mode, where it ran: its tokens are the base's (identical: the share of answers),
  several a forward."""
  rows = {n: r["verify"] for n, r in gen_tasks.items() if "verify" in r}
  if not rows:
    return []
  lines = ["", "Verify mode (the base's tokens, the micro decoder's drafts checked by the base): "
           "answers identical to the base's, score, tokens a base forward, decode tok/s against "
           "the base's:", "", "| task | identical | score | tokens/forward | speed ratio |",
           "|---|---|---|---|---|"]
  for n, v in rows.items():
    lines.append(f"| {n} | {v['identical']:.1%} | {fmt(v['score'])} | "
                 f"{v['tokens_per_forward']:.2f} | {v['speed_ratio']:.2f}x |")
  return lines


def _nll_table(r: dict[str, Any]) -> list[str]:
  h = r["hamburger"]
  accs = sorted((n for n in h if n.startswith("acc_s")), key=lambda n: int(n[5:]))
  return ["", f"Teacher-forced NLL on {r['data']} ({r['split']}, {r['n']} records, "
          f"{r['tokens']} response tokens; nats/token, lower is better):", "",
          "| base NLL | HAMburger NLL | base acc | " + " | ".join(accs) +
          " | stop acc | data tokens/group |", "|---|---|---|" + "---|" * (len(accs) + 2),
          f"| {fmt(r['base']['score'])} | {fmt(h['score'])} | "
          f"{fmt(r['base']['accuracy'])} | " + " | ".join(fmt(h[a]) for a in accs) +
          f" | {fmt(h.get('stop_acc'))} | {r['data_kv_compression']:.2f} |"]


def _teacher_agreement_table(agree: dict[str, Any] | None) -> list[str]:
  if agree and "skipped" in agree:
    return ["", f"Teacher agreement: not measured ({agree['skipped']})."]
  if not agree:
    return []
  names = [n for n in agree if n != "groups"]
  return ["", "Teacher-forced agreement of HAMburger's micro-step argmax with the teacher's "
          "greedy token (the base on the unmerged sequence, stored in the data): merged / "
          "unmerged = the first token of groups predicted from a merged / an unmerged "
          "entry; s_i = micro step i of each group's window (in parentheses: the groups "
          "counted).",
          "", "| " + " | ".join(names) + " |", "|" + "---|" * len(names),
          "| " + " | ".join(f"{fmt(agree[n])} ({agree['groups'][n]})" for n in names) +
          " |"]


def _teacher_acceptance_table(accept: dict[str, Any] | None) -> list[str]:
  if not accept:
    return []
  tags = sorted({n.rsplit("_", 1)[1] for n in accept}, key=lambda t: int(t[1:]))
  return ["", "Teacher-forced acceptance: what decoding at each confidence would do on "
          "these windows, without generating (tokens per macro step; share of the "
          "accepted micro-step tokens that are the teacher's greedy token).", "",
          "| confidence | " + " | ".join(f"{int(t[1:]) / 100:g}" for t in tags) + " |",
          "|---|" + "---|" * len(tags),
          "| tokens per step | " + " | ".join(
              fmt(accept[f"tf_tokens_per_step_{t}"]) for t in tags) + " |",
          "| accepted tokens that are the base's | " + " | ".join(
              fmt(accept[f"tf_accepted_agree_{t}"]) for t in tags) + " |"]


def _verify_drafts_table(drafts: dict[str, Any] | None) -> list[str]:
  if not drafts:
    return []
  steps = list(drafts["agree"])
  return ["", f"Verify mode's drafts ({drafts['drafter']}), teacher-forced from the base's exact "
          "features (a plain context, as verify drafts): the share of draft i that is the "
          "base's greedy token (in parentheses: the windows counted).", "",
          "| " + " | ".join(f"draft {int(n[1:]) - 1}" for n in steps) + " | KL |",
          "|" + "---|" * (len(steps) + 1),
          "| " + " | ".join(f"{fmt(drafts['agree'][n])} ({drafts['groups'][n]})" for n in steps)
          + f" | {fmt(drafts['kl'])} |"]
