"""megahet.convert and tools/convert_checkpoint.py on synthetic checkpoints (one process, no launcher).

A TP=1 GPT's weights are sharded into TP=2 x PP=2 DeepSpeed-style `mp_rank_XX_model_states.pt` files;
consolidating them must give the weights back exactly, and the Hugging Face export must reproduce the
model's logits and greedy generation. Real TP x PP checkpoints: tests/distributed/test_convert_distributed.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from megahet.config import ConfigError, load_config
from megahet.convert import consolidate, export_hf, merge_shards, model_states_file, shard

MODEL = ["--model.num_layers", "4", "--model.hidden_size", "64", "--model.num_attention_heads", "4",
         "--model.seq_length", "32"]  # fmt: skip
VOCAB = 256


def write_checkpoint(root, state, tp, pp, iteration=5):
    folder = root / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    for p, shards in enumerate(shard(state, tp, pp)):
        for t, module in enumerate(shards):
            torch.save({"module": {**module, "x._extra_state": None}}, folder / model_states_file(p * tp + t))
    meta = {"iteration": iteration, "layout": {"tp": tp, "pp": pp, "dp": 1, "zero_stage": 1}, "files": {}}
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


def logits_of(model, tokens):
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)


def greedy(model, prompt, steps):
    tokens = prompt
    for _ in range(steps):
        tokens = torch.cat([tokens, logits_of(model, tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1), (1, 4)])
def test_consolidate_inverts_sharding(gpt, tmp_path, tp, pp):
    _, _, state = gpt
    write_checkpoint(tmp_path, state, tp, pp)
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


def test_hf_export_matches_logits_and_greedy_generation(gpt, tmp_path):
    from transformers import GPT2LMHeadModel

    cfg, model, state = gpt
    export_hf(state, cfg.model, tmp_path / "hf")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(tokens).logits - logits_of(model, tokens)).abs().max().item()
    assert diff < 1e-5
    prompt = tokens[:1, :8]
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                      pad_token_id=0)  # fmt: skip
    assert torch.equal(out, greedy(model, prompt, 10))


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


def test_cli(gpt, tmp_path, capsys):
    import sys

    sys.path.insert(0, "tools")
    from convert_checkpoint import main

    _, _, state = gpt
    write_checkpoint(tmp_path / "ck", state, 2, 2)
    assert main(["consolidate", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "m.pt")]) == 0
    merged = torch.load(tmp_path / "m.pt")
    assert all(torch.equal(merged[k], v) for k, v in state.items())
    assert main(["export-hf", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "hf"), *MODEL]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
    assert main(["export-vit", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "v")]) == 2
    assert main(["export-hf", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "hf2")]) == 2
    assert "pass the run's --config" in capsys.readouterr().err


def test_vit_export_round_trip(world1, tmp_path):
    import dataclasses

    from megahet.config import MegahetConfig
    from megahet.convert import export_vit, load_vit_export
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
