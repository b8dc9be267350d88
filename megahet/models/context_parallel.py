"""Context parallelism (issue 45), static: the sequence split over the `parallel.cp` ranks of a CP group.

Role: models (what the attention, the data and the loss do differently when a sequence is split).

The sequence is cut into 2 x cp chunks and CP rank r holds chunks r and 2cp - 1 - r (megatron-core's
load-balanced causal split, its `get_batch_on_this_cp_rank`: under a causal mask chunk i attends to i + 1
chunks, so every rank gets the same attention work). Everything but attention is per token and runs on the
rank's own tokens unchanged; rotary embeddings take this rank's chunks' positions from megatron-core's
`RotaryEmbedding` (it slices them by the CP group), learned positions come with the sliced position ids.

Attention all-gathers the keys and values of the whole sequence once per layer (the Llama 3 approach, and
torchtitan's for document masks); each of the rank's query chunks attends to the keys up to its end, causal
in the chunk's own corner (`attend_spans`): on CPU as key blocks merged by log-sum-exp (no mask:
block_attention.py), on CUDA and with dropout as SDPA with `causal_lower_right` (which the fused kernels
take without a mask). The gather's backward sums the key / value gradients of every rank and hands each its
own chunks (a reduce-scatter; on gloo, which has none, an all-reduce and its slice). Packed documents are
split per document (cp_documents.py) and attend inside their own document (`cp_packed_attention`).

    chunks = head_tail_chunks(cp_rank, cp)                        # (r, 2cp - 1 - r)
    context = cp_attention(q, k, v, group, sdpa, causal=True)    # (b, np, 2L, hn), this rank's queries
    batch = packed_on_this_cp_rank(batch)                         # packed: its chunks of every document
    loss_sum, tokens = cp_totals(loss_sum, tokens, group)         # the sequence's, over the CP group

The loss: each rank's loss is its own tokens' sum over the whole sequence's token count, so the gradients
summed over the CP group are the sequence's; DeepSpeed sums them over CP and averages over DP (the CP
ranks are its "sequence parallel" ranks: megahet/parallel.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch.nn.attention.bias import causal_lower_right

from megahet.models.block_attention import Span, causal_chunk_spans, merged_block_attention
from megahet.models.cp_documents import DocumentLayout, head_tail_chunks, packed_batch_on_this_cp_rank


def natural_order(cp_size: int) -> list[int]:
    """Where each of the 2 x cp chunks lies in the gathered tensor (rank r's two chunks at 2r, 2r + 1):
    gathered[natural_order[i]] is chunk i."""
    where = [0] * (2 * cp_size)
    for rank in range(cp_size):
        for k, chunk in enumerate(head_tail_chunks(rank, cp_size)):
            where[chunk] = 2 * rank + k
    return where


def _reduce_scatter(full: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `full` summed, this rank's equal part along dim 0 returned."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter
        full = full.contiguous()
        dist.all_reduce(full, group=group)
        return full.chunk(size)[rank].clone()
    out = torch.empty((full.shape[0] // size, *full.shape[1:]), dtype=full.dtype, device=full.device)
    dist.reduce_scatter_tensor(out, full.contiguous(), group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    """(s, ...) per rank -> (cp * s, ...), ranks in order along dim 0; the backward reduce-scatters."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.group), None


def gather_sequence(local: torch.Tensor, group) -> torch.Tensor:
    """This rank's (2L, b, ng, hn) keys or values -> the whole sequence's (2cp L, b, ng, hn), in order."""
    cp = dist.get_world_size(group)
    gathered = _GatherSequence.apply(local, group)  # (cp 2L, b, ng, hn), rank by rank
    chunks = gathered.chunk(2 * cp)
    return torch.cat([chunks[i] for i in natural_order(cp)])


Sdpa = Callable[..., torch.Tensor]
"""SDPA as the core attention calls it: (q, k, v, mask, dropout, causal, gqa) -> context."""


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    sdpa: Sdpa,
    causal: bool,
    dropout: float = 0.0,
    scale: float | None = None,
    merge: bool | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence.

    q (b, np, 2L, hn): this rank's two chunks; k, v (b, ng, 2L, hn): its own chunks' keys and values.
    Returns (b, np, 2L, hn). `causal`: chunk i's queries attend to the keys of chunks 0..i (its own
    lower-right corner causal); else to every key (no mask). `scale`: the softmax scale `sdpa` applies;
    `merge`: see `attend_spans`."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    # (b, ng, 2L, hn) -> (2L, b, ng, hn) for the gather along the sequence, and back
    k_all, v_all = (gather_sequence(x.permute(2, 0, 1, 3), group).permute(1, 2, 0, 3) for x in (k, v))
    if not causal:
        return sdpa(q, k_all, v_all, None, dropout, False, k.shape[1] != q.shape[1])
    spans = causal_chunk_spans(head_tail_chunks(rank, cp), q.shape[2] // 2)
    return attend_spans(q, k_all, v_all, spans, sdpa, dropout, scale, merge)


def attend_spans(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spans: Sequence[Span],
    sdpa: Sdpa,
    dropout: float = 0.0,
    scale: float | None = None,
    merge: bool | None = None,
) -> torch.Tensor:
    """q (b, np, sq, hn) over k, v (b, ng, sk, hn) by `spans` (block_attention.py: each span's queries, the
    key blocks they attend to, the last causal) -> (b, np, sq, hn). `merge`: the blocks merged by
    log-sum-exp (no mask), else SDPA per span over its keys with a lower-right causal bias; None chooses
    the blocks on CPU without dropout (the CPU flash kernel materializes the bias as a mask), SDPA on CUDA
    (its fused kernels take the lower-right corner without a mask) and with dropout
    (benchmarks/cp_attention_choice.py)."""
    if merge is None:
        merge = dropout == 0.0 and not q.is_cuda
    if merge:
        return merged_block_attention(q, k, v, spans, scale)
    gqa = k.shape[1] != q.shape[1]
    out = []
    for (q0, q1), blocks in spans:
        k0, k1 = blocks[0][0], blocks[-1][1]
        mask = causal_lower_right(q1 - q0, k1 - k0)
        out.append(sdpa(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], mask, dropout, False, gqa))
    return torch.cat(out, dim=2)  # (b, np, sq, hn)


