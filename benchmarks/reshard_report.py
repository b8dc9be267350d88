"""The tables and plot of benchmarks/reshard_cost.py (issue 32): rows per change and path from the ranks'
measurements, and the plot of time and peak memory against model size, extrapolated to 7 B and 70 B.

    rows = _rows("100M", {"resplit": ..., "elastic": ...}, layers=8)   # what reshard_cost's workers wrote
    _plot(rows, Path("benchmarks/results/reshard_cost.png"))
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path


def _rows(size: str, result: dict, layers: int = 8) -> list[dict]:
    """Table rows: per change and path, the slowest rank's time and the worst peak against own shard (rank
    0's path only where it ran)."""
    mib = 2**20
    rs, el = result["resplit"], result["elastic"]
    ranks = rs["ranks"]
    base = {"size": size, "layers": layers, "ranks": rs.get("world", 4), "params_M": rs["params"] / 1e6}
    shard = max(r["shard"] for r in ranks)
    minimum = ranks[0]["new"]["bytes_minimum"]

    def worst(rs: list[dict], path: str, key: str) -> float:
        return max(r[path][key] for r in rs)

    def peak(rs: list[dict], path: str) -> float:
        return max(r[path]["peak_rss"] - r[path]["rss_before"] for r in rs)

    rows = []
    if ranks[0]["old"] is not None:
        parts = " + ".join(
            f"{part} {worst(ranks, 'old', part + '_s'):.2f}" for part in ("save", "reshard", "build")
        )
        rows.append({
            **base, "change": "re-split 1 layer", "path": "rank 0 (save, merge, load)",
            "time_s": worst(ranks, "old", "total_s"), "parts": parts, "peak_extra_MiB": peak(ranks, "old") / mib,
            "shard_MiB": shard / mib, "peak_over_shard": peak(ranks, "old") / shard,
            "bytes_MiB": 2 * ranks[0]["old"]["disk_bytes"] / mib, "minimum_MiB": minimum / mib,
        })  # fmt: skip
    # the plan's re-splits, each part the slowest rank's; over repeats, medians (the peak: the worst)
    runs = [r["new"].get("repeats", [r["new"]]) for r in ranks]  # [rank][repeat]

    def each(key: str) -> list[float]:
        return [max(run[key] for run in repeat) for repeat in zip(*runs)]

    def median(key: str) -> float:
        return statistics.median(each(key))

    ratios = [t / r for t, r in zip(each("transfer_s"), each("raw_send_s"))]
    parts = f"plan {median('plan_s'):.2f} + transfer {median('transfer_s'):.2f} (plain send {median('raw_send_s'):.2f}: "
    parts += f"x{statistics.median(ratios):.1f}" + (
        f", x{min(ratios):.1f}-{max(ratios):.1f} over {len(ratios)}" if len(ratios) > 1 else ""
    )
    build, copy = median("build_s"), median("shard_copy_s")
    parts += f") + build {build:.2f} ({build / copy:.1f} copies of the own shard)"
    peak_new = max(run["peak_rss"] - run["rss_before"] for rank in runs for run in rank)
    rows.append({
        **base, "change": "re-split 1 layer", "path": "plan (rank to rank)", "time_s": median("total_s"),
        "parts": parts, "peak_extra_MiB": peak_new / mib, "shard_MiB": shard / mib,
        "peak_over_shard": peak_new / shard, "bytes_MiB": ranks[0]["new"]["bytes_moved"] / mib,
        "minimum_MiB": minimum / mib, "transfer_over_send": statistics.median(ratios), "repeats": len(ratios),
        "transfer_s": median("transfer_s"), "send_s": median("raw_send_s"), "build_s": build,
    })  # fmt: skip
    if el is None:
        return rows
    eranks = el["ranks"]
    eshard = max(r["shard"] for r in eranks)
    for path, key, label in (
        ("rank 0 (merge, write, load)", "old", "reshard"),
        ("plan (own slices)", "new", "read"),
    ):
        if eranks[0][key] is None:
            continue
        rows.append({
            **base, "change": "elastic 4 -> 2 ranks", "path": path, "time_s": worst(eranks, key, "total_s"),
            "parts": f"{label} {worst(eranks, key, label + '_s'):.2f} + build {worst(eranks, key, 'build_s'):.2f}",
            "peak_extra_MiB": peak(eranks, key) / mib, "shard_MiB": eshard / mib,
            "peak_over_shard": peak(eranks, key) / eshard, "bytes_MiB": float("nan"), "minimum_MiB": float("nan"),
        })  # fmt: skip
    for r in eranks:  # the read alone: what the rank holds beyond its process before the read
        r["read_over_shard"] = (r["new"]["read_peak_rss"] - r["new"]["read_rss_before"]) / r["shard"]
        r["read_anon_over_shard"] = (r["new"]["read_peak_anon"] - r["new"]["read_anon_before"]) / r["shard"]
    rows[-1]["parts"] += (
        f" (the read into the built engine: +{max(r['read_over_shard'] for r in eranks):.2f}x own shard, allocated "
        f"+{max(r['read_anon_over_shard'] for r in eranks):.2f}x, the rest mapped file pages)"
    )
    return rows


