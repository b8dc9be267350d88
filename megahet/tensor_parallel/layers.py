"""Resizable tensor-parallel layers: megatron-core's TP linears and self-attention, computing a subset.

Role: mechanism (layers that compute the index set they are given).

Each layer executes the index set it is given (`set_kept`) and nothing else; which units to keep
is decided elsewhere (the plan). With no index set they are megatron-core's layers exactly.

- `ResizableColumnParallelLinear`: computes only the kept output rows of its shard. Its input is
  replicated across the TP group, so the backward still all-reduces the input gradient over the
  whole group; the output is narrower: (s, b, kept rows).
- `ResizableRowParallelLinear`: consumes that narrower input with the matching kept columns and
  all-reduces a full-width partial sum; dropped units contribute zero and the all-reduce keeps
  its shape.
- `ResizableSelfAttention`: runs megatron-core's attention over the kept heads only.

Both GEMMs of a block shrink together, so a resized rank executes proportionally fewer FLOPs;
every layer counts the FLOPs it executed (`executed_flops`, forward GEMMs; `backward_flops` when
`count_backward` is set, for virtual devices).
Sequence parallelism is not supported while resized (a clear error says so).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention


def _charge_backward(layer, output: torch.Tensor, forward_flops: int) -> None:
    """Add 2x a forward's FLOPs (input and weight gradients) to `layer.backward_flops` when the output's
    gradient arrives, just before the layer's own backward runs (a virtual device charges them before the
    backward's next collective). Called only with `layer.count_backward` (no call per layer otherwise)."""
    if output.requires_grad:
        output.register_hook(functools.partial(_count_backward, layer, 2 * forward_flops))


def _count_backward(layer, flops: int, grad: torch.Tensor) -> None:
    layer.backward_flops += flops


class _GatherUnits(torch.autograd.Function):
    """`weight.index_select(dim, index)` whose backward writes the (unique) kept units' gradient with
    `index_copy_` into a zero gradient: autograd's own backward for index_select is an `index_add_`,
    which on CUDA adds element by element with atomics (slow for bf16)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        ctx.dim, ctx.shape = dim, weight.shape
        ctx.save_for_backward(index)
        return weight.index_select(dim, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        full = grad.new_zeros(ctx.shape)
        return full.index_copy_(ctx.dim, index, grad), None, None


def gather_units(weight: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """The kept units of a weight along `dim` (a copy), differentiable; `index` holds unique indices."""
    return _GatherUnits.apply(weight, dim, index)


def _joined(guests: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Guest rows given as parts (grouped-query attention: q heads, then k/v groups), joined at each call so
    that the parts, which migration fills in place, stay the tensors the layer reads."""
    return torch.cat(guests) if isinstance(guests, tuple) else guests


def _append_rows(own: torch.Tensor, guests: torch.Tensor, groups: int) -> torch.Tensor:
    """Own rows then guest rows, within each of `groups` stacked halves: [own_g; guest_g] per group."""
    if groups == 1:
        return torch.cat([own, guests])
    return torch.cat([own.unflatten(0, (groups, -1)), guests.unflatten(0, (groups, -1))], dim=1).flatten(0, 1)


def _check_resizable(layer) -> None:
    if layer.sequence_parallel:
        raise NotImplementedError(
            "resizing with sequence parallelism is not supported: disable sequence_parallel or resizing"
        )


class ResizableColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear that computes only `kept` output rows of its shard."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept: torch.Tensor | None = None
        self.guest_weight: torch.Tensor | None = None  # (guest rows, in): units migrated here
        self.guest_bias: torch.Tensor | None = None
        self.unit_groups = 1
        """Output rows are `unit_groups` stacked halves ([gates; ups] for SwiGLU: 2); own and guest rows
        are interleaved per group so that the activation's chunk(2) still splits gates from ups."""
        self.executed_flops = self.backward_flops = 0
        self.count_backward = False

    def set_guests(
        self, weight: torch.Tensor | tuple | None, bias: torch.Tensor | tuple | None = None
    ) -> None:
        """Rows of other ranks' units to compute after this rank's own (migration), or None; a tuple of
        tensors is their rows in parts, joined at each call."""
        if weight is not None:
            _check_resizable(self)
        self.guest_weight, self.guest_bias = weight, bias

    def set_kept(self, rows: torch.Tensor | None) -> None:
        """Local output rows to compute (sorted int64), or None for all."""
        if rows is not None:
            _check_resizable(self)
            if self.gather_output:
                raise NotImplementedError("a resized column-parallel layer cannot gather its output")
        self.kept = rows

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        if self.kept is None and self.guest_weight is None:
            flops = 2 * (input_.numel() // input_.shape[-1]) * self.weight.shape[0] * self.weight.shape[1]
            self.executed_flops += flops
            out = super().forward(input_, weight, runtime_gather_output)
            if self.count_backward:
                _charge_backward(self, out[0], flops)
            return out
        x = copy_to_tensor_model_parallel_region(input_)  # (s, b, h); all-reduces dgrad over TP
        w = self.weight if self.kept is None else gather_units(self.weight, 0, self.kept)  # (kept, h)
        bias = self.bias
        if bias is not None and self.kept is not None:
            bias = gather_units(bias, 0, self.kept)
        if self.guest_weight is not None:  # guests' input is the replicated x this rank already holds
            w = _append_rows(w, _joined(self.guest_weight), self.unit_groups)  # (kept + guest rows, h)
            bias = (
                _append_rows(bias, _joined(self.guest_bias), self.unit_groups) if bias is not None else None
            )
        flops = 2 * (input_.numel() // input_.shape[-1]) * w.shape[0] * w.shape[1]
        self.executed_flops += flops
        out = F.linear(x, w, None if self.skip_bias_add else bias)  # (s, b, kept + guests)
        if self.count_backward:
            _charge_backward(self, out, flops)
        return out, (bias if self.skip_bias_add else None)


class ResizableRowParallelLinear(RowParallelLinear):
    """RowParallelLinear that consumes only `kept` input columns of its shard."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept: torch.Tensor | None = None
        self.guest_weight: torch.Tensor | None = None  # (out, guest cols): units migrated here
        self.executed_flops = self.backward_flops = 0
        self.count_backward = False

    def set_guests(self, weight: torch.Tensor | None) -> None:
        """Columns of other ranks' units, consumed after this rank's own (migration), or None."""
        if weight is not None:
            _check_resizable(self)
        self.guest_weight = weight

    def set_kept(self, cols: torch.Tensor | None) -> None:
        """Local input columns to consume (sorted int64), or None for all."""
        if cols is not None:
            _check_resizable(self)
            if not self.input_is_parallel:
                raise NotImplementedError("a resized row-parallel layer needs input_is_parallel=True")
        self.kept = cols

    def forward(self, input_: torch.Tensor):
        if self.kept is None and self.guest_weight is None:
            flops = 2 * (input_.numel() // input_.shape[-1]) * self.weight.shape[0] * self.weight.shape[1]
            self.executed_flops += flops
            out = super().forward(input_)
            if self.count_backward:
                _charge_backward(self, out[0], flops)
            return out
        w = self.weight if self.kept is None else gather_units(self.weight, 1, self.kept)  # (h, kept)
        if self.guest_weight is not None:
            w = torch.cat([w, self.guest_weight], dim=1)  # (h, kept + guest cols)
        # (s, b, kept + guests) -> (s, b, h): this rank's partial sum, guests' share included, so the
        # all-reduce it already does combines them (migration-aware all-reduce).
        flops = 2 * (input_.numel() // input_.shape[-1]) * w.shape[0] * w.shape[1]
        self.executed_flops += flops
        partial = F.linear(input_, w)
        if self.count_backward:
            _charge_backward(self, partial, flops)
        out = reduce_from_tensor_model_parallel_region(partial)  # full-width all-reduce over TP
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


class ResizableSelfAttention(SelfAttention):
    """megatron-core SelfAttention over a subset of this rank's heads, plus guest heads (migration).

    Multi-head attention: a head's [q, k, v] rows are one unit, and megatron-core's own split runs on
    the narrower projection. Grouped-query attention: a unit is one query head; the k/v rows of every
    group with a computed head are computed once, laid out as [own q | own k/v | guest q | guest k/v],
    and each query head is paired with its group's k and v (`head_groups`) before core attention, which
    then sees as many k/v heads as query heads. With nothing resized or migrated, megatron-core's own
    forward runs unchanged.
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.heads = self.num_attention_heads_per_partition
        self.groups = self.num_query_groups_per_partition
        self.kept_heads: torch.Tensor | None = None
        self.guest_heads = 0  # heads of other ranks computed here (migration)
        self.guest_head_groups: torch.Tensor | None = None  # (guest heads,) position among guest k/v groups
        self.head_groups: torch.Tensor | None = None  # grouped, resized: (heads run,) row of its k/v
        self.own_groups = 0  # grouped, resized: own k/v groups computed
        self.executed_flops = self.backward_flops = 0
        self.count_backward = False

    @property
    def num_local_heads(self) -> int:
        return self.heads

    @property
    def num_local_groups(self) -> int:
        return self.groups

    @property
    def grouped(self) -> bool:
        """Grouped-query attention: fewer key/value groups than query heads on this rank."""
        return self.groups < self.heads

    def set_kept(self, heads: torch.Tensor | None) -> None:
        """Local heads to run (sorted int64), or None for all; sets the projections' rows/columns."""
        self.kept_heads = heads
        hn = self.hidden_size_per_attention_head
        if self.grouped:
            self._arrange_grouped()
            return
        if heads is None:
            self.linear_qkv.set_kept(None)
            self.linear_proj.set_kept(None)
            return
        # megatron-core's fused QKV layout per head (MHA): [q (hn), k (hn), v (hn)] rows.
        offsets = torch.arange(3 * hn, device=heads.device)
        self.linear_qkv.set_kept((heads[:, None] * 3 * hn + offsets).reshape(-1))  # (kept * 3 hn,)
        self.linear_proj.set_kept((heads[:, None] * hn + offsets[:hn]).reshape(-1))  # (kept * hn,)

    def _arrange_grouped(self) -> None:
        """Grouped-query attention: the qkv rows to compute, [kept q | their groups' k/v], and each run
        head's k/v position (own groups first, then the guests'); megatron-core's layout when nothing
        is resized or migrated."""
        if self.kept_heads is None and not self.guest_heads:
            self.linear_qkv.set_kept(None)
            self.linear_proj.set_kept(None)
            self.head_groups = None
            return
        device = self.linear_qkv.weight.device
        hn, per_group = self.hidden_size_per_attention_head, self.heads // self.groups
        heads = self.kept_heads if self.kept_heads is not None else torch.arange(self.heads, device=device)
        groups = heads // per_group  # (kept,) each head's group
        needed = torch.unique(groups)  # sorted: the groups whose k/v this rank computes (once per plan)
        period = (per_group + 2) * hn  # per group: [q_0 .. q_{r-1}, k, v] heads of hn rows
        span = torch.arange(hn, device=device)
        q_rows = (groups[:, None] * period + heads[:, None] % per_group * hn + span).reshape(-1)
        kv_rows = (needed[:, None] * period + per_group * hn + torch.arange(2 * hn, device=device)).reshape(
            -1
        )
        self.linear_qkv.set_kept(torch.cat([q_rows, kv_rows]))  # (kept hn + needed 2 hn,)
        kept = self.kept_heads is not None
        self.linear_proj.set_kept((heads[:, None] * hn + span).reshape(-1) if kept else None)
        self.own_groups = len(needed)
        own = torch.searchsorted(needed, groups)  # (kept,) position of each head's group
        guests = self.guest_head_groups
        self.head_groups = own if guests is None else torch.cat([own, guests + len(needed)])

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True
    ):
        if self.head_groups is None:
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, output_gate, split_qkv
            )
        if output_gate or not split_qkv:
            raise NotImplementedError("resized grouped-query attention needs split q, k, v without a gate")
        mixed, _ = self.linear_qkv(hidden_states)  # (s, b, [own q | own k/v | guest q | guest k/v])
        hn = self.hidden_size_per_attention_head
        own_q = (len(self.head_groups) - self.guest_heads) * hn
        sizes = [own_q, 2 * hn * self.own_groups, self.guest_heads * hn]
        own_q, own_kv, guest_q, guest_kv = torch.split(mixed, [*sizes, mixed.shape[-1] - sum(sizes)], dim=-1)
        query = torch.cat([own_q, guest_q], dim=-1).unflatten(-1, (-1, hn))  # (s, b, heads, hn)
        kv = torch.cat([own_kv, guest_kv], dim=-1).unflatten(-1, (-1, 2, hn))  # (s, b, groups, 2, hn)
        key = kv[..., 0, :].index_select(2, self.head_groups)  # (s, b, heads, hn)
        value = kv[..., 1, :].index_select(2, self.head_groups)  # (s, b, heads, hn)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value

    @contextlib.contextmanager
    def _running_heads(self, n: int):
        """Make megatron-core's attention reshape to n local heads for the duration of one call."""
        core = self.core_attention
        saved = (
            self.num_attention_heads_per_partition,
            self.num_query_groups_per_partition,
            core.num_attention_heads_per_partition,
            core.num_query_groups_per_partition,
            core.hidden_size_per_partition,
        )
        hn = self.hidden_size_per_attention_head
        self.num_attention_heads_per_partition = self.num_query_groups_per_partition = n
        core.num_attention_heads_per_partition = core.num_query_groups_per_partition = n
        core.hidden_size_per_partition = n * hn
        try:
            yield
        finally:
            (
                self.num_attention_heads_per_partition,
                self.num_query_groups_per_partition,
                core.num_attention_heads_per_partition,
                core.num_query_groups_per_partition,
                core.hidden_size_per_partition,
            ) = saved

    def set_guests(self, num_heads: int, qkv=None, qkv_bias=None, proj=None, head_groups=None) -> None:
        """Run `num_heads` other ranks' heads after this rank's own, from the given weights (grouped-query
        attention: q rows then k/v rows, and each guest head's position among the guest k/v groups)."""
        self.guest_heads = num_heads
        self.guest_head_groups = head_groups if num_heads else None
        self.linear_qkv.set_guests(qkv, qkv_bias)
        self.linear_proj.set_guests(proj)
        if self.grouped:
            self._arrange_grouped()

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        own = self.num_local_heads if self.kept_heads is None else len(self.kept_heads)
        heads = own + self.guest_heads
        s, b = hidden_states.shape[0], hidden_states.shape[1]
        packed = kwargs.get("packed_seq_params")
        if packed is not None:  # attention inside each packed document: sum(s_i^2) score entries
            lengths = getattr(packed, "lengths", ()) or packed.cu_seqlens_q.diff().tolist()
            squares = sum(n * n for n in lengths)
        else:
            squares = b * s * s
        flops = 4 * squares * heads * self.hidden_size_per_attention_head  # QK^T and AV
        self.executed_flops += flops
        if heads == self.num_local_heads and self.kept_heads is None:
            out = super().forward(hidden_states, *args, **kwargs)
        else:
            with self._running_heads(heads):
                out = super().forward(hidden_states, *args, **kwargs)
        if self.count_backward:
            _charge_backward(self, out[0], flops)
        return out
