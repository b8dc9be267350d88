"""Step time with 50 % migration vs a plain step, and the bytes migration moves, for the default GPT.

    torchrun --nproc_per_node 4 benchmarks/migration_step.py [--steps 60] [--fraction 0.5] [-- --section.key v ...]

One run of the main job's model (examples/cpu/gpt_tp2_pp2.yaml: TP=2 x PP=2, gloo) that alternates,
every `--period` steps, between the plain plan and TP rank 0 migrating `--fraction` of its units to
TP rank 1, so both modes see the same machine noise; the first step after each switch (it carries
the plan change) is left out of the medians. Writes benchmarks/results/migration_step.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist

import pretrain_gpt
from benchmarks.common import save_results
from megahet.config import load_config
from megahet.training import setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--period", type=int, default=5)
    parser.add_argument("--fraction", type=float, default=0.5)
    args, overrides = parser.parse_known_args()
    overrides = [a for a in overrides if a != "--"]
    base = f"--logging.wandb false --train.train_iters {args.steps} --resize.migrate 0:{args.fraction}"
    base += f" --resize.reselect_interval {args.period}"
    cfg = load_config(["--config", str(ROOT / "examples/cpu/gpt_tp2_pp2.yaml"), *base.split(), *overrides])
    trainer = setup(cfg, pretrain_gpt.SPEC)
    controller = trainer.step_hooks[0]
    moves = controller.moves
    times = {"plain": [], "migrate": []}
    step_bytes, plan_bytes = [], []
    for step in range(args.steps):
        mode = "migrate" if (step // args.period) % 2 else "plain"
        controller.moves = moves if mode == "migrate" else {}
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step()
        elapsed = time.perf_counter() - t0
        if step % args.period:
            times[mode].append(elapsed)
        exchange = controller.executor.exchange
        if mode == "migrate":
            step_bytes.append(exchange.bytes_last_step)
            if step % args.period == 0:
                plan_bytes.append(exchange.bytes_plan_change)
    # Bytes are per rank: report the owner's (TP rank 0) and the step time as every rank sees it.
    stats = [
        statistics.median(times["plain"]),
        statistics.median(times["migrate"]),
        max(step_bytes),
        max(plan_bytes),
    ]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats)
    if dist.get_rank() == 0:
        plain = max(g[0] for g in gathered)
        migrate = max(g[1] for g in gathered)
        row = {
            "fraction": args.fraction,
            "plain_step_s": plain,
            "migrate_step_s": migrate,
            "ratio": migrate / plain,
            "mb_per_step_max_rank": max(g[2] for g in gathered) / 2**20,
            "mb_per_plan_change_max_rank": max(g[3] for g in gathered) / 2**20,
        }
        save_results("migration_step", [row], list(row), {"steps": args.steps, "period": args.period})


if __name__ == "__main__":
    main()
