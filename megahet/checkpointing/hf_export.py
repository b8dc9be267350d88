"""Exports of a consolidated megahet state (TP=1 PP=1 names, see convert.consolidate): Hugging Face
transformers models with the run's tokenizer, and the ViT as safetensors.

Role: tooling (behind tools/convert_checkpoint.py export-hf / export-vit).

    export_hf(state, cfg.model, "hf_dir", "ckpt/iter_0000300/tokenizer.model")  # + tokenizer.json

`export_hf` writes GPT2LMHeadModel + generation config (eos / bos / pad ids set) + the run's
SentencePiece BPE tokenizer as a `tokenizers` tokenizer.json (`hf_tokenizer`: the same ids, checked on
every piece; AutoTokenizer loads it); linear biases a bias-free model lacks are written as zeros.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megahet.checkpointing.convert import num_layers_of
from megahet.checkpointing.hf_tokenizer import hf_tokenizer, save_hf_tokenizer
from megahet.config import ConfigError, ModelConfig

# --- GPT-2 ---------------------------------------------------------------------------


def _hf_config(state: dict[str, torch.Tensor], m: ModelConfig):
    """The GPT2Config of a megahet GPT state (checked against the model settings); no special ids yet."""
    from transformers import GPT2Config

    if "embedding.word_embeddings.weight" not in state:
        raise ConfigError("export-hf: not a GPT checkpoint (no embedding.word_embeddings.weight)")
    vocab, hidden = state["embedding.word_embeddings.weight"].shape
    positions = state["embedding.position_embeddings.weight"].shape[0]
    layers = num_layers_of(state)
    ffn = state["decoder.layers.0.mlp.linear_fc1.weight"].shape[0]
    qkv = state["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0]
    if (m.hidden_size, m.num_layers, m.seq_length) != (hidden, layers, positions):
        raise ConfigError(
            f"export-hf: the config says hidden {m.hidden_size}, {m.num_layers} layers, seq_length "
            f"{m.seq_length}; the checkpoint has {hidden}, {layers}, {positions}: pass the run's --config"
        )
    if hidden % m.num_attention_heads or qkv != 3 * hidden:
        raise ConfigError(
            f"export-hf: GPT-2 needs multi-head attention with hidden % heads == 0 and a [q,k,v] of 3 x hidden "
            f"(hidden {hidden}, heads {m.num_attention_heads}, qkv rows {qkv})"
        )
    return GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=hidden,
        n_layer=layers,
        n_head=m.num_attention_heads,
        n_inner=ffn,
        activation_function="gelu_new",
        layer_norm_epsilon=m.layernorm_epsilon,
        resid_pdrop=m.hidden_dropout,
        embd_pdrop=m.hidden_dropout,
        attn_pdrop=m.attention_dropout,
        initializer_range=m.init_method_std,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )


def _linear_bias(state: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """A linear's bias; zeros (out,) for a model without linear biases (model.add_bias_linear false), since
    GPT-2's Conv1D always adds one: the same function."""
    bias = state.get(prefix + ".bias")
    if bias is not None:
        return bias
    weight = state[prefix + ".weight"]  # (out, in)
    return torch.zeros(weight.shape[0], dtype=weight.dtype)


