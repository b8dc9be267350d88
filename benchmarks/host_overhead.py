"""What the balancer costs on the host per training step (issue 48): step time and machine-independent counts
of plain megatron-core, megahet without a balancer, megahet measuring, and SEMI (at its defaults and
deciding every step), side by side in one launch per tensor-parallel size.

    python benchmarks/host_overhead.py                       # CPU: tiny Llama, TP=1 and TP=2, ~9 min on 2 cores
    python benchmarks/host_overhead.py --tp 1 --rounds 5
    python benchmarks/host_overhead.py --rounds 0 --healthy-gap 0.9 --name host_counts   # counts only, as CI
    python benchmarks/host_overhead.py --arch llama --layers 24 --hidden 1536 --heads 12 --groups 4 \\
        --ffn 4096 --seq 2048 --micro 4 --accum 2 --tp 1 --name host_overhead_h100   # a GPU: 629 M Llama

The default shape is host-bound on purpose (a 4-layer Llama, hidden 64, sequence 64): the step is mostly
Python launching work, as a 0.3-0.6 B model's is on an H200, so what the balancer adds on the host shows.
Each TP size runs under torchrun (nproc = TP, gloo on CPU, each rank pinned to a core of its own where the
machine has enough: tools/pin_ranks.py); every rank builds all the systems and times them in interleaved
blocks of `--steps` steps (`--rounds` rounds, each round starting one system later), so machine noise hits
all alike. Then each system's steps are counted (benchmarks/host_counts.py, on rank 0): ATen ops
dispatched, Python calls into megahet, host syncs, CUDA events recorded; these do not drift with load.

- `mcore`: plain megatron-core, the same GPT / Llama (its GPTModel, local layer spec) driven by its own
  forward_backward_func; on a GPU with its DDP and optimizer, on CPU with torch's AdamW (megatron's
  optimizer needs CUDA);
- `megahet`: megahet's trainer (DeepSpeed ZeRO-1 engine) with no balancer;
- `measuring`: resizable layers and the balancer's clock, no planning (`--balance.trace`, mode static);
- `semi`: SEMI at its defaults; `semi_every_step`: SEMI deciding every step (`balance.interval 1`);
  `semi_healthy`: SEMI at its defaults with `balance.healthy_gap 0.9`, so that it never moves work: its host
  cost alone (on a shared CPU `semi` also reacts to ranks the machine really slows for a while, which costs
  or gains on its own);
- `compiled`, `semi_compiled`: megahet and SEMI with `--train.compile` (each layer's forward under
  torch.compile, compiled in the warm-up steps).

`vs_megahet` = the median over rounds of megahet's block / this system's block in the same round (paired:
a drift of the machine's speed between rounds cancels); `vs_megahet_iqr`, those ratios' quartiles;
`vs_megahet_ci90`, a 90 % bootstrap interval of their median;
`hooks_ms`, the median step's time in megahet's step hooks (the balancers' host work between the
micro-batches and the optimizer step: gathering, estimating, deciding).
Writes benchmarks/results/<name>.{md,json}, and <name>_ops.md: per operator, what megahet dispatches beyond megatron-core, and measuring and SEMI beyond
megahet (where the host work goes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
import torch.distributed as dist

from benchmarks.common import RESULTS, save_results, torchrun
from benchmarks.gpu_throughput import base_args, mcore_step_fn, model_parser, timed_block
from benchmarks.host_counts import HostCounts, op_differences

COLUMNS = [
    "system",
    "tp",
    "step_s",
    "vs_megahet",
    "vs_megahet_iqr",
    "vs_megahet_ci90",
    "hooks_ms",
    "aten_ops",
    "megahet_calls",
    "host_syncs",
    "cuda_events",
]
COUNTED_STEPS = 10
"""Counted steps per system: a whole period of the sampled priority statistics (resize.score_interval 5)
and of a reselection (resize.reselect_interval 10), so the counts are the per-step average."""


def systems(args, trace_dir: Path) -> dict[str, list[str]]:
    """megahet's systems: the overrides each adds to the shape."""
    semi = ["--balance.mode", "semi"]
    if args.healthy_gap is not None:
        semi += ["--balance.healthy_gap", str(args.healthy_gap)]
    return {
        "megahet": [],
        "measuring": ["--balance.trace", str(trace_dir / "trace.jsonl")],
        "semi": semi,
        "semi_every_step": [*semi, "--balance.interval", "1"],
        "semi_healthy": ["--balance.mode", "semi", "--balance.healthy_gap", "0.9"],
        "compiled": ["--train.compile", "true"],
        "semi_compiled": [*semi, "--train.compile", "true"],
    }


def chosen_systems(args, trace_dir: Path) -> dict[str, list[str]]:
    """The systems `--systems` names (all by default), megahet without a balancer always among them."""
    every = systems(args, trace_dir)
    if not args.systems:
        return every
    names = ["megahet", *(n for n in args.systems.split(",") if n != "megahet")]
    if unknown := [n for n in names if n not in every]:
        raise SystemExit(f"--systems: unknown {unknown}: choose from {sorted(every)}")
    return {n: every[n] for n in names}


