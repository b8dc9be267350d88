"""Hugging Face tokenizers (a `tokenizer.json`) behind megatron-core's tokenizer interface: the data path's
second tokenizer, beside SentencePiece (`load_tokenizer` in megahet/data/tokenizer.py picks one by file).

Role: data.

    tok = HFTokenizer("hf_llama/tokenizer.json")   # or the folder holding it
    tok.tokenize("Hello"), tok.eod, tok.vocab_size

A model imported from the Hub (tools/convert_checkpoint.py import-hf) keeps its own tokenizer: GPT-2's
byte-level BPE, Llama 3's, any the `tokenizers` library reads. Text is encoded without the special tokens
a template would add; every document ends in the end-of-document id, the tokenizer's eos token: the
`eos_token` of a `tokenizer_config.json` beside it, else the first of its special tokens named like one
("</s>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>"); a tokenizer without one is a one-line error.
Needs the `tokenizers` package (`pip install -e ".[hf]"`).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron.core.tokenizers import MegatronTokenizerBase

from megahet.config import ConfigError

TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>")


def tokenizer_json(path: str | os.PathLike[str]) -> Path:
    """The tokenizer.json a path names: the file, or the one in a folder."""
    path = Path(path).expanduser()
    return path / TOKENIZER_JSON if path.is_dir() else path


def _token(value: Any) -> str | None:
    """A tokenizer_config.json special token: a string, or a dict with its `content`."""
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer(MegatronTokenizerBase):
    """A `tokenizers.Tokenizer` from a tokenizer.json, as `GPTDatasetConfig.tokenizer` takes it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        file = tokenizer_json(path)
        if not file.is_file():
            raise FileNotFoundError(
                f"tokenizer {file} not found; give a tokenizer.json or the folder holding one"
            )
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(
                f'tokenizer {file} needs the `tokenizers` package: pip install -e ".[hf]"'
            ) from None
        super().__init__(str(file), {"library": "tokenizers"})
        self._tok = Tokenizer.from_file(str(file))
        config_file = file.with_name(TOKENIZER_CONFIG)
        self.config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self._eod = self._special("eos_token", EOS_NAMES)
        if self._eod is None:
            raise ConfigError(
                f"tokenizer {file} has no end-of-document token (no eos_token in a {TOKENIZER_CONFIG} beside "
                f"it, none of {', '.join(EOS_NAMES)}): add one, every document ends with it"
            )

    def _special(self, key: str, names: Sequence[str] = ()) -> int | None:
        """The id of the config's `key` token, else of the first of `names` the tokenizer has."""
        for name in (_token(self.config.get(key)), *names):
            if name is not None and (i := self._tok.token_to_id(name)) is not None:
                return i
        return None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])

    def tokenize(self, text: str) -> list[int]:
        """Text -> token ids (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Many texts -> token ids (the library's own threads)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int] | Any) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("HFTokenizer has no chat template")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: piece for piece, i in self.vocab.items()}

    @property
    def eod(self) -> int:
        """End-of-document id (the eos token), appended to every document."""
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def bos(self) -> int:
        found = self._special("bos_token")
        return -1 if found is None else found

    @property
    def pad(self) -> int:
        found = self._special("pad_token")
        return self._eod if found is None else found

    @property
    def unk(self) -> int:
        found = self._special("unk_token")
        return -1 if found is None else found

    @property
    def unique_identifiers(self) -> OrderedDict[str, Any]:
        return OrderedDict(class_=type(self).__name__, tokenizer_path=self.path, vocab_size=self.vocab_size)
