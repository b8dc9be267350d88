"""Test support: the reference model of ZERO-resizing — dropped units' weights set to zero by
explicit index arithmetic, independent of megahet.tensor_parallel.blocks. Shared by the unit tests
and the torchrun workers (which put tests/ on sys.path)."""

from __future__ import annotations

import torch


@torch.no_grad()
def zero_units(model, drops: dict[tuple[str, int], tuple[int, ...]]) -> None:
    """Zero fc1 rows + biases and fc2 columns of dropped MLP units (SwiGLU: the unit's gate row u and up
    row F + u of the rank's F units); qkv rows + biases and proj columns of dropped heads (megatron-core's
    MHA layout: per head [q, k, v] rows of head size)."""
    for layer in model.decoder.layers:
        n = layer.layer_number
        attention, mlp = layer.self_attention, layer.mlp
        hn = attention.hidden_size_per_attention_head
        fc1 = mlp.linear_fc1
        units = fc1.weight.shape[0] // (2 if mlp.config.gated_linear_unit else 1)
        for u in drops.get(("mlp", n), ()):
            rows = [u, units + u] if mlp.config.gated_linear_unit else [u]
            fc1.weight[rows, :] = 0
            if fc1.bias is not None:
                fc1.bias[rows] = 0
            mlp.linear_fc2.weight[:, u] = 0
        for h in drops.get(("attn", n), ()):
            attention.linear_qkv.weight[3 * hn * h : 3 * hn * (h + 1), :] = 0
            if attention.linear_qkv.bias is not None:
                attention.linear_qkv.bias[3 * hn * h : 3 * hn * (h + 1)] = 0
            attention.linear_proj.weight[:, hn * h : hn * (h + 1)] = 0
