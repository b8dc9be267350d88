"""Compute time of a resized rank vs an unresized one, on one transformer layer large enough to measure.

    python benchmarks/resize_compute.py [--hidden 1024] [--heads 16] [--tokens 1024] [--repeats 5]
    # one rank's shard of a TP=8 layer of hidden 8192 (64 heads of 128, FFN 28672) in bf16 on a GPU:
    python benchmarks/resize_compute.py --hidden 8192 --heads 8 --kv-channels 128 --ffn 3584 \
        --tokens 8192 --dtype bf16 --gammas 0,0.125,0.25,0.5 --mlp-units 3584,3136,3100,3072,2688,2650,1792

One megatron-core TransformerLayer built from megahet's resizable spec (TP=1, one process, on the GPU
when there is one): forward + backward of the whole layer and of its MLP block alone, with gamma of both
blocks' units dropped, measured round-robin (CUDA-synchronized on a GPU). `--mlp-units` adds the MLP
alone at each kept unit count, to show tile / wave quantization (multiples of 64 or 128 against others).
`--unit-multiple` rounds each resized MLP's kept units up to a multiple (resize.unit_multiple).
Writes benchmarks/results/resize_compute.{md,json,png} (resize_compute_multipleN.* with --unit-multiple N,
and resize_compute_mlp_units.{md,json}).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from benchmarks.common import interleaved_medians, save_results
from megahet.config import MegahetConfig
from megahet.models.common import resizable_layer_spec, transformer_config
from megahet.parallel import initialize_parallel
from megahet.platform import cuda_available, device, synchronize
from megahet.policy.resize_planner import plan_resize
from megahet.policy.selection import select_random
from megahet.tensor_parallel.executor import ResizeExecutor
from megahet.tensor_parallel.plan import ResizePlan


def dense_mlp_step(hidden: int, units: int, x: torch.Tensor):
    """fwd + bwd of a plain two-linear MLP `units` wide: the GEMM cost alone, without resizing's gathers."""
    fc1 = torch.nn.Linear(hidden, units, device=x.device, dtype=x.dtype)  # (units, h)
    fc2 = torch.nn.Linear(units, hidden, device=x.device, dtype=x.dtype)  # (h, units)

    def step():
        fc2(torch.nn.functional.gelu(fc1(x), approximate="tanh")).sum().backward()  # (s, b, h)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-channels", type=int, default=None, help="per-head width (default hidden/heads)")
    parser.add_argument("--ffn", type=int, default=None, help="MLP units (default 4 x hidden)")
    parser.add_argument("--tokens", type=int, default=1024, help="sequence length x micro-batch")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--gammas", default="0,0.25,0.5", help="comma-separated; 0 is the reference")
    parser.add_argument(
        "--unit-multiple", type=int, default=1, help="resize.unit_multiple: MLP keeps a multiple"
    )
    parser.add_argument("--mlp-units", default="", help="comma-separated kept MLP unit counts to time")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    gammas = sorted({0.0, *(float(g) for g in args.gammas.split(","))})

    initialize_parallel(tp=1, pp=1, seed=1234)
    cfg = MegahetConfig()
    cfg.model.hidden_size, cfg.model.num_attention_heads, cfg.model.num_layers = args.hidden, args.heads, 1
    cfg.model.ffn_hidden_size, cfg.train.precision = args.ffn, args.dtype
    config = transformer_config(cfg)
    if args.kv_channels:
        config = dataclasses.replace(config, kv_channels=args.kv_channels)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    layer = TransformerLayer(config, resizable_layer_spec().submodules, layer_number=1).to(device(), dtype)
    executor = ResizeExecutor(layer, dp_rank=0, tp_rank=0, dp_size=1)
    seq, batch = args.tokens // 4, 4
    x = torch.randn(seq, batch, args.hidden, device=device(), dtype=dtype, requires_grad=True)  # (s, b, h)

    def layer_step():
        out, _ = layer(x, attention_mask=None)
        out.sum().backward()

    def mlp_step():
        out, bias = layer.mlp(x)
        (out if bias is None else out + bias).sum().backward()

    units = executor.block_units
    choose = lambda b, r, n: select_random(units[b], n, 0)
    plans = {g: plan_resize(units, {(0, 0): g}, choose, mlp_multiple=args.unit_multiple) for g in gammas}
    fns = {}
    for g in gammas:
        for part, step in (("layer", layer_step), ("mlp", mlp_step)):
            fns[(g, part)] = lambda g=g, step=step: (executor.apply(plans[g]), step())
    mlp_block = next(b for b in units if b[0] == "mlp")
    kept_counts = [int(k) for k in filter(None, args.mlp_units.split(","))]
    for kept in kept_counts:
        dropped = select_random(units[mlp_block], units[mlp_block] - kept, 0)
        plan = ResizePlan({mlp_block: {(0, 0): dropped}})
        fns[(kept, "mlp_units")] = lambda plan=plan: (executor.apply(plan), mlp_step())
        fns[(kept, "dense")] = dense_mlp_step(args.hidden, kept, x)
    times = interleaved_medians(fns, args.repeats, synchronize=synchronize)

    flops = {}
    for g in gammas:
        executor.apply(plans[g])
        before = executor.executed_flops()
        layer(x, attention_mask=None)
        flops[g] = executor.executed_flops() - before
    rows = []
    for g in gammas:
        rows.append(
            {
                "gamma": g,
                "layer_fwd_bwd_s": times[(g, "layer")],
                "layer_ratio": times[(g, "layer")] / times[(0.0, "layer")],
                "mlp_fwd_bwd_s": times[(g, "mlp")],
                "mlp_ratio": times[(g, "mlp")] / times[(0.0, "mlp")],
                "flops_ratio": flops[g] / flops[0.0],
            }
        )
    columns = ["gamma", "layer_fwd_bwd_s", "layer_ratio", "mlp_fwd_bwd_s", "mlp_ratio", "flops_ratio"]
    meta = {
        "hidden": args.hidden,
        "heads": args.heads,
        "tokens": args.tokens,
        "kv_channels": config.kv_channels,
        "ffn": config.ffn_hidden_size,
        "dtype": args.dtype,
        "unit_multiple": args.unit_multiple,
        "device": torch.cuda.get_device_name()
        if cuda_available()
        else f"cpu, {torch.get_num_threads()} threads",
    }
    name = "resize_compute" if args.unit_multiple == 1 else f"resize_compute_multiple{args.unit_multiple}"
    folder = save_results(name, rows, columns, meta)
    if kept_counts:
        full = units[mlp_block]
        reference = times[(kept_counts[0], "mlp_units")] if kept_counts[0] == full else times[(0.0, "mlp")]
        sweep = [
            {"kept_units": k, "multiple_of_128": k % 128 == 0, "multiple_of_64": k % 64 == 0,
             "mlp_fwd_bwd_s": times[(k, "mlp_units")], "time_ratio": times[(k, "mlp_units")] / reference,
             "units_ratio": k / full, "dense_mlp_s": times[(k, "dense")],
             "dense_ratio": times[(k, "dense")] / times[(kept_counts[0], "dense")]}
            for k in kept_counts
        ]  # fmt: skip
        save_results("resize_compute_mlp_units", sweep, list(sweep[0]), meta)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    width = 0.25
    for i, key in enumerate(("layer_ratio", "mlp_ratio", "flops_ratio")):
        ax.bar([j + (i - 1) * width for j in range(len(rows))], [r[key] for r in rows], width, label=key)
    ax.set_xticks(range(len(rows)), [f"gamma {r['gamma']}" for r in rows])
    ax.set_ylabel("relative to gamma 0")
    ax.set_title(f"Resized compute, hidden {args.hidden}, {args.tokens} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / f"{name}.png", dpi=120)


if __name__ == "__main__":
    main()
