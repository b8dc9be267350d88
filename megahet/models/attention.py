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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


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
        if config.context_parallel_size != 1:
            raise NotImplementedError("SDPA core attention does not support context parallelism")
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise NotImplementedError(
                "SDPA core attention supports the vanilla softmax over full windows: "
                "set model.attention local for softmax_type / window_size"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp = (
            tensor_parallel.get_tensor_model_parallel_world_size()
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
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPA core attention takes no packed_seq_params or attention_bias")
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
        if dropout > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = self._sdpa(q, k, v, mask, dropout, causal, gqa)
        else:
            context = self._sdpa(q, k, v, mask, dropout, causal, gqa)  # (b, np, sq, hn)
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)  # (sq, b, np*hn)

    def _sdpa(self, q, k, v, mask, dropout: float, causal: bool, gqa: bool) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.softmax_scale,
            enable_gqa=gqa,
        )  # fmt: skip
