"""Long context (issue 45), parts (b) and (c): the training step time of static CP, megatron-core's
power-of-two rule and megahet's dynamic placement on a long-tail document mix at CP 2, with equal ranks and
with one CP rank slowed (emulated 2x, and by real contention).

    python benchmarks/long_context_speed.py                      # ~10 min on 2 cores
    python benchmarks/long_context_speed.py --steps 3 --rounds 2 --conditions equal

For each condition one torchrun launch of 2 gloo ranks, each pinned to a core of its own, builds
pretrain_gpt.py's Trainer (megahet.training.setup) for part (a)'s small Llama shape on the shipped data re-cut
to the long-context mix (`data.length_mix long`: median 256 tokens, 1/16 of the documents from 1024 tokens
with a Pareto tail, cut at --max-tokens), packed into micro-batches of --max-tokens tokens. The document cost
model is pretrain_gpt's own start-up profile. `--steps` global batches are drawn once and replayed for every
planner, so all train on the same documents; the planners alternate in rounds (ABC, CBA, ...) and each one's
figure is the median over rounds of its mean step time.

Planners, all through pretrain_gpt's packed forward step:
- static: head-tail CP (every document padded to 2 cp chunks, the keys and values all-gathered per layer);
- power_of_two: megatron-core's hybrid CP rule (a document over the next power of two of ceil(s / cap)
  ranks, cap = max-tokens / cp), executed by the placed path;
- dynamic: megahet's placement by cost and speed (each rank receives only the keys it needs), given the
  speeds (1, 1, or 1, 0.5 with a slow rank: declared, `parallel.cp_speeds`);
- measured: the same with the speeds measured as training runs (`parallel.cp_speeds measured`: the runtime's
  own `CPPlacement` hook, starting from equal speeds; its estimate is reported).

Conditions: `equal`; `emulated`: CP rank 1's transformer layers take twice their own compute (each layer's
forward and backward followed by a sleep as long as it computed, its time in collectives taken out);
`contention`: a busy process on rank 1's core (benchmarks/contention.py).

Reported per planner and condition: step seconds, speed-up over static, the ranks' compute max / mean
(each rank's forward-backward compute, collectives excluded, from the Trainer's clock), and the key / value
tokens received per step (static: every rank receives every other rank's tokens, padding included).

Writes benchmarks/results/long_context.json ("speed" rows; summary `dynamic_vs_static`,
`slow_rank_vs_static`, other parts' keys kept) and long_context_speed.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
import torch.distributed as dist

from benchmarks.common import RESULTS, markdown_table
from benchmarks.long_context import MODEL, merge_part

CONDITIONS = ("equal", "emulated", "contention")
SLOW = (1.0, 0.5)
"""The CP ranks' declared speeds with a slow rank 1."""
COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor")


class Replay:
    """The Trainer's packed stream, replaying global batches drawn once (every planner trains on them)."""

    def __init__(self, stream, steps: int, dp_rank: int):
        self.cost = stream.cost
        self.steps = []
        for _ in range(steps):
            plan = stream.begin_step()
            self.steps.append((plan, [next(stream) for _ in range(plan.counts[dp_rank])]))
        self.index, self.queue = 0, []

    def begin_step(self):
        plan, micro_batches = self.steps[self.index % len(self.steps)]
        self.index += 1
        self.queue = list(micro_batches)
        return plan

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return self.queue.pop(0)


class CollectiveClock:
    """Seconds this process spends inside torch.distributed's collectives (patched in place)."""

    def __init__(self):
        self.seconds = 0.0
        for name in COLLECTIVES:
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return run


class _Mark(torch.autograd.Function):
    """Identity; in the backward, the layer's output side starts a clock and its input side sleeps for as
    long as the layer's backward computed."""

    @staticmethod
    def forward(ctx, x, state, side: str):
        ctx.state, ctx.side = state, side
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        state = ctx.state
        if ctx.side == "out":
            state.t0, state.waited = time.perf_counter(), state.clock.seconds
        else:
            computed = time.perf_counter() - state.t0 - (state.clock.seconds - state.waited)
            time.sleep(max(computed, 0.0) * (state.factor - 1.0))
        return grad, None, None


def slow_down(model, factor: float, clock: CollectiveClock) -> None:
    """Every transformer layer of `model` takes `factor` times its own compute, forward and backward."""
    for module in model.modules():
        if type(module).__name__ != "TransformerLayer":
            continue
        forward = module.forward

        def run(*args, _forward=forward, **kwargs):
            state = types.SimpleNamespace(t0=0.0, waited=0.0, clock=clock, factor=factor)
            if "hidden_states" in kwargs:
                kwargs["hidden_states"] = _Mark.apply(kwargs["hidden_states"], state, "in")
            else:
                args = (_Mark.apply(args[0], state, "in"), *args[1:])
            t0, waited = time.perf_counter(), clock.seconds
            out = _forward(*args, **kwargs)
            time.sleep(max(time.perf_counter() - t0 - (clock.seconds - waited), 0.0) * (factor - 1.0))
            if isinstance(out, tuple):
                return (_Mark.apply(out[0], state, "out"), *out[1:])
            return _Mark.apply(out, state, "out")

        module.forward = run


