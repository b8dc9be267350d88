"""The GPU benchmarks' arithmetic (benchmarks/gpu_throughput.py): the model-FLOPs count MFU rests on.

Run: ``python -m pytest tests/unit/test_gpu_benchmarks.py -q`` (seconds; the benchmarks themselves
need a GPU to mean anything, see docs/gpu.md).
"""

from __future__ import annotations

import pytest

from benchmarks.gpu_throughput import model_flops_per_step
from megahet.config import MegahetConfig, apply_overrides


def _cfg(layers: int, hidden: int, seq: int, **extra) -> MegahetConfig:
    base = {"model.num_layers": layers, "model.hidden_size": hidden, "model.num_attention_heads": 16,
            "model.seq_length": seq}  # fmt: skip
    return apply_overrides(MegahetConfig(), {**base, **extra})


@pytest.mark.parametrize("layers, hidden, seq, vocab", [(24, 1024, 2048, 8192), (12, 768, 1024, 50304)])
def test_model_flops_match_megatrons_formula_with_causal_attention(layers, hidden, seq, vocab) -> None:
    """With a 4h MLP: 72 B s L h^2 (1 + s / 6h) + 6 B s h V is Megatron's count without recompute over the
    full s x s (Narayanan et al. 2021); a causal kernel computes half the attention term: s / 12h."""
    tokens = 8 * seq
    expected = 72 * tokens * layers * hidden**2 * (1 + seq / (12 * hidden)) + 6 * tokens * hidden * vocab
    assert model_flops_per_step(_cfg(layers, hidden, seq), vocab, tokens) == pytest.approx(expected)


def test_model_flops_follow_the_mlp_width_swiglu_and_query_groups() -> None:
    """Each MLP unit is 2 h multiply-adds per token forward (12 h FLOPs per token per step), 3 h with SwiGLU;
    grouped-query attention shrinks K and V by groups / heads."""
    base = model_flops_per_step(_cfg(2, 256, 128, **{"model.ffn_hidden_size": 1024}), 1000, 512)
    wider = model_flops_per_step(_cfg(2, 256, 128, **{"model.ffn_hidden_size": 1025}), 1000, 512)
    assert wider - base == pytest.approx(2 * 12 * 256 * 512)
    swiglu = {"model.ffn_hidden_size": 1024, "model.activation": "swiglu"}
    gated = model_flops_per_step(_cfg(2, 256, 128, **swiglu), 1000, 512)
    assert gated - base == pytest.approx(2 * 3 * 2 * 256 * 1024 * 512)  # one more matrix, 2 layers
    gqa = model_flops_per_step(_cfg(2, 256, 128, **swiglu, **{"model.num_query_groups": 4}), 1000, 512)
    assert gated - gqa == pytest.approx(2 * 3 * 4 * 256 * (256 - 64) * 512)  # K and V of 4 of 16 heads