def gpt_to_hf(state: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """megahet GPT (TP=1 PP=1 names) -> GPT2LMHeadModel state dict (Conv1D weights are (in, out))."""
    out = {
        "transformer.wte.weight": state["embedding.word_embeddings.weight"],
        "transformer.wpe.weight": state["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": state["decoder.final_layernorm.weight"],
        "transformer.ln_f.bias": state["decoder.final_layernorm.bias"],
        "lm_head.weight": state["embedding.word_embeddings.weight"],
    }
    for i in range(num_layers_of(state)):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        w = state[src + "self_attention.linear_qkv.weight"]  # (3 hidden, hidden)
        b = _linear_bias(state, src + "self_attention.linear_qkv")  # (3 hidden,)
        hidden = w.shape[1]
        # megatron: rows per head [q_h | k_h | v_h]; HF: columns [all q | all k | all v]
        w = w.reshape(heads, 3, hidden // heads, hidden).transpose(0, 1).reshape(3 * hidden, hidden)
        b = b.reshape(heads, 3, hidden // heads).transpose(0, 1).reshape(3 * hidden)
        pairs = {
            "ln_1": "input_layernorm",
            "ln_2": "pre_mlp_layernorm",
        }
        for hf, mg in pairs.items():
            out[dst + hf + ".weight"] = state[src + mg + ".weight"]
            out[dst + hf + ".bias"] = state[src + mg + ".bias"]
        out[dst + "attn.c_attn.weight"], out[dst + "attn.c_attn.bias"] = w.t(), b
        for hf, mg in {
            "attn.c_proj": "self_attention.linear_proj",
            "mlp.c_fc": "mlp.linear_fc1",
            "mlp.c_proj": "mlp.linear_fc2",
        }.items():
            out[dst + hf + ".weight"] = state[src + mg + ".weight"].t()
            out[dst + hf + ".bias"] = _linear_bias(state, src + mg)
    return {k: v.contiguous().clone() for k, v in out.items()}


def _set_special_ids(config, tokenizer, vocab_size: int | None) -> None:
    """bos / eos / pad ids of the tokenizer on the GPT2Config (so generate() stops at </s>), after
    checking that the tokenizer fits the model's (padded) vocabulary and the one megahet.json records."""
    pieces = len(tokenizer)
    if pieces > config.vocab_size or vocab_size not in (None, pieces):
        recorded = f" (megahet.json records {vocab_size})" if vocab_size is not None else ""
        raise ConfigError(
            f"export-hf: the tokenizer has {pieces} pieces, the model {config.vocab_size} embedding rows"
            f"{recorded}: pass the run's tokenizer with --tokenizer"
        )
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id


def export_hf(
    state: dict[str, torch.Tensor],
    model_cfg: ModelConfig,
    out: str | Path,
    tokenizer: str | Path | None = None,
    *,
    vocab_size: int | None = None,
):
    """Write a transformers GPT2LMHeadModel (save_pretrained, with its generation config) and the run's
    tokenizer (tokenizer.json, see hf_tokenizer) into `out`; returns the model. `tokenizer`: the run's
    SentencePiece model (a checkpoint's tokenizer.model); `vocab_size`: megahet.json's, checked against it.
    config.json and generation_config.json carry the tokenizer's bos / eos / pad ids (pad = eos when it has
    no pad piece)."""
    from transformers import GPT2LMHeadModel

    config = _hf_config(state, model_cfg)
    if tokenizer is None:
        raise ConfigError(
            "export-hf: no tokenizer: the checkpoint has no tokenizer.model (saved by an older megahet): "
            "pass --tokenizer PATH, the run's SentencePiece model (data.tokenizer_model; shipped corpus: "
            "~/.cache/megahet/gpt/spm<data.vocab_size>.model)"
        )
    hf_tok = hf_tokenizer(tokenizer, model_max_length=config.n_positions)
    _set_special_ids(config, hf_tok, vocab_size)
    model = GPT2LMHeadModel(config)
    missing, unexpected = model.load_state_dict(gpt_to_hf(state, config.n_head), strict=False)
    missing = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise ConfigError(f"export-hf: GPT-2 mapping incomplete (missing {missing}, unexpected {unexpected})")
    out = Path(out)
    model.save_pretrained(str(out))
    save_hf_tokenizer(hf_tok, out)
    return model


# --- ViT: safetensors + JSON config ----------------------------------------------------------------

VIT_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "layernorm_epsilon",
            "image_size", "patch_size", "in_channels", "num_classes")  # fmt: skip


def export_vit(state: dict[str, torch.Tensor], model_cfg: ModelConfig, out: str | Path) -> None:
    """Write out/model.safetensors (TP=1 PP=1 names) and out/config.json (the ModelConfig it needs)."""
    from safetensors.torch import save_file

    if "patch_embedding.weight" not in state:
        raise ConfigError("export-vit: not a ViT checkpoint (no patch_embedding.weight)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    config = {k: getattr(model_cfg, k) for k in VIT_KEYS}
    (out / "config.json").write_text(json.dumps({"megahet_model": "vit", **config}, indent=1))


def load_vit_export(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, state dict) of an export_vit folder, for megahet.models.vit.build_vit at TP=1."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("megahet_model")
    return ModelConfig(**config), load_file(str(folder / "model.safetensors"))
