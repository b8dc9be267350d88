"""The accuracy study's plots (benchmarks/accuracy_study.py writes them after its table): accuracy or
perplexity against the straggler skew, and against training time.

    from benchmarks.accuracy_plots import plot
    plot(rows, out_folder)   # accuracy_vs_skew.png, accuracy_vs_time.png (needs matplotlib)
"""

from __future__ import annotations

import math
from pathlib import Path

METRIC = {"vit": "val_acc", "gpt": "val_ppl"}


def plot(rows: list[dict], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots")
        return
    labels = list(dict.fromkeys(r["label"] for r in rows if r["method"] != "baseline"))
    style = {label: {"color": f"C{i}", "marker": "osD^vP*X"[i % 8]} for i, label in enumerate(labels)}
    plot_skew(plt, rows, style, out / "accuracy_vs_skew.png")
    plot_time(plt, rows, style, out / "accuracy_vs_time.png")


def plot_skew(plt, rows: list[dict], style: dict, path: Path) -> None:
    """Accuracy (perplexity) against the slowdown of one straggler, and against the number of 4x
    stragglers (over every TP size: a model is the same function of its seed at any TP size)."""
    panels = []
    for model in dict.fromkeys(r["model"] for r in rows):
        panels.append((model, "slowdown", lambda r: r["stragglers"] == 1))
        if any(r["model"] == model and r["stragglers"] > 1 for r in rows):
            panels.append((model, "stragglers", lambda r: r["stragglers"] >= 1 and r["slowdown"] == 4))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False)
    for ax, (model, axis, keep) in zip(axes[0], panels):
        metric, mine = METRIC[model], [r for r in rows if r["model"] == model]
        base = min((r for r in mine if r["method"] == "baseline"), key=lambda r: r["tp"], default=None)
        points = [r for r in mine if keep(r)]
        for label, line in style.items():
            pts = sorted((r[axis], r[metric]) for r in points if r["label"] == label)
            if base is not None and pts:
                pts.insert(0, (1 if axis == "slowdown" else 0, base[metric]))
            if len(pts) > 1:
                ax.plot(*zip(*pts), label=label, markersize=5, alpha=0.85, **line)
        tps = "/".join(str(tp) for tp in sorted({r["tp"] for r in points}))
        what = "slowdown of one straggler" if axis == "slowdown" else "number of 4x stragglers"
        ax.set(xlabel=what, ylabel=metric, title=f"{model.upper()}, TP={tps}")
        if axis == "slowdown":
            ax.set_xscale("log", base=2)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_time(plt, rows: list[dict], style: dict, path: Path) -> None:
    """Accuracy (perplexity) against training time, one panel per arm x profile, the baseline dashed."""
    panels = list(dict.fromkeys((r["model"], r["tp"], r["profile"]) for r in rows if r["profile"] != "none"))
    cols = min(3, len(panels))
    fig, axes = plt.subplots(
        math.ceil(len(panels) / cols),
        cols,
        figsize=(4.4 * cols, 3.3 * math.ceil(len(panels) / cols)),
        squeeze=False,
    )
    for ax, (model, tp, profile) in zip(axes.flat, panels):
        metric = METRIC[model]
        for r in rows:
            if (r["model"], r["tp"]) == (model, tp) and r["profile"] in (profile, "none"):
                _, times, values, _ = zip(*r["curve"])
                line = (
                    {"color": "black", "linestyle": "--", "marker": "."}
                    if r["method"] == "baseline"
                    else style[r["label"]]
                )
                ax.plot(times, values, label=r["label"], markersize=4, **line)
        ax.set_xlabel("training time (s)")
        ax.set_ylabel(metric)
        ax.set_title(f"{model.upper()} TP={tp}, {profile}")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
