"""The run's SentencePiece BPE tokenizer as a Hugging Face `tokenizers` tokenizer.json, with the same ids
(a run that trained with a tokenizer.json exports that one as it is).

Role: tooling (Hugging Face export).

    tokenizer = hf_tokenizer("ckpt/iter_0000300/tokenizer.model", model_max_length=1024)
    save_hf_tokenizer(tokenizer, Path("hf_dir"))     # AutoTokenizer.from_pretrained("hf_dir")

The pieces and merges of the SentencePiece model become a BPE model; the leading "▁" SentencePiece adds
to every text is a normalizer, words split before each "▁", unknown characters fall back to bytes, and
<s>, </s>, <unk>, <pad> are special tokens plain text never produces. Settings that cannot be
reproduced (unigram models, normalization rules, ...) are refused, and every piece is checked to
tokenize to its own id. Used by megahet/checkpointing/convert.py's export_hf.
"""

from __future__ import annotations

import json
from pathlib import Path

from megahet.config import ConfigError

SPACE = "\u2581"  # "▁": SentencePiece's whitespace
TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # a tokenizer.json as it is (transformers 4 and 5)


def _spm_proto(path: Path):
    """The SentencePiece ModelProto of a .model file."""
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2

    if not path.is_file():
        raise ConfigError(
            f"--tokenizer: {path} not found: pass the run's SentencePiece model (data.tokenizer_model)"
        )
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except DecodeError:
        proto.Clear()
    if not proto.pieces:
        raise ConfigError(
            f"--tokenizer: {path} is not a SentencePiece model: pass the run's data.tokenizer_model"
        )
    return proto


def _check_exportable(proto, path: Path) -> None:
    """Only the SentencePiece settings the tokenizer.json reproduces exactly (train_sentencepiece's)."""
    t, n = proto.trainer_spec, proto.normalizer_spec
    unsupported = {
        "a non-BPE model": t.model_type != t.BPE,
        f"normalization {n.name!r}": bool(n.precompiled_charsmap),
        "remove_extra_whitespaces": n.remove_extra_whitespaces,
        "unescaped whitespace": not n.escape_whitespaces,
        "no split_by_whitespace": not t.split_by_whitespace,
        "treat_whitespace_as_suffix": t.treat_whitespace_as_suffix,
        "allow_whitespace_only_pieces": t.allow_whitespace_only_pieces,
        "multi-character user-defined symbols": any(
            p.type == p.USER_DEFINED and len(p.piece) > 1 for p in proto.pieces
        ),
    }
    found = [what for what, bad in unsupported.items() if bad]
    if found:
        raise ConfigError(
            f"export-hf: tokenizer {path} uses {', '.join(found)}, which the Hugging Face tokenizer does not "
            f"reproduce: use a tokenizer trained by tools/train_tokenizer.py"
        )


