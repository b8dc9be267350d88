"""Imports of Hugging Face transformers checkpoints: a `LlamaForCausalLM` or `GPT2LMHeadModel` folder (its
config.json and safetensors weights) -> a weights-only megahet checkpoint at any TP x PP, which
`pretrain_gpt.py --train.load OUT --parallel.tp T --parallel.pp P` continues from (fresh optimizer and LR
schedule, as a fine-tuning run starts).

Role: tooling (behind tools/convert_checkpoint.py import-hf); the inverse of hf_export.py.

    settings, state, vocab = read_hf("hf_llama")     # ModelConfig from config.json, TP=1 PP=1 names
    folder, meta, seconds = import_hf("hf_llama", "ckpt", tp=2, pp=2)

The model settings come from config.json alone (grouped-query attention, the rope base, tied or untied
output layer, RMSNorm epsilon; GPT-2's positions and LayerNorm epsilon). What megahet does not run is a
one-line error before anything is written: rope scaling (YaRN, Llama 3.1's `llama3`, linear, dynamic),
sliding-window attention, biases on only some linears (megahet has one switch for all), another head
size than hidden / heads, another activation. The vocabulary is padded as megahet pads it (to a multiple
of `model.make_vocab_size_divisible_by` x TP, with copies of the last row, as Megatron's converter pads);
megahet.json records the real size. The folder's tokenizer travels into the checkpoint as it is: a
SentencePiece `tokenizer.model` (Llama 2's), or a `tokenizer.json` with its `tokenizer_config.json`
(GPT-2's, Llama 3's), which megahet's data path reads too (megahet/data/hf_tokenizers.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from megahet.checkpointing.checkpoint import save_weights_only
from megahet.checkpointing.convert import carried_files, check_reshard, repad_vocab, resharded_stages
from megahet.checkpointing.finder import META
from megahet.config import ConfigError, ModelConfig
from megahet.models.gpt import padded_vocab_size
from megahet.policy.reshard_plan import WORD_EMBEDDING

ARCHITECTURES = ("LlamaForCausalLM", "GPT2LMHeadModel")


# --- settings -------------------------------------------------------------------------------------


def _refuse(what: str, fix: str) -> ConfigError:
    return ConfigError(f"import-hf: {what}; {fix}")


def _rope_base(c: dict) -> int:
    """The rotary base of a Llama config.json (transformers 5's `rope_parameters` or 4's `rope_theta` /
    `rope_scaling`); scaled variants are refused."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    for kind in (params.get("rope_type"), scaling.get("rope_type", scaling.get("type"))):
        if kind not in (None, "default"):
            raise _refuse(
                f"rope scaling {kind!r} is not supported", "megahet runs plain rotary positions only"
            )
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    if theta != int(theta):
        raise _refuse(f"rope base {theta} is not a whole number", "megahet's model.rotary_base is one")
    return int(theta)


