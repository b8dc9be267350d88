"""The efficiency benchmark's pipeline profiles: one stage slow, layers re-split by measured stage speed.

    python benchmarks/pp_efficiency.py                          # both profiles (~10 min on 2 quiet cores)
    python benchmarks/pp_efficiency.py --profiles pp2_1.5x --slow-steps 16

As benchmarks/dp_efficiency.py does for replicas: for each profile, real torchrun launches of
pretrain_gpt.py (16 layers; virtual devices over the whole mesh, one speed per global rank,
`--device.profile schedule:...`; rank r is stage r at TP = DP = 1) run the same job with the even split
(`static`: what a plain pipeline gets), with `--hetero.pp_split measured`, and once on the profile's
homogeneous *twin*: every device at the profile's mean speed at that step, even split (same total speed,
same sends, same framework overhead). A profile is homogeneous for `--warmup` steps, then the slow stage
arrives (an event the balancer must react to: measure, re-split by checkpoint -> reshard with the
optimizer state -> rebuild), and after `--slow-steps` it recovers.

Per profile x mode: the median step time over the steady slow phase (its second half: the re-split is
done), T_opt (the twin's median over it), E = T_opt / T, the speed-up over static; for `measured` also E
over the whole slow phase (the reaction and the re-split's cost included), the split it settled on, the
reaction (steps from the slowdown, and from the recovery, to the split's change) and what each re-split
cost (`resplit_s`: the state move and the rebuild). The bounds any whole-layer split allows, against
the twin: `bound_stage`, the twin's stage time over the best split's slowest stage time (layers only:
the virtual devices slow the transformer layers), and `bound_1f1b`, the same through 1F1B's step time
sum_s t_s + (M - 1) max_s t_s over M micro-batches.

Writes benchmarks/results/pp_efficiency.{md,json,png}; metrics and per-run pipeline trace PNGs go to
benchmarks/results/pp_efficiency_runs/.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.balance_efficiency import run_profiles, slow_phase_args, slow_phase_meta, write_results
from benchmarks.common import RESULTS, torchrun
from megahet.policy.stage_split import best_split, even_split, split_times

RUNS = RESULTS / "pp_efficiency_runs"
MODES = ("static", "measured")
LAYERS, MICRO_BATCHES = 16, 8
# A GPT of 16 small layers (hidden 128, vocabulary 1024: the output layer weighs ~0.6 of a layer by
# FLOPs), 8 micro-batches of one sample per step: 1F1B's bubble is (P - 1) / (M + P - 1).
MODEL = [
    *("--model.num_layers", str(LAYERS), "--model.hidden_size", "128", "--model.num_attention_heads", "4"),
    *("--model.ffn_hidden_size", "512", "--model.seq_length", "64", "--data.vocab_size", "1024"),
    *("--train.micro_batch_size", "1", "--train.global_batch_size", str(MICRO_BATCHES)),
    *("--resize.enabled", "true"),  # the resizable layers count the FLOPs a virtual device charges
]


@dataclasses.dataclass(frozen=True)
class PpProfile:
    name: str
    stages: tuple[float, ...]
    """Each pipeline stage's speed while slow."""

    @property
    def world(self) -> int:
        return len(self.stages)

    def spec(self, warmup: int, slow: int, twin: bool = False) -> str:
        mean = statistics.fmean(self.stages)
        slow_speeds = [mean] * self.world if twin else self.stages

        def speeds(values) -> str:
            return ",".join(f"{s:.6g}" for s in values)

        even = speeds([1] * self.world)
        return f"schedule:0={even};{warmup}={speeds(slow_speeds)};{warmup + slow}={even}"

    def bounds(self) -> tuple[tuple[int, ...], float, float]:
        """(the best whole-layer split, bound_stage, bound_1f1b) against the twin (layers only)."""
        layer_s = [1 / s for s in self.stages]
        split = best_split(layer_s, [0.0] * self.world, LAYERS)
        twin = [n / statistics.fmean(self.stages) for n in even_split(LAYERS, self.world)]
        best = split_times(split, layer_s, [0.0] * self.world)

        def step(times: list[float]) -> float:
            return sum(times) + (MICRO_BATCHES - 1) * max(times)

        return split, max(twin) / max(best), step(twin) / step(best)


PROFILES = [
    PpProfile("pp4_2x", (1.0, 0.5, 1.0, 1.0)),
    PpProfile("pp2_1.5x", (1 / 1.5, 1.0)),
]


