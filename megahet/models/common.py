"""Shared pieces of the megahet models: the megatron-core TransformerConfig and the layer specs.

Role: models (the ModuleSpec seam where resizable layers plug in).

The layer spec is the plug-in point: the GPT and ViT builders take a `ModuleSpec`, so resizable
tensor-parallel layers replace megatron-core's own through a spec, never through a fork.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from megahet.config import MegahetConfig
from megahet.config_checks import stage_split
from megahet.models.attention import SDPACoreAttention
from megahet.platform import cuda_available
from megahet.policy.stage_split import megatron_layout
from megahet.tensor_parallel.layers import (
    ResizableColumnParallelLinear,
    ResizableRowParallelLinear,
    ResizableSelfAttention,
)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's activation ("gelu_new"), so exported GPT checkpoints match Hugging Face's GPT-2."""
    return F.gelu(x, approximate="tanh")


def has_fused_softmax_kernel() -> bool:
    """Whether the CUDA extension behind megatron-core's fused masked softmax is installed (it comes
    with apex or Megatron-LM's fused kernels, not with megatron-core); without it the fused path fails
    with ImportError on its first call."""
    try:
        return importlib.util.find_spec("scaled_upper_triang_masked_softmax_cuda") is not None
    except (ImportError, ValueError):
        return False


def initializes(config: TransformerConfig) -> bool:
    """Whether a model built from `config` initializes its weights (false: it is built to be loaded)."""
    return config.perform_initialization


def mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Mark each TP weight of a stage built to be loaded (`perform_initialization=False`) with its partition
    (`tensor_model_parallel`, `partition_dim`, `partition_stride`), as megatron-core's initialization path
    does and skips with the initialization: column-parallel and vocab-parallel weights split along dim 0,
    row-parallel ones along dim 1, a gated MLP's fc1 with stride 2 (each rank holds its gate and up rows).
    DeepSpeed's gradient norm counts a weight once per rank only if it is marked (else once per TP group).

    Skipping that path, not running it with no-op init methods, matters for the re-split's rebuild: on the
    CPU it makes each weight's full master, concatenates this rank's part and copies it in, a pass over the
    stage that grows with its layers."""
    gated_fc1 = {
        id(m.linear_fc1) for m in model.modules() if isinstance(m, MLP) and m.config.gated_linear_unit
    }
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, True, dim, 2 if id(module) in gated_fc1 else 1)


def transformer_config(
    cfg: MegahetConfig, split: Sequence[int] | None = None, initialize: bool = True
) -> TransformerConfig:
    """megatron-core's TransformerConfig for this run: fused CUDA kernels only where CUDA exists, and
    uneven pipeline stages (`split`: the run's layers per stage, default parallel.stage_layers or even)
    as a `pipeline_model_parallel_layout`.

    GPT-2's tanh GELU on both paths: on CUDA, megatron-core fuses bias + GELU only for `F.gelu`, and
    its fused kernel (`fusions/fused_bias_gelu.bias_gelu`) *is* the tanh approximation; without
    fusion the activation is applied as given, so the CPU path names the tanh GELU itself. A model
    without linear biases (model.add_bias_linear false) has no bias to fuse: it names the tanh GELU too.

    `initialize` false: megatron-core's initialization is skipped (`perform_initialization=False`) and the
    weights are left as allocated, for a stage whose state is loaded right after the build
    (ParallelLayout.weights_loaded; the builders then mark the TP weights: mark_tensor_parallel_weights).
    """
    m, p = cfg.model, cfg.parallel
    split = stage_split(cfg) if split is None else split
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    fused = cuda_available()
    swiglu = m.activation == "swiglu"
    packed = cfg.data.packing == "documents"
    # megatron-core's bias-GELU kernel needs a bias; its SwiGLU kernel runs with or without one.
    fused_bias_act = fused and (swiglu or m.add_bias_linear)
    if swiglu:
        activation = F.silu
    else:
        activation = F.gelu if fused_bias_act else gelu_tanh  # tanh GELU either way (see above)
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        ffn_hidden_size=m.ffn_size,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        context_parallel_size=p.cp,
        # Uneven stages through megatron-core's own seam; an even split needs none.
        pipeline_model_parallel_layout=megatron_layout(split) if len(set(split)) > 1 else None,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        layernorm_epsilon=m.layernorm_epsilon,
        activation_func=activation,
        gated_linear_unit=swiglu,
        add_bias_linear=m.add_bias_linear,
        normalization=m.normalization,
        # Initialize every weight from its full (unsharded) master on the CPU, so a model is the
        # same function of the seed whatever its TP size.
        use_cpu_initialization=True,
        perform_initialization=initialize,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=cfg.train.precision == "bf16",
        gradient_accumulation_fusion=False,
        bias_activation_fusion=fused_bias_act,
        masked_softmax_fusion=fused and has_fused_softmax_kernel(),
        bias_dropout_fusion=fused,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        rotary_interleaved=m.rotary_interleaved,
        # Packed documents: a micro-batch's loss is its token sum, normalized by the global batch's token
        # count (megatron-core's per-token loss), and pipeline stages exchange activation shapes first.
        calculate_per_token_loss=packed,
        variable_seq_lengths=packed and p.pp > 1,
        # No MoE here; megatron-core refuses variable lengths with its default (allgather) dispatcher anyway.
        moe_token_dispatcher_type="alltoall" if packed and p.pp > 1 else "allgather",
    )


def local_layer_spec(
    attn_mask_type: AttnMaskType = AttnMaskType.causal,
    *,
    attention: str = "sdpa",
    normalization: str = "LayerNorm",
) -> ModuleSpec:
    """megatron-core's local (no Transformer Engine) layer spec with the given attention mask, core
    attention (sdpa: megahet's SDPACoreAttention; local: megatron-core's DotProductAttention) and norm."""
    if attention not in ("sdpa", "local"):
        raise ValueError(f"attention must be sdpa or local, got {attention!r}")
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization))
    spec.submodules.self_attention.params["attn_mask_type"] = attn_mask_type
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def resizable_layer_spec(
    attn_mask_type: AttnMaskType = AttnMaskType.causal,
    *,
    attention: str = "sdpa",
    normalization: str = "LayerNorm",
) -> ModuleSpec:
    """The local layer spec with megahet's resizable attention and TP linears plugged in."""

    spec = local_layer_spec(attn_mask_type, attention=attention, normalization=normalization)
    attention_spec, mlp = spec.submodules.self_attention, spec.submodules.mlp
    attention_spec.module = ResizableSelfAttention
    attention_spec.submodules.linear_qkv = ResizableColumnParallelLinear
    attention_spec.submodules.linear_proj = ResizableRowParallelLinear
    mlp.submodules.linear_fc1 = ResizableColumnParallelLinear
    mlp.submodules.linear_fc2 = ResizableRowParallelLinear
    return spec


def default_layer_spec(cfg: MegahetConfig, attn_mask_type: AttnMaskType = AttnMaskType.causal) -> ModuleSpec:
    """Resizable layers when resizing or virtual devices are on, else megatron-core's own local layers;
    the core attention and norm the model config names in both."""
    # Virtual devices and the balancer need the resizable layers' FLOP counters and plans.
    resizable = cfg.resize.active or bool(cfg.device.profile) or cfg.balance.active
    build = resizable_layer_spec if resizable else local_layer_spec
    return build(attn_mask_type, attention=cfg.model.attention, normalization=cfg.model.normalization)
