"""The data path's Hugging Face tokenizers (megahet/data/hf_tokenizers.py): a byte-level BPE tokenizer.json
trained here on a slice of the real corpus (GPT-2's kind, with `<|endoftext|>`), used as SentencePiece
models are:
- `load_tokenizer` picks it for a tokenizer.json or its folder; text round-trips; the end of document is the
  eos token of the tokenizer_config.json beside it (else a special token named like one); a tokenizer
  without one is a one-line error; it pickles (DataLoader workers);
- `preprocess_jsonl` writes an indexed dataset with it, each document its ids plus the eod;
- a checkpoint carries tokenizer.json and tokenizer_config.json; export-hf ships it as it is, and
  transformers' AutoTokenizer gives megahet's ids.

Run: ``python -m pytest tests/unit/test_hf_tokenizers.py -q`` (a few seconds).
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from one_line import one_line

from megahet.config import ConfigError
from megahet.data.hf_tokenizers import HFTokenizer
from megahet.data.tokenizer import SentencePieceTokenizer, load_tokenizer, tokenizer_files

EOT = "<|endoftext|>"


def make_bpe(folder, texts: list[str], vocab: int = 400, config: dict | None = None):
    """A byte-level BPE tokenizer.json (GPT-2's kind) trained on `texts`, `<|endoftext|>` its one special
    token; with a tokenizer_config.json of `config` beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


@pytest.fixture
def texts(corpus_docs) -> list[str]:
    plays, chapters = corpus_docs
    return [*plays[:2], *chapters[:38]]


def test_a_tokenizer_json_is_the_data_paths_tokenizer(tmp_path, texts, spm_model):
    path = make_bpe(tmp_path / "gpt2tok", texts, config={"eos_token": {"content": EOT}})
    for given in (path, path.parent):
        tok = load_tokenizer(given)
        assert isinstance(tok, HFTokenizer)
    assert isinstance(load_tokenizer(spm_model), SentencePieceTokenizer)
    ids = tok.tokenize(texts[0][:2000])
    assert tok.detokenize(ids) == texts[0][:2000] and EOT not in tok.detokenize(ids)
    assert tok.eod == tok.eos == tok._tok.token_to_id(EOT) and tok.pad == tok.eod and tok.vocab_size == 400
    assert tok.tokenize_batch(texts[:3]) == [tok.tokenize(t) for t in texts[:3]]
    again = pickle.loads(pickle.dumps(tok))
    assert again.tokenize(texts[1][:500]) == tok.tokenize(texts[1][:500])
    assert set(tokenizer_files(path)) == {"tokenizer.json", "tokenizer_config.json"}


def test_the_eod_is_found_without_a_config_and_refused_without_one(tmp_path, texts):
    assert HFTokenizer(make_bpe(tmp_path / "named", texts)).eod == 0  # "<|endoftext|>": the first token
    bare = make_bpe(tmp_path / "bare", texts, config={"eos_token": "<missing>"})
    data = json.loads(bare.read_text())
    data["added_tokens"] = []
    data["model"]["vocab"].pop(EOT)
    bare.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        HFTokenizer(bare)
    one_line(err, str(bare), "no end-of-document token", "eos_token")


def test_preprocess_writes_the_documents_with_an_hf_tokenizer(tmp_path, texts):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megahet.data.preprocess import preprocess_jsonl

    path = make_bpe(tmp_path / "tok", texts, config={"eos_token": EOT})
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:5]))
    prefix = preprocess_jsonl(corpus, tmp_path / "data", path, progress=False)
    tok = HFTokenizer(path)
    dataset = IndexedDataset(prefix)
    for i, text in enumerate(texts[:5]):
        assert np.array_equal(dataset.get(i), [*tok.tokenize(text), tok.eod]), i


def test_export_hf_ships_the_runs_tokenizer_json(world1, tmp_path, texts):
    from convert_models import MODEL
    from transformers import AutoTokenizer

    from megahet.checkpointing.hf_export import export_hf
    from megahet.config import load_config
    from megahet.models.gpt import build_gpt

    path = make_bpe(tmp_path / "tok", texts, config={"eos_token": EOT})
    cfg = load_config(MODEL)
    model = build_gpt(cfg, 400)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    export_hf(state, cfg.model, tmp_path / "hf", path, vocab_size=400)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = HFTokenizer(path)
    for text in texts[5:10]:
        assert theirs(text[:1000], add_special_tokens=False)["input_ids"] == ours.tokenize(text[:1000])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == ours.eod
