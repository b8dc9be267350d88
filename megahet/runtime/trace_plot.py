"""Draw a balancer trace (`--balance.trace run.jsonl`): per-rank step time and plan over the run.

Role: reporting (draws a balancer trace; no training state).

    python tools/plot_balance.py run.jsonl [--out run.png] [--dp 0]

Three panels, one line per TP rank of one DP replica: compute (busy) time per step with the step
time in black; the plan as each rank's work in units of its own shard (1 - dropped - sent + hosted;
dropped units dashed); the estimated speed, with the step's compute efficiency in black.

A data-parallel trace (run_dp.jsonl, written with hetero.dp_shares) draws as three panels too
(`plot_dp_trace`): the step time, each replica's estimated speed, and its share of the global batch;
a pipeline trace (run_pp.jsonl, hetero.pp_split) likewise (`plot_pp_trace`): each stage's measured speed
per layer and its layers.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_trace(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"balance trace {path} does not exist: run with --balance.trace {path}")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(
                f"balance trace {path} line {number} is not JSON: is the run still writing it?"
            ) from None
    if not rows:
        raise ValueError(f"balance trace {path} is empty: the run logged no step")
    return rows


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, png: str | Path) -> Path:
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    fig.clf()
    return png


def plot_trace(trace: str | Path, png: str | Path, dp: int = 0, title: str | None = None) -> Path:
    plt = _pyplot()
    rows = read_trace(trace)
    tp_size = len(rows[0]["busy_s"][dp])
    steps = [r["step"] for r in rows]
    fig, (ax_time, ax_plan, ax_speed) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    colors = plt.get_cmap("tab10")
    ax_time.plot(steps, [r["step_s"] for r in rows], color="black", label="step")
    for tp in range(tp_size):
        color = colors(tp % 10)
        ax_time.plot(steps, [r["busy_s"][dp][tp] for r in rows], color=color, label=f"TP {tp} compute")
        work = [1 - r["dropped"][dp][tp] - r["sent"][dp][tp] + r["hosted"][dp][tp] for r in rows]
        ax_plan.plot(steps, work, color=color, label=f"TP {tp}")
        ax_plan.plot(steps, [r["dropped"][dp][tp] for r in rows], color=color, linestyle="--")
        speeds = [r["speed"][dp][tp] if r["speed"][dp] else float("nan") for r in rows]
        ax_speed.plot(steps, speeds, color=color)
    ax_speed.plot(steps, [r["efficiency"][dp] for r in rows], color="black", label="compute efficiency")
    ax_time.set_ylabel("seconds")
    ax_time.legend(fontsize=7, ncol=2)
    ax_plan.set_ylabel("work (own units = 1)\n-- dropped")
    ax_plan.legend(fontsize=7, ncol=4)
    ax_speed.set_ylabel("estimated speed")
    ax_speed.set_ylim(0, 1.1)
    ax_speed.legend(fontsize=7)
    ax_speed.set_xlabel("step")
    ax_time.set_title(title or f"{Path(trace).name}: DP replica {dp}")
    png = _save(fig, png)
    plt.close(fig)
    return png


def plot_dp_trace(trace: str | Path, png: str | Path, title: str | None = None) -> Path:
    """Step time, each replica's estimated speed and its share (micro-batches of the global batch)."""
    return _plot_groups(
        trace, png, title or f"{Path(trace).name}: data-parallel shares",
        ("shares", "replica_speed", "DP {}"), ("estimated replica speed", "micro-batches per step"),
    )  # fmt: skip


def plot_pp_trace(trace: str | Path, png: str | Path, title: str | None = None) -> Path:
    """Step time, each pipeline stage's measured speed per layer and its layers (re-splits as steps)."""
    return _plot_groups(
        trace, png, title or f"{Path(trace).name}: pipeline stages",
        ("split", "stage_speed", "stage {}"), ("measured speed per layer", "transformer layers"),
    )  # fmt: skip


def plot_packing_trace(trace: str | Path, png: str | Path, title: str | None = None) -> Path:
    """Packed documents: step time; each replica's predicted (dashed) and measured (solid) seconds; its tokens
    and, on the right axis, its sum of squared document lengths (what attention costs)."""
    plt = _pyplot()
    rows = read_trace(trace)
    steps = [r["step"] for r in rows]
    fig, (ax_time, ax_pred, ax_tokens) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    colors = plt.get_cmap("tab10")
    ax_time.plot(steps, [r["step_s"] for r in rows], color="black", label="step")
    ax_squares = ax_tokens.twinx()
    for replica in range(len(rows[0]["tokens"])):
        color, label = colors(replica % 10), f"DP {replica}"
        ax_pred.plot(steps, [r["measured_s"][replica] for r in rows], color=color, label=f"{label} measured")
        ax_pred.plot(
            steps, [r["predicted_s"][replica] for r in rows], color=color, ls="--", label=f"{label} predicted"
        )
        ax_tokens.plot(steps, [r["tokens"][replica] for r in rows], color=color, label=f"{label} tokens")
        ax_squares.plot(
            steps, [r["sum_sq"][replica] for r in rows], color=color, ls=":", label=f"{label} sum s^2"
        )
    ax_time.set_ylabel("seconds")
    ax_time.legend(fontsize=7)
    ax_pred.set_ylabel("replica seconds")
    ax_pred.set_ylim(bottom=0)
    ax_pred.legend(fontsize=7, ncol=4)
    ax_tokens.set_ylabel("tokens")
    ax_squares.set_ylabel("sum of s^2 (dotted)")
    ax_tokens.set_ylim(bottom=0)
    ax_tokens.legend(fontsize=7, ncol=4)
    ax_tokens.set_xlabel("step")
    fig.suptitle(title or f"{Path(trace).name}: packed documents")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


def _plot_groups(trace, png, title: str, keys: tuple[str, str, str], ylabels: tuple[str, str]) -> Path:
    """Three panels over the steps: the step time; per group (replica, stage) its speed (`keys[1]`) and
    what it holds (`keys[0]`: micro-batches, layers), labelled `keys[2]`.format(group)."""
    plt = _pyplot()
    rows = read_trace(trace)
    held, speed, label = keys
    steps = [r["step"] for r in rows]
    fig, (ax_time, ax_speed, ax_held) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    colors = plt.get_cmap("tab10")
    ax_time.plot(steps, [r["step_s"] for r in rows], color="black", label="step")
    for group in range(len(rows[0][held])):
        color = colors(group % 10)
        speeds = [r[speed][group] if r[speed] else float("nan") for r in rows]
        ax_speed.plot(steps, speeds, color=color, label=label.format(group))
        ax_held.step(
            steps, [r[held][group] for r in rows], where="post", color=color, label=label.format(group)
        )
    ax_time.set_ylabel("seconds")
    ax_time.legend(fontsize=7)
    ax_speed.set_ylabel(ylabels[0])
    ax_speed.set_ylim(0, 1.1)
    ax_speed.legend(fontsize=7, ncol=4)
    ax_held.set_ylabel(ylabels[1])
    ax_held.set_ylim(bottom=0)
    ax_held.legend(fontsize=7, ncol=4)
    ax_held.set_xlabel("step")
    ax_time.set_title(title)
    png = _save(fig, png)
    plt.close(fig)
    return png
