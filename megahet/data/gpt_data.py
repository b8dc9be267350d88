"""Train/valid/test megatron-core ``GPTDataset``s over one preprocessed indexed dataset.

Role: data.

``build_gpt_datasets(prefix, tokenizer, seq_length, split="949,50,1", num_samples=(n, m, k))``
wraps ``BlendedMegatronDatasetBuilder`` + ``GPTDatasetConfig`` and adds the checks megatron-core
lacks: a missing or foreign ``.bin/.idx`` and a split that would receive zero documents (megatron-core
would loop forever in ``GPTDataset._get_num_epochs``) raise one-line errors up front. The index is read
by megatron-core's own ``IndexedDataset`` (`open_indexed`), never by hand.

Each sample is a dict of ``tokens`` / ``labels`` (int64 [seq_length], labels = tokens shifted
by one), ``loss_mask`` (float [seq_length]), ``position_ids`` (int64 [seq_length]) and, when
``create_attention_mask``, ``attention_mask`` (bool [1, seq_length, seq_length], True = masked).

Works with torch.distributed uninitialized or initialized (any backend, e.g. gloo): then every
rank of the default group must call it; rank 0 builds the index cache, the others load it.
The cache (``<prefix folder>/cache`` unless ``cache_dir``) is keyed by a hash of the config.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, IndexedDataset, get_bin_path, get_idx_path
from megatron.core.datasets.utils import Split
from megatron.core.tokenizers import MegatronTokenizerBase

SPLIT_NAMES = tuple(s.name for s in Split)  # ("train", "valid", "test")


def open_indexed(data_prefix: str) -> IndexedDataset:
    """megatron-core's ``IndexedDataset`` over ``data_prefix.bin/.idx`` (memory-mapped: its index's dtype,
    sequence lengths and pointers), with one-line errors for a missing file and for a file that is not an
    indexed dataset (megatron-core asserts on its magic number and version)."""
    data_prefix = str(data_prefix)
    for path in (get_bin_path(data_prefix), get_idx_path(data_prefix)):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} not found; build it: python tools/preprocess_data.py --input corpus.jsonl "
                f"--output-prefix {data_prefix.removesuffix('_text_document')} "
                f"--tokenizer-model spm.model --append-eod"
            )
    problem = _index_problem(get_idx_path(data_prefix))
    if problem:
        raise ValueError(
            f"{get_idx_path(data_prefix)} is not a megatron-core indexed dataset ({problem}); "
            f"rebuild it with tools/preprocess_data.py"
        )
    return IndexedDataset(data_prefix)


def _index_problem(idx_path: str) -> str | None:
    """What makes a file no megatron-core .idx, checked before megatron-core reads it (its reader asserts,
    and a half-built IndexedDataset then raises again in its __del__): the magic number and version, and
    the size its counts call for (header, int32 lengths and int64 pointers per sequence, int64 document
    indices)."""
    with open(idx_path, "rb") as f:
        header = f.read(34)  # magic 9, version 8, dtype code 1, sequences 8, documents 8
    if len(header) < 34 or header[:9] != _INDEX_HEADER:
        return "no megatron-core index header"
    version, _code, sequences, documents = struct.unpack("<QBQQ", header[9:])
    if version != 1:
        return f"index version {version}, megatron-core reads 1"
    if os.path.getsize(idx_path) < 34 + 12 * sequences + 8 * documents:
        return f"cut short: {sequences} sequences and {documents} documents need more bytes"
    return None


def read_sequence_lengths(data_prefix: str) -> np.ndarray:
    """Token count per sequence (= per document here), from the index: int32 [n_seq] (a copy: the
    IndexedDataset closes its memory maps when it is collected)."""
    dataset = open_indexed(data_prefix)
    return np.array(dataset.sequence_lengths)  # copied while `dataset` holds the map


def split_document_ranges(data_prefix: str, split: str = "949,50,1") -> dict[str, tuple[int, int] | None]:
    """``{split name: (first document, end document)}`` as megatron-core will cut them; None = split unused.

    Mirrors ``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``: contiguous
    document ranges ``[round(lo * n), round(hi * n))`` of the normalized split matrix.
    """
    n = read_sequence_lengths(data_prefix).shape[0]
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return {
        name: None if bookends is None else (round(bookends[0] * float(n)), round(bookends[1] * float(n)))
        for name, bookends in zip(SPLIT_NAMES, matrix)
    }


def split_document_counts(data_prefix: str, split: str = "949,50,1") -> dict[str, tuple[int, int] | None]:
    """``{split name: (documents, tokens)}`` as megatron-core will cut them; None = split unused."""
    lengths = read_sequence_lengths(data_prefix)
    return {
        name: None if span is None else (span[1] - span[0], int(lengths[span[0] : span[1]].sum()))
        for name, span in split_document_ranges(data_prefix, split).items()
    }


def build_gpt_datasets(
    data_prefix: str | os.PathLike[str],
    tokenizer: MegatronTokenizerBase,
    seq_length: int,
    split: str = "949,50,1",
    num_samples: tuple[int | None, int | None, int | None] = (None, None, None),
    seed: int = 1234,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
) -> tuple[GPTDataset | None, GPTDataset | None, GPTDataset | None]:
    """(train, valid, test) GPTDatasets; a split with weight 0 in ``split`` comes back None.

    ``num_samples[i]`` is the number of samples split i must provide (megatron-core repeats
    epochs, each a fresh shuffle, to reach it); None means exactly one epoch.
    """
    data_prefix = str(data_prefix)
    open_indexed(data_prefix)  # the one-line errors of a missing or foreign file
    if len(num_samples) != len(SPLIT_NAMES):
        raise ValueError(f"num_samples needs one entry per split {SPLIT_NAMES}, got {num_samples}")
    for name, count in split_document_counts(data_prefix, split).items():
        if count is not None and min(count) == 0:
            raise ValueError(
                f"split {name!r} of {data_prefix} gets {count[0]} documents / {count[1]} tokens with "
                f"split={split!r}; give it a larger weight, weight 0 to drop it, or use more documents"
            )
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([data_prefix], None),
        split=split,
        path_to_cache=str(cache_dir if cache_dir is not None else Path(data_prefix).parent / "cache"),
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), lambda: True, config)
    train, valid, test = builder.build()
    return train, valid, test