def planners(cp: int, cap: int, block: int, ablate: list[int], speeds, stream) -> dict:
    """Each planner as pretrain_gpt's forward step takes it (None: static head-tail); `ablate`: blocks of
    extra dynamic planners (dynamic_b<B>). The dynamic ones are the runtime's own placer at fixed speeds."""
    from megahet.policy.cp_placement import power_of_two_plan
    from megahet.runtime.cp_placement import CPPlacement
    from pretrain_gpt import KV_COST

    def dynamic(block: int):
        return CPPlacement(
            cost_of=lambda: stream.cost, speeds=speeds, measured=False, cp_rank=0, group=None, block=block,
            kv_cost=KV_COST, window=1,
        ).placer  # fmt: skip

    out = {
        "static": None,
        "power_of_two": lambda lengths: power_of_two_plan(lengths, cp, cap, stream.cost),
        "dynamic": dynamic(block),
    }
    out.update({f"dynamic_b{b}": dynamic(b) for b in ablate})
    return out


def kv_received(name: str, placer, lengths: list[int], cp: int) -> int:
    """Key / value tokens the CP ranks receive per layer for one micro-batch (forward)."""
    if placer is None:  # every rank gathers every other rank's chunks, padding included
        padded = sum(-(-n // (2 * cp)) * 2 * cp for n in lengths)
        return (cp - 1) * padded
    return sum(placer(lengths).kv_tokens())


def worker(args) -> None:
    import pretrain_gpt
    from megahet.config import load_config
    from megahet.models.context_parallel import cp_group
    from megahet.runtime.cp_placement import CPPlacement
    from megahet.training import setup

    clock = CollectiveClock()
    values = {
        **MODEL, "model.seq_length": args.max_tokens, "parallel.cp": 2, "data.packing": "documents",
        "data.max_tokens": args.max_tokens, "data.length_mix": "long", "train.global_batch_size": None,
        "train.global_batch_tokens": args.batch_tokens,
    }  # fmt: skip
    argv = [part for key, value in values.items() if value is not None for part in (f"--{key}", str(value))]
    trainer = setup(load_config(argv), pretrain_gpt.SPEC)
    cp, rank = 2, dist.get_rank()
    if args.condition == "emulated" and rank == 1:
        slow_down(trainer.task.model, 2.0, clock)
    speeds = SLOW if args.condition != "equal" else (1.0, 1.0)
    trainer.train_step()  # the start-up profile, the optimizer state
    replay = Replay(trainer.task.train_data, args.steps, trainer.layout.dp_rank)
    trainer.task.train_data = replay
    ablate = [int(b) for b in args.ablate_blocks.split(",")] if args.ablate_blocks else []
    chosen = planners(cp, args.max_tokens // cp, args.block, ablate, speeds, replay)
    measured = CPPlacement(
        cost_of=lambda: replay.cost, speeds=(1.0,) * cp, measured=True, cp_rank=rank, group=cp_group(),  # TP 1: the CP group
        block=args.block, kv_cost=pretrain_gpt.KV_COST, window=3,
    )  # fmt: skip
    measured.ctx = trainer
    trainer.step_hooks.append(measured)
    chosen["measured"] = measured.placer
    order = list(chosen)
    times: dict[str, list[float]] = {name: [] for name in order}
    compute: dict[str, list[list[float]]] = {name: [] for name in order}
    for round_ in range(args.rounds + 1):  # round 0 warms every planner up
        for name in order if round_ % 2 == 0 else order[::-1]:
            trainer.task.forward_step = functools.partial(
                pretrain_gpt.packed_forward_step, placer=chosen[name]
            )
            replay.index = 0
            steps, ranks = [], []
            for _ in range(args.steps):
                record = trainer.train_step()
                mine = torch.tensor([record["compute_s"]])
                every = [torch.zeros(1) for _ in range(cp)]
                dist.all_gather(every, mine)
                steps.append(record["step_time_s"])
                ranks.append([float(x) for x in every])
            if round_:
                times[name].append(statistics.mean(steps))
                compute[name] += ranks
            if rank == 0:
                print(
                    f"{args.condition} round {round_} {name}: {statistics.mean(steps):.2f} s/step", flush=True
                )
    if rank == 0:
        docs = [[int(n) for n in mb["doc_lengths"]] for _, mbs in replay.steps for mb in mbs]
        out = {
            name: {
                "step_s": statistics.median(times[name]), "rounds": times[name],
                "compute_max_mean": statistics.mean(max(r) / statistics.mean(r) for r in compute[name]),
                "kv_tokens_per_step": sum(kv_received(name, chosen[name], d, cp) for d in docs) / args.steps,
            }
            for name in order
        }  # fmt: skip
        cost = replay.cost
        out["measured"]["speeds"] = list(measured.speeds)
        args.out.write_text(json.dumps({"planners": out, "cost": [cost.a, cost.b, cost.c], "batches": docs}))
    dist.barrier()


def rows_of(condition: str, result: dict) -> list[dict]:
    static = result["planners"]["static"]["step_s"]
    return [
        {
            "condition": condition, "planner": name, "step_s": round(r["step_s"], 3),
            "vs_static": round(static / r["step_s"], 3), "compute_max_mean": round(r["compute_max_mean"], 3),
            "kv_tokens_per_step": round(r["kv_tokens_per_step"]),
            "kv_vs_static": round(r["kv_tokens_per_step"] / result["planners"]["static"]["kv_tokens_per_step"], 3),
            "speeds": ",".join(f"{v:.2f}" for v in r["speeds"]) if "speeds" in r else "",
        }
        for name, r in result["planners"].items()
    ]  # fmt: skip


COLUMNS = [
    "condition", "planner", "step_s", "vs_static", "compute_max_mean", "kv_tokens_per_step", "kv_vs_static", "speeds",
]  # fmt: skip


def save(out: Path, rows: list[dict], meta: dict) -> None:
    """long_context.json's "speed" rows and summary keys (other parts' kept) and long_context_speed.md."""
    speedup = {(r["condition"], r["planner"]): r["vs_static"] for r in rows}
    summary = {}
    if ("equal", "dynamic") in speedup:
        summary["dynamic_vs_static"] = speedup[("equal", "dynamic")]
    if ("emulated", "dynamic") in speedup:
        summary["slow_rank_vs_static"] = speedup[("emulated", "dynamic")]
    if ("contention", "dynamic") in speedup:
        summary["contended_rank_vs_static"] = speedup[("contention", "dynamic")]
    for condition in ("emulated", "contention"):
        if (condition, "measured") in speedup:
            summary[f"{condition}_measured_vs_static"] = speedup[(condition, "measured")]
    merge_part(out, "speed", rows, summary, meta)
    lines = [
        "## (b), (c) Step time on the long-tail mix at CP 2",
        "",
        (
            f"{meta['model']}; micro-batches of {meta['max_tokens']} tokens, {meta['batch_tokens']} per step, "
            f"{meta['steps']} steps replayed per planner, median of {meta['rounds']} rounds; 2 ranks pinned to "
            "2 cores; `kv_tokens_per_step`: key / value tokens received per layer, summed over ranks."
        ),
        "",
        markdown_table(rows, COLUMNS),
        "",
        *(f"- {key}: {value}" for key, value in summary.items()),
    ]
    (out / "long_context_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=8192, help="tokens per packed micro-batch")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="tokens per global batch")
    parser.add_argument("--steps", type=int, default=4, help="global batches replayed per planner and round")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    parser.add_argument("--block", type=int, default=2048, help="the dynamic planner's block, tokens")
    parser.add_argument(
        "--ablate-blocks", default="", help="more dynamic planners, one per block, e.g. 512,1024"
    )
    parser.add_argument("--conditions", default=",".join(CONDITIONS), help="of " + ",".join(CONDITIONS))
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--condition", default="equal", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from benchmarks.common import torchrun
    from benchmarks.contention import pinned_launch, two_cores

    cores = two_cores()
    if cores is None:
        raise SystemExit("this benchmark pins its 2 ranks to 2 cores: run it where 2 cores are available")
    conditions = args.conditions.split(",")
    unknown = sorted(set(conditions) - set(CONDITIONS))
    if unknown:
        raise SystemExit(f"--conditions: unknown {unknown}; choose from {','.join(CONDITIONS)}")
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="long_context_speed_") as runs:
        for condition in conditions:
            out = Path(runs) / f"{condition}.json"
            flags = [str(Path(__file__).resolve()), "--worker", "--condition", condition, "--out", str(out)]
            for key in ("max_tokens", "batch_tokens", "steps", "rounds", "block", "ablate_blocks"):
                flags += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
            wall = pinned_launch(
                torchrun, flags, cores, Path(runs) / f"{condition}.log", condition == "contention"
            )
            result = json.loads(out.read_text())
            rows += rows_of(condition, result)
            print(f"{condition}: {wall:.0f} s", flush=True)
    meta = {
        "model": "Llama shape, 2 layers, hidden 128, 4 heads / 2 key-value heads, ffn 352, vocab 1024, fp32",
        "max_tokens": args.max_tokens, "batch_tokens": args.batch_tokens, "steps": args.steps,
        "rounds": args.rounds, "block": args.block, "slow_speeds": SLOW, "torch": torch.__version__,
        "wall_s": time.perf_counter() - t0, "cost": result["cost"],
    }  # fmt: skip
    save(args.out, rows, meta)


if __name__ == "__main__":
    main()
