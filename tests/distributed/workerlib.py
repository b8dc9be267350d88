"""Helpers used inside the distributed test workers (run under torchrun, one process per rank).

Parameter naming: a pipeline stage names its layers locally (`decoder.layers.0` is the first layer
*of the stage*); we name everything by the unsharded TP=1 PP=1 model's names, i.e. local layer i of
stage p is global layer p * layers_per_stage + i, and TP shards are concatenated along
`param.partition_dim`. The last stage's tied copy of the word embedding (`output_layer.weight`,
present only when PP > 1) keeps its own name; it must equal `embedding.word_embeddings.weight`.

Workers import the pretrain scripts from the repository root: harness.torchrun puts it on PYTHONPATH.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed as dist
from harness import EMBEDDING, TIED_COPY
from megatron.core import parallel_state as ps

from megahet.checkpointing.convert import merge_tp_shards, split_tp_shards
from megahet.parallel import current_layout
from megahet.task import TaskSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def reset_model_parallel() -> None:
    """Forget megatron-core's TP/PP/DP groups (the process group stays) so setup() can regroup."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def layer_offset(model: torch.nn.Module) -> int:
    """The global index of the stage's first transformer layer (megatron-core numbers layers globally
    from 1 in `layer_number`, whatever the split: even or a pipeline_model_parallel_layout)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return next(m.layer_number for m in model.modules() if isinstance(m, TransformerLayer)) - 1


def global_name(local: str, offset: int) -> str:
    """Local (stage) parameter name -> name in the unsharded TP=1 PP=1 model (`offset`: layer_offset)."""
    match = _LAYER.match(local)
    if not match:
        return local
    return f"decoder.layers.{offset + int(match.group(1))}." + local[match.end() :]


def _gated(model: torch.nn.Module, name: str) -> bool:
    """SwiGLU's fc1: its TP shards are [gate; up] each (megahet.checkpointing.convert.merge_tp_shards)."""
    return getattr(getattr(model, "config", None), "gated_linear_unit", False) and "linear_fc1" in name


def is_tp_sharded(param: torch.Tensor) -> bool:
    return (
        bool(getattr(param, "tensor_model_parallel", False)) and ps.get_tensor_model_parallel_world_size() > 1
    )


def stage_tensors(model: torch.nn.Module, what: str = "data") -> dict[str, torch.Tensor]:
    """This stage's parameters (what="data") or gradients (what="grad"), TP-gathered, by global name.

    Collective over the TP group (every TP rank must call it with the same model structure).
    """
    tp_size, offset = ps.get_tensor_model_parallel_world_size(), layer_offset(model)
    out = {}
    for name, param in model.named_parameters():
        tensor = param.detach() if what == "data" else param.grad
        if tensor is None:
            raise AssertionError(f"{name} has no {what} on rank {dist.get_rank()}")
        tensor = tensor.detach().float().contiguous()
        if is_tp_sharded(param):
            parts = [torch.empty_like(tensor) for _ in range(tp_size)]
            dist.all_gather(parts, tensor, group=ps.get_tensor_model_parallel_group())
            tensor = merge_tp_shards(parts, param.partition_dim, _gated(model, name))
        out[global_name(name, offset)] = tensor.clone()
    return out


def gather_replicas(local: dict, root: int = 0) -> dict[int, dict[str, torch.Tensor]] | None:
    """Collect every rank's `stage_tensors` on `root`: {dp_rank: full model by global name}.

    Replicated (non-TP) tensors come from every TP rank: they must agree, and AssertionError says
    where they do not (TP ranks computing different replicated gradients is a bug in itself).
    """
    layout = current_layout()
    items = [None] * dist.get_world_size() if dist.get_rank() == root else None
    dist.gather_object((layout.dp_rank, layout.pp_rank, layout.tp_rank, local), items, dst=root)
    if dist.get_rank() != root:
        return None
    replicas: dict[int, dict[str, torch.Tensor]] = {}
    for dp_rank, pp_rank, tp_rank, tensors in sorted(items, key=lambda it: it[:3]):
        full = replicas.setdefault(dp_rank, {})
        for name, tensor in tensors.items():
            if name in full:
                if not torch.equal(full[name], tensor):
                    diff = (full[name] - tensor).abs().max().item()
                    raise AssertionError(
                        f"dp {dp_rank} pp {pp_rank} tp {tp_rank}: {name} differs across TP ranks by {diff:.3e}"
                    )
            else:
                full[name] = tensor
    return replicas


@torch.no_grad()
def load_full_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy an unsharded TP=1 PP=1 state (by global name) into this rank's stage / TP shard."""
    tp_size, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    offset = layer_offset(model)
    for name, param in model.named_parameters():
        key = EMBEDDING if name == TIED_COPY and TIED_COPY not in state else global_name(name, offset)
        full = state[key]
        if is_tp_sharded(param):
            full = split_tp_shards(full, tp_size, param.partition_dim, _gated(model, name))[tp_rank]
        if full.shape != param.shape:
            raise AssertionError(f"{name} <- {key}: shape {tuple(full.shape)} vs {tuple(param.shape)}")
        param.copy_(full)


def full_batch_spec(spec: TaskSpec) -> TaskSpec:
    """The task, but every DP rank reads the whole global batch (as if DP were 1).

    Lets each DP replica compute the undistributed full-batch gradient, for gradient comparisons.
    """

    def build(cfg, layout):
        return spec.build(cfg, dataclasses.replace(layout, dp_rank=0, dp_size=1))

    return dataclasses.replace(spec, build=build)


def loading_spec(spec: TaskSpec, state: dict[str, torch.Tensor] | None, keep: list) -> TaskSpec:
    """The task, with `state` (unsharded, by global name) loaded into the model before the engine is
    built (so DeepSpeed's fp32 master copy starts from it too). Appends (Task, this stage's initial
    TP-gathered weights) to `keep`."""

    def build(cfg, layout):
        task = spec.build(cfg, layout)
        if state is not None:
            load_full_state(task.model, state)
        keep.append((task, stage_tensors(task.model, "data")))
        return task

    return dataclasses.replace(spec, build=build)
