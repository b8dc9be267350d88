"""Compute time of a resized rank vs an unresized one, on one transformer layer large enough to measure.

    python benchmarks/resize_compute.py [--hidden 1024] [--tokens 1024] [--repeats 5]

One megatron-core TransformerLayer built from megahet's resizable spec (TP=1, one process): forward +
backward of the whole layer and of its MLP block alone, with gamma in {0, 0.25, 0.5} of both blocks'
units dropped, measured round-robin. Writes benchmarks/results/resize_compute.{md,json,png}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from benchmarks.common import interleaved_medians, save_results
from megahet.balance.resize_planner import plan_resize
from megahet.balance.selection import select_random
from megahet.config import MegahetConfig
from megahet.models.common import resizable_layer_spec, transformer_config
from megahet.parallel import initialize_parallel
from megahet.tensor_parallel.executor import ResizeExecutor

GAMMAS = (0.0, 0.25, 0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024, help="sequence length x micro-batch")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    initialize_parallel(tp=1, pp=1, seed=1234)
    cfg = MegahetConfig()
    cfg.model.hidden_size, cfg.model.num_attention_heads, cfg.model.num_layers = args.hidden, args.heads, 1
    layer = TransformerLayer(transformer_config(cfg), resizable_layer_spec().submodules, layer_number=1)
    executor = ResizeExecutor(layer, dp_rank=0, tp_rank=0, dp_size=1)
    seq, batch = args.tokens // 4, 4
    x = torch.randn(seq, batch, args.hidden, requires_grad=True)  # (s, b, h)

    def layer_step():
        out, _ = layer(x, attention_mask=None)
        out.sum().backward()

    def mlp_step():
        out, bias = layer.mlp(x)
        (out + bias).sum().backward()

    plans = {
        g: plan_resize(
            executor.block_units, {(0, 0): g}, lambda b, r, n: select_random(executor.block_units[b], n, 0)
        )
        for g in GAMMAS
    }
    fns = {}
    for g in GAMMAS:
        for part, step in (("layer", layer_step), ("mlp", mlp_step)):
            fns[(g, part)] = lambda g=g, step=step: (executor.apply(plans[g]), step())
    times = interleaved_medians(fns, args.repeats)

    flops = {}
    for g in GAMMAS:
        executor.apply(plans[g])
        before = executor.executed_flops()
        layer(x, attention_mask=None)
        flops[g] = executor.executed_flops() - before
    rows = []
    for g in GAMMAS:
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
        "threads": torch.get_num_threads(),
    }
    folder = save_results("resize_compute", rows, columns, meta)
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
    fig.savefig(folder / "resize_compute.png", dpi=120)


if __name__ == "__main__":
    main()
