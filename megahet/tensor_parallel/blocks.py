"""Resizable blocks of a model: the two TP layers that share work units, found by walking the model.

Role: mechanism.

    blocks = find_blocks(model)             # {("mlp", 1): Block, ("attn", 1): Block, ...}
    blocks[("mlp", 1)].apply(kept_units)     # the layers compute only those units

A block knows how its units map onto parameters: an MLP unit is fc1 row u (+ bias u) and fc2
column u (SwiGLU: fc1 rows u and F + u, its gate and up rows, of the rank's F units); an attention
head h is linear_qkv rows [3*hn*h, 3*hn*(h+1)) (+ biases) and linear_proj columns [hn*h, hn*(h+1)).
With grouped-query attention a unit is one query head (its q rows and proj columns), and the k/v rows
of its group are `shared_params`: computed, moved and updated with the group while any of its heads is.
Why per query head: at TP=8 a Llama rank holds one or two groups, so whole groups could not shift
attention work finely; a head moves 1/r of a group's query work and its group's k/v (2 of r + 2 head
rows) go along, recomputed by the helper from the input it already holds.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megahet.tensor_parallel.layers import (
    ResizableColumnParallelLinear,
    ResizableRowParallelLinear,
    ResizableSelfAttention,
)
from megahet.tensor_parallel.plan import BlockKey
from megahet.tensor_parallel.units import GroupedUnitParam, UnitParam

__all__ = ["Block", "UnitParam", "find_blocks"]


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
    query_groups: int = 0
    """Grouped-query attention: this rank's key/value groups, whose k/v rows its query-head units share
    (0: nothing shared)."""

    @functools.cached_property  # built once: UnitParams key the executor's per-parameter dicts by identity
    def unit_params(self) -> list[UnitParam]:
        """Each unit's own slices: column rows (+ bias), row columns."""
        if self.query_groups:  # a query head: its q rows of linear_qkv, its proj columns
            per_group = self.num_units // self.query_groups
            params = [
                GroupedUnitParam(p, 0, self.column_width, blocks=self.query_groups, count=per_group)
                for p in (self.column.weight, self.column.bias)
                if p is not None
            ]
        else:
            params = [
                UnitParam(p, 0, self.column_width, self.column_groups)
                for p in (self.column.weight, self.column.bias)
                if p is not None
            ]
        params.append(UnitParam(self.row.weight, 1, self.row_width))
        return params

    @functools.cached_property
    def shared_params(self) -> list[UnitParam]:
        """Grouped-query attention: each group's k/v rows of linear_qkv (+ bias), units = groups; else []."""
        if not self.query_groups:
            return []
        per_group = self.num_units // self.query_groups
        offset = per_group * self.column_width
        return [
            GroupedUnitParam(p, 0, 2 * self.column_width, blocks=self.query_groups, offset=offset)
            for p in (self.column.weight, self.column.bias)
            if p is not None
        ]

    def unit_group(self, units) -> np.ndarray:
        """The key/value group of each unit (grouped-query attention)."""
        return np.asarray(units, np.int64) // (self.num_units // max(self.query_groups, 1))

    def apply(self, kept: torch.Tensor | None) -> None:
        """Compute only `kept` units (sorted local indexes), or all of them when None."""
        if kept is not None and len(kept) == self.num_units:
            kept = None
        if self.attention is not None:
            self.attention.set_kept(kept)
            return
        self.column.set_kept(None if kept is None else self.unit_params[0].rows(kept))
        self.row.set_kept(kept)

    def set_guests(
        self, tensors: list[torch.Tensor] | None, num_units: int = 0, head_groups: torch.Tensor | None = None
    ) -> None:
        """Compute `num_units` migrated-in units from `tensors` (laid out like `unit_params`, then
        `shared_params`), or none. Grouped-query attention: `head_groups`, each guest head's position
        among the guest k/v groups."""
        column_w, column_b, row_w = None, None, None
        if tensors is not None:
            own = tensors[: len(self.unit_params)]
            column_w, row_w = own[0], own[-1]
            column_b = own[1] if len(own) == 3 else None
            if self.query_groups:  # guest rows: [guest q heads; guest k/v groups], joined per call
                shared = tensors[len(self.unit_params) :]
                column_w = (column_w, shared[0])
                column_b = (column_b, shared[1]) if column_b is not None else None
        if self.attention is not None:
            self.attention.set_guests(
                num_units if tensors is not None else 0, column_w, column_b, row_w, head_groups
            )
            return
        self.column.set_guests(column_w, column_b)
        self.row.set_guests(row_w)

    @property
    def layers(self) -> list:
        return [m for m in (self.column, self.row, self.attention) if m is not None]

    def unit_work(self, seq_length: int) -> float:
        """One unit's forward FLOPs per token: its GEMM rows and columns (2 x hidden each), with
        grouped-query attention its share of its group's key/value rows, and attention's QK^T and AV over
        sequences of `seq_length` (packed documents: their buffer's, an upper bound). From shapes alone,
        so every rank of a TP group gets the same number (`plan_migration` runs on each) at every step,
        and a resumed run the same plan."""
        hidden = self.column.weight.shape[1]
        rows = self.column_width * self.column_groups + self.row_width
        if self.query_groups:
            rows += 2 * self.column_width * self.query_groups / self.num_units
        work = 2.0 * hidden * rows
        if self.attention is not None:
            work += 4.0 * seq_length * self.attention.hidden_size_per_attention_head
        return work

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
            gqa = attention.grouped
            blocks[("attn", module.layer_number)] = Block(
                ("attn", module.layer_number),
                attention.linear_qkv,
                attention.linear_proj,
                attention,
                attention.num_local_heads,
                hn if gqa else 3 * hn,
                hn,
                query_groups=attention.num_local_groups if gqa else 0,
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
