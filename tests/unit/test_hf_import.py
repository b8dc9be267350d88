"""Starting from a Hugging Face checkpoint (tools/convert_checkpoint.py import-hf, issue 49 item 17).

Small `LlamaForCausalLM` and `GPT2LMHeadModel`s are made here by transformers (random init, seeded,
`save_pretrained`: nothing is downloaded), with a vocabulary megahet must pad (300 rows):
- imported at TP=1, megahet's GPT gives transformers' logits (the real vocabulary's) within fp32
  tolerance, and the same greedy tokens; Llama with grouped-query attention, tied and untied, with and
  without linear biases; GPT-2;
- import then export (hf_export's mappings) gives transformers' state dict back bit for bit;
- imported at TP=2 x PP=2, the checkpoint consolidates to the TP=1 import bit for bit, records the real
  vocabulary and the model settings, and carries a SentencePiece tokenizer.model along;
- what megahet does not run (rope scaling, sliding windows, biases on some linears only, another head
  size, pickled weights, another architecture) is a one-line error before anything is written.
(Training on from an import at TP=2 x PP=2 through pretrain_gpt.py: tests/distributed/test_hf_import_training.py.)

Run: ``python -m pytest tests/unit/test_hf_import.py -q`` (about 15 s).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from convert_models import greedy, logits_of
from one_line import one_line

from megahet.checkpointing.convert import consolidate
from megahet.checkpointing.hf_export import gpt_to_hf, llama_to_hf
from megahet.checkpointing.hf_import import import_hf, read_hf
from megahet.config import ConfigError, MegahetConfig
from megahet.models.gpt import build_gpt
from megahet.policy.reshard_plan import WORD_EMBEDDING

VOCAB = 300  # not a multiple of 128: megahet pads it to 384 rows


def _llama(tmp_path, name="llama", **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    }  # fmt: skip
    settings.update(overrides)
    config = LlamaConfig(**settings)
    if "rope_theta" in overrides and hasattr(config, "rope_parameters"):  # transformers 5
        config.rope_parameters = {"rope_type": "default", "rope_theta": float(overrides["rope_theta"])}
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / name, safe_serialization=True)
    return model, tmp_path / name


def _gpt2(tmp_path, name="gpt2"):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    ).eval()
    model.save_pretrained(tmp_path / name, safe_serialization=True)
    return model, tmp_path / name


def _megahet(folder, tmp_path, tp=1, pp=1):
    """(the imported checkpoint consolidated at TP=1 PP=1, a megahet GPT with its weights, its settings)."""
    checkpoint, meta, _ = import_hf(folder, tmp_path / f"ck_{folder.name}_{tp}{pp}", tp, pp)
    state, _ = consolidate(checkpoint.parent)
    m, _, vocab = read_hf(folder)
    model = build_gpt(dataclasses.replace(MegahetConfig(), model=m), vocab).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    return state, model, meta


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True}, {"attention_bias": True, "mlp_bias": True, "rope_theta": 500000}],
    ids=["untied", "tied", "biases-rope500k"],
)
def test_an_imported_llama_gives_transformers_logits_and_greedy_tokens(world1, tmp_path, overrides):
    hf, folder = _llama(tmp_path, **overrides)
    if overrides.get("attention_bias"):  # random biases, or zeros would hide a mapping error
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.1)
        hf.save_pretrained(folder, safe_serialization=True)
    _, model, meta = _megahet(folder, tmp_path)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens).logits
    ours = logits_of(model, tokens)
    assert ours.shape[-1] == 384  # padded as megahet pads: the real vocabulary's logits are compared
    assert (ours[..., :VOCAB] - expected).abs().max().item() < 1e-5
    prompt = tokens[:1, :6]
    mine = greedy(model, prompt, 10)
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False)
    assert torch.equal(out[:, : mine.shape[1]], mine[:, : out.shape[1]]) and out.shape[1] > 6
    assert meta["vocab_size"] == VOCAB and meta["imported_from"]["architecture"] == "LlamaForCausalLM"
    assert meta["model"]["num_query_groups"] == 2 and meta["model"]["position_embedding_type"] == "rope"


def test_an_imported_gpt2_gives_transformers_logits(world1, tmp_path):
    hf, folder = _gpt2(tmp_path)
    _, model, meta = _megahet(folder, tmp_path)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(tokens).logits
    assert (logits_of(model, tokens)[..., :VOCAB] - expected).abs().max().item() < 1e-5
    assert meta["model"]["seq_length"] == 32 and meta["model"]["normalization"] == "LayerNorm"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_import_then_export_gives_the_hf_state_dict_bit_for_bit(tmp_path, arch):
    hf, folder = _llama(tmp_path) if arch == "llama" else _gpt2(tmp_path)
    m, state, _ = read_hf(folder)
    back = llama_to_hf(state, m) if arch == "llama" else gpt_to_hf(state, m.num_attention_heads)
    theirs = {k: v for k, v in hf.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    assert sorted(back) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(back[name], tensor), name


def test_a_tp2_pp2_import_consolidates_to_the_tp1_import(tmp_path):
    """The sharded checkpoint holds the same tensors (the embedding padded for TP 2: 512 rows, copies of
    the last real row beyond the vocabulary, as Megatron's converter pads), and the SentencePiece tokenizer.model of the folder travels with it."""
    _, folder = _llama(tmp_path)
    (folder / "tokenizer.model").write_bytes(b"sentencepiece model bytes")
    one, _ = consolidate(import_hf(folder, tmp_path / "tp1", 1, 1)[0].parent)
    checkpoint, meta, seconds = import_hf(folder, tmp_path / "tp2pp2", 2, 2)
    four, _ = consolidate(checkpoint.parent)
    assert (meta["layout"]["tp"], meta["layout"]["pp"], meta["iteration"], meta["weights_only"]) == (
        2,
        2,
        0,
        True,
    )
    assert sorted(one) == sorted(four)
    for name in one:
        if name in (WORD_EMBEDDING, "output_layer.weight"):
            assert four[name].shape[0] == 512 and torch.equal(four[name][:384], one[name]), name
            assert torch.equal(four[name][VOCAB:], four[name][VOCAB - 1].expand(512 - VOCAB, -1)), name
        else:
            assert torch.equal(four[name], one[name]), name
    assert (checkpoint / "tokenizer.model").read_bytes() == b"sentencepiece model bytes"
    assert seconds > 0


def test_the_cli_imports_and_says_where(tmp_path, capsys):
    _, folder = _llama(tmp_path)
    sys.path.insert(0, "tools")
    from convert_checkpoint import main

    out = tmp_path / "ckpt"
    assert main(["import-hf", "--hf", str(folder), "--out", str(out), "--tp", "2", "--pp", "2"]) == 0
    printed = capsys.readouterr().out
    assert "import-hf: LlamaForCausalLM" in printed and "TP 2 x PP 2" in printed and str(out) in printed
    settings = json.loads((out / "model.json").read_text())
    assert settings["model"]["num_query_groups"] == 2  # --config OUT/model.json trains on from it
    assert main(["import-hf", "--hf", str(folder), "--out", str(out), "--tp", "2", "--pp", "2"]) == 2
    assert "not empty" in capsys.readouterr().err  # nothing saved is overwritten


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes, needles",
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ("rope scaling 'llama3'",)),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, ("rope scaling 'yarn'",)),
        ({"sliding_window": 4096}, ("sliding-window",)),
        ({"attention_bias": True, "mlp_bias": False}, ("attention_bias True with mlp_bias False",)),
        ({"head_dim": 32}, ("head size 32",)),
        ({"hidden_act": "gelu"}, ("activation 'gelu'",)),
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, ("model_type 'mistral'",)),
    ],
    ids=["llama3-scaling", "yarn", "sliding", "some-biases", "head-dim", "gelu", "mistral"],
)
def test_what_megahet_does_not_run_is_a_one_line_error(tmp_path, changes, needles):
    _, folder = _llama(tmp_path)
    _edit_config(folder, **changes)
    with pytest.raises(ConfigError) as err:
        import_hf(folder, tmp_path / "out", 1, 1)
    one_line(err, "import-hf", *needles)
    assert not (tmp_path / "out").exists()


def test_missing_or_pickled_weights_are_one_line_errors(tmp_path):
    _, folder = _llama(tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ConfigError) as err:
        read_hf(folder)
    one_line(err, "no model.safetensors", "safe_serialization=True")
    with pytest.raises(ConfigError) as err:
        read_hf(tmp_path / "nowhere")
    one_line(err, "no config.json")
