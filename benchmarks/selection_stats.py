"""Priority against random selection in the accuracy study's rows: per arm x profile, the paired means
over the seeds that ran both, the per-seed differences, their mean and its standard error, and the
differences pooled over every cell. Pure functions over the study's row dicts; used by
benchmarks/accuracy_study.py and benchmarks/priority_ablation.py.
"""

from __future__ import annotations

import math
import statistics

from benchmarks.accuracy_plots import METRIC

SELECTION_COLUMNS = ["seeds", "random", "priority", "differences", "difference", "se"]


def selection_comparison(rows: list[dict]) -> list[dict]:
    """Per arm x profile: random and priority resizing (zero imputation), averaged over the seeds that
    ran both (paired: the same seed gives both the same initialization and data order)."""
    cells: dict[tuple, dict[str, dict[int, float]]] = {}
    for r in rows:
        if r["method"] == "resize" and r["imputation"] == "zero":
            cell = cells.setdefault((r["model"], r["tp"], r["profile"]), {"random": {}, "priority": {}})
            cell[r["selection"]][r["seed"]] = r[METRIC[r["model"]]]
    out = []
    for (model, tp, profile), cell in cells.items():
        seeds = sorted(set(cell["random"]) & set(cell["priority"]))
        if not seeds:
            continue
        pri, rnd = ([cell[k][seed] for seed in seeds] for k in ("priority", "random"))
        diffs = [p - q for p, q in zip(pri, rnd)]
        out.append(
            {
                "model": model,
                "tp": tp,
                "profile": profile,
                "metric": METRIC[model],
                "seeds": ",".join(map(str, seeds)),
                "random": sum(rnd) / len(seeds),
                "priority": sum(pri) / len(seeds),
                "differences": " ".join(f"{d:+.4g}" for d in diffs),
                "difference": statistics.fmean(diffs),
                "se": standard_error(diffs),
                "pairs": diffs,
            }
        )
    return out


def standard_error(values: list[float]) -> float:
    """Standard error of the mean (nan for fewer than two values)."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def pooled_selection_lines(comparison: list[dict]) -> list[str]:
    """Priority - random over every paired seed of every cell, per metric: the noise the per-cell
    verdicts sit in (informational; the goal is per cell)."""
    lines = []
    for metric in sorted({c["metric"] for c in comparison}):
        diffs = [d for c in comparison if c["metric"] == metric for d in c["pairs"]]
        cells = sum(c["metric"] == metric for c in comparison)
        lines.append(
            f"- priority - random, {metric}, pooled over {len(diffs)} paired runs in {cells} cells: "
            f"{statistics.fmean(diffs):+.3g} (standard error {standard_error(diffs):.2g}; per-run "
            f"spread {statistics.stdev(diffs) if len(diffs) > 1 else math.nan:.2g})"
        )
    return lines
