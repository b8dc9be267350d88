"""Packed documents under context parallelism (issue 45): each document split head-tail over the CP ranks.

Role: models (the per-document layout of a packed micro-batch on a CP rank; pure index arithmetic on the
host, plus the one gather of the batch by those indices).

As megatron-core's `thd` context parallelism does, every document of a packed micro-batch is padded to a
multiple of 2 x cp tokens (padding masked out of the loss, after the document's last token, so no real
token attends to it) and cut into 2 x cp chunks of c = padded / 2cp tokens; CP rank r holds chunks r and
2cp - 1 - r of every document, document after document. Rotary positions follow megatron-core's own thd
path (it slices each document's positions by the CP group from `cu_seqlens`); learned positions come with
the gathered position ids.

    layout = DocumentLayout.of([5, 12], cp=2)            # padded to [8, 12]: chunks of 2 and 3 tokens
    local = packed_batch_on_this_cp_rank(batch, layout, rank)   # this rank's tokens of every document
    keys = gathered[layout.natural_index()]               # ranks' tokens -> the documents in order
    spans = layout.causal_spans(rank)                     # block_attention spans of this rank's queries
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
import torch

from megahet.models.block_attention import Span, causal_chunk_spans

PADDED_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""The (1, t) tensors of a packed micro-batch (megahet/data/packed.py) that follow its tokens."""


def head_tail_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of a sequence's 2 x cp chunks CP rank `cp_rank` holds, in the order it holds them."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


@dataclasses.dataclass(frozen=True)
class DocumentLayout:
    """Where each token of a packed micro-batch lives under CP: `lengths` the documents' own lengths,
    `cp` the CP size; padded lengths are multiples of 2 x cp."""

    lengths: tuple[int, ...]
    cp: int

    @classmethod
    def of(cls, lengths: Sequence[int], cp: int) -> DocumentLayout:
        return cls(tuple(int(n) for n in lengths), int(cp))

    @functools.cached_property
    def padded(self) -> np.ndarray:
        """Each document's length rounded up to a multiple of 2 x cp."""
        step = 2 * self.cp
        return -(-np.asarray(self.lengths, dtype=np.int64) // step) * step

    @functools.cached_property
    def chunk(self) -> np.ndarray:
        """Each document's chunk length c (padded / 2cp)."""
        return self.padded // (2 * self.cp)

    @functools.cached_property
    def starts(self) -> np.ndarray:
        """Each padded document's first position in the padded micro-batch."""
        return np.concatenate([[0], np.cumsum(self.padded)[:-1]]).astype(np.int64)

    def local_positions(self, rank: int) -> np.ndarray:
        """Positions in the padded micro-batch of CP rank `rank`'s tokens, in the order it holds them."""
        pieces = [
            np.arange(start + i * c, start + (i + 1) * c)
            for start, c in zip(self.starts, self.chunk)
            for i in head_tail_chunks(rank, self.cp)
        ]
        return np.concatenate(pieces)

    def source_index(self) -> np.ndarray:
        """For each padded position: the token of the unpadded micro-batch it holds, or its length
        (the pad slot) for padding."""
        total = int(sum(self.lengths))
        own = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        pieces = [
            np.concatenate([np.arange(o, o + n), np.full(p - n, total)])
            for o, n, p in zip(own, self.lengths, self.padded)
        ]
        return np.concatenate(pieces)

    def natural_index(self) -> np.ndarray:
        """Index into the CP ranks' tokens gathered rank after rank (cp x local, dim 0) that puts the padded
        micro-batch back in order: gathered[natural_index()] is the padded micro-batch."""
        where = np.empty(int(self.padded.sum()), dtype=np.int64)
        local = int(self.padded.sum()) // self.cp
        for rank in range(self.cp):
            where[self.local_positions(rank)] = rank * local + np.arange(local)
        return where

    def causal_spans(self, rank: int) -> list[Span]:
        """block_attention spans of rank `rank`'s queries (its local tokens) over the padded micro-batch's
        keys: each of its chunks attends to its document's earlier chunks unmasked and to itself causally."""
        spans, q = [], 0
        for start, c in zip(self.starts.tolist(), self.chunk.tolist()):
            spans += causal_chunk_spans(head_tail_chunks(rank, self.cp), c, key_start=start, query_start=q)
            q += 2 * c
        return spans


def packed_batch_on_this_cp_rank(batch: dict, layout: DocumentLayout, rank: int) -> dict:
    """CP rank `rank`'s part of a packed micro-batch: its chunks of every padded document (padding masked
    out of the loss), `cu_seqlens` and `doc_lengths` of the padded documents (what megatron-core's thd
    rotary embedding and the attention read)."""
    device = batch["tokens"].device
    index = torch.from_numpy(layout.source_index()[layout.local_positions(rank)]).to(device)  # (t_local,)
    out = dict(batch)
    for key in PADDED_KEYS:
        x = batch[key]  # (1, t)
        with_pad = torch.cat([x, torch.zeros((1, 1), dtype=x.dtype, device=x.device)], dim=1)  # (1, t + 1)
        out[key] = with_pad[:, index]  # (1, t_local)
    cu = np.concatenate([[0], np.cumsum(layout.padded)]).astype(np.int32)
    out["cu_seqlens"] = torch.from_numpy(cu).to(batch["cu_seqlens"].device)  # (k + 1,), padded documents
    out["doc_lengths"] = [int(n) for n in layout.padded]
    return out
