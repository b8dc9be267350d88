"""Tokenize a ``{"text": ...}`` jsonl into a megatron-core indexed dataset (``.bin`` + ``.idx``).

Role: data.

Like Megatron-LM's ``tools/preprocess_data.py``: one sequence per document (plus ``eod`` when
``append_eod``), written with ``IndexedDatasetBuilder`` to ``<output_prefix>_<json_key>_document``
``.bin/.idx``, with the smallest token dtype that holds the vocabulary (uint16 below 65500).
Both files are written under temporary names and renamed at the end (``.idx`` last), so a
crashed run never leaves a dataset that looks complete.

CLI: ``python tools/preprocess_data.py --input corpus.jsonl --output-prefix DIR/corpus
--tokenizer-model DIR/spm.model --append-eod``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron.core.tokenizers import MegatronTokenizerBase
from tqdm import tqdm

from megahet.data.tokenizer import load_tokenizer


def dataset_prefix(output_prefix: str | os.PathLike[str], json_key: str = "text") -> str:
    """The prefix of the files ``preprocess_jsonl`` writes: ``<output_prefix>_<json_key>_document``."""
    return f"{output_prefix}_{json_key}_document"


def _iter_texts(jsonl_path: str | os.PathLike[str], json_key: str) -> Iterator[str]:
    with open(jsonl_path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if json_key not in record:
                raise KeyError(f"{jsonl_path}:{lineno} has no key {json_key!r}; pass --json-key")
            yield record[json_key]


def preprocess_jsonl(
    input_path: str | os.PathLike[str],
    output_prefix: str | os.PathLike[str],
    tokenizer: MegatronTokenizerBase | str | os.PathLike[str],
    json_key: str = "text",
    append_eod: bool = True,
    workers: int = 1,
    batch_size: int = 64,
    progress: bool = True,
) -> str:
    """Tokenize every document of ``input_path``; return the dataset prefix (no extension).

    ``tokenizer`` is a tokenizer or the path of one (a SentencePiece ``.model`` or a Hugging Face
    ``tokenizer.json``, `load_tokenizer`). ``workers`` is the number of encoding threads (documents are
    encoded in batches, order kept).
    """
    if not isinstance(tokenizer, MegatronTokenizerBase):
        tokenizer = load_tokenizer(tokenizer)
    if not Path(input_path).is_file():
        raise FileNotFoundError(
            f"input {input_path} not found; build it: python -m megahet.data.corpus OUT.jsonl"
        )
    prefix = dataset_prefix(output_prefix, json_key)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f"{prefix}.tmp{os.getpid()}"
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(get_bin_path(tmp_prefix), dtype=dtype)
    texts = _iter_texts(input_path, json_key)
    bar = tqdm(desc=f"tokenize {Path(input_path).name}", unit="doc", disable=not progress)
    try:
        while batch := list(islice(texts, batch_size)):
            for ids in tokenizer.tokenize_batch(batch, num_threads=workers):
                if append_eod:
                    ids.append(tokenizer.eod)
                doc = np.asarray(ids, dtype=dtype)  # [n_tokens]; numpy, not the hinted tensor:
                builder.add_document(doc, [doc.size])  # numpy.array(tensor, dtype) warns on numpy 2
            bar.update(len(batch))
        builder.finalize(get_idx_path(tmp_prefix))
    except BaseException:
        builder.data_file.close()
        for path in (get_bin_path(tmp_prefix), get_idx_path(tmp_prefix)):
            if os.path.exists(path):
                os.remove(path)
        raise
    finally:
        bar.close()
    os.replace(get_bin_path(tmp_prefix), get_bin_path(prefix))
    os.replace(get_idx_path(tmp_prefix), get_idx_path(prefix))
    return prefix
