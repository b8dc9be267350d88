"""megahet.checkpointing.convert and tools/convert_checkpoint.py on synthetic checkpoints (one process, no launcher).

A TP=1 GPT's weights are sharded into TP=2 x PP=2 DeepSpeed-style `mp_rank_XX_model_states.pt` files;
consolidating them must give the weights back exactly. Resharding (TP2xPP2 -> TP1 -> TP4xPP2) must keep
every weight, write module states a TP=1 model loads strictly, re-pad the vocabulary where the padding
changes, and refuse bad layouts and non-empty output folders. A checkpoint carries its tokenizer (save,
reshard). Real TP x PP checkpoints: tests/distributed/test_convert_distributed.py; the Hugging Face
export: tests/unit/test_hf_export.py.

Run: ``python -m pytest tests/unit/test_convert.py -q`` (about 10 s; needs ``python tools/fetch_data.py``).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from convert_models import MODEL, PIECES, VOCAB, logits_of, write_checkpoint

from megahet.checkpointing.convert import (
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
    engine = build_engine(cfg, torch.nn.Linear(4, 4), 1, {})
    parts = checkpoint.CheckpointParts(cfg, world1, engine, vocab_size=PIECES, tokenizer_model=str(spm_model))
    folder, _ = checkpoint.save(parts, checkpoint.Progress(iteration=3, consumed_samples=12))
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
