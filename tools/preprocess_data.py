"""Tokenize a jsonl corpus into a megatron-core indexed dataset (Megatron-LM style CLI).

Usage::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix DIR/corpus \
        --tokenizer-model DIR/spm.model --append-eod [--json-key text] [--workers 2]
    python tools/preprocess_data.py ... --tokenizer-model hf_model/tokenizer.json --append-eod   # an HF tokenizer

writes ``DIR/corpus_text_document.bin`` and ``.idx``; train on the prefix ``DIR/corpus_text_document``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megahet.data.preprocess import preprocess_jsonl
from megahet.data.tokenizer import load_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, type=Path, help="jsonl, one document a line")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_<json-key>_document.bin/.idx")
    parser.add_argument(
        "--tokenizer-model",
        required=True,
        type=Path,
        help="SentencePiece .model, or a Hugging Face tokenizer.json",
    )
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod id")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer threads")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer_model)
    prefix = preprocess_jsonl(
        args.input, args.output_prefix, tokenizer, args.json_key, args.append_eod, args.workers
    )
    print(f"wrote {prefix}.bin/.idx in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
