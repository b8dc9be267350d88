"""Exports of a consolidated megahet state (TP=1 PP=1 names, see convert.consolidate): Hugging Face
transformers models with the run's tokenizer, and the ViT as safetensors.

Role: tooling (behind tools/convert_checkpoint.py export-hf / export-vit).

    export_hf(state, cfg.model, "hf_dir", "ckpt/iter_0000300/tokenizer.model")  # + tokenizer.json

`export_hf` writes GPT2LMHeadModel (GPT-2-shaped runs) or LlamaForCausalLM (Llama-shaped runs: rotary
positions, RMSNorm, SwiGLU, grouped-query attention) + generation config (eos / bos / pad ids set) + the run's
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
        tie_word_embeddings=not m.untie_embeddings_and_output_weights,
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
        "lm_head.weight": state.get("output_layer.weight", state["embedding.word_embeddings.weight"]),
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


# --- Llama ---------------------------------------------------------------------------------------


def is_llama(m: ModelConfig) -> bool:
    """Rotary positions, RMSNorm and SwiGLU: exported as transformers' LlamaForCausalLM."""
    return (m.position_embedding_type, m.normalization, m.activation) == ("rope", "RMSNorm", "swiglu")


def _check_shapes(state: dict[str, torch.Tensor], m: ModelConfig) -> tuple[int, int]:
    """(padded vocabulary, layers) of a GPT state, checked against the model settings."""
    if "embedding.word_embeddings.weight" not in state:
        raise ConfigError("export-hf: not a GPT checkpoint (no embedding.word_embeddings.weight)")
    vocab, hidden = state["embedding.word_embeddings.weight"].shape
    layers = num_layers_of(state)
    if (m.hidden_size, m.num_layers) != (hidden, layers):
        raise ConfigError(
            f"export-hf: the config says hidden {m.hidden_size}, {m.num_layers} layers; the checkpoint has "
            f"{hidden}, {layers}: pass the run's --config"
        )
    return vocab, layers


def llama_config(state: dict[str, torch.Tensor], m: ModelConfig):
    """The LlamaConfig of a megahet Llama-shaped GPT state; no special ids yet."""
    import inspect

    from transformers import LlamaConfig

    vocab, layers = _check_shapes(state, m)
    heads, groups = m.num_attention_heads, m.query_groups
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": float(m.rotary_base)}}
    if "rope_parameters" not in inspect.signature(LlamaConfig.__init__).parameters:  # transformers < 5
        rope = {"rope_theta": float(m.rotary_base)}
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=m.hidden_size // heads,
        hidden_act="silu",
        max_position_embeddings=m.seq_length,
        rms_norm_eps=m.layernorm_epsilon,
        initializer_range=m.init_method_std,
        attention_bias=m.add_bias_linear,
        mlp_bias=m.add_bias_linear,
        attention_dropout=m.attention_dropout,
        tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        bos_token_id=None,
        eos_token_id=None,
        **rope,
    )


def _half_split(rows: torch.Tensor, head_dim: int, interleaved: bool) -> torch.Tensor:
    """q or k rows (heads * head_dim, ...) in the rotary layout transformers' Llama uses: halves rotated
    together, (x_i, x_{i + d/2}). megatron-core's interleaved layout rotates pairs (x_{2i}, x_{2i+1}):
    reorder each head's rows to [even; odd] (the same permutation of q and k leaves q.k unchanged)."""
    if not interleaved:
        return rows
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return rows.unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)


