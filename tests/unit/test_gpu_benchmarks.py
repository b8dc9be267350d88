"""The GPU benchmarks' arithmetic (benchmarks/gpu_throughput.py): the model-FLOPs count MFU rests on.

Run: ``python -m pytest tests/unit/test_gpu_benchmarks.py -q`` (seconds; the benchmarks themselves
need a GPU to mean anything, see docs/gpu.md).
"""

from __future__ import annotations

import pytest

from benchmarks.gpu_throughput import model_flops_per_step


@pytest.mark.parametrize("layers, hidden, seq, vocab", [(24, 1024, 2048, 8192), (12, 768, 1024, 50304)])
def test_model_flops_match_megatrons_formula(layers: int, hidden: int, seq: int, vocab: int) -> None:
    """With a 4h MLP: 72 B s L h^2 (1 + s / 6h) + 6 B s h V, Megatron's count without recompute
    (Narayanan et al. 2021: 96 ... with full recompute, whose logit term is not recomputed)."""
    tokens = 8 * seq
    expected = 72 * tokens * layers * hidden**2 * (1 + seq / (6 * hidden)) + 6 * tokens * hidden * vocab
    assert model_flops_per_step(layers, hidden, 4 * hidden, seq, vocab, tokens) == pytest.approx(expected)


def test_model_flops_follow_the_mlp_width() -> None:
    """Each MLP unit is 2 h multiply-adds per token forward: 12 h FLOPs per token per step."""
    base = model_flops_per_step(2, 256, 1024, 128, 1000, 512)
    assert model_flops_per_step(2, 256, 1025, 128, 1000, 512) - base == pytest.approx(2 * 12 * 256 * 512)