def megahet_step(args, extra: list[str]):
    import pretrain_gpt
    from megahet.config import load_config
    from megahet.training import setup

    cfg = load_config([*base_args(args), "--parallel.tp", str(args.tp), *extra])
    trainer = setup(cfg, pretrain_gpt.SPEC)
    hooks: list[float] = []  # each step's time in the step hooks (the balancers' host work)

    def step():
        hooks.append(trainer.train_step()["hooks_s"])

    step.hooks = hooks
    return step, cfg


def mcore_cpu_step(cfg, vocab_size: int, accum: int):
    """One optimizer step of plain megatron-core on CPU: its GPTModel (the local layer spec megahet's
    layers extend) and forward_backward_func, torch's AdamW (no DP: the TP ranks' replicated parameters
    get equal gradients)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megahet.models.common import local_layer_spec
    from megahet.models.gpt import build_gpt

    spec = local_layer_spec(attention=cfg.model.attention, normalization=cfg.model.normalization)
    model = build_gpt(cfg, vocab_size, spec)
    t = cfg.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    micro, seq = t.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, vocab_size, (micro, seq + 1))  # (b, s+1)
    positions = torch.arange(seq).expand(micro, seq)  # (b, s)

    def forward_step(data_iterator, module):
        out = module(tokens[:, :-1], positions, None, labels=tokens[:, 1:])  # (b, s) per-token losses
        return out, lambda loss: (loss.float().mean(), {})

    forward_backward = get_forward_backward_func()

    def step():
        optimizer.zero_grad(set_to_none=True)
        forward_backward(forward_step_func=forward_step, data_iterator=iter(range(accum)), model=[model],
                         num_microbatches=accum, seq_length=seq, micro_batch_size=micro, forward_only=False)  # fmt: skip
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
        optimizer.step()

    return step


def counted(step, steps: int) -> dict[str, float]:
    with HostCounts() as counts:
        for _ in range(steps):
            step()
    return counts.as_dict(steps)


def rank_main(args) -> None:
    """On each rank of one TP size: build the systems, time them interleaved, count them; rank 0 writes."""
    import pretrain_gpt
    from megahet.platform import cuda_available, synchronize

    copies: dict[str, list] = {}  # system -> its `--instances` trainers' step functions
    cfg = None
    for i in range(args.instances):
        trace_dir = Path(tempfile.mkdtemp())  # an instance's own trace
        for name, extra in chosen_systems(args, trace_dir).items():
            step, cfg = megahet_step(args, extra)
            copies.setdefault(name, []).append(step)
    vocab = pretrain_gpt.SPEC.vocab_size(cfg)
    mcore_step = (lambda: mcore_step_fn(cfg, vocab, args.accum)[0]) if cuda_available() else (
        lambda: mcore_cpu_step(cfg, vocab, args.accum))  # fmt: skip
    copies = {"mcore": [mcore_step() for _ in range(args.instances)], **copies}
    for instances in copies.values():  # warm-up: DeepSpeed's first step, the balancer's first plans
        for step in instances:
            timed_block(step, 3)
    names = list(copies)
    seconds = {name: [float("nan")] for name in names} if args.rounds == 0 else {name: [] for name in names}
    blocks = [(name, i) for i in range(args.instances) for name in names]
    for r in range(args.rounds):  # each round starts one block later: no system always follows the same one
        took: dict[str, list[float]] = {name: [] for name in names}
        for name, i in blocks[r % len(blocks) :] + blocks[: r % len(blocks)]:
            dist.barrier()
            synchronize()
            took[name].append(timed_block(copies[name][i], args.steps))
        for name in names:  # a system's round: the mean over its instances (each built on its own memory)
            seconds[name].append(statistics.fmean(took[name]))
    steps = {name: instances[0] for name, instances in copies.items()}
    hooks = {
        name: statistics.median(h for step in instances for h in step.hooks) * 1e3
        for name, instances in copies.items()
        if getattr(instances[0], "hooks", None)
    }
    counts = {name: counted(step, args.counted_steps) for name, step in steps.items()}
    if dist.get_rank() != 0:
        return
    rows = [
        {"system": name, "tp": args.tp, "step_s": statistics.median(samples),
         "vs_megahet": statistics.median(m / x for m, x in zip(seconds["megahet"], samples)),
         "vs_megahet_iqr": _quartiles([m / x for m, x in zip(seconds["megahet"], samples)]),
         "vs_megahet_ci90": _median_ci([m / x for m, x in zip(seconds["megahet"], samples)]),
         "hooks_ms": hooks.get(name, 0.0),
         **counts[name], "block_seconds": samples}
        for name, samples in seconds.items()
    ]  # fmt: skip
    Path(args.out).write_text(json.dumps(rows))


def _quartiles(ratios: list[float]) -> str:
    """The paired ratios' 25th and 75th percentiles ("lo-hi"): how far one round's ratio strays."""
    if len(ratios) < 4:
        return ""
    q = statistics.quantiles(ratios, n=4)
    return f"{q[0]:.3f}-{q[2]:.3f}"


def _median_ci(ratios: list[float], resamples: int = 2000) -> str:
    """A 90 % bootstrap interval of the paired ratios' median ("lo-hi"): how far the reported ratio could
    be off from round-to-round noise alone."""
    if len(ratios) < 4:
        return ""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return f"{medians[resamples // 20]:.3f}-{medians[resamples - 1 - resamples // 20]:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = model_parser(__doc__.split("\n")[0], layers=4, seq=64, micro=2, accum=2)
    parser.set_defaults(hidden=64, heads=4)
    parser.add_argument("--arch", choices=["gpt", "llama"], default="llama")
    parser.add_argument("--groups", type=int, default=0, help="key/value heads (0: one per head)")
    parser.add_argument("--ffn", type=int, default=0, help="MLP units (0: 4 x hidden)")
    parser.add_argument("--attention", choices=["sdpa", "local"], default="sdpa")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (ranks)")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=20, help="0: count only (no timing: CI's budget test)")
    parser.add_argument("--name", default="host_overhead")
    parser.add_argument("--healthy-gap", type=float, help="SEMI's balance.healthy_gap (CI's counts: 0.9, so "
                        "that timing noise never resizes and the counts are the healthy steady state's)")  # fmt: skip
    parser.add_argument("--systems", help="megahet's systems to run, comma-separated (default: all; megatron-core "
                        "and megahet always run)")  # fmt: skip
    parser.add_argument("--instances", type=int, default=3, help="trainers built per system, timed in turn "
                        "(default 3; 1 on a GPU's large shapes): one trainer's speed also depends on where its "
                        "memory landed, by 2-3 %% on CPU")  # fmt: skip
    parser.add_argument("--counted-steps", type=int, default=COUNTED_STEPS, help="steps counted per system "
                        f"(default {COUNTED_STEPS}: a whole period of the sampled statistics)")  # fmt: skip
    parser.add_argument("--out", help=argparse.SUPPRESS)  # a rank's results file (set by the launch below)
    args = parser.parse_args(argv)
    if "RANK" in os.environ:  # a rank of the launch below
        args.tp = args.tp[0]
        rank_main(args)
        return
    rows, forwarded = [], strip_option(sys.argv[1:] if argv is None else argv, "--tp")
    for tp in args.tp:
        out = RESULTS / f"{args.name}_runs" / f"tp{tp}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)
        # a rank per core where there are enough (tools/pin_ranks.py): the scheduler moving ranks between
        # cores would add more noise than the 2 % this measures
        pinned = tp <= len(os.sched_getaffinity(0))
        script = (
            ["tools/pin_ranks.py", "benchmarks/host_overhead.py"]
            if pinned
            else ["benchmarks/host_overhead.py"]
        )
        torchrun(script[0], tp, [*script[1:], *forwarded, "--tp", str(tp), "--out", str(out)],
                 out.with_suffix(".log"))  # fmt: skip
        rows += json.loads(out.read_text())
    meta = {"shape": {k: getattr(args, k) for k in ("arch", "layers", "hidden", "heads", "seq", "micro", "accum")},
            "steps_per_block": args.steps, "rounds": args.rounds, "counted_steps": args.counted_steps,
            "instances": args.instances,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "pinned_ranks": max(args.tp) <= len(os.sched_getaffinity(0)),
            "torch": torch.__version__}  # fmt: skip
    save_results(args.name, rows, COLUMNS, meta)
    write_op_table(RESULTS / f"{args.name}_ops.md", rows)


def write_op_table(path: Path, rows: list[dict], top: int = 30) -> None:
    """Per TP size, the operators megahet's unbalanced step dispatches more (or fewer) times than plain
    megatron-core's, and the ones measuring adds to it: where the host work of each goes."""
    lines = []
    for tp in sorted({r["tp"] for r in rows}):
        by = {r["system"]: r["ops"] for r in rows if r["tp"] == tp}
        for system, base in (("megahet", "mcore"), ("measuring", "megahet"), ("semi", "megahet")):
            if system not in by:
                continue
            header = f"| operator | extra | {system} | {base} |"
            lines += [
                f"### TP {tp}: {system} - {base} (dispatches per step)",
                "",
                header,
                "|---|---|---|---|",
            ]
            for name, extra in op_differences(by[system], by[base])[:top]:
                mine, theirs = by[system].get(name, 0), by[base].get(name, 0)
                lines.append(f"| {name} | {extra:+.1f} | {mine:.1f} | {theirs:.1f} |")
            lines.append("")
    path.write_text("\n".join(lines))


def strip_option(argv: list[str], option: str) -> list[str]:
    """argv without `option` and the values after it."""
    out, skipping = [], False
    for arg in argv:
        if arg == option:
            skipping = True
            continue
        if skipping and not arg.startswith("--"):
            continue
        skipping = False
        out.append(arg)
    return out


if __name__ == "__main__":
    main()
