"""Matmul FLOPs of a transformer, per token: what the stage planner weighs layers by and what MFU counts.

Role: policy (pure arithmetic, no torch).

    transformer_layer_flops(hidden=1536, ffn=4096, seq=2048, heads=12, query_groups=4, gated=True, causal=True)

Forward FLOPs per token at 2 per multiply-add; a training step is 3x the forward (Megatron's count, no
recompute).
"""

from __future__ import annotations


def transformer_layer_flops(
    hidden: int,
    ffn: int,
    seq: int,
    *,
    heads: int | None = None,
    query_groups: int | None = None,
    gated: bool = False,
    causal: bool = False,
) -> float:
    """One layer's forward matmul FLOPs per token:
    - Q and output projections 2 x 2 h^2; K and V 2 x 2 h kv, with kv = h g / heads (grouped-query
      attention; kv = h for multi-head);
    - MLP 2 h ffn per matrix: 3 with a gated linear unit (gate, up, down: SwiGLU), else 2;
    - attention scores and values 2 x 2 s h over the full s x s, or half of it where the kernel skips
      the masked half (causal: flash attention computes the lower triangle only)."""
    kv = hidden if not heads or not query_groups else hidden * query_groups // heads
    projections = 4 * hidden * hidden + 4 * hidden * kv
    mlp = 2 * hidden * ffn * (3 if gated else 2)
    attention = 4 * seq * hidden * (0.5 if causal else 1.0)
    return projections + mlp + attention


def output_layer_flops(hidden: int, vocab: int) -> float:
    """The language-model head's forward FLOPs per token (2 h V); the embedding lookup is free."""
    return 2 * hidden * vocab
