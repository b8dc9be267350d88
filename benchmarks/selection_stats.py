"""Priority against random selection in the accuracy study's rows: per arm x profile, the paired means
over the seeds that ran both, the per-seed differences, their mean and its standard error, and the
differences pooled over every cell. Pure functions over the study's row dicts; used by
benchmarks/accuracy_study.py and benchmarks/priority_ablation.py.

Each cell also says whether its mean is resolved (a two-sided paired t-test at 5 %: the mean more than
t(0.975, pairs - 1) standard errors from zero) and how many seeds would resolve the study's resolution
with 80 % power at the measured spread: for a goal of the form "priority >= random", a mean inside the
noise is not evidence either way.
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
Z_POWER = 1.96 + 0.8416  # normal quantiles: 5 % two-sided test, 80 % power
T_95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)  # fmt: skip
"""Student's t, 97.5 % quantile, for 1..30 degrees of freedom (beyond: 2.042, slightly conservative)."""


def t_critical(pairs: int) -> float:
    """The paired t-test's two-sided 5 % threshold, in standard errors, for `pairs` differences."""
    if pairs < 2:
        raise ValueError(f"a t-test needs at least 2 pairs, got {pairs}")
    return T_95[min(pairs - 1, len(T_95)) - 1]


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
        metric, random_mean = METRIC[model], sum(rnd) / len(seeds)
        out.append(
            {
                "model": model,
                "tp": tp,
                "profile": profile,
                "metric": metric,
                "seeds": ",".join(map(str, seeds)),
                "random": random_mean,
                "priority": sum(pri) / len(seeds),
                "differences": " ".join(f"{d:+.4g}" for d in diffs),
                "difference": statistics.fmean(diffs),
                "se": standard_error(diffs),
                "verdict": verdict(metric, diffs),
                "seeds_needed": seeds_needed(diffs, resolution(metric, random_mean)),
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
    """'priority better' / 'priority worse' when a paired t-test at 5 % (two-sided) rejects "no
    difference" (perplexity: lower is better), else 'within noise' (also for a single pair)."""
    se = standard_error(diffs)
    gain = statistics.fmean(diffs) * (1 if metric == "val_acc" else -1)
    if math.isnan(se) or abs(gain) <= t_critical(len(diffs)) * se:
        return "within noise"
    return "priority better" if gain > 0 else "priority worse"


def seeds_needed(diffs: list[float], resolution: float) -> int | None:
    """Paired seeds that resolve a true difference of `resolution` with 80 % power (5 % two-sided) at the
    measured spread: ((1.96 + 0.84) sd / resolution)^2, rounded up (normal approximation; None for fewer
    than two pairs). It depends on the spread, not on the cell's mean."""
    if len(diffs) < 2:
        return None
    return max(2, math.ceil((Z_POWER * statistics.stdev(diffs) / resolution) ** 2 - 1e-9))


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
