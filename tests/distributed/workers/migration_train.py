"""Worker: real pretrain_gpt / pretrain_vit training runs with lightweight migration, several per launch.

    torchrun --nproc_per_node 8 migration_train.py --out DIR \
        --job base=gpt:plain:"--resize.enabled true" --job m50=gpt:plain:"--resize.migrate 0:0.5" \
        -- <common config overrides>

Each job (in order, regrouping the same processes) runs `setup()` and then `train_iters` calls of
`Trainer.train_step()` followed by one `Trainer.evaluate()`. Modes:
- plain: the configured plan (resize.gamma / resize.migrate) as the controller builds it;
- schedule: the plan changes in the middle of the run (see SCHEDULE_MOVES / HAND_PLANS below):
  migrate, move back, migrate to other helpers (new `controller.moves` at reselection steps) and a
  hand-written plan applied between steps with `executor.apply()` (bidirectional swaps, scattered units).

Rank 0 saves DIR/<name>.pt = {(dp, tp): {
    steps: [{plan, changed, bytes_plan_change, loss, grad_norm, bytes_step}] per step,
    init, final: {parameter name: this rank's shard}, flops: {block name: executed forward FLOPs},
    units: {block name: units per rank}, metrics: controller.metrics(), val: evaluate() summary,
    hidden, head_dim, seq, global_batch, has_bias}}.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from jobargs import parse_jobs
from megatron.core import parallel_state as ps

import pretrain_gpt
import pretrain_vit
from megahet.config import load_config
from megahet.runtime.resizer import ResizeController
from megahet.tensor_parallel.plan import ResizePlan, block_name
from megahet.training import setup

# schedule mode (DP=2, TP=4, reselect_interval 3): controller.moves set before these steps' reselection
SCHEDULE_MOVES = {
    3: {},  # move everything back
    6: {(0, 2): (0.85, (0,)), (1, 1): (0.5, (3,))},  # other owners, other helpers, per replica
    9: {(0, 1): (0.5, (0, 2)), (1, 0): (0.85, (3, 1))},
    12: {(0, 3): (0.5, (1,)), (1, 3): (0.5, (0, 1, 2))},
}
_SWAP = {  # scattered units, two owners swapping units with each other, both replicas differently
    "migrated": {
        f"{kind}:{layer}": {
            "0,0": {"3": [1, 5, 9], "1": [60]} if kind == "mlp" else {"1": [1]},
            "0,1": {"0": [0, 2]} if kind == "mlp" else {"0": [0]},
            "1,1": {"2": [63]} if kind == "mlp" else {"3": [1]},
            "1,2": {"1": [10, 11], "0": [40]} if kind == "mlp" else {},
        }
        for kind in ("mlp", "attn")
        for layer in (1, 2)
    }
}
HAND_PLANS = {7: ResizePlan.from_dict(_SWAP), 13: ResizePlan.from_dict(_SWAP)}


def shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def run(name: str, task: str, mode: str, argv: list[str], out: Path) -> None:
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    module = pretrain_gpt if task == "gpt" else pretrain_vit
    defaults = pretrain_vit.default_config() if task == "vit" else None
    t0 = time.perf_counter()
    cfg = load_config(argv, defaults=defaults)
    trainer = setup(cfg, module.SPEC)
    t1 = time.perf_counter()
    (controller,) = [hook for hook in trainer.step_hooks if isinstance(hook, ResizeController)]
    executor = controller.executor
    exchange = executor.exchange
    layout = trainer.layout
    init = shards(trainer.task.model)
    steps: list[dict] = []
    before_forward_backward = controller.before_forward_backward

    def recording(step: int) -> None:
        previous = executor.plan
        if mode == "schedule" and step in SCHEDULE_MOVES:
            controller.moves = SCHEDULE_MOVES[step]
            controller.request_replan()  # as the balancer's set_targets does
        before_forward_backward(step)
        if mode == "schedule" and step in HAND_PLANS:
            executor.apply(HAND_PLANS[step])
        changed = executor.plan is not previous
        steps.append(
            {
                "plan": executor.plan.to_dict(),
                "changed": changed,
                "bytes_plan_change": exchange.bytes_plan_change if changed else None,
            }
        )

    controller.before_forward_backward = recording
    for _ in range(cfg.train.train_iters):
        record = trainer.train_step()
        steps[-1].update(
            loss=record["loss"], grad_norm=record["grad_norm"], bytes_step=exchange.bytes_last_step
        )
    t2 = time.perf_counter()
    metrics = controller.metrics()
    val = trainer.evaluate()
    trainer.logger.close()

    model = trainer.task.model
    attention = next(b.attention for b in executor.blocks.values() if b.attention is not None)
    mine = {
        "steps": steps,
        "init": init,
        "final": shards(model),
        "flops": {block_name(k): b.executed_flops for k, b in executor.blocks.items()},
        "units": {block_name(k): n for k, n in executor.block_units.items()},
        "metrics": metrics,
        "val": val,
        "hidden": cfg.model.hidden_size,
        "head_dim": attention.hidden_size_per_attention_head,
        "seq": trainer.task.seq_length,
        "global_batch": cfg.train.global_batch_size,
        "has_bias": all(b.column.bias is not None for b in executor.blocks.values()),
    }
    items = [None] * dist.get_world_size() if layout.rank == 0 else None
    dist.gather_object(((layout.dp_rank, layout.tp_rank), mine), items, dst=0)
    if layout.rank == 0:
        torch.save(dict(items), out / f"{name}.pt")
        print(
            f"migration_train {name}: setup {t1 - t0:.1f} s, {len(steps)} steps {t2 - t1:.1f} s", flush=True
        )


def main(argv: list[str]) -> None:
    args, jobs = parse_jobs(argv, ["task", "mode"])
    for name, (task, mode), overrides in jobs:
        run(name, task, mode, overrides, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