def llama_to_hf(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """megahet Llama-shaped GPT (TP=1 PP=1 names) -> LlamaForCausalLM state dict.

    megatron-core's linear_qkv holds per key/value group [q_0 .. q_{r-1}, k, v] (head_dim rows each);
    transformers' q_proj / k_proj / v_proj hold all query heads, all key heads, all value heads. fc1 is
    [gate; up]."""
    heads, groups = m.num_attention_heads, m.query_groups
    hn, r = m.hidden_size // heads, heads // groups
    out = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
        "lm_head.weight": state.get("output_layer.weight", state["embedding.word_embeddings.weight"]),
    }
    for i in range(num_layers_of(state)):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "pre_mlp_layernorm.weight"]
        suffixes = ("weight", "bias") if m.add_bias_linear else ("weight",)
        for suffix in suffixes:
            qkv = state[src + "self_attention.linear_qkv." + suffix].unflatten(0, (groups, r + 2, hn))
            q = qkv[:, :r].flatten(0, 2)  # (heads * hn, ...)
            k, v = qkv[:, r].flatten(0, 1), qkv[:, r + 1].flatten(0, 1)  # (groups * hn, ...)
            out[dst + "self_attn.q_proj." + suffix] = _half_split(q, hn, m.rotary_interleaved)
            out[dst + "self_attn.k_proj." + suffix] = _half_split(k, hn, m.rotary_interleaved)
            out[dst + "self_attn.v_proj." + suffix] = v
            gate, up = state[src + "mlp.linear_fc1." + suffix].chunk(2)
            out[dst + "mlp.gate_proj." + suffix], out[dst + "mlp.up_proj." + suffix] = gate, up
            out[dst + "self_attn.o_proj." + suffix] = state[src + "self_attention.linear_proj." + suffix]
            out[dst + "mlp.down_proj." + suffix] = state[src + "mlp.linear_fc2." + suffix]
    return {k: v.contiguous().clone() for k, v in out.items()}


# --- both -----------------------------------------------------------------------------------------


def export_hf(
    state: dict[str, torch.Tensor],
    model_cfg: ModelConfig,
    out: str | Path,
    tokenizer: str | Path | None = None,
    *,
    vocab_size: int | None = None,
):
    """Write a transformers model (save_pretrained, with its generation config) and the run's tokenizer
    (tokenizer.json, see hf_tokenizer) into `out`; returns the model: GPT2LMHeadModel for the GPT-2 shape,
    LlamaForCausalLM for the Llama shape (rotary positions, RMSNorm, SwiGLU; grouped-query attention and
    tied or untied output layers alike). `tokenizer`: the run's SentencePiece model (a checkpoint's
    tokenizer.model); `vocab_size`: megahet.json's, checked against it. config.json and
    generation_config.json carry the tokenizer's bos / eos / pad ids (pad = eos when it has no pad piece)."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    m = model_cfg
    if is_llama(m):
        config, build, weights, name = (
            llama_config(state, m),
            LlamaForCausalLM,
            llama_to_hf(state, m),
            "Llama",
        )
    elif (m.position_embedding_type, m.normalization, m.activation) == (
        "learned_absolute",
        "LayerNorm",
        "gelu",
    ):
        config, build, weights, name = _hf_config(state, m), GPT2LMHeadModel, None, "GPT-2"
    else:
        raise ConfigError(
            f"export-hf: no Hugging Face model for positions {m.position_embedding_type}, {m.normalization}, "
            f"{m.activation}: export GPT-2's (learned_absolute, LayerNorm, gelu) or Llama's (rope, RMSNorm, "
            f"swiglu), or use `consolidate`"
        )
    if tokenizer is None:
        raise ConfigError(
            "export-hf: no tokenizer: the checkpoint has no tokenizer.model (saved by an older megahet): "
            "pass --tokenizer PATH, the run's SentencePiece model (data.tokenizer_model; shipped corpus: "
            "~/.cache/megahet/gpt/spm<data.vocab_size>.model)"
        )
    hf_tok = hf_tokenizer(tokenizer, model_max_length=m.seq_length)
    _set_special_ids(config, hf_tok, vocab_size)
    model = build(config)
    if weights is None:
        weights = gpt_to_hf(state, config.n_head)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ConfigError(
            f"export-hf: {name} mapping incomplete (missing {missing}, unexpected {unexpected})"
        )
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