def run(profile: PpProfile, mode: str, spec: str, rate: float, steps: int) -> list[dict]:
    """One launch; its metrics records by step (step time per step: log_interval 1), re-split costs
    included (rows with `resplit_s`)."""
    name = f"{profile.name}_{mode}"
    metrics = RUNS / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    split = "measured" if mode == "measured" else "even"
    args = [
        *MODEL,
        *("--parallel.pp", str(profile.world), "--parallel.zero_stage", "1"),
        *("--device.profile", spec, "--device.rate_gflops", str(rate)),
        *("--hetero.pp_split", split, "--train.train_iters", str(steps), "--train.log_interval", "1"),
        *("--train.eval_interval", str(10 * steps), "--train.eval_iters", "1", "--logging.wandb", "false"),
        *("--logging.metrics_file", str(metrics), "--logging.log_dir", str(RUNS / "logs" / name)),
    ]
    if mode == "measured":
        args += ["--balance.trace", str(RUNS / f"{name}_trace.jsonl")]  # the PP trace: <name>_trace_pp.jsonl
    wall = torchrun("pretrain_gpt.py", profile.world, args, RUNS / f"{name}.log")
    print(f"  {name}: {wall:.0f} s", flush=True)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _changes(splits: list[tuple[int, ...]], start: int, end: int) -> int | None:
    """Steps from `start` until the split first changes (None if it does not before `end`)."""
    return next((k - start for k in range(start + 1, end) if splits[k] != splits[start]), None)


def bench_profile(profile: PpProfile, warmup: int, slow: int, rate: float) -> tuple[list[dict], dict]:
    steps = warmup + slow + slow // 2
    records = {
        mode: run(profile, mode, profile.spec(warmup, slow, twin=mode == "twin"), rate, steps)
        for mode in ("twin", *MODES)
    }
    stepped = {
        mode: sorted((r for r in rows if "step_time_s" in r), key=lambda r: r["step"])
        for mode, rows in records.items()
    }
    times = {mode: [r["step_time_s"] for r in rows] for mode, rows in stepped.items()}
    steady, whole = slice(warmup + slow // 2, warmup + slow), slice(warmup, warmup + slow)
    t_opt = statistics.median(times["twin"][steady])
    static = statistics.median(times["static"][steady])
    split, bound_stage, bound_1f1b = profile.bounds()
    out = []
    for mode in MODES:
        t = statistics.median(times[mode][steady])
        row = {
            "profile": profile.name,
            "mode": mode,
            "speeds": "/".join(f"{s:.3g}" for s in profile.stages),
            "step_time_s": t,
            "t_opt_s": t_opt,
            "efficiency": t_opt / t,
            "efficiency_whole": statistics.median(times["twin"][whole])
            / statistics.fmean(times[mode][whole]),
            "speedup_vs_static": static / t,
            "best_split": ",".join(map(str, split)),
            "bound_stage": bound_stage,
            "bound_1f1b": bound_1f1b,
            "split_slow": None,
            "react_slow": None,
            "react_back": None,
            "resplit_s": None,
        }
        if mode == "measured":
            splits = [tuple(int(r[f"layers_pp{s}"]) for s in range(profile.world)) for r in stepped[mode]]
            row["split_slow"] = ",".join(map(str, splits[warmup + slow - 1]))
            row["react_slow"] = _changes(splits, warmup, warmup + slow)
            row["react_back"] = _changes(splits, warmup + slow, steps)
            costs = [r["resplit_s"] for r in records[mode] if "resplit_s" in r]
            row["resplit_s"] = "/".join(f"{c:.2f}" for c in costs)
            trace = RUNS / f"{profile.name}_measured_trace_pp.jsonl"
            from megahet.runtime.trace_plot import plot_pp_trace

            plot_pp_trace(
                trace, trace.with_suffix(".png"), title=f"{profile.name}: stage speeds {row['speeds']}"
            )
        out.append(row)
    return out, times


GOAL = 0.85


def main(argv: list[str] | None = None) -> None:
    args = slow_phase_args(__doc__, "pp_efficiency", "the slow stage", 24, "half as many", argv)
    RUNS.mkdir(parents=True, exist_ok=True)
    chosen, rows, all_times, wall = run_profiles(
        "pp_efficiency",
        PROFILES,
        args.profiles,
        lambda p: bench_profile(p, args.warmup, args.slow_steps, args.rate),
        lambda p: f"{p.name} (PP={p.world}, {p.spec(args.warmup, args.slow_steps)})",
    )
    meta = slow_phase_meta(MODEL, args, chosen, wall)
    lines = [
        f"- {r['profile']} measured: E {r['efficiency']:.3f} vs >= {GOAL:.2f} -> "
        f"{'met' if r['efficiency'] >= GOAL else 'MISSED'} (bound {r['bound_stage']:.3f} by stage time, "
        f"{r['bound_1f1b']:.3f} through 1F1B; static {s['efficiency']:.3f}; speed-up over static "
        f"{r['speedup_vs_static']:.2f}x; over the whole slow phase {r['efficiency_whole']:.3f}); split "
        f"{r['split_slow']} (best {r['best_split']}); reaction {r['react_slow']} steps to the slow stage, "
        f"{r['react_back']} back; re-splits {r['resplit_s']} s"
        for r, s in zip(rows[1::2], rows[0::2])
    ]
    write_results(args.name, rows, list(rows[-1]), meta, lines, all_times)


if __name__ == "__main__":
    main()
