"""A model's parameters or gradients in the TP=1 layout, gathered over the tensor-parallel group (imported
by the workers in this folder; not a worker). SwiGLU's fc1 shards are merged as [all gates; all ups]."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megahet.checkpointing.convert import merge_tp_shards


def gathered(model: torch.nn.Module, what: str) -> dict[str, torch.Tensor]:
    """Parameters (`what` "data") or gradients by name, TP shards merged along their partition dim."""
    tp = ps.get_tensor_model_parallel_world_size()
    gated = getattr(model.config, "gated_linear_unit", False)
    out = {}
    for name, param in model.named_parameters():
        tensor = (param.detach() if what == "data" else param.grad).float().contiguous()
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(parts, tensor, group=ps.get_tensor_model_parallel_group())
            tensor = merge_tp_shards(parts, param.partition_dim, gated and "linear_fc1" in name)
        out[name] = tensor.clone()
    return out
