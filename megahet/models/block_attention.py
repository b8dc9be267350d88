"""Attention of query chunks over blocks of keys, merged by log-sum-exp: no mask anywhere (issue 45).

Role: models (a kernel composition; context parallelism calls it, megahet/models/context_parallel.py).

A context-parallel rank's query chunk i attends causally to the keys of chunks 0..i: a causal corner that is
not the top-left one. SDPA takes it as a `causal_lower_right` bias, which the CPU flash kernel materializes
as a mask quadratic in the chunk. Here the keys are cut into blocks instead, each run by the flash kernel
with its log-sum-exp: the earlier chunks unmasked, the chunk's own diagonal block `is_causal` (square, so
top-left and lower-right agree), and the blocks' outputs merged by their log-sum-exps:

    lse = logaddexp(lse_1, lse_2);  out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2

The backward runs the flash kernel's own backward on each block with the merged output and log-sum-exp
(the block's share of the whole softmax), as ring attention does, and sums the blocks' gradients.
Grouped-query attention repeats the key / value heads per block inside the kernel calls only: what is
saved for the backward is the unrepeated keys and values, the output and the log-sum-exp.

    spans = [((0, L), [(0, L, True)]), ((L, 2L), [(0, 3L, False), (3L, 4L, True)])]
    out = merged_block_attention(q, k, v, spans, scale)   # q (b, np, 2L, hn), k, v (b, ng, 4L, hn)

CPU only (`_scaled_dot_product_flash_attention_for_cpu`, float64 / float32 / bfloat16 / float16); on CUDA the
fused kernels take the lower-right causal corner without a mask, so the caller keeps SDPA there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Block = tuple[int, int, bool]
"""Keys [start, end) of the whole sequence, and whether the block is the query chunk's causal diagonal."""
Span = tuple[tuple[int, int], Sequence[Block]]
"""Queries [start, end) of this rank's chunks, and the key blocks they attend to."""

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, ng, n, hn) -> (b, heads, n, hn): every query head given its key / value head."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """(b, np, n, hn) -> (b, ng, n, hn): the query heads' gradients summed per key / value head."""
    b, heads, n, hn = grad.shape
    return grad if heads == groups else grad.view(b, groups, heads // groups, n, hn).sum(2)


def _block(q, k, v, causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention of q (b, np, m, hn) over k, v (b, np, n, hn): out (b, np, m, hn), lse (b, np, m)."""
    return _forward(q, k, v, 0.0, causal, scale=scale)


def _merge(out, lse, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax-normalized partial attentions over disjoint keys -> the one over both (fp32 or wider)."""
    merged = torch.logaddexp(lse, block_lse)  # (b, np, m)
    out = out * torch.exp(lse - merged)[..., None] + block_out * torch.exp(block_lse - merged)[..., None]
    return out, merged


class _MergedBlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spans: Sequence[Span], scale: float | None):
        heads, wide = q.shape[1], torch.promote_types(q.dtype, torch.float32)
        outs, lses = [], []
        for (q0, q1), blocks in spans:
            queries = q[:, :, q0:q1]  # (b, np, m, hn)
            out = lse = None
            for k0, k1, causal in blocks:
                block_out, block_lse = _block(
                    queries, _heads(k[:, :, k0:k1], heads), _heads(v[:, :, k0:k1], heads), causal, scale
                )
                block_out, block_lse = block_out.to(wide), block_lse.to(wide)
                out, lse = (block_out, block_lse) if out is None else _merge(out, lse, block_out, block_lse)
            outs.append(out)
            lses.append(lse)
        out = torch.cat(outs, dim=2).to(q.dtype)  # (b, np, sq, hn)
        lse = torch.cat(lses, dim=2).to(torch.float32 if q.dtype != torch.float64 else q.dtype)  # (b, np, sq)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spans, ctx.scale = spans, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        heads, groups = q.shape[1], k.shape[1]
        grad = grad.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (q0, q1), blocks in ctx.spans:
            rows = slice(q0, q1)
            for k0, k1, causal in blocks:
                dq_b, dk_b, dv_b = _backward(
                    grad[:, :, rows], q[:, :, rows], _heads(k[:, :, k0:k1], heads),
                    _heads(v[:, :, k0:k1], heads), out[:, :, rows], lse[:, :, rows], 0.0, causal,
                    scale=ctx.scale,
                )  # fmt: skip
                dq[:, :, rows] += dq_b
                dk[:, :, k0:k1] += _groups(dk_b, groups)
                dv[:, :, k0:k1] += _groups(dv_b, groups)
        return dq, dk, dv, None, None


def merged_block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Sequence[Span], scale: float | None = None
) -> torch.Tensor:
    """q (b, np, sq, hn), k and v (b, ng, sk, hn) -> (b, np, sq, hn): each span's queries attend to its key
    blocks (softmax over all of them together); `scale` as SDPA's (None: 1 / sqrt(hn))."""
    if q.device.type != "cpu":
        raise ValueError(
            f"merged key blocks run the CPU flash kernel; on {q.device.type} take SDPA's lower-right causal "
            "corner (context_parallel.attend_spans with merge None or False)"
        )
    return _MergedBlockAttention.apply(q, k, v, spans, scale)


def causal_chunk_spans(
    chunks: Sequence[int], length: int, key_start: int = 0, query_start: int = 0
) -> list[Span]:
    """The spans of a rank holding chunks `chunks` of one sequence (each `length` tokens, in the order held)
    under a causal mask: chunk c's queries attend to the keys before it unmasked and to its own chunk
    causally. The sequence's keys begin at `key_start` of the keys, the rank's chunks at `query_start` of
    its queries (a packed document's place in its micro-batch)."""
    spans = []
    for i, chunk in enumerate(chunks):
        first = key_start + chunk * length
        before = [(key_start, first, False)] if chunk else []
        queries = (query_start + i * length, query_start + (i + 1) * length)
        spans.append((queries, [*before, (first, first + length, True)]))
    return spans
