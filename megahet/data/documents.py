"""Whole documents of an indexed dataset as training pieces of at most `max_tokens` positions.

Role: data (issue 28: packed variable-length documents).

megatron-core's indexed dataset records every document's length (`.idx`); a split is a contiguous
range of documents, so its tokens are one contiguous run of the `.bin` file, read here through one
memory map. A document of n tokens (its eod included) trains n - 1 positions: inputs tokens[:-1],
labels tokens[1:]. One longer than `max_tokens` positions is cut into pieces of at most that many
(each piece predicts its own next tokens; the boundary token is the next piece's first input).

`length_mix` re-cuts a split's token stream into documents of generated lengths, for length mixes
the corpus does not have (web-like, code-like, long-context: a log-normal body with a Pareto tail);
`documents` keeps the corpus's own (plays, books, chapters).

    docs = DocumentPieces.from_split(prefix, split="90,5,5", name="train", max_tokens=2048, mix="documents")
    len(docs), docs.lengths[:4]         # pieces, positions per piece (int64)
    inputs, labels = docs.read(7)       # int64 [s] each
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
from megatron.core.datasets.indexed_dataset import get_bin_path

from megahet.data.gpt_data import SPLIT_NAMES, open_indexed, split_document_ranges

LengthMix = Literal["documents", "web", "code", "long"]
LENGTH_MIXES = ("documents", "web", "code", "long")

# Log-normal body (median, sigma) and Pareto tail (fraction of documents, shortest, shape) of the
# generated mixes, in tokens. Shapes, not measurements of a dataset: web pages are mostly short with a
# thin tail; code files are longer with a heavier one; the long-context mix (context parallelism, issue 45)
# is mostly short documents with one in 16 from a heavy tail reaching 16-32x the median and beyond.
_MIXES = {
    "web": {"median": 400.0, "sigma": 1.0, "tail": 0.05, "tail_min": 2000.0, "alpha": 1.5},
    "code": {"median": 600.0, "sigma": 1.2, "tail": 0.15, "tail_min": 2500.0, "alpha": 1.1},
    "long": {"median": 256.0, "sigma": 0.6, "tail": 1 / 16, "tail_min": 1024.0, "alpha": 1.0},
}


def generated_lengths(mix: str, total_tokens: int, seed: int, longest: int = 65536) -> np.ndarray:
    """Document lengths (tokens, eod included) of a web-, code-like or long-context mix that together cover at most
    `total_tokens`: int64 [n], each in [2, longest]."""
    if mix not in _MIXES:
        raise ValueError(f"unknown length mix {mix!r}; choose from {', '.join(LENGTH_MIXES)}")
    p = _MIXES[mix]
    rng = np.random.default_rng(seed)
    n = max(8, int(2 * total_tokens / p["median"]))  # more than enough; the cumulative sum cuts them
    body = rng.lognormal(np.log(p["median"]), p["sigma"], n)
    tail = p["tail_min"] * (1.0 + rng.pareto(p["alpha"], n))
    lengths = np.where(rng.random(n) < p["tail"], tail, body)
    lengths = np.clip(np.round(lengths), 2, longest).astype(np.int64)
    keep = np.searchsorted(np.cumsum(lengths), total_tokens, side="right")
    return lengths[:keep]


def split_pieces(starts: np.ndarray, lengths: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents (first token offset, tokens incl. eod) -> pieces (first token offset, positions <= max_tokens).
    A document of n tokens has n - 1 positions; one-token documents have none and are dropped."""
    positions = lengths.astype(np.int64) - 1
    counts = np.maximum(0, -(-positions // max_tokens))  # pieces per document
    doc = np.repeat(np.arange(len(lengths)), counts)
    first = np.cumsum(counts) - counts
    k = np.arange(counts.sum()) - np.repeat(first, counts)  # piece number inside its document
    piece_starts = starts[doc].astype(np.int64) + k * max_tokens
    piece_lengths = np.minimum(max_tokens, positions[doc] - k * max_tokens)
    return piece_starts, piece_lengths


@dataclasses.dataclass
class DocumentPieces:
    """Pieces of one split: `starts[i]` is piece i's first token in `tokens` (the split's token stream),
    `lengths[i]` its positions; it reads tokens[start : start + length + 1]."""

    tokens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    max_tokens: int

    def __len__(self) -> int:
        return len(self.lengths)

    def read(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, labels) of piece i: int64 [s] each."""
        return self.read_span(int(self.starts[i]), int(self.lengths[i]))

    def read_span(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, labels) of the `length` positions from token `start` (a piece or part of one)."""
        run = np.asarray(self.tokens[start : start + length + 1], dtype=np.int64)
        return run[:-1], run[1:]

    @classmethod
    def from_split(
        cls,
        data_prefix: str,
        *,
        split: str,
        name: str,
        max_tokens: int,
        mix: str = "documents",
        seed: int = 1234,
    ) -> DocumentPieces:
        """The pieces of split `name` ("train", "valid", "test") of the indexed dataset at `data_prefix`."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if name not in SPLIT_NAMES:
            raise ValueError(f"unknown split {name!r}; choose from {', '.join(SPLIT_NAMES)}")
        if mix not in LENGTH_MIXES:
            raise ValueError(f"unknown length mix {mix!r}; choose from {', '.join(LENGTH_MIXES)}")
        span = split_document_ranges(data_prefix, split)[name]
        if span is None:
            raise ValueError(f"split {name!r} has weight 0 in {split!r}")
        beg, end = span
        dataset = open_indexed(data_prefix)  # copies only: it closes its memory maps when collected
        doc_lengths = dataset.sequence_lengths.astype(np.int64)
        pointer = int(dataset.index.sequence_pointers[beg]) if beg < len(doc_lengths) else 0
        dtype = dataset.index.dtype
        del dataset
        mine = doc_lengths[beg:end]
        tokens = np.memmap(
            get_bin_path(data_prefix), dtype=dtype, mode="r", offset=pointer, shape=(int(mine.sum()),)
        )
        if mix == "documents":
            lengths = mine
        else:  # the same tokens, cut at generated boundaries (seeded per split)
            lengths = generated_lengths(mix, len(tokens), seed + SPLIT_NAMES.index(name))
        starts = np.cumsum(lengths) - lengths
        piece_starts, piece_lengths = split_pieces(starts, lengths, max_tokens)
        if len(piece_lengths) == 0:
            raise ValueError(f"split {name!r} of {data_prefix} has no document with a token to predict")
        return cls(tokens, piece_starts, piece_lengths, max_tokens)
