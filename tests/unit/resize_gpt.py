"""A tiny resizable GPT (TP=1) and the helpers the resize unit tests share: batches, a Trainer-like
step, and where each block's units sit in the parameters (spelled out independently of blocks.py).
Imported by tests/unit/test_resize_executor.py and test_resize_controller.py; not a test module.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel

from megahet.config import MegahetConfig, apply_overrides
from megahet.models.common import resizable_layer_spec
from megahet.models.gpt import build_gpt
from megahet.tensor_parallel.plan import ResizePlan

SEED = 4321
LAYERS, HIDDEN, HEADS, FFN = 2, 32, 4, 64
HN = HIDDEN // HEADS
VOCAB, SEQ, MICRO = 64, 8, 2

DROPS = {("mlp", 1): (2, 3, 10, 31, 47, 60), ("attn", 1): (1,), ("attn", 2): (0, 3), ("mlp", 2): (0, 63)}


def gpt(**overrides) -> torch.nn.Module:
    """The tiny resizable GPT; `overrides` are model config keys (e.g. {"model.activation": "swiglu"})."""
    cfg = apply_overrides(
        MegahetConfig(),
        {
            "model.num_layers": LAYERS,
            "model.hidden_size": HIDDEN,
            "model.num_attention_heads": HEADS,
            "model.ffn_hidden_size": FFN,
            "model.seq_length": SEQ,
            "model.make_vocab_size_divisible_by": 1,
            **overrides,
        },
    )
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    return build_gpt(cfg, VOCAB, resizable_layer_spec())


def batches(step: int, n: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [
        {
            "tokens": torch.randint(0, VOCAB, (MICRO, SEQ), generator=g),
            "labels": torch.randint(0, VOCAB, (MICRO, SEQ), generator=g),
        }
        for _ in range(n)
    ]


def backward(model, micro_batches: list[dict[str, torch.Tensor]]) -> None:
    """Accumulate the gradients of the micro-batches (each loss divided by their count, as the schedule does)."""
    positions = torch.arange(SEQ).expand(MICRO, SEQ)
    for b in micro_batches:
        loss = model(b["tokens"], positions, None, labels=b["labels"]).mean() / len(micro_batches)
        loss.backward()


def step(model, executor, optimizer, micro_batches) -> dict[str, torch.Tensor]:
    """One training step as the Trainer drives it; returns the gradients the optimizer saw."""
    optimizer.zero_grad(set_to_none=True)
    backward(model, micro_batches)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    executor.before_step(optimizer)
    optimizer.step()
    executor.after_step(optimizer)
    return grads


def unit_params(key: tuple[str, int]) -> list[tuple[str, int, int]]:
    """(parameter name, unit axis, unit width) of a block's units, spelled out independently of blocks.py."""
    kind, layer = key
    prefix = f"decoder.layers.{layer - 1}."
    if kind == "mlp":
        return [(prefix + "mlp.linear_fc1.weight", 0, 1), (prefix + "mlp.linear_fc1.bias", 0, 1),
                (prefix + "mlp.linear_fc2.weight", 1, 1)]  # fmt: skip
    return [(prefix + "self_attention.linear_qkv.weight", 0, 3 * HN),
            (prefix + "self_attention.linear_qkv.bias", 0, 3 * HN),
            (prefix + "self_attention.linear_proj.weight", 1, HN)]  # fmt: skip


def unit(tensor: torch.Tensor, dim: int, width: int, u: int) -> torch.Tensor:
    return tensor.narrow(dim, u * width, width)


def num_units(key: tuple[str, int]) -> int:
    return FFN if key[0] == "mlp" else HEADS


def plan_of(drops) -> ResizePlan:
    return ResizePlan({block: {(0, 0): units} for block, units in drops.items()})
