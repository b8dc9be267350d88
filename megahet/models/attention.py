"""Core attention through `torch.nn.functional.scaled_dot_product_attention` (flash / cuDNN on GPUs).

Role: models (a megatron-core core-attention module, plugged in through the layer spec's
`core_attention`, the same seam Transformer Engine's attention uses).

megatron-core 0.16's local `DotProductAttention` materializes the scores `[b*np, s, s]`, upcasts
them to fp32, builds a causal mask per call and runs softmax and the second GEMM unfused; this
module hands the same query, key and value to PyTorch's fused kernel instead, and so keeps
O(s) activation memory per head on GPUs (flash) and a flash-style kernel on CPU.

    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    context = core(query, key, value, attention_mask)   # (sq, b, np, hn), (sk, b, ng, hn) x2 -> (sq, b, np*hn)

The head count is read from the tensors, never from the config, so resized (heads dropped) and
migrated (guest heads appended) attention runs through it unchanged.

Packed documents (megatron-core's `thd` format, `PackedSeqParams` with `cu_seqlens`): query, key and
value come as (tokens, heads, hn) and attention stays inside each document, causal. On CUDA with
bf16/fp16 it runs `torch.nn.attention.varlen.varlen_attn` (flash, its causal switch detected from the
signature: `window_size=(-1, 0)` or `is_causal=True`); elsewhere causal SDPA per document, exact, whose
cost is truly sum(s^2).

Context parallelism (config.context_parallel_size > 1, parallel.cp): the queries are this rank's head-tail
chunks of the sequence (of every document, when packed: megahet/models/cp_documents.py), and the keys and
values are gathered over the CP group (megahet/models/context_parallel.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from megahet.models.context_parallel import cp_attention, cp_packed_attention
from megahet.models.cp_placed import RankPlacement, placed_attention


@dataclasses.dataclass
class PackedDocuments(PackedSeqParams):
    """megatron-core's `thd` packed-sequence parameters plus the documents' lengths on the host, so that
    attention splits documents and counts their FLOPs without reading `cu_seqlens` back from the GPU."""

    lengths: tuple[int, ...] = ()


@dataclasses.dataclass
class PlacedDocuments(PackedSeqParams):
    """A CP rank's tokens under a dynamic placement (megahet/models/cp_placed.py): one sequence of batch 1 to
    megatron-core (`qkv_format` sbhd), whose attention executes `placement` and whose rotary embedding takes
    `positions` (t,), each token's position in its document (megahet/models/gpt.py)."""

    placement: RankPlacement | None = None
    positions: torch.Tensor | None = None


