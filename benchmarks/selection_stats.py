"""Priority against random selection in the accuracy study's rows: per arm x profile, the paired means
over the seeds that ran both, the per-seed differences, their mean and its standard error, and the
differences pooled over every cell. Pure functions over the study's row dicts; used by
benchmarks/accuracy_study.py and benchmarks/priority_ablation.py.

Each cell also says whether its mean is resolved (more than two standard errors from zero) and how many
seeds a verdict at the study's resolution would take at the measured spread: for a goal of the form
"priority >= random", a mean inside the noise is not evidence either way.
"""

from __future__ import annotations

import math
import statistics

from benchmarks.accuracy_plots import METRIC

SELECTION_COLUMNS = [
    "seeds",
    "random",
    "priority",
    "differences",
    "difference",
    "se",
    "verdict",
    "seeds_needed",
]
RESOLUTION = 0.005
"""The difference a verdict should resolve: half a point of accuracy (the SEMI goal's tolerance), or
0.5 % of random's perplexity."""
Z = 2.0  # standard errors that count as resolved (about 95 % two-sided)


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
                "verdict": verdict(METRIC[model], diffs),
                "seeds_needed": seeds_needed(diffs, resolution(METRIC[model], sum(rnd) / len(seeds))),
                "pairs": diffs,
            }
        )
    return out


def standard_error(values: list[float]) -> float:
    """Standard error of the mean (nan for fewer than two values)."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def resolution(metric: str, random_mean: float) -> float:
    """The smallest priority - random difference worth resolving, in the metric's units."""
    return RESOLUTION if metric == "val_acc" else RESOLUTION * random_mean


def verdict(metric: str, diffs: list[float]) -> str:
    """'priority better' / 'priority worse' when the mean difference is more than Z standard errors from
    zero (perplexity: lower is better), else 'within noise' (also for a single pair)."""
    se = standard_error(diffs)
    gain = statistics.fmean(diffs) * (1 if metric == "val_acc" else -1)
    if math.isnan(se) or abs(gain) <= Z * se:
        return "within noise"
    return "priority better" if gain > 0 else "priority worse"


def seeds_needed(diffs: list[float], resolution: float) -> int | None:
    """Paired seeds for a standard error of resolution / Z at the measured spread: (Z sd / resolution)^2,
    rounded up (None for fewer than two pairs)."""
    if len(diffs) < 2:
        return None
    return max(2, math.ceil((Z * statistics.stdev(diffs) / resolution) ** 2 - 1e-9))  # 32.000001 -> 32


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
