"""Worker: resizing and migration of Llama-shaped units at TP = world size, against megatron-core's own spec.

    torchrun --nproc_per_node 3 llama_equivalence.py --out DIR

The model: 2 layers, hidden 96, 12 query heads in 6 key/value groups (GQA, 2 heads per group), SwiGLU
MLP of 96 units, RMSNorm, rotary positions, untied output layer, linear biases kept (so that the bias
rows of a unit are moved and checked too). Phase TP=N (DP=1), every model from the same seed:
- gamma0: megatron-core's local spec (SDPA plugged in) and the resizable spec, no plan;
- drops: the last TP rank drops LOCAL_DROPS (MLP units; one whole key/value group's heads and one head
  of another group);
- migrate: the same drops plus MOVES: TP rank 0 hands heads (a whole group and half of another) and
  MLP units to rank 1 (and, at TP=3, rank 2 hands a head and units to ranks 0 and 1).
Phase TP=1 (DP=N): reference, the TP=1 model with the global units of LOCAL_DROPS zeroed (q rows + proj
columns of heads; gate, up rows and fc2 column of MLP units; spelled out from megatron-core's layouts).
Every result is {"out", "grads", "params"} with TP shards merged into the TP=1 layout (SwiGLU's fc1 as
[gates; ups]); rank 0 saves DIR/llama_tp<N>.pt with them and "meta".
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from tp_gather import gathered

from megahet.config import MegahetConfig, apply_overrides
from megahet.models.attention import SDPACoreAttention
from megahet.models.common import resizable_layer_spec, transformer_config
from megahet.models.gpt import build_gpt
from megahet.parallel import current_layout, initialize_parallel
from megahet.tensor_parallel.executor import ResizeExecutor
from megahet.tensor_parallel.plan import ResizePlan

SEED = 77
LAYERS, HIDDEN, HEADS, GROUPS, FFN = 2, 96, 12, 6, 96
HN, R = HIDDEN // HEADS, HEADS // GROUPS
PERIOD = (R + 2) * HN
VOCAB, SEQ, BATCH = 96, 8, 2  # the vocabulary split over TP=2 and TP=3


def local_drops(tp: int) -> dict:
    """Local units the last TP rank drops: at TP=2 it holds 6 heads (3 groups), 48 MLP units; at TP=3,
    4 heads (2 groups), 32 units. Layer 1 drops all of its group 0 and one head of its group 1."""
    return {("attn", 1): (0, 1, 3), ("attn", 2): (2,), ("mlp", 1): (0, 5, 31), ("mlp", 2): (7, 8)}


def moves(tp: int) -> dict:
    """ResizePlan "migrated" entries: owner "0,tp" -> {helper: units}."""
    out = {
        "attn:1": {"0,0": {"1": [0, 1, 2]}},  # group 0 whole, half of group 1
        "attn:2": {"0,0": {"1": [3]}},
        "mlp:1": {"0,0": {"1": [1, 2, 30]}},
        "mlp:2": {"0,0": {"1": [0]}},
    }
    if tp == 3:
        out["attn:2"]["0,2"] = {"0": [0], "1": [3]}
        out["mlp:2"]["0,2"] = {"0": [4, 5], "1": [6]}
    return out


def config(tp: int) -> MegahetConfig:
    return apply_overrides(
        MegahetConfig(),
        {
            "model.num_layers": LAYERS, "model.hidden_size": HIDDEN, "model.num_attention_heads": HEADS,
            "model.num_query_groups": GROUPS, "model.ffn_hidden_size": FFN, "model.seq_length": SEQ,
            "model.make_vocab_size_divisible_by": 1, "model.activation": "swiglu",
            "model.normalization": "RMSNorm", "model.position_embedding_type": "rope",
            "model.untie_embeddings_and_output_weights": True, "parallel.tp": tp,
        },
    )  # fmt: skip


def build(spec: str, tp: int):
    cfg = config(tp)
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    if spec == "resizable":
        return build_gpt(cfg, VOCAB, resizable_layer_spec(normalization="RMSNorm"))
    layer = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))  # megatron-core's own
    layer.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return GPTModel(
        config=transformer_config(cfg), transformer_layer_spec=layer, vocab_size=VOCAB, max_sequence_length=SEQ,
        share_embeddings_and_output_weights=False, position_embedding_type="rope",
    )  # fmt: skip


def run(model, before_gather=None) -> dict:
    g = torch.Generator().manual_seed(3)
    tokens, labels = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    params = gathered(model, "data")
    out = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels)  # (b, s) per-token loss
    out.mean().backward()
    if before_gather is not None:
        before_gather()
    return {"out": out.detach().clone(), "grads": gathered(model, "grad"), "params": params}


def global_drops(tp: int) -> dict:
    """local_drops of the last TP rank as global units of the TP=1 model."""
    per_rank = {"mlp": FFN // tp, "attn": HEADS // tp}
    return {
        block: tuple((tp - 1) * per_rank[block[0]] + u for u in units)
        for block, units in local_drops(tp).items()
    }


@torch.no_grad()
def zero_global(model, drops: dict) -> None:
    params = dict(model.named_parameters())
    for (kind, layer), units in drops.items():
        prefix = f"decoder.layers.{layer - 1}."
        for u in units:
            if kind == "mlp":
                for name in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
                    params[prefix + name][[u, FFN + u]] = 0
                params[prefix + "mlp.linear_fc2.weight"][:, u] = 0
            else:
                start = u // R * PERIOD + u % R * HN
                for name in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
                    params[prefix + name][start : start + HN] = 0
                params[prefix + "self_attention.linear_proj.weight"][:, u * HN : (u + 1) * HN] = 0


def tp_phase(tp: int, results: dict) -> None:
    initialize_parallel(tp=tp, pp=1, seed=SEED)
    layout = current_layout()
    results["gamma0"] = {spec: run(build(spec, tp)) for spec in ("megatron", "resizable")}
    drops = ResizePlan({block: {(0, tp - 1): units} for block, units in local_drops(tp).items()})
    for name, plan in (
        ("drops", drops),
        ("migrate", ResizePlan.from_dict({**drops.to_dict(), "migrated": moves(tp)})),
    ):
        model = build("resizable", tp)
        executor = ResizeExecutor(
            model, dp_rank=0, tp_rank=layout.tp_rank, dp_size=1, tp_group=ps.get_tensor_model_parallel_group()
        )
        executor.apply(plan)
        results[name] = run(model, before_gather=executor.before_step)
        flops = [None] * tp
        dist.all_gather_object(flops, executor.executed_flops())
        results[name]["flops"] = flops
    ps.destroy_model_parallel()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    tp = int(os.environ["WORLD_SIZE"])
    results: dict = {}
    tp_phase(tp, results)
    initialize_parallel(tp=1, pp=1, seed=SEED)
    reference = build("resizable", 1)
    zero_global(reference, global_drops(tp))
    results["reference"] = run(reference)
    ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        results["meta"] = {"tp": tp, "head_dim": HN, "ffn": FFN, "global_drops": global_drops(tp)}
        torch.save(results, args.out / f"llama_tp{tp}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
