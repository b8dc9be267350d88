"""Train megahet's SentencePiece BPE tokenizer on a ``{"text": ...}`` jsonl corpus.

Usage::

    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix DIR/spm --vocab-size 8192

writes ``DIR/spm.model`` (and ``DIR/spm.vocab``, pieces repr-quoted with their scores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megahet.data.tokenizer import SentencePieceTokenizer, train_sentencepiece


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, type=Path, help="jsonl corpus, one document a line")
    parser.add_argument("--output-prefix", required=True, type=Path, help="writes PREFIX.model / .vocab")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--json-key", default="text")
    args = parser.parse_args(argv)
    if not args.input.is_file():
        parser.error(
            f"--input {args.input} does not exist; build it: python -m megahet.data.corpus OUT.jsonl"
        )
    start = time.perf_counter()
    model = train_sentencepiece(args.input, args.output_prefix, args.vocab_size, args.json_key)
    tok = SentencePieceTokenizer(model)
    print(f"wrote {model} (vocab {tok.vocab_size}, eod {tok.eod}) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
