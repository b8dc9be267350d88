"""SentencePiece BPE tokenizer: deterministic training and a megatron-core tokenizer wrapper.

Role: data.

``train_sentencepiece(corpus.jsonl, DIR/spm)`` trains a byte-fallback BPE model (about 1.5 s for
8k pieces on the ~9 M-character corpus) and writes ``DIR/spm.model`` and ``DIR/spm.vocab``.
``SentencePieceTokenizer(DIR/spm.model)`` is what ``GPTDatasetConfig.tokenizer`` takes;
``load_tokenizer(path)`` gives it, or a Hugging Face ``tokenizer.json``'s (megahet/data/hf_tokenizers.py).

Special ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>`` (= end of document, ``eod``), 3 ``<pad>``,
4 ``"\\n"``. Normalization is the identity and whitespace is kept as is, so
``detokenize(tokenize(text)) == text`` for any text (unknown characters fall back to bytes).

CLI: ``python tools/train_tokenizer.py --input corpus.jsonl --output-prefix DIR/spm``.
"""

from __future__ import annotations

import io
import json
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm
from megatron.core.tokenizers import MegatronTokenizerBase

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
NEWLINE = "\n"


def _iter_training_sentences(jsonl_path: str | os.PathLike[str], json_key: str) -> Iterator[str]:
    """Paragraphs (blank-line separated) of every document, so that words right after a line
    break (verse lines, speaker names) are seen in context with the newline piece."""
    with open(jsonl_path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            for paragraph in json.loads(line)[json_key].split("\n\n"):
                if paragraph.strip():
                    yield paragraph


def train_sentencepiece(
    jsonl_path: str | os.PathLike[str],
    model_prefix: str | os.PathLike[str],
    vocab_size: int = 8192,
    json_key: str = "text",
) -> Path:
    """Train a BPE SentencePiece model on the texts of a jsonl; return the ``.model`` path.

    Deterministic: every sentence is used in file order (no sampling, no shuffling) and one
    trainer thread. ``vocab_size`` must exceed 256 byte pieces + 5 specials + the corpus's
    distinct characters (~340 for the real corpus). Files are written atomically.
    """
    model_prefix = Path(model_prefix)
    model_prefix.parent.mkdir(parents=True, exist_ok=True)
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_iter_training_sentences(jsonl_path, json_key),
        model_writer=proto,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        user_defined_symbols=[NEWLINE],
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=PAD_ID,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=1 << 17,  # a Bible chapter is one paragraph (Psalm 119: ~25k bytes)
        num_threads=1,
        minloglevel=2,
    )
    model_path = model_prefix.with_name(model_prefix.name + ".model")
    vocab_path = model_prefix.with_name(model_prefix.name + ".vocab")
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    vocab_lines = [f"{sp.id_to_piece(i)!r}\t{sp.get_score(i)}\n" for i in range(sp.get_piece_size())]
    for path, data in ((vocab_path, "".join(vocab_lines).encode()), (model_path, proto.getvalue())):
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return model_path


def load_tokenizer(path: str | os.PathLike[str]) -> MegatronTokenizerBase:
    """The data path's tokenizer for `path`: a Hugging Face tokenizer.json (or a folder holding one) is an
    `HFTokenizer` (megahet/data/hf_tokenizers.py), anything else a SentencePiece model."""
    path = Path(path).expanduser()
    if path.suffix == ".json" or path.is_dir():
        from megahet.data.hf_tokenizers import HFTokenizer

        return HFTokenizer(path)
    return SentencePieceTokenizer(path)


def tokenizer_files(path: str | os.PathLike[str]) -> dict[str, Path]:
    """The files a checkpoint carries for the tokenizer at `path`, by the names they take there: a
    SentencePiece model as tokenizer.model; a tokenizer.json with the tokenizer_config.json beside it."""
    path = Path(path).expanduser()
    if path.suffix == ".json" or path.is_dir():
        from megahet.data.hf_tokenizers import TOKENIZER_CONFIG, TOKENIZER_JSON, tokenizer_json

        file = tokenizer_json(path)
        files = {TOKENIZER_JSON: file, TOKENIZER_CONFIG: file.with_name(TOKENIZER_CONFIG)}
        return {name: f for name, f in files.items() if f.is_file()}
    return {"tokenizer.model": path}


class SentencePieceTokenizer(MegatronTokenizerBase):
    """A SentencePiece model behind megatron-core's tokenizer interface.

    megatron-core 0.16 types ``GPTDatasetConfig.tokenizer`` as ``MegatronTokenizerBase``
    (``megatron.core.tokenizers``); ``datasets/megatron_tokenizer.py`` only holds the deprecated
    ``MegatronLegacyTokenizer``. GPTDataset reads ``vocab_size``, ``eod``, ``pad`` and hashes
    ``unique_identifiers`` into its index-cache key.
    """

    def __init__(self, model_path: str | os.PathLike[str]) -> None:
        model_path = Path(model_path)
        if not model_path.is_file():
            raise FileNotFoundError(
                f"tokenizer model {model_path} not found; train it: python tools/train_tokenizer.py "
                f"--input corpus.jsonl --output-prefix {model_path.with_suffix('')}"
            )
        super().__init__(str(model_path), {"library": "sentencepiece"})
        self._sp = spm.SentencePieceProcessor(model_file=str(model_path))
        if self._sp.eos_id() < 0:
            raise ValueError(f"tokenizer model {model_path} has no </s> piece to use as end of document")
        self._vocab: dict[str, int] | None = None

    # pickling (DataLoader workers): reload the model from its path
    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])

    def tokenize(self, text: str) -> list[int]:
        """Text -> token ids (no bos/eos added)."""
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Many texts -> token ids, encoded by ``num_threads`` SentencePiece threads."""
        return self._sp.encode(list(texts), num_threads=num_threads)

    def detokenize(self, ids: Sequence[int] | Any) -> str:
        """Token ids (list, numpy array or 1-D tensor) -> text."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._sp.decode([int(i) for i in ids])

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("SentencePieceTokenizer has no chat template")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def vocab(self) -> dict[str, int]:
        """Piece -> id."""
        if self._vocab is None:
            self._vocab = {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id -> piece."""
        return {i: piece for piece, i in self.vocab.items()}

    @property
    def eod(self) -> int:
        """End-of-document id (the ``</s>`` piece), appended to every document."""
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    @property
    def unk(self) -> int:
        return self._sp.unk_id()

    @property
    def unique_identifiers(self) -> OrderedDict[str, Any]:
        """What identifies this tokenizer in megatron-core's dataset cache key."""
        return OrderedDict(class_=type(self).__name__, tokenizer_path=self.path, vocab_size=self.vocab_size)
