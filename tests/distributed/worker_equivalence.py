"""Worker: logits, loss and gradients of one global batch under several TP x PP layouts, one launch.

    torchrun --nproc_per_node 4 worker_equivalence.py --task gpt --out DIR --phases 1x1,2x1,2x2 \
        -- --model.num_layers 4 ...            # config overrides for pretrain_gpt / pretrain_vit

For each phase TPxPP (in order, regrouping the same processes): setup() the real Trainer with that
layout, every DP replica reading the whole global batch; load the first phase's weights (the
unsharded reference) when the phase has PP > 1 (a pipelined model draws other random numbers);
run `Trainer.forward_backward()` (zero grads + megatron-core's schedule through the DeepSpeed
engine, tied embeddings reduced); run the schedule forward-only for the logits (TP-gathered).
Rank 0 saves DIR/<phase>.pt = {params, grads: {dp_rank: {global name: full tensor}},
losses: {dp_rank: [per micro-batch]}, logits: {dp_rank: tensor}}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from workerlib import full_batch_spec, gather_replicas, load_full_state, reset_model_parallel, stage_tensors

from megahet.config import load_config
from megahet.parallel import current_layout
from megahet.training import setup


def _capture(output: torch.Tensor):
    return output.sum() * 0.0, {"logits": output.detach().clone()}


def gpt_logits_step(data_iterator, model):
    batch = next(data_iterator)
    # No labels: the last stage returns vocab-parallel logits (b, s, vocab / TP).
    return model(batch["tokens"], batch["position_ids"], None), _capture


def vit_logits_step(data_iterator, model):
    batch = next(data_iterator)
    return model(batch["images"]), _capture  # (b, classes), replicated over TP


def task_module(name: str):
    if name == "gpt":
        import pretrain_gpt as module

        return module, gpt_logits_step, None
    import pretrain_vit as module

    return module, vit_logits_step, module.default_config


def run_phase(args, overrides: list[str], tp: int, pp: int, reference: dict | None) -> dict | None:
    module, logits_step, defaults = task_module(args.task)
    reset_model_parallel()
    cfg = load_config(
        overrides + ["--parallel.tp", str(tp), "--parallel.pp", str(pp)],
        defaults=defaults() if defaults else None,
    )
    trainer = setup(cfg, full_batch_spec(module.SPEC))
    layout, model = trainer.layout, trainer.task.model
    num_micro = cfg.train.global_batch_size // cfg.train.micro_batch_size
    batches = [next(trainer.task.train_data) for _ in range(num_micro)]
    if reference is not None and pp > 1:
        load_full_state(model, reference)
    params = stage_tensors(model, "data")

    trainer.num_microbatches = num_micro  # the whole global batch on every DP replica
    trainer.task.train_data = iter(batches)
    outputs = trainer.forward_backward()
    grads = stage_tensors(model, "grad")

    trainer.engine.eval()
    with torch.no_grad():
        logit_outputs = trainer.schedule(
            forward_step_func=logits_step,
            data_iterator=iter(batches),
            model=trainer.scheduled,
            num_microbatches=num_micro,
            seq_length=trainer.task.seq_length,
            micro_batch_size=cfg.train.micro_batch_size,
            forward_only=True,
        )
    trainer.engine.train()

    last = None
    if layout.is_last_stage:
        logits = torch.cat([out["logits"] for out in logit_outputs])
        if args.task == "gpt" and layout.tp_size > 1:  # vocab-parallel -> full vocabulary
            parts = [torch.empty_like(logits) for _ in range(layout.tp_size)]
            dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, dim=-1)
        last = {"losses": torch.stack([out["loss"].float() for out in outputs]), "logits": logits}
    params, grads = gather_replicas(params), gather_replicas(grads)
    lasts = [None] * dist.get_world_size() if layout.rank == 0 else None
    dist.gather_object((current_layout(), last), lasts, dst=0)
    trainer.logger.close()
    if layout.rank != 0:
        return None
    result = {"params": params, "grads": grads, "losses": {}, "logits": {}, "tp_last": {}}
    for where, item in lasts:
        if item is None:
            continue
        if where.tp_rank == 0:
            result["losses"][where.dp_rank] = item["losses"]
            result["logits"][where.dp_rank] = item["logits"]
        else:  # every TP rank of the last stage must see the same loss and (gathered) logits
            result["tp_last"][(where.dp_rank, where.tp_rank)] = item
    torch.save(result, Path(args.out) / f"{tp}x{pp}.pt")
    return result


def main(argv: list[str]) -> None:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=("gpt", "vit"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--phases", required=True, help="comma-separated TPxPP, the first is the reference")
    args = parser.parse_args(argv[:split])
    overrides = argv[split + 1 :]
    reference = None
    for i, phase in enumerate(args.phases.split(",")):
        tp, pp = (int(x) for x in phase.split("x"))
        result = run_phase(args, overrides, tp, pp, reference)
        if i == 0:  # every rank needs the reference weights to load them into pipelined phases
            box = [result["params"][0] if result is not None else None]
            dist.broadcast_object_list(box, src=0)
            reference = box[0]
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
