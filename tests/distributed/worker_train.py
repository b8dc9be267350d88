"""Worker: real `pretrain()` runs of pretrain_gpt's SPEC, one or more per launch, results saved.

    torchrun --nproc_per_node 2 worker_train.py --out DIR --variant z1="--parallel.zero_stage 1" \
        --variant z2="--parallel.zero_stage 2" [--load-init FILE] -- <common config overrides>

Each variant (in order, regrouping the same processes) calls `pretrain(cfg, SPEC)` with the common
overrides plus its own. With --load-init, the unsharded initial weights in FILE (global names, as
saved by an earlier TP=1 PP=1 run) are loaded into every stage / shard before the engine is built.
Rank 0 saves DIR/<run>.pt = {
    history: the logging rank's per-step records (loss, grad_norm, lr, val_loss at the end),
    losses: {(dp, pp, tp): [per-step loss]} of every last-stage rank,
    stage_layers: {pp_rank: transformer layers the stage built (the last build: after any re-split)},
    init, final: {dp_rank: {global name: full tensor}} (parameters before and after training)}.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.transformer.transformer_layer import TransformerLayer
from workerlib import gather_replicas, loading_spec, reset_model_parallel, stage_tensors

import pretrain_gpt
from megahet.config import load_config
from megahet.parallel import current_layout
from megahet.training import pretrain


def run(name: str, argv: list[str], out: Path, init: dict | None) -> None:
    reset_model_parallel()
    cfg = load_config(argv)
    built: list = []
    history = pretrain(cfg, loading_spec(pretrain_gpt.SPEC, init, built))

    task, initial = built[-1][0], built[0][1]  # a re-split builds again: the last build trained on
    layout = current_layout()
    final = gather_replicas(stage_tensors(task.model, "data"))
    start = gather_replicas(initial)
    losses = [r["loss"] for r in history] if layout.is_last_stage else None
    layers = sum(1 for m in task.model.modules() if isinstance(m, TransformerLayer))
    items = [None] * dist.get_world_size() if layout.rank == 0 else None
    dist.gather_object((layout, losses, history, layers), items, dst=0)
    if layout.rank != 0:
        return
    result = {"init": start, "final": final, "losses": {}, "history": None, "stage_layers": {}}
    for where, item_losses, item_history, item_layers in items:
        result["stage_layers"][where.pp_rank] = item_layers
        if item_losses is not None:
            result["losses"][(where.dp_rank, where.pp_rank, where.tp_rank)] = item_losses
        if where.is_logging_rank:
            result["history"] = item_history
    torch.save(result, out / f"{name}.pt")


def main(argv: list[str]) -> None:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--variant", action="append", required=True, help="NAME=extra overrides")
    parser.add_argument("--load-init", help="torch file of unsharded initial weights by global name")
    args = parser.parse_args(argv[:split])
    common = argv[split + 1 :]
    init = torch.load(args.load_init, weights_only=True) if args.load_init else None
    for spec in args.variant:
        name, _, extra = spec.partition("=")
        run(name, common + shlex.split(extra), args.out, init)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