def _bpe_vocab_and_merges(proto) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(piece -> id, merges): every split of a normal piece into two normal pieces, ranked as SentencePiece
    BPE merges (the merged piece with the highest score first)."""
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    normal = {p.piece: (-p.score, i) for i, p in enumerate(proto.pieces) if p.type == p.NORMAL}
    ranked = sorted(
        (normal[piece], vocab[piece[:k]], piece[:k], piece[k:])
        for piece in normal
        for k in range(1, len(piece))
        if piece[:k] in normal and piece[k:] in normal
    )
    return vocab, [(left, right) for *_, left, right in ranked]


def _backend(proto):
    """The `tokenizers` pipeline of a SentencePiece BPE model: its dummy-prefix "▁" as a normalizer (never
    skipped, unlike Metaspace's prepend), spaces as "▁", words split before each "▁" (split_by_whitespace),
    BPE with byte fallback; control and unknown pieces are special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab, merges = _bpe_vocab_and_merges(proto)
    t = proto.trainer_spec
    bpe = BPE(vocab=vocab, merges=merges, unk_token=t.unk_piece, fuse_unk=True, byte_fallback=t.byte_fallback)
    backend = Tokenizer(bpe)
    prefix = [normalizers.Prepend(SPACE)] if proto.normalizer_spec.add_dummy_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", SPACE)])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=True)
    strip = [decoders.Strip(" ", 1, 0)] if proto.normalizer_spec.add_dummy_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    special = [p.piece for p in proto.pieces if p.type in (p.CONTROL, p.UNKNOWN)]
    backend.add_special_tokens([AddedToken(piece, special=True, normalized=False) for piece in special])
    return backend


def _check_same_ids(sp, tokenizer, path: Path) -> None:
    """The tokenizer must give SentencePiece's ids (and decoding) on every piece's text, whitespace runs and
    newlines; a difference is an error, never a silently different export."""
    pieces = range(sp.get_piece_size())
    texts = [sp.id_to_piece(i).replace(SPACE, " ") for i in pieces if not sp.is_control(i)]
    probes = [" ".join(texts), "".join(texts), "\n".join(texts), "  two  spaces\n\n x \n", "\n", " ", "</s>"]
    for text in probes:
        ids = sp.encode(text)
        if tokenizer(text)["input_ids"] != ids or tokenizer.decode(ids) != sp.decode(ids):
            raise ConfigError(
                f"export-hf: the Hugging Face tokenizer built from {path} tokenizes {text[:40]!r} "
                f"differently from SentencePiece: use a tokenizer trained by tools/train_tokenizer.py"
            )


def hf_tokenizer(path: str | Path, model_max_length: int | None = None):
    """A transformers fast tokenizer (`tokenizers` BPE, saved as tokenizer.json) that gives exactly the ids
    of the SentencePiece BPE model at `path` (SentencePieceTokenizer.tokenize: no <s> / </s> added) and
    decodes as it does. Text never produces control ids ("</s>" in text is characters, as in
    SentencePiece: split_special_tokens). bos / eos / unk are <s> / </s> / <unk>; pad is <pad>, or </s>
    when the model has no pad piece (as GPT-2 users pad with eos)."""
    import sentencepiece as spm
    from transformers import PreTrainedTokenizerFast

    path = Path(path).expanduser()
    if path.suffix == ".json" or path.is_dir():
        return _json_tokenizer(path, model_max_length)
    proto = _spm_proto(path)
    _check_exportable(proto, path)
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    if sp.eos_id() < 0:
        raise ConfigError(
            f"export-hf: tokenizer {path} has no </s> piece (megahet's end of document): pass the run's one"
        )
    ids = {"bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id(), "pad": sp.pad_id()}  # -1: none
    piece = {name: sp.id_to_piece(i) if i >= 0 else None for name, i in ids.items()}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_backend(proto),
        bos_token=piece["bos"],
        eos_token=piece["eos"],
        unk_token=piece["unk"],
        pad_token=piece["pad"] or piece["eos"],
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )
    _check_same_ids(sp, tokenizer, path)
    if model_max_length is not None:  # after the check, whose texts are longer
        tokenizer.model_max_length = model_max_length
    return tokenizer


def _json_tokenizer(path: Path, model_max_length: int | None):
    """A run that trained with a Hugging Face tokenizer.json (megahet/data/hf_tokenizers.py) exports it as it
    is, with the special tokens megahet used: eos its end of document, pad its pad (eos without one)."""
    from transformers import PreTrainedTokenizerFast

    from megahet.data.hf_tokenizers import HFTokenizer

    tok = HFTokenizer(path)
    name = {key: tok._tok.id_to_token(i) if i >= 0 else None for key, i in
            (("bos", tok.bos), ("eos", tok.eos), ("unk", tok.unk), ("pad", tok.pad))}  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=tok.path, bos_token=name["bos"], eos_token=name["eos"], unk_token=name["unk"],
        pad_token=name["pad"], clean_up_tokenization_spaces=False,
    )  # fmt: skip
    if model_max_length is not None:
        tokenizer.model_max_length = model_max_length
    return tokenizer


def save_hf_tokenizer(tokenizer, out: Path) -> None:
    """save_pretrained, naming the class that loads a tokenizer.json as it is in transformers 4 and 5."""
    tokenizer.save_pretrained(str(out))
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = TOKENIZER_CLASS
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))
