"""Plan a GPT's layout for a mixed cluster: the fastest plans that fit, with predicted step time and memory,
the Pareto set of memory against time, and a ready configuration for each.

    python tools/plan.py --cluster cluster.yaml --config model.yaml [--section.key VALUE ...] [--top 10] [--out plans]

The cluster file lists the nodes (GPU kind, count, memory, rate, links: docs/planning.md). The model and
training settings are pretrain_gpt.py's (`--config`, `--model.*`, `--train.global_batch_size`,
`--train.precision`, `--plan.micro_batches`, ...). `--plan.profile trace.jsonl` calibrates the cost model
from a short profiling run of the model (its `--balance.trace`; docs/planning.md). Every plan is checked
by megahet's own validation. With
`--out DIR` each listed plan is written as DIR/plan_NN.yaml (the run's settings and the plan's) with the
command that runs it, its nodes launched in the plan's order:

    torchrun --nnodes N --nproc-per-node G --node-rank R ... pretrain_gpt.py --config DIR/plan_01.yaml

`pretrain_gpt.py --plan auto --cluster cluster.yaml` plans the same way at start-up (its nodes in the
file's order) and runs the fastest plan. Bad inputs are one-line errors (exit status 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # pretrain_gpt.py: the tokenizer's vocabulary

from megahet.config import ConfigError, config_help, load_config
from megahet.layout_plan import plan_layouts, plan_overrides_yaml, plan_table, read_plan_cluster
from megahet.policy.layout_search import pareto


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="every setting of pretrain_gpt.py (the model, training and plan.* keys):\n\n"
        + config_help().split("\n", 2)[2],  # its own usage line is pretrain_gpt.py's
    )
    parser.add_argument("--top", type=int, default=10, help="how many of the fastest plans to list")
    parser.add_argument("--out", type=Path, help="write each listed plan as OUT/plan_NN.yaml")
    args, rest = parser.parse_known_args(argv)
    try:
        cfg = load_config(rest)
        cluster = read_plan_cluster(cfg)
        import pretrain_gpt

        pretrain_gpt.preflight(cfg)
        plans = plan_layouts(cfg, cluster, pretrain_gpt.vocab_size(cfg))
    except ConfigError as err:
        print(f"megahet: error: {err}", file=sys.stderr)
        return 2
    nodes = f"{len(cluster.nodes)} nodes x {cluster.gpus_per_node} GPUs"
    if not plans:
        print(f"megahet: error: no layout of this model fits the cluster's {nodes}: use more or larger GPUs, "
              f"smaller micro-batches (--plan.micro_batches) or a smaller model", file=sys.stderr)  # fmt: skip
        return 2
    print(f"{len(plans)} plans fit {cfg.plan.cluster} ({nodes}); nodes: "
          f"{', '.join(f'{i}={n.name}' for i, n in enumerate(cluster.nodes))}")  # fmt: skip
    print(plan_table(plans, top=args.top))
    if args.out is not None:
        front = {id(p) for p in pareto(plans)}
        listed = [p for i, p in enumerate(plans) if i < args.top or id(p) in front]
        args.out.mkdir(parents=True, exist_ok=True)
        for plan in listed:
            path = args.out / f"plan_{plans.index(plan) + 1:02d}.yaml"
            header = (
                f"# {plan.layout}, micro-batch {plan.micro_batch}, ZeRO-{plan.zero_stage}: predicted "
                f"{plan.step_s:.4g} s per step, {plan.peak_gib:.2f} GiB on the fullest GPU\n"
                f"# launch the cluster file's nodes in this order (node_rank = position): "
                f"{','.join(map(str, plan.node_order))}\n"
                f"# torchrun --nnodes {len(cluster.nodes)} --nproc-per-node {cluster.gpus_per_node} "
                f"--node-rank R ... pretrain_gpt.py --config {path}\n"
            )
            path.write_text(header + yaml.safe_dump(plan_overrides_yaml(cfg, plan), sort_keys=False))
        print(f"wrote {len(listed)} configurations to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
