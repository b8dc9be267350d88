"""The Hugging Face export (tools/convert_checkpoint.py export-hf / export-vit) on synthetic checkpoints.

The export must reproduce the model's logits and greedy generation (GPT-2 and Llama shapes, ViT) and ship
the run's tokenizer (a 512-piece SentencePiece BPE trained on a slice of the real corpus): AutoTokenizer
loads it and gives SentencePieceTokenizer's ids on unseen corpus text, and generate() stops at </s>.
Without a tokenizer in the checkpoint export-hf says how to pass it. A GPT without linear biases
(model.add_bias_linear false) builds, trains (local and resizable layers, ViT too), converts and exports
with the same logits.

Run: ``python -m pytest tests/unit/test_hf_export.py -q`` (about 10 s; needs ``python tools/fetch_data.py``).
"""

from __future__ import annotations

import dataclasses
import io
import sys

import pytest
import torch
from convert_models import MODEL, PIECES, gpt_for_pieces, greedy, logits_of, write_checkpoint

from megahet.checkpointing.convert import (
    consolidate,
    reshard,
)
from megahet.checkpointing.hf_export import export_hf
from megahet.compat.deepspeed_checkpoint import model_states_file
from megahet.config import ConfigError, load_config
from megahet.data.tokenizer import SentencePieceTokenizer


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


# --- a GPT without linear biases (model.add_bias_linear false) ------------------------------------

BIAS_FREE = [*MODEL, "--model.add_bias_linear", "false"]
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@pytest.fixture(scope="module")
def bias_free(world1):
    return gpt_for_pieces(BIAS_FREE)


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

    cfg, model, state, full = gpt_for_pieces([*LLAMA, *extra])
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
    cfg, _, state, _ = gpt_for_pieces([*MODEL, "--model.activation", "swiglu"])
    with pytest.raises(ConfigError, match="no Hugging Face model"):
        export_hf(state, cfg.model, tmp_path / "x", spm_model)