def cp_packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], group, sdpa: Sdpa, scale=None
) -> torch.Tensor:
    """Causal attention inside each packed document, its tokens split over the CP group (cp_documents.py):
    q (t, np, hn), k, v (t, ng, hn) this rank's chunks of every document; `lengths` the padded documents'
    lengths (multiples of 2 cp). Returns (t, np, hn)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = DocumentLayout.of(lengths, cp)
    order = _natural_index(layout, k.device)  # (cp t,)
    k_all, v_all = (_GatherSequence.apply(x, group).index_select(0, order) for x in (k, v))  # (cp t, ng, hn)
    q4, k4, v4 = (x.permute(1, 0, 2)[None] for x in (q, k_all, v_all))  # (1, heads, tokens, hn)
    out = attend_spans(q4, k4, v4, layout.causal_spans(rank), sdpa, 0.0, scale)  # (1, np, t, hn)
    return out[0].permute(1, 0, 2)  # (t, np, hn)


@functools.lru_cache(maxsize=8)
def _natural_index(layout: DocumentLayout, device: torch.device) -> torch.Tensor:
    """The micro-batch's gather order on `device`, once per micro-batch (every layer reuses it)."""
    return torch.from_numpy(layout.natural_index()).to(device)


def cp_totals(loss_sum: torch.Tensor, tokens: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, token count) of the whole sequences over the CP group: new tensors, detached (for the
    denominator and the reports; the schedule divides the loss in place); this rank's own without a group."""
    if group is None or dist.get_world_size(group) == 1:
        return loss_sum.detach().clone(), tokens.clone()
    totals = torch.stack([loss_sum.detach().float(), tokens.float()])  # (2,)
    dist.all_reduce(totals, group=group)
    return totals[0], totals[1]


def packed_on_this_cp_rank(batch: dict) -> dict:
    """A packed micro-batch (megahet/data/packed.py) as this rank holds it: unchanged without context
    parallelism, else its chunks of every document, padded to multiples of 2 cp (cp_documents.py)."""
    group = cp_group()
    if group is None:
        return batch
    layout = DocumentLayout.of(batch["doc_lengths"], dist.get_world_size(group))
    return packed_batch_on_this_cp_rank(batch, layout, dist.get_rank(group))


def cp_group():
    """The context-parallel group of this rank, None without context parallelism (parallel.cp 1)."""
    if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
        return None
    return ps.get_context_parallel_group()


def cp_rank() -> int:
    """This rank's place in its CP group (0 without context parallelism)."""
    group = cp_group()
    return 0 if group is None else dist.get_rank(group)