def llama_settings(c: dict) -> ModelConfig:
    """A Llama config.json -> megahet's model settings (rope, RMSNorm, SwiGLU, grouped-query attention)."""
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("sliding_window") or c.get("use_sliding_window"):
        raise _refuse("sliding-window attention is not supported", "megahet attends over the whole sequence")
    if c.get("hidden_act", "silu") != "silu":
        raise _refuse(f"activation {c['hidden_act']!r}", "megahet's SwiGLU is SiLU-gated")
    if c.get("head_dim", hidden // heads) != hidden // heads or hidden % heads:
        raise _refuse(
            f"head size {c.get('head_dim')} with hidden {hidden} and {heads} heads",
            "megahet's head size is hidden / heads",
        )
    attention_bias, mlp_bias = bool(c.get("attention_bias", False)), bool(c.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise _refuse(
            f"attention_bias {attention_bias} with mlp_bias {mlp_bias}",
            "megahet has linear biases everywhere or nowhere (model.add_bias_linear)",
        )
    return ModelConfig(
        num_layers=c["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=c.get("num_key_value_heads") or heads,
        ffn_hidden_size=c["intermediate_size"],
        seq_length=c.get("max_position_embeddings", 2048),
        attention_dropout=float(c.get("attention_dropout", 0.0)),
        init_method_std=float(c.get("initializer_range", 0.02)),
        layernorm_epsilon=float(c.get("rms_norm_eps", 1e-6)),
        add_bias_linear=attention_bias,
        position_embedding_type="rope",
        rotary_base=_rope_base(c),
        normalization="RMSNorm",
        activation="swiglu",
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
    )


def gpt2_settings(c: dict) -> ModelConfig:
    """A GPT-2 config.json -> megahet's model settings (learned positions, LayerNorm, tanh GELU, tied)."""
    if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise _refuse(f"activation {c['activation_function']!r}", "megahet's GPT-2 MLP uses the tanh GELU")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if c.get(flag):
            raise _refuse(f"{flag} is set", "megahet runs GPT-2's plain attention")
    if c.get("scale_attn_weights") is False:
        raise _refuse("scale_attn_weights is false", "megahet scales the scores by 1 / sqrt(head size)")
    hidden = c["n_embd"]
    return ModelConfig(
        num_layers=c["n_layer"],
        hidden_size=hidden,
        num_attention_heads=c["n_head"],
        ffn_hidden_size=c.get("n_inner") or 4 * hidden,
        seq_length=c["n_positions"],
        hidden_dropout=float(c.get("resid_pdrop", 0.0)),
        attention_dropout=float(c.get("attn_pdrop", 0.0)),
        init_method_std=float(c.get("initializer_range", 0.02)),
        layernorm_epsilon=float(c.get("layer_norm_epsilon", 1e-5)),
    )


def hf_settings(c: dict) -> ModelConfig:
    """megahet's model settings from a transformers config.json (a dict)."""
    kind = c.get("model_type")
    if kind == "llama":
        return llama_settings(c)
    if kind == "gpt2":
        return gpt2_settings(c)
    raise _refuse(
        f"model_type {kind!r} ({', '.join(c.get('architectures') or ['?'])})",
        f"megahet imports {' and '.join(ARCHITECTURES)}",
    )


# --- weights --------------------------------------------------------------------------------------


def llama_from_hf(hf: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM state dict -> megahet's (TP=1 PP=1 names): q, k, v back into linear_qkv's per-group
    [q_0 .. q_{r-1}, k, v] rows, gate and up into fc1 (the inverse of hf_export.llama_to_hf, halves
    rotary layout: model.rotary_interleaved false)."""
    heads, groups = m.num_attention_heads, m.query_groups
    hn, r = m.hidden_size // heads, heads // groups
    embedding = hf["model.embed_tokens.weight"]
    state = {WORD_EMBEDDING: embedding, "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if m.untie_embeddings_and_output_weights:
        state["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(m.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        state[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        state[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        for suffix in ("weight", "bias") if m.add_bias_linear else ("weight",):
            q = hf[src + "self_attn.q_proj." + suffix].unflatten(0, (groups, r, hn))
            k = hf[src + "self_attn.k_proj." + suffix].unflatten(0, (groups, 1, hn))
            v = hf[src + "self_attn.v_proj." + suffix].unflatten(0, (groups, 1, hn))
            state[dst + "self_attention.linear_qkv." + suffix] = torch.cat([q, k, v], dim=1).flatten(0, 2)
            gate, up = hf[src + "mlp.gate_proj." + suffix], hf[src + "mlp.up_proj." + suffix]
            state[dst + "mlp.linear_fc1." + suffix] = torch.cat([gate, up])
            state[dst + "self_attention.linear_proj." + suffix] = hf[src + "self_attn.o_proj." + suffix]
            state[dst + "mlp.linear_fc2." + suffix] = hf[src + "mlp.down_proj." + suffix]
    return {k: v.contiguous().clone() for k, v in state.items()}


def gpt_from_hf(hf: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel state dict -> megahet's (TP=1 PP=1 names): Conv1D weights (in, out) transposed, and
    c_attn's [all q | all k | all v] columns into linear_qkv's per-head [q_h | k_h | v_h] rows (the inverse
    of hf_export.gpt_to_hf)."""
    heads, hidden = m.num_attention_heads, m.hidden_size
    state = {
        WORD_EMBEDDING: hf["transformer.wte.weight"],
        "embedding.position_embeddings.weight": hf["transformer.wpe.weight"],
        "decoder.final_layernorm.weight": hf["transformer.ln_f.weight"],
        "decoder.final_layernorm.bias": hf["transformer.ln_f.bias"],
    }
    for i in range(m.num_layers):
        src, dst = f"transformer.h.{i}.", f"decoder.layers.{i}."
        for hf_norm, norm in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
            state[dst + norm + ".weight"] = hf[src + hf_norm + ".weight"]
            state[dst + norm + ".bias"] = hf[src + hf_norm + ".bias"]
        w = hf[src + "attn.c_attn.weight"].t()  # (3 hidden, hidden): [all q; all k; all v]
        b = hf[src + "attn.c_attn.bias"]
        state[dst + "self_attention.linear_qkv.weight"] = (
            w.reshape(3, heads, hidden // heads, hidden).transpose(0, 1).reshape(3 * hidden, hidden)
        )
        state[dst + "self_attention.linear_qkv.bias"] = (
            b.reshape(3, heads, hidden // heads).transpose(0, 1).reshape(3 * hidden)
        )
        for hf_name, name in (
            ("attn.c_proj", "self_attention.linear_proj"),
            ("mlp.c_fc", "mlp.linear_fc1"),
            ("mlp.c_proj", "mlp.linear_fc2"),
        ):
            state[dst + name + ".weight"] = hf[src + hf_name + ".weight"].t()
            state[dst + name + ".bias"] = hf[src + hf_name + ".bias"]
    return {k: v.contiguous().clone() for k, v in state.items()}


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards model.safetensors.index.json lists, in fp32."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ConfigError('import-hf needs the `safetensors` package: pip install -e ".[hf]"') from None

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ConfigError(
            f"import-hf: {folder} has no model.safetensors (or its index): save the model with "
            "save_pretrained(..., safe_serialization=True); megahet reads no pickled weights"
        )
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(str(folder / name)))
    return {k: v.float() for k, v in out.items()}


def read_hf(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], int]:
    """(model settings, megahet state dict with TP=1 PP=1 names, the vocabulary) of a transformers folder;
    the word embedding (and an untied output layer) keep the folder's rows, unpadded."""
    folder = Path(folder).expanduser()
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(f"import-hf: --hf {folder} has no config.json: give a save_pretrained folder")
    c = json.loads(config.read_text())
    m = hf_settings(c)
    hf = _read_safetensors(folder)
    try:
        state = llama_from_hf(hf, m) if m.position_embedding_type == "rope" else gpt_from_hf(hf, m)
    except KeyError as missing:
        raise ConfigError(
            f"import-hf: {folder}'s weights lack {missing} that its config.json calls for: a partial save?"
        ) from None
    vocab = state[WORD_EMBEDDING].shape[0]
    if c.get("vocab_size", vocab) != vocab:
        raise ConfigError(
            f"import-hf: config.json says vocab_size {c['vocab_size']}, the embedding has {vocab} rows"
        )
    return m, state, vocab


def import_hf(
    folder: str | Path, out: str | Path, tp: int, pp: int, stage_layers: tuple[int, ...] | None = None
) -> tuple[Path, dict, float]:
    """Write the transformers model in `folder` as a weights-only megahet checkpoint for TP=tp x PP=pp into
    the new folder `out` (step 0, nothing consumed; `stage_layers`: layers per stage, default even).
    Returns (checkpoint folder, its megahet.json, seconds)."""
    t0 = time.perf_counter()
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"--out: {out} exists and is not empty: choose a new folder (saved data is never overwritten)"
        )
    m, state, vocab = read_hf(folder)
    split = tuple(stage_layers) if stage_layers is not None and pp > 1 else None
    check_reshard(m, tp, pp, split)
    rows = padded_vocab_size(vocab, m.make_vocab_size_divisible_by, 1)
    state = {
        k: repad_vocab(v, rows) if k in (WORD_EMBEDDING, "output_layer.weight") else v
        for k, v in state.items()
    }
    stages = resharded_stages(state, m, 1, tp, pp, vocab, split)
    folder = Path(folder).expanduser()
    checkpoint = save_weights_only(
        out,
        stages,
        iteration=0,
        consumed_samples=0,
        meta={
            "model": dataclasses.asdict(m),
            "vocab_size": vocab,
            "imported_from": {"path": str(folder.resolve()), "architecture": _architecture(m)},
        },
        stage_layers=split,
        files=carried_files(folder),
    )
    meta = json.loads((checkpoint / META).read_text())
    return checkpoint, meta, time.perf_counter() - t0


def _architecture(m: ModelConfig) -> str:
    return ARCHITECTURES[0] if m.position_embedding_type == "rope" else ARCHITECTURES[1]
