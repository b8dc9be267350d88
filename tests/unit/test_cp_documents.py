"""The per-document layout of packed micro-batches under context parallelism (megahet/models/cp_documents.py):
every token placed exactly once, padding only at documents' ends and masked, the gather order inverted,
each rank's attention spans causal inside its own document.

Run: ``python -m pytest tests/unit/test_cp_documents.py -q`` (a second).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megahet.data.packed import collate_spans
from megahet.models.cp_documents import DocumentLayout, packed_batch_on_this_cp_rank

LENGTHS = (5, 12, 3, 16)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_every_padded_position_is_held_by_exactly_one_rank(cp: int) -> None:
    layout = DocumentLayout.of(LENGTHS, cp)
    assert all(p % (2 * cp) == 0 and 0 <= p - n < 2 * cp for p, n in zip(layout.padded, LENGTHS))
    held = np.concatenate([layout.local_positions(r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(int(layout.padded.sum())))
    assert len({len(layout.local_positions(r)) for r in range(cp)}) == 1  # the same tokens per rank


@pytest.mark.parametrize("cp", [2, 4])
def test_the_gather_order_puts_the_documents_back_in_order(cp: int) -> None:
    layout = DocumentLayout.of(LENGTHS, cp)
    gathered = np.concatenate([layout.local_positions(r) for r in range(cp)])  # rank after rank
    assert gathered[layout.natural_index()].tolist() == list(range(int(layout.padded.sum())))


def test_source_index_pads_after_each_documents_last_token() -> None:
    layout = DocumentLayout.of((3, 6), 2)  # padded to 4 and 8
    pad = 9
    assert layout.source_index().tolist() == [0, 1, 2, pad, 3, 4, 5, 6, 7, 8, pad, pad]


@pytest.mark.parametrize("cp", [2, 4])
def test_each_chunk_attends_to_its_own_document_up_to_itself(cp: int) -> None:
    """Spans cover the rank's queries in order; every query's keys are its document's, from its first
    token up to the query's own chunk (the last block causal)."""
    layout = DocumentLayout.of(LENGTHS, cp)
    for rank in range(cp):
        positions = layout.local_positions(rank)
        spans = layout.causal_spans(rank)
        assert spans[0][0][0] == 0 and spans[-1][0][1] == len(positions)
        for (q0, q1), blocks in spans:
            first, last = int(positions[q0]), int(positions[q1 - 1])
            doc = int(np.searchsorted(layout.starts, first, side="right")) - 1
            assert blocks[0][0] == layout.starts[doc] and blocks[-1][1] == last + 1
            assert blocks[-1] == (first, last + 1, True) and all(not causal for *_, causal in blocks[:-1])


class _Pieces:
    """Two documents of tokens 10.. and 20.. (the DocumentPieces reads collate_spans makes)."""

    def read_span(self, start: int, length: int):
        x = np.arange(start, start + length, dtype=np.int64)
        return x, x + 1


def test_a_rank_gets_its_chunks_with_positions_labels_and_masked_padding() -> None:
    batch = collate_spans(_Pieces(), [(10, 3), (20, 6)])  # padded at CP 2 to 4 and 8: chunks of 1 and 2
    layout = DocumentLayout.of(batch["doc_lengths"], 2)
    mine = packed_batch_on_this_cp_rank(batch, layout, rank=1)  # chunks 1 and 2 of each document
    assert mine["tokens"].tolist() == [[11, 12, 22, 23, 24, 25]]
    assert mine["labels"].tolist() == [[12, 13, 23, 24, 25, 26]]
    assert mine["position_ids"].tolist() == [[1, 2, 2, 3, 4, 5]]
    assert mine["loss_mask"].tolist() == [[1, 1, 1, 1, 1, 1]]
    last = packed_batch_on_this_cp_rank(batch, layout, rank=0)  # chunks 0 and 3: the padding
    assert last["tokens"].tolist() == [[10, 0, 20, 21, 0, 0]] and last["loss_mask"].tolist() == [
        [1, 0, 1, 1, 0, 0]
    ]
    assert mine["cu_seqlens"].tolist() == [0, 4, 12] and mine["doc_lengths"] == [4, 8]
    assert mine["cu_seqlens"].dtype == torch.int32
