"""Resizable blocks of a model: the two TP layers that share work units, found by walking the model.

Role: mechanism.

    blocks = find_blocks(model)             # {("mlp", 1): Block, ("attn", 1): Block, ...}
    blocks[("mlp", 1)].apply(kept_units)     # the layers compute only those units

A block knows how its units map onto parameters: an MLP unit is fc1 row u (+ bias u) and fc2
column u (SwiGLU: fc1 rows u and F + u, its gate and up rows, of the rank's F units); an attention
head h is linear_qkv rows [3*hn*h, 3*hn*(h+1)) (+ biases) and linear_proj columns [hn*h, hn*(h+1)).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megahet.tensor_parallel.layers import (
    ResizableColumnParallelLinear,
    ResizableRowParallelLinear,
    ResizableSelfAttention,
)
from megahet.tensor_parallel.plan import BlockKey


@dataclasses.dataclass(frozen=True, eq=False)  # identity semantics: a key in per-parameter dicts
class UnitParam:
    """A parameter whose slices along `dim` are work units of `width` elements each.

    With `groups` > 1 the dim is laid out as (groups, units, width): SwiGLU's fc1 holds every unit's
    gate row in its first half and its up row in the second (groups 2), so a unit is one row of each."""

    param: torch.nn.Parameter
    dim: int
    width: int
    groups: int = 1

    def units(self, tensor: torch.Tensor) -> torch.Tensor:
        """A view of `tensor` (shaped like the parameter) with the unit axis first: (units, ...); with
        groups, (units, ..., groups, width, ...)."""
        if self.groups == 1:
            return tensor.unflatten(self.dim, (-1, self.width)).movedim(self.dim, 0)
        return tensor.unflatten(self.dim, (self.groups, -1, self.width)).movedim(self.dim + 1, 0)

    def rows(self, units: torch.Tensor) -> torch.Tensor:
        """Indexes along `dim` of the given units' elements (a device tensor in, on its device), in the
        parameter's own order: per group, the units' rows."""
        offsets = torch.arange(self.width, device=units.device)
        rows = (units[:, None] * self.width + offsets).reshape(-1)  # (units * width,)
        if self.groups == 1:
            return rows
        stride = self.param.shape[self.dim] // self.groups
        return (torch.arange(self.groups, device=units.device)[:, None] * stride + rows).reshape(-1)

    def offsets(self, units: np.ndarray) -> np.ndarray:
        """Where the given units' elements sit in the flat parameter: host int64, computed from the shape
        alone (no device tensor is read, so no synchronization)."""
        shape = self.param.shape
        before, after = math.prod(shape[: self.dim]), math.prod(shape[self.dim + 1 :])
        rows = (np.asarray(units, np.int64)[:, None] * self.width + np.arange(self.width)).reshape(-1)
        stride = shape[self.dim] // self.groups
        rows = (np.arange(self.groups)[:, None] * stride + rows).reshape(-1)  # every group's rows
        start = np.arange(before)[:, None, None] * (shape[self.dim] * after)  # (before, 1, 1)
        return (start + rows[None, :, None] * after + np.arange(after)[None, None, :]).reshape(-1)


@dataclasses.dataclass
class Block:
    key: BlockKey
    column: ResizableColumnParallelLinear
    row: ResizableRowParallelLinear
    attention: ResizableSelfAttention | None
    num_units: int
    column_width: int
    row_width: int
    column_groups: int = 1
    """SwiGLU: fc1 rows are [gates; ups], a unit one row of each (2); else 1."""

    @functools.cached_property  # built once: UnitParams key the executor's per-parameter dicts by identity
    def unit_params(self) -> list[UnitParam]:
        params = [UnitParam(self.column.weight, 0, self.column_width, self.column_groups)]
        if self.column.bias is not None:
            params.append(UnitParam(self.column.bias, 0, self.column_width, self.column_groups))
        params.append(UnitParam(self.row.weight, 1, self.row_width))
        return params

    def apply(self, kept: torch.Tensor | None) -> None:
        """Compute only `kept` units (sorted local indexes), or all of them when None."""
        if kept is not None and len(kept) == self.num_units:
            kept = None
        if self.attention is not None:
            self.attention.set_kept(kept)
            return
        self.column.set_kept(None if kept is None else self.unit_params[0].rows(kept))
        self.row.set_kept(kept)

    def set_guests(self, tensors: list[torch.Tensor] | None, num_units: int = 0) -> None:
        """Compute `num_units` migrated-in units from `tensors` (laid out like `unit_params`), or none."""
        column_w, column_b, row_w = None, None, None
        if tensors is not None:
            column_w, row_w = tensors[0], tensors[-1]
            column_b = tensors[1] if len(tensors) == 3 else None
        if self.attention is not None:
            self.attention.set_guests(num_units if tensors is not None else 0, column_w, column_b, row_w)
            return
        self.column.set_guests(column_w, column_b)
        self.row.set_guests(row_w)

    @property
    def layers(self) -> list:
        return [m for m in (self.column, self.row, self.attention) if m is not None]

    @property
    def executed_flops(self) -> int:
        """Forward FLOPs executed so far (GEMMs of the computed units, attention's QK^T and AV)."""
        return sum(m.executed_flops for m in self.layers)

    @property
    def backward_flops(self) -> int:
        """Backward FLOPs executed so far (2x the forward's), counted once `count_backward()` is on."""
        return sum(m.backward_flops for m in self.layers)

    def count_backward(self) -> None:
        for m in self.layers:
            m.count_backward = True


def find_blocks(model: torch.nn.Module) -> dict[BlockKey, Block]:
    """Every resizable attention and MLP block of this rank's stage, keyed by global layer number."""
    blocks = {}
    for module in model.modules():
        if not isinstance(module, TransformerLayer):
            continue
        attention, mlp = module.self_attention, module.mlp
        if isinstance(attention, ResizableSelfAttention):
            hn = attention.hidden_size_per_attention_head
            blocks[("attn", module.layer_number)] = Block(
                ("attn", module.layer_number),
                attention.linear_qkv,
                attention.linear_proj,
                attention,
                attention.num_local_heads,
                3 * hn,
                hn,
            )
        fc1 = getattr(mlp, "linear_fc1", None)
        if isinstance(fc1, ResizableColumnParallelLinear):
            groups = 2 if mlp.config.gated_linear_unit else 1  # SwiGLU: [gate; up] rows per unit
            fc1.unit_groups = groups
            blocks[("mlp", module.layer_number)] = Block(
                ("mlp", module.layer_number), fc1, mlp.linear_fc2, None, fc1.weight.shape[0] // groups, 1, 1,
                column_groups=groups,
            )  # fmt: skip
    return blocks