def _extrapolated(ax, pts: list[tuple[float, float]], style: str, label: str, targets) -> None:
    """Measured points and their straight-line fit (fixed + per-parameter cost), drawn out to `targets`."""
    import numpy as np

    x, y = (np.array(v) for v in zip(*pts))
    slope, intercept = np.polyfit(x, y, 1)
    ax.loglog(x, y, style, label=f"{label}: measured")
    xs = np.concatenate([x, targets])
    ax.loglog(
        xs, np.maximum(intercept + slope * xs, 1e-3), ":", label=f"{label}: {slope * 1e9:.3g} per G params"
    )


def _plot_parts(ax, rows: list[dict], targets) -> None:
    """The plan's re-split in parts against the model size: its transfer beside a plain send of the same
    bytes, and its rebuild (the fixed part)."""
    plan = [r for r in rows if r["change"] == "re-split 1 layer" and r["path"].startswith("plan")]
    for key, style, label in (
        ("transfer_s", "s-", "transfer"),
        ("send_s", "^-", "plain send"),
        ("build_s", "d-", "rebuild"),
    ):
        pts = [(r["params_M"] * 1e6, max(r[key], 1e-3)) for r in plan if key in r]
        if len(pts) >= 2:
            _extrapolated(ax, pts, style, label, targets)
    ax.set_title("re-split 1 layer, parts (plan)")
    ax.set_xlabel("parameters")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)


def _plot(rows: list[dict], path: Path) -> None:
    """Time per change and path, and the peak memory beyond the process's own, against the model size,
    extrapolated to 7 B and 70 B parameters."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    targets = np.array([7e9, 70e9])
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    elastic = any(r["change"].startswith("elastic") for r in rows)
    panels = [
        ("re-split 1 layer", "time_s", "wall time (s)"),
        ("elastic 4 -> 2 ranks", "time_s", "wall time (s)") if elastic else ("parts", None, "seconds"),
        (None, "peak_extra_MiB", "peak memory beyond the process's, worst rank (MiB)"),
    ]
    for ax, (change, key, ylabel) in zip(axes, panels):
        if change == "parts":  # without the elastic case: the re-split's transfer, plain send and rebuild
            _plot_parts(ax, rows, targets)
            continue
        layer_counts = sorted({r.get("layers", 8) for r in rows})
        worlds = sorted({r.get("ranks", 4) for r in rows})
        for r_change in [change] if change else ["re-split 1 layer", "elastic 4 -> 2 ranks"]:
            ways = (("rank 0", "o-"), ("plan", "s-"))
            for (way, style), layers, world in itertools.product(ways, layer_counts, worlds):
                pts = [
                    (r["params_M"] * 1e6, max(r[key], 1e-3))
                    for r in rows
                    if r["change"] == r_change and r["path"].startswith(way)
                    and (r.get("layers", 8), r.get("ranks", 4)) == (layers, world)
                ]  # fmt: skip
                if len(pts) >= 2:
                    label = way if change else f"{r_change}, {way}"
                    label += f", {layers} layers" if len(layer_counts) > 1 else ""
                    label += f", {world} ranks" if len(worlds) > 1 else ""
                    _extrapolated(ax, pts, style, label, targets)
        ax.set_title(change or "memory")
        ax.set_xlabel("parameters")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
