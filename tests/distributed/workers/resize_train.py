"""Worker: real pretrain_gpt / pretrain_vit training runs with ZERO-resizing, several per launch.

    torchrun --nproc_per_node 2 resize_train.py --out DIR --job gpt=gpt:"--resize.selection random" \
        --job vit=vit:"--resize.selection priority" -- <common config overrides>

Each run (in order, regrouping the same processes) is what `pretrain(cfg, SPEC)` does: `setup()` then
`Trainer.train()` (the script's defaults for vit), with the common overrides plus its own. The plan
in force at every training step is recorded. Rank 0 saves DIR/<name>.pt = {
    history: the logging rank's per-step records (loss, ..., val_* at the end),
    ranks: {(dp, tp): {metrics: controller.metrics(), plans: [plan dict per step],
                       flops: {block: executed forward FLOPs}, losses: [per-step loss]}}}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from jobargs import parse_jobs
from megatron.core import parallel_state as ps

import pretrain_gpt
import pretrain_vit
from megahet.config import load_config
from megahet.runtime.resizer import ResizeController
from megahet.training import setup


def run(name: str, task: str, argv: list[str], out: Path) -> None:
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    module = pretrain_gpt if task == "gpt" else pretrain_vit
    defaults = pretrain_vit.default_config() if task == "vit" else None
    trainer = setup(load_config(argv, defaults=defaults), module.SPEC)
    (controller,) = [hook for hook in trainer.step_hooks if isinstance(hook, ResizeController)]
    executor = controller.executor
    plans = []  # the plan in force at every training step
    before_forward_backward = controller.before_forward_backward

    def recording(step: int) -> None:
        before_forward_backward(step)
        plans.append(executor.plan.to_dict())

    controller.before_forward_backward = recording
    history = trainer.train()
    trainer.logger.close()

    layout = trainer.layout
    mine = {
        "metrics": controller.metrics(),
        "plans": plans,
        "flops": {str(key): block.executed_flops for key, block in executor.blocks.items()},
        "losses": [r["loss"] for r in history],
        "history": history if layout.is_logging_rank else None,
    }
    items = [None] * dist.get_world_size() if layout.rank == 0 else None
    dist.gather_object(((layout.dp_rank, layout.tp_rank), mine), items, dst=0)
    if layout.rank == 0:
        ranks = dict(items)
        history = next(item["history"] for item in ranks.values() if item["history"] is not None)
        torch.save({"history": history, "ranks": ranks}, out / f"{name}.pt")


def main(argv: list[str]) -> None:
    args, jobs = parse_jobs(argv, ["task"])
    for name, (task,), overrides in jobs:
        run(name, task, overrides, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
