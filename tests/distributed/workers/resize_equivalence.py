"""Worker: ZERO-resizing's numerics on 2 ranks, one launch, results saved for the test to compare.

    torchrun --nproc_per_node 2 resize_equivalence.py --out DIR

Phase TP=2 (DP=1), every model built from the same seed (`use_cpu_initialization`: each TP shard is
a slice of the same full weight):
- gamma0_gpt / gamma0_vit: megatron-core's local-spec model and the resizable-spec model (no plan);
- tp0_drops / tp1_drops: the resizable GPT where only TP rank 0 (resp. 1) drops the MLP units and
  heads in LOCAL_DROPS (its local indexes), plus every rank's executed FLOPs;
- mixed_<gpt|vit>_<sdpa|local>: the resizable model running MIXED_PLAN (heads and MLP units dropped
  and migrated) with SDPA and with megatron-core's local core attention.
Phase TP=1 (DP=2):
- ref_tp0_drops / ref_tp1_drops: the TP=1 GPT with the corresponding global units zeroed
  (local unit u of TP rank r = global unit r * units_per_rank + u), no plan;
- count_aware: each DP replica drops different units (plan entries (0,0) and (1,0)), computes its
  gradients with the executor's hooks on its own data, and the replicas all-reduce-mean them (what
  DeepSpeed's DP reduction does); plus, per replica, the gradients of the same model with that
  replica's dropped units zeroed (no plan, no hooks) on the same data, for the hand-made reference.
Every result is {"out": output, "grads": {name: full (TP-gathered) gradient}}; rank 0 saves
DIR/resize_equivalence.pt with them and "meta" (the sizes and drops used).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType

from megahet.config import MegahetConfig, apply_overrides
from megahet.models.common import local_layer_spec, resizable_layer_spec
from megahet.models.gpt import build_gpt
from megahet.models.vit import build_vit
from megahet.parallel import current_layout, initialize_parallel
from megahet.tensor_parallel.executor import ResizeExecutor
from megahet.tensor_parallel.plan import ResizePlan

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: shared test support
from resize_reference import zero_units
from tp_gather import gathered

SEED = 2024
LAYERS, HIDDEN, HEADS, FFN = 2, 32, 4, 64
HN = HIDDEN // HEADS
VOCAB, SEQ, BATCH = 64, 8, 4
# Local indexes on the dropping TP rank at TP=2: 32 MLP units and 2 heads per rank per layer.
LOCAL_DROPS = {("mlp", 1): (0, 3, 17, 31), ("attn", 1): (1,), ("attn", 2): (0,), ("mlp", 2): (5, 6)}
# DP=2 at TP=1 (64 units, 4 heads): replica 0 and replica 1 drop different units, some of them both.
REPLICA_DROPS = {
    0: {("mlp", 1): (0, 1, 2, 10, 40), ("attn", 1): (0, 2), ("attn", 2): (3,)},
    1: {("mlp", 1): (2, 3, 40, 63), ("attn", 1): (2,), ("mlp", 2): (7,), ("attn", 2): (0, 1)},
}


# At TP=2, attention through SDPA and through megatron-core's local DotProductAttention, with heads
# dropped and migrated (and MLP units, so both kinds of block run resized): TP rank 0 drops head 1 of
# layer 1 and hands MLP units 2, 9 of layer 1 to rank 1; rank 1 hands head 0 of layer 2 to rank 0.
MIXED_PLAN = ResizePlan.from_dict(
    {
        "blocks": {"attn:1": {"0,0": [1]}, "mlp:2": {"0,1": [3, 4]}},
        "migrated": {"attn:2": {"0,1": {"0": [0]}}, "mlp:1": {"0,0": {"1": [2, 9]}}},
    }
)


def config(tp: int, attention: str = "sdpa") -> MegahetConfig:
    return apply_overrides(
        MegahetConfig(),
        {
            "model.attention": attention,
            "model.num_layers": LAYERS,
            "model.hidden_size": HIDDEN,
            "model.num_attention_heads": HEADS,
            "model.ffn_hidden_size": FFN,
            "model.seq_length": SEQ,
            "model.make_vocab_size_divisible_by": 1,
            "model.patch_size": 7,
            "parallel.tp": tp,
        },
    )


def build(kind: str, spec: str, tp: int, attention: str = "sdpa"):
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    make = resizable_layer_spec if spec == "resizable" else local_layer_spec
    if kind == "gpt":
        return build_gpt(config(tp, attention), VOCAB, make(attention=attention))
    return build_vit(config(tp, attention), make(AttnMaskType.no_mask, attention=attention))


def batch(kind: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "gpt":
        return {
            "tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        }
    return {
        "images": torch.randn(BATCH, 1, 28, 28, generator=g),
        "labels": torch.randint(0, 10, (BATCH,), generator=g),
    }


def run(model, kind: str, seed: int = 1, before_gather=None) -> dict:
    """Forward + backward on one batch; output, full gradients and full initial parameters.
    `before_gather`: called after the backward (a migrating executor brings its guests' gradients home)."""
    b = batch(kind, seed)
    params = gathered(model, "data")
    if kind == "gpt":
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        out = model(b["tokens"], positions, None, labels=b["labels"])  # (b, s) per-token loss
        loss = out.mean()
    else:
        out = model(b["images"])  # (b, classes), replicated over TP
        loss = F.cross_entropy(out, b["labels"])
    loss.backward()
    if before_gather is not None:
        before_gather()
    return {"out": out.detach().clone(), "grads": gathered(model, "grad"), "params": params}


def plan_for(drops: dict, rank: tuple[int, int]) -> ResizePlan:
    return ResizePlan({block: {rank: units} for block, units in drops.items()})


def global_drops(tp_rank: int, tp: int) -> dict:
    """LOCAL_DROPS of TP rank `tp_rank` as global unit indexes of the TP=1 model."""
    per_rank = {"mlp": FFN // tp, "attn": HEADS // tp}
    return {
        block: tuple(tp_rank * per_rank[block[0]] + u for u in units) for block, units in LOCAL_DROPS.items()
    }


def tp2_phase(results: dict) -> None:
    initialize_parallel(tp=2, pp=1, seed=SEED)
    layout = current_layout()
    for kind in ("gpt", "vit"):
        results[f"gamma0_{kind}"] = {spec: run(build(kind, spec, 2), kind) for spec in ("local", "resizable")}
    for dropping in (0, 1):
        model = build("gpt", "resizable", 2)
        executor = ResizeExecutor(model, dp_rank=0, tp_rank=layout.tp_rank, dp_size=1)
        executor.apply(plan_for(LOCAL_DROPS, (0, dropping)))
        result = run(model, "gpt")
        flops = [None, None]
        dist.all_gather_object(flops, {str(k): b.executed_flops for k, b in executor.blocks.items()})
        result["flops"] = flops
        results[f"tp{dropping}_drops"] = result
    for kind in ("gpt", "vit"):
        for attention in ("sdpa", "local"):
            model = build(kind, "resizable", 2, attention)
            executor = ResizeExecutor(
                model,
                dp_rank=0,
                tp_rank=layout.tp_rank,
                dp_size=1,
                tp_group=ps.get_tensor_model_parallel_group(),
            )
            executor.apply(MIXED_PLAN)
            results[f"mixed_{kind}_{attention}"] = run(model, kind, before_gather=executor.before_step)
    ps.destroy_model_parallel()


def tp1_phase(results: dict) -> None:
    layout = initialize_parallel(tp=1, pp=1, seed=SEED)
    assert layout.dp_size == 2 and layout.tp_size == 1
    for dropping in (0, 1):
        model = build("gpt", "resizable", 1)
        zero_units(model, global_drops(dropping, 2))
        results[f"ref_tp{dropping}_drops"] = run(model, "gpt")

    # Count-aware averaging: replica r drops REPLICA_DROPS[r], computes on its own data.
    plan = ResizePlan(
        {
            block: {(r, 0): REPLICA_DROPS[r][block] for r in (0, 1) if block in REPLICA_DROPS[r]}
            for block in set(REPLICA_DROPS[0]) | set(REPLICA_DROPS[1])
        }
    )
    model = build("gpt", "resizable", 1)
    executor = ResizeExecutor(model, dp_rank=layout.dp_rank, tp_rank=0, dp_size=2, imputation="zero")
    executor.apply(plan)
    local = run(model, "gpt", seed=10 + layout.dp_rank)
    averaged = {}
    for name, grad in local["grads"].items():
        grad = grad.clone()
        dist.all_reduce(grad, group=ps.get_data_parallel_group())
        averaged[name] = grad / 2

    reference = build("gpt", "resizable", 1)  # this replica's units zeroed, no plan, no hooks
    zero_units(reference, REPLICA_DROPS[layout.dp_rank])
    own = run(reference, "gpt", seed=10 + layout.dp_rank)
    replicas = [None, None]
    dist.all_gather_object(replicas, (layout.dp_rank, own["grads"], local["grads"]))
    results["count_aware"] = {
        "averaged": averaged,
        "replica_reference": {r: grads for r, grads, _ in replicas},
        "replica_hooked": {r: hooked for r, _, hooked in replicas},
        "plan": plan.to_dict(),
    }
    ps.destroy_model_parallel()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    results: dict = {}
    tp2_phase(results)
    tp1_phase(results)
    if dist.get_rank() == 0:
        results["meta"] = {
            "hidden": HIDDEN, "heads": HEADS, "ffn": FFN, "head_dim": HN, "batch": BATCH, "seq": SEQ,
            "local_drops": LOCAL_DROPS, "replica_drops": REPLICA_DROPS,
            "global_drops": {r: global_drops(r, 2) for r in (0, 1)},
        }  # fmt: skip
        torch.save(results, args.out / "resize_equivalence.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
