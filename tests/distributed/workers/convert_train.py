"""Worker: a short pretrain_gpt run that saves a checkpoint, then the sharded model's logits on fixed tokens.

    torchrun --nproc_per_node 4 convert_train.py --out DIR -- <config overrides incl. --train.save CKPT>

After training (the checkpoint is saved at the end), every stage runs a forward on the same token
batch (seeded, vocabulary ids < 1000), stage outputs are broadcast down the pipeline, and the last
stage's TP-gathered logits (b, s, padded vocab) go to DIR/logits.pt with the tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

import pretrain_gpt
from megahet.config import load_config
from megahet.training import setup


@torch.no_grad()
def sharded_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full logits on the last stage (None elsewhere), by a plain stage-by-stage forward."""
    model.eval()
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    hidden = None
    for stage in range(pp):
        if pp_rank == stage:
            if stage > 0:
                model.set_input_tensor(hidden)
            out = model(tokens, positions, None)
        if stage < pp - 1:
            shape = (tokens.shape[1], tokens.shape[0], model.config.hidden_size)
            buf = out.contiguous() if pp_rank == stage else torch.empty(shape)
            dist.broadcast(buf, src=ranks[stage], group=ps.get_pipeline_model_parallel_group())
            hidden = buf
    if pp_rank != pp - 1:
        return None
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def main(argv: list[str]) -> None:
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv[:split])
    cfg = load_config(argv[split + 1 :])
    trainer = setup(cfg, pretrain_gpt.SPEC)
    trainer.train()
    trainer.logger.close()
    tokens = torch.randint(0, 1000, (2, cfg.model.seq_length), generator=torch.Generator().manual_seed(7))
    logits = sharded_logits(trainer.engine.module, tokens)
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save({"tokens": tokens, "logits": logits}, args.out / "logits.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
