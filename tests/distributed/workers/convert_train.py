"""Worker: short pretrain_gpt / pretrain_vit runs (save, or load a checkpoint), with the model's logits
on fixed inputs before and after training; several jobs per launch, regrouping the same processes.

    torchrun --nproc_per_node 4 convert_train.py --out DIR --jobs DIR/jobs.json

jobs.json: [{"name": ..., "task": "gpt" | "vit", "argv": [config overrides incl. --train.save/load]}].
Each job runs `setup()` (which loads --train.load through the normal resume path), a plain
stage-by-stage forward on fixed inputs (GPT: seeded tokens < 1000; ViT: the first 8 MNIST validation
images), `Trainer.train()` up to train.train_iters (saving at the end with --train.save), and the same
forward again. The last stage's TP-gathered logits ((b, s, padded vocab) or (b, classes)) go to
DIR/<name>.pt with the inputs, the config, the step records, and where the run started (iteration,
sample).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

import pretrain_gpt
import pretrain_vit
from megahet.config import load_config
from megahet.data.mnist import load_mnist
from megahet.training import setup


@torch.no_grad()
def sharded_logits(model: torch.nn.Module, forward, batch: int, seq: int) -> torch.Tensor | None:
    """Full logits on the last stage (None elsewhere): forward(model) stage by stage, each stage's
    output (seq, batch, hidden) broadcast down the pipeline, the last stage's output TP-gathered
    along its last dim when it is vocab-parallel (GPT)."""
    was_training = model.training
    model.eval()
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    for stage in range(pp):
        if pp_rank == stage:
            out = forward(model)
        if stage < pp - 1:
            buf = out.contiguous() if pp_rank == stage else torch.empty(seq, batch, model.config.hidden_size)
            dist.broadcast(buf, src=ranks[stage], group=group)
            if pp_rank == stage + 1:
                model.set_input_tensor(buf)
    model.train(was_training)
    if pp_rank != pp - 1:
        return None
    if not getattr(model, "parallel_output", False):  # the ViT head: full logits on every TP rank
        return out
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def run(name: str, task: str, argv: list[str], out: Path) -> None:
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    module = pretrain_gpt if task == "gpt" else pretrain_vit
    cfg = load_config(argv, defaults=pretrain_vit.default_config() if task == "vit" else None)
    trainer = setup(cfg, module.SPEC)
    model, seq = trainer.engine.module, trainer.task.seq_length
    if task == "gpt":
        inputs = torch.randint(0, 1000, (2, seq), generator=torch.Generator().manual_seed(7))  # (b, s)
        positions = torch.arange(seq).expand_as(inputs)

        def forward(m):
            return m(inputs, positions, None)  # (b, s, vocab/tp) on the last stage, (s, b, h) before
    else:
        inputs = load_mnist("valid")[0][:8]  # (b, 1, 28, 28)

        def forward(m):
            return m(inputs)  # (b, classes) on the last stage, (s, b, h) before

    result = {
        "cfg": cfg,
        "inputs": inputs,
        "start_iteration": trainer.start_iteration,
        "start_sample": trainer.start_sample,
        "before": sharded_logits(model, forward, inputs.shape[0], seq),
    }
    result["history"] = trainer.train()
    trainer.logger.close()
    result["after"] = sharded_logits(model, forward, inputs.shape[0], seq)
    result["iteration"] = trainer.iteration
    layout = trainer.layout
    if layout.is_last_stage and layout.tp_rank == 0 and layout.dp_rank == 0:
        torch.save(result, out / f"{name}.pt")
    dist.barrier()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--jobs", required=True, type=Path)
    args = parser.parse_args(argv)
    for job in json.loads(args.jobs.read_text()):
        run(job["name"], job["task"], job["argv"], args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
