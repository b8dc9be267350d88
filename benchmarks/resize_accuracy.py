"""ViT (MNIST) validation accuracy under ZERO-resizing: gamma in {0, 0.25, 0.5} x random / priority selection.

    python benchmarks/resize_accuracy.py [--steps 300] [--imputation zero]

Each configuration is a real 2-rank TP=2 run of pretrain_vit.py (torchrun, gloo) with TP rank 0
resized by gamma, same seed and step budget for all. Writes benchmarks/results/resize_accuracy.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, save_results
from megahet.launch import torchrun_cmd

CONFIGS = [(0.0, "none"), (0.25, "random"), (0.25, "priority"), (0.5, "random"), (0.5, "priority")]


def run(gamma: float, selection: str, steps: int, imputation: str, port: int) -> dict:
    metrics = RESULTS / "resize_accuracy_runs" / f"g{gamma}_{selection}_{imputation}.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.unlink(missing_ok=True)
    cmd = [
        *torchrun_cmd(2, port),
        "pretrain_vit.py",
        "--parallel.tp",
        "2",
        "--train.train_iters",
        str(steps),
        "--train.eval_interval",
        str(steps),
        "--train.log_interval",
        "50",
        "--logging.wandb",
        "false",
        "--logging.metrics_file",
        str(metrics),
    ]
    if gamma > 0:
        cmd += [
            "--resize.gamma",
            f"0:{gamma}",
            "--resize.selection",
            selection,
            "--resize.imputation",
            imputation,
        ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    final = next(r for r in reversed(records) if "val_acc" in r)
    return {
        "gamma": gamma,
        "selection": selection,
        "imputation": imputation if gamma > 0 else "-",
        "val_acc": final["val_acc"],
        "val_loss": final["val_loss"],
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--imputation", default="zero", choices=["zero", "same", "average"])
    args = parser.parse_args()
    rows = []
    for i, (gamma, selection) in enumerate(CONFIGS):
        rows.append(run(gamma, selection, args.steps, args.imputation, 29700 + i))
        print(rows[-1], flush=True)
    columns = ["gamma", "selection", "imputation", "val_acc", "val_loss", "wall_s"]
    folder = save_results("resize_accuracy", rows, columns, {"steps": args.steps, "model": "vit tp2"})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    base = rows[0]["val_acc"]
    for selection in ("random", "priority"):
        pts = [(0.0, base)] + [(r["gamma"], r["val_acc"]) for r in rows if r["selection"] == selection]
        ax.plot(*zip(*pts), marker="o", label=selection)
    ax.set_xlabel("gamma of TP rank 0")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"ViT/MNIST, TP=2, {args.steps} steps, {args.imputation} imputation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "resize_accuracy.png", dpi=120)


if __name__ == "__main__":
    main()