def placed_documents(
    placement: RankPlacement, positions: torch.Tensor, longest: int, cp: int
) -> PlacedDocuments:
    """The parameters of one placed micro-batch; positions (1, t) on the model's device, `longest` the longest
    document. `max_seqlen_q` (the rotary length megatron-core computes before the per-token one replaces it)
    is rounded up to 2 cp, which megatron-core's CP split of it needs."""
    longest = -(-int(longest) // (2 * cp)) * 2 * cp
    return PlacedDocuments(
        qkv_format="sbhd", max_seqlen_q=longest, max_seqlen_kv=longest, placement=placement,
        positions=positions[0],
    )  # fmt: skip


def packed_documents(cu_seqlens: torch.Tensor, lengths: Sequence[int]) -> PackedDocuments:
    """The parameters of one packed micro-batch: `cu_seqlens` int32 [docs + 1] on the model's device and
    the same documents' lengths as Python ints."""
    longest = max(lengths)
    return PackedDocuments(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest, max_seqlen_kv=longest, lengths=tuple(int(s) for s in lengths),
    )  # fmt: skip


class SDPACoreAttention(MegatronModule):
    """megatron-core's core-attention interface (`DotProductAttention`'s) over PyTorch SDPA.

    Masks: `AttnMaskType.causal` runs SDPA's `is_causal` (the flash kernel stays eligible); a given
    `attention_mask` (megatron-core's convention: True = masked) becomes SDPA's boolean mask
    (True = attend), which rules the flash kernel out; `no_mask` attends everywhere (ViT).
    Dropout runs inside the kernel under megatron-core's model-parallel RNG tracker, as
    `DotProductAttention`'s does.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise NotImplementedError(
                "SDPA core attention supports the vanilla softmax over full windows: "
                "set model.attention local for softmax_type / window_size"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp = (
            parallel_state.get_tensor_model_parallel_world_size()
            if pg_collection is None
            else (pg_collection.tp.size())
        )
        projection_size = config.kv_channels * config.num_attention_heads
        # Kept for megatron-core code that reads them (resizable attention sets them per call); the
        # forward pass reads the head counts from the tensors.
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.hidden_size_per_partition = divide(projection_size, tp)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        # apply_query_key_layer_scaling divides the scores by the layer number and multiplies them
        # back before an fp32 softmax: no net change, so SDPA needs neither step.
        self.softmax_scale = (
            softmax_scale
            if softmax_scale is not None
            else 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_group = None
        """Context parallelism (config.context_parallel_size > 1): the ranks that split the sequence; queries
        are this rank's head-tail chunks and the keys / values are gathered (megahet/models/context_parallel.py)."""
        if config.context_parallel_size > 1:
            cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
            self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPA core attention takes no attention_bias")
        if getattr(packed_seq_params, "placement", None) is not None:
            return self._placed(query, key, value, packed_seq_params.placement)
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, np_, hn = query.shape
        q = query.permute(1, 2, 0, 3)  # (b, np, sq, hn)
        k = key.permute(1, 2, 0, 3)  # (b, ng, sk, hn)
        v = value.permute(1, 2, 0, 3)  # (b, ng, sk, hn)
        mask, causal = None, False
        if attention_mask is not None:
            mask = ~attention_mask  # megatron-core: True = masked; SDPA: True = attend
        elif mask_type == AttnMaskType.causal and sq > 1:
            causal = True
        dropout = self.dropout_p if self.training else 0.0
        gqa = k.shape[1] != np_
        if self.cp_group is not None:
            if mask is not None:
                raise NotImplementedError(
                    "context parallelism runs causal or unmasked attention, not a given mask"
                )
            causal = mask_type == AttnMaskType.causal
            with tensor_parallel.get_cuda_rng_tracker().fork() if dropout > 0.0 else contextlib.nullcontext():
                context = cp_attention(
                    q, k, v, self.cp_group, self._sdpa, causal, dropout, self.softmax_scale
                )  # (b, np, sq, hn)
        elif dropout > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = self._sdpa(q, k, v, mask, dropout, causal, gqa)
        else:
            context = self._sdpa(q, k, v, mask, dropout, causal, gqa)  # (b, np, sq, hn)
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)  # (sq, b, np*hn)

    def _placed(self, query, key, value, placement: RankPlacement) -> torch.Tensor:
        """Documents placed over the CP group by a plan: (t, 1, np, hn), (t, 1, ng, hn) x2 -> (t, 1, np*hn)."""
        if self.attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError("placed documents need causal attention")
        if self.training and self.dropout_p > 0.0:
            raise NotImplementedError(
                "placed documents run without attention dropout: set model.attention_dropout 0"
            )
        t, _, np_, hn = query.shape
        out = placed_attention(query[:, 0], key[:, 0], value[:, 0], placement, self._sdpa, self.softmax_scale)
        return out.reshape(t, 1, np_ * hn)  # (t, 1, np*hn)

    def _packed(self, query, key, value, params) -> torch.Tensor:
        """Causal attention inside each packed document: (t, np, hn), (t, ng, hn) x2 -> (t, np*hn)."""
        if params.qkv_format != "thd" or self.attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError("packed documents need causal attention in the thd format")
        if self.training and self.dropout_p > 0.0:
            raise NotImplementedError(
                "packed documents run without attention dropout: set model.attention_dropout 0"
            )
        cu = params.cu_seqlens_q  # int32 [docs + 1]
        t, np_, hn = query.shape
        gqa = key.shape[1] != np_
        if self.cp_group is not None:  # this rank's chunks of every document (cp_documents.py)
            lengths, scale = _doc_lengths(params), self.softmax_scale
            out = cp_packed_attention(query, key, value, lengths, self.cp_group, self._sdpa, scale)
            return out.reshape(t, np_ * hn)  # (t, np*hn)
        varlen = _varlen_attn() if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) else None
        if varlen is not None:
            return varlen(query, key, value, cu, params.max_seqlen_q, self.softmax_scale).reshape(t, np_ * hn)
        lengths = _doc_lengths(params)
        # 4-D (1, heads, s, hn) per document: with 3-D inputs the CPU takes SDPA's unfused math path
        # (measured 4.5x slower at s = 2048), with 4-D its flash kernel.
        q = query.permute(1, 0, 2)[None]  # (1, np, t, hn)
        k, v = key.permute(1, 0, 2)[None], value.permute(1, 0, 2)[None]  # (1, ng, t, hn)
        pieces = [
            self._sdpa(qd, kd, vd, None, 0.0, True, gqa)  # (1, np, s, hn)
            for qd, kd, vd in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))
        ]
        return torch.cat(pieces, dim=2)[0].permute(1, 0, 2).reshape(t, np_ * hn)  # (t, np*hn)

    def _sdpa(self, q, k, v, mask, dropout: float, causal: bool, gqa: bool) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.softmax_scale,
            enable_gqa=gqa,
        )  # fmt: skip


def _doc_lengths(params) -> list[int]:
    """The packed documents' lengths: from the host when `packed_documents` recorded them, else read back
    from `cu_seqlens`."""
    cu = params.cu_seqlens_q  # int32 [docs + 1]
    return list(getattr(params, "lengths", ())) or (cu[1:] - cu[:-1]).tolist()


@dataclasses.dataclass(frozen=True)
class VarlenKernel:
    """torch's varlen flash attention as this torch spells it: `causal`, its causal keyword; `takes_gqa`,
    whether it takes `enable_gqa` (torch 2.13 does, 2.11 does not: there every query head is given its
    key / value head by repeating them, exactly what enable_gqa computes)."""

    fn: Callable
    causal: dict
    takes_gqa: bool

    def __call__(self, query, key, value, cu, max_len: int, scale: float | None) -> torch.Tensor:
        """(t, np, hn), (t, ng, hn) x2, cu_seqlens int32 [docs + 1] -> (t, np, hn), causal per document."""
        gqa = {}
        if key.shape[1] != query.shape[1]:
            if self.takes_gqa:
                gqa = {"enable_gqa": True}
            else:
                repeat = query.shape[1] // key.shape[1]
                key, value = (x.repeat_interleave(repeat, 1) for x in (key, value))  # (t, np, hn)
        return self.fn(query, key, value, cu, cu, max_len, max_len, scale=scale, **self.causal, **gqa)


@functools.cache
def _varlen_attn() -> VarlenKernel | None:
    """torch's varlen_attn and how to call it, when this torch has the varlen API, else None. Its causal
    switch was `is_causal=True` in early releases and `window_size=(-1, 0)` later: read from the signature,
    as is whether it takes `enable_gqa`."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    takes_gqa = "enable_gqa" in params
    if "window_size" in params:
        return VarlenKernel(varlen_attn, {"window_size": (-1, 0)}, takes_gqa)
    if "is_causal" in params:
        return VarlenKernel(varlen_attn, {"is_causal": True}, takes_gqa)
    return None
