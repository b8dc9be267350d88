"""Key blocks merged by log-sum-exp (megahet/models/block_attention.py) against SDPA over the whole sequence,
on one process: every context-parallel rank's spans, forward and backward, float64 to 1e-10, multi-head and
grouped-query; and what it saves for the backward grows linearly with the chunk (no mask).

Run: ``python -m pytest tests/unit/test_block_attention.py -q`` (a few seconds).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.cp_attention_choice import saved_bytes
from megahet.models.block_attention import causal_chunk_spans, merged_block_attention
from megahet.models.context_parallel import head_tail_chunks


def test_causal_chunk_spans_cut_the_keys_before_and_on_the_diagonal() -> None:
    assert causal_chunk_spans((0, 3), 4) == [
        ((0, 4), [(0, 4, True)]),
        ((4, 8), [(0, 12, False), (12, 16, True)]),
    ]


@pytest.mark.parametrize("groups", [4, 2, 1])
@pytest.mark.parametrize("cp", [2, 4])
def test_every_rank_gets_the_whole_sequence_attention_and_its_gradients(cp: int, groups: int) -> None:
    b, heads, length, hn = 2, 4, 6, 8
    s = 2 * cp * length
    gen = torch.Generator().manual_seed(cp * 10 + groups)
    q, k, v = (torch.randn(b, h, s, hn, generator=gen, dtype=torch.float64) for h in (heads, groups, groups))
    scale = 0.3  # not 1 / sqrt(hn): the scale reaches the kernels, forward and backward
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=groups != heads)
    grad = torch.randn(full.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(full, (q, k, v), grad)
    got = [torch.zeros_like(x) for x in (q, k, v)]
    for rank in range(cp):
        chunks = head_tail_chunks(rank, cp)
        mine = torch.cat([torch.arange(c * length, (c + 1) * length) for c in chunks])  # (2L,)
        q_rank = q.detach()[:, :, mine].requires_grad_()
        out = merged_block_attention(q_rank, k, v, causal_chunk_spans(chunks, length), scale)
        torch.testing.assert_close(out, full.detach()[:, :, mine], rtol=1e-10, atol=1e-10)
        dq, dk, dv = torch.autograd.grad(out, (q_rank, k, v), grad[:, :, mine])
        got[0][:, :, mine] += dq
        got[1] += dk
        got[2] += dv
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=f"d{name}")


def _saved_bytes(length: int) -> int:
    """Bytes autograd saves for the last CP rank's chunks (the longest key prefix) at CP 2."""
    q = torch.randn(1, 4, 2 * length, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 4 * length, 16, requires_grad=True) for _ in range(2))
    return saved_bytes(
        lambda: merged_block_attention(q, k, v, causal_chunk_spans(head_tail_chunks(1, 2), length))
    )


def test_what_is_saved_grows_linearly_with_the_chunk() -> None:
    """q, k, v, the output and the log-sum-exp: 8x the tokens, 8x the bytes (a mask would be 64x)."""
    assert _saved_bytes(512) == 8 * _saved_bytes(64)


def test_merged_blocks_refuse_a_device_other_than_the_cpu() -> None:
    q = torch.empty(1, 2, 4, 8, device="meta")
    with pytest.raises(ValueError, match="merged key blocks run the CPU flash kernel; on meta take SDPA"):
        merged_block_attention(q, q, q, causal_chunk_spans((0, 1), 2))
