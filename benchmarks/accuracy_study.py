"""Accuracy study (issue 6): ViT (MNIST) validation accuracy and GPT validation perplexity under
straggler profiles of growing skew, for every balancing method, with the wall time each run needed.

    python benchmarks/accuracy_study.py                                  # default grid, benchmarks/results
    python benchmarks/accuracy_study.py --grid smoke --out /tmp/smoke    # 2-rank smoke grid (the test)
    python benchmarks/accuracy_study.py --only vit_tp4_1x4x --resume     # a subset; reuse finished runs

Every configuration is a real `torchrun` launch of pretrain_vit.py / pretrain_gpt.py on virtual
heterogeneous devices (`--device.profile static:...`), with the same seed, data order and step budget
as every other run of its arm (model x TP size). Methods, per profile:

- baseline: the homogeneous group (every rank at speed 1), no balancing;
- static:   the profile without balancing (the numbers of the baseline, slower);
- resize:   `--balance.mode resize` (ZERO-resizing only), random or priority selection, zero / same /
  average imputation;
- migrate:  `--balance.mode migrate` (lossless migration only);
- semi:     `--balance.mode semi` (the planner picks resize or migrate per straggler).

The balancer reads only measured (charged) busy times, never the profile. `--device.rate_gflops` is
set per arm so that a nominal rank's charged compute per step (0.26 s; 0.52 s at TP=8) is of the
order of the real per-step cost of 4 or 8 ranks sharing 2 cores (more ranks, and the GPT's
uncharged vocabulary layer, need a lower rate); a straggler's charge then dominates its step, so
static runs are about k times slower and balanced ones are not. Times still include real compute
and communication, so they move with the machine's load; accuracies do not (same seed,
deterministic plans).

The default grid, 60 steps per run (ViT: 2 layers, hidden 128, 16 heads, batches of 256 MNIST
images, 1,024 validation images; GPT: 2 layers, hidden 128, 16 heads, 16 x 64 tokens of the shipped
corpus), 31 launches sized for under an hour on the 2-core machine:

- ViT TP=4, severity axis: one straggler slowed 2x, 4x, 8x; number axis: one and two stragglers at
  4x. All five methods, plus the imputation policies same / average, at 1x4x; elsewhere migrate-only
  is left out, because there SEMI's plan is pure migration (every straggler's gap 1 - share is above
  `balance.tolerance` and the helpers can absorb it; the rows show dropped 0 for SEMI).
- ViT TP=8, four stragglers at 4x (four equal stragglers in TP=4 would be a homogeneous group), with
  the same reduced method set: an 8-rank launch costs about twice a 4-rank one on 2 cores.
- GPT TP=4, one 4x straggler, all five methods, validation perplexity.

Writes <out>/<name>.{md,json} (one row per configuration: final validation accuracy or perplexity,
training wall time without start-up and evaluation, time to reach the target — 95 % of the baseline's
final accuracy, or a perplexity within 1/0.95 of the baseline's — total launch wall time, the
straggler's mean dropped share, MB moved at a plan change), accuracy_vs_skew.png and
accuracy_vs_time.png (matplotlib, when installed), and each run's log + metrics JSONL under
<out>/<name>_runs/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.accuracy_plots import METRIC, plot
from benchmarks.common import RESULTS, markdown_table, settings_to_args, torchrun
from benchmarks.selection_stats import SELECTION_COLUMNS, pooled_selection_lines, selection_comparison

TARGET = 0.95  # time-to-target: first evaluation within 5 % of the baseline's final metric
SEED = 1234  # megahet's default train.seed


@dataclasses.dataclass(frozen=True)
class Arm:
    """A model x TP size: launch settings shared by every run in it (same seed, data, steps)."""

    model: str  # "vit" or "gpt"
    tp: int
    steps: int
    eval_interval: int
    log_interval: int
    rate_gflops: float
    args: tuple[str, ...]  # model / train overrides

    @property
    def metric(self) -> str:
        return METRIC[self.model]

    @property
    def name(self) -> str:
        return f"{self.model}_tp{self.tp}"


@dataclasses.dataclass(frozen=True)
class Run:
    arm: Arm
    speeds: tuple[float, ...]  # per TP rank, 1 = nominal
    method: str  # baseline, static, resize, migrate, semi
    selection: str = "-"
    imputation: str = "-"
    seed: int | None = None
    """A selection-comparison repeat's own train.seed; None: the study's --seed."""

    @property
    def profile(self) -> str:
        """'none' or e.g. '1x4x' (one 4x straggler), '2x4x', '1x2x+1x8x'."""
        slow = Counter(round(1 / s, 3) for s in self.speeds if s < 1)
        return "+".join(f"{n}x{k:g}x" for k, n in sorted(slow.items())) or "none"

    @property
    def label(self) -> str:
        if self.method != "resize":
            return self.method
        return f"resize-{self.selection}" + ("" if self.imputation == "zero" else f"/{self.imputation}")

    @property
    def name(self) -> str:
        seed = "" if self.seed is None else f"_seed{self.seed}"
        return f"{self.arm.name}_{self.profile}_{self.label.replace('/', '_')}{seed}"

    def args(self, metrics: Path, log_dir: Path) -> list[str]:
        a = self.arm
        args = [
            *a.args,
            *("--parallel.tp", str(a.tp), "--train.train_iters", str(a.steps)),
            *("--train.eval_interval", str(a.eval_interval), "--train.log_interval", str(a.log_interval)),
            *("--device.profile", "static:" + ",".join(f"{s:g}" for s in self.speeds)),
            *("--device.rate_gflops", str(a.rate_gflops)),
            *("--logging.wandb", "false", "--logging.metrics_file", str(metrics)),
            *("--logging.log_dir", str(log_dir)),
        ]
        if self.method in ("baseline", "static"):
            return [*args, "--resize.enabled", "true"]  # virtual devices count the resizable layers' FLOPs
        args += ["--balance.mode", self.method]
        if self.method == "resize":
            args += ["--resize.selection", self.selection, "--resize.imputation", self.imputation]
        return args


RESIZE = [("resize", "random", "zero"), ("resize", "priority", "zero")]
ALL_METHODS = [("static",), *RESIZE, ("migrate",), ("semi",)]
REDUCED = [("static",), *RESIZE, ("semi",)]
IMPUTATION = [("resize", "priority", "same"), ("resize", "priority", "average")]


def stragglers(tp: int, count: int, slowdown: float) -> tuple[float, ...]:
    """The last `count` TP ranks slowed by `slowdown`."""
    return (1.0,) * (tp - count) + (1.0 / slowdown,) * count


def profile_runs(arm: Arm, speeds: tuple[float, ...], methods) -> list[Run]:
    return [Run(arm, speeds, *method) for method in methods]


SMALL_MODEL = ("--model.num_layers", "2", "--model.hidden_size", "128", "--model.num_attention_heads", "16")
VIT_TRAIN = (
    *("--train.micro_batch_size", "256", "--train.global_batch_size", "256", "--train.eval_iters", "4"),
    *("--train.lr", "6e-3", "--train.lr_warmup_iters", "10"),
)
GPT_ARGS = (
    *SMALL_MODEL,
    *("--model.seq_length", "64", "--train.micro_batch_size", "16", "--train.global_batch_size", "16"),
    *("--train.eval_iters", "16", "--train.lr", "3e-3", "--train.lr_warmup_iters", "10"),
)


def default_grid() -> list[Run]:
    vit4 = Arm("vit", 4, 60, 10, 5, 10.0, SMALL_MODEL + VIT_TRAIN)
    vit8 = Arm("vit", 8, 60, 10, 5, 2.5, SMALL_MODEL + VIT_TRAIN)
    gpt4 = Arm("gpt", 4, 60, 10, 5, 2.5, GPT_ARGS)
    runs = [Run(vit4, stragglers(4, 0, 1), "baseline")]
    for slowdown in (2, 4, 8):
        methods = [*ALL_METHODS, *IMPUTATION] if slowdown == 4 else REDUCED
        runs += profile_runs(vit4, stragglers(4, 1, slowdown), methods)
    runs += profile_runs(vit4, stragglers(4, 2, 4), REDUCED)
    runs += [Run(vit8, stragglers(8, 0, 1), "baseline"), *profile_runs(vit8, stragglers(8, 4, 4), REDUCED)]
    runs += [
        Run(gpt4, stragglers(4, 0, 1), "baseline"),
        *profile_runs(gpt4, stragglers(4, 1, 4), ALL_METHODS),
    ]
    return runs


def smoke_grid() -> list[Run]:
    """Three 2-rank ViT runs of 16 steps (enough for the balancer's 5-sample median to act): baseline,
    and a 4x straggler with priority resizing and with migration."""
    small = ("--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_attention_heads", "4")
    train = ("--train.micro_batch_size", "64", "--train.global_batch_size", "64", "--train.eval_iters", "2")
    vit2 = Arm("vit", 2, 16, 8, 2, 5.0, small + train)
    methods = [("resize", "priority", "zero"), ("migrate",)]
    return [Run(vit2, (1.0, 1.0), "baseline"), *profile_runs(vit2, (1.0, 0.25), methods)]


GRIDS = {"default": default_grid, "smoke": smoke_grid}


def selection_repeats(runs: list[Run], seeds: list[int]) -> list[Run]:
    """Every random / priority resizing run (zero imputation) again under each of `seeds`: at a short
    budget the seed moves accuracy by more than the selection policy does, so the policies are
    compared on paired means (same seed: same initialization and data order)."""
    compared = [r for r in runs if r.method == "resize" and r.imputation == "zero"]
    return [dataclasses.replace(r, seed=seed) for seed in seeds for r in compared]


STUDY_KEYS = (
    *("train.seed", "train.train_iters", "parallel.tp", "balance.mode"),
    *("resize.enabled", "resize.selection", "resize.imputation", "device.", "logging."),
)
"""Settings every run's identity or the study's bookkeeping rests on: not overridable (the seed is --seed)."""


def setting_overrides(settings: list[str], flag: str = "--priority-set") -> list[str]:
    """`--set` / `--priority-set` KEY=VALUE values (e.g. resize.priority_score=snr) as megahet
    command-line overrides."""
    why = "the study sets it per run (seed: --seed; grid: --grid, --only); override another setting"
    return settings_to_args(settings, flag, STUDY_KEYS, why)


def launch(
    run: Run, folder: Path, resume: bool, seed: int, overrides: list[str] = (), priority: list[str] = ()
) -> dict:
    """Run one configuration (or reuse a finished one with the same seed and overrides); returns its
    records and wall times. `overrides` reach every launch, `priority` only priority-selection ones."""
    metrics, meta_file = folder / f"{run.name}.jsonl", folder / f"{run.name}.json"
    meta = json.loads(meta_file.read_text()) if resume and meta_file.is_file() and metrics.is_file() else {}
    overrides = [*overrides, *(priority if run.selection == "priority" else [])]
    same_seed = meta.get("seed", SEED) == (seed if run.seed is None else run.seed)
    reused = bool(meta) and same_seed and meta.get("overrides", []) == overrides
    if not reused:
        metrics.unlink(missing_ok=True)  # megahet appends to the metrics file
        script = "pretrain_vit.py" if run.arm.model == "vit" else "pretrain_gpt.py"
        log = folder / f"{run.name}.log"
        seed = seed if run.seed is None else run.seed
        args = [*run.args(metrics, folder / "logdir"), "--train.seed", str(seed), *overrides]
        wall = torchrun(script, run.arm.tp, args, log)
        loop = re.search(r"megahet \w+: \d+ steps in ([\d.]+) s", log.read_text())
        meta = {"total_wall_s": wall, "loop_s": float(loop.group(1)) if loop else math.nan, "seed": seed}
        meta["overrides"] = overrides
        meta_file.write_text(json.dumps(meta))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {**meta, "reused": reused, "records": records}


def summarize(run: Run, result: dict) -> dict:
    """One row: the final metric, training time (sum of logged step times: no start-up, no evaluation),
    the curve (step, training seconds so far, metric, val_loss) and what the balancer did."""
    a, records = run.arm, result["records"]
    logs = [r for r in records if "step_time_s" in r]
    clock, previous, elapsed = {}, 0, 0.0
    for r in logs:
        elapsed += r["step_time_s"] * (r["step"] - previous)  # step_time_s is the window's mean
        clock[r["step"]], previous = elapsed, r["step"]
    curve = [(r["step"], clock[r["step"]], r[a.metric], r["val_loss"]) for r in records if a.metric in r]
    if not curve or curve[-1][0] != a.steps:
        raise RuntimeError(f"{run.name}: no final {a.metric} in its metrics file")
    return {
        "model": a.model,
        "tp": a.tp,
        "profile": run.profile,
        "stragglers": sum(s < 1 for s in run.speeds),
        "slowdown": round(1 / min(run.speeds), 3),
        "method": run.method,
        "selection": run.selection,
        "imputation": run.imputation,
        "seed": result.get("seed", SEED),
        "repeat": run.seed is not None,
        a.metric: curve[-1][2],
        "val_loss": curve[-1][3],
        "train_wall_s": elapsed,
        "step_s": elapsed / a.steps,
        "total_wall_s": result["total_wall_s"],
        "loop_s": result["loop_s"],
        "dropped": sum(r.get("dropped_frac_max", 0.0) for r in logs) / len(logs),
        "moved_mb": max(r.get("migration_mb_plan_max", 0.0) for r in logs),
        "plan_changes": max(r.get("plan_changes_max", 0.0) for r in logs),
        "name": run.name,
        "label": run.label,
        "curve": curve,
    }


def better(metric: str, value: float, reference: float) -> bool:
    """value is at least as good as reference (accuracy up, perplexity down)."""
    return value >= reference if metric == "val_acc" else value <= reference


def add_time_to_target(rows: list[dict]) -> None:
    """Target per arm: 95 % of the baseline's final accuracy / its final perplexity / 0.95."""
    for row in rows:
        metric = METRIC[row["model"]]
        if row["repeat"]:  # compared on accuracy only; its seed has no baseline run
            row["target"] = row["time_to_target_s"] = None
            continue
        base = next(
            (b for b in rows if (b["model"], b["tp"], b["method"]) == (row["model"], row["tp"], "baseline")),
            None,
        )
        if base is None:
            row["target"] = row["time_to_target_s"] = None
            continue
        target = base[metric] * TARGET if metric == "val_acc" else base[metric] / TARGET
        row["target"] = target
        row["time_to_target_s"] = next((t for _, t, v, _ in row["curve"] if better(metric, v, target)), None)


def goals(rows: list[dict]) -> list[str]:
    """The issue's benchmark goals, evaluated on the measured rows (lines for the Markdown file)."""
    lines, main = [], [r for r in rows if not r["repeat"]]

    def find(model, tp, profile, label):
        return next(
            (
                r
                for r in main
                if (r["model"], r["tp"], r["profile"], r["label"]) == (model, tp, profile, label)
            ),
            None,
        )

    def pairs(label: str, other: str, profile: str | None = None):
        """Each `label` row with the `other` row of its arm, in the same profile or in `profile`."""
        for row in main:
            match = find(row["model"], row["tp"], profile or row["profile"], other)
            if row["label"] == label and match is not None:
                yield row, match

    for mig, base in pairs("migrate", "baseline", "none"):
        metric = METRIC[mig["model"]]
        final_equal = math.isclose(mig["curve"][-1][2], base["curve"][-1][2], rel_tol=1e-4)
        loss_diff = max(abs(m[3] - b[3]) / abs(b[3]) for m, b in zip(mig["curve"], base["curve"]))
        acc_diff = max(abs(m[2] - b[2]) for m, b in zip(mig["curve"], base["curve"]))
        ok = final_equal and loss_diff <= 1e-4
        lines.append(
            f"- migrate-only = baseline, {mig['model']} TP={mig['tp']} {mig['profile']}: final {metric} "
            f"{mig['curve'][-1][2]:.6g} vs {base['curve'][-1][2]:.6g}; over {len(mig['curve'])} evaluations "
            f"val_loss within {loss_diff:.1e} (relative), {metric} within {acc_diff:.2g} "
            f"-> {'met' if ok else 'MISSED'}"
        )
    semi, base = find("vit", 4, "1x4x", "semi"), find("vit", 4, "none", "baseline")
    if semi and base:
        points = 100 * (base["val_acc"] - semi["val_acc"])
        lines.append(
            f"- SEMI within 0.5 point of the baseline, ViT TP=4 1x4x: {100 * semi['val_acc']:.2f} vs "
            f"{100 * base['val_acc']:.2f} ({points:+.2f} points below) "
            f"-> {'met' if points <= 0.5 else 'MISSED'}"
        )
    comparison = selection_comparison(rows)
    for c in comparison:
        lines.append(
            f"- priority >= random, {c['model']} TP={c['tp']} {c['profile']}: {c['metric']} "
            f"{c['priority']:.4g} vs {c['random']:.4g} (mean over seeds {c['seeds']}; per seed "
            f"priority - random {c['differences']}, mean {c['difference']:+.3g}, standard error "
            f"{c['se']:.2g}: {c['verdict']}{_needed(c)}) -> {_selection_outcome(c)}"
        )
    lines += pooled_selection_lines(comparison)
    for semi, static in pairs("semi", "static"):
        s, t = semi["time_to_target_s"], static["time_to_target_s"]
        ok = s is not None and (t is None or s < t)
        lines.append(
            f"- SEMI time-to-target < static, {semi['model']} TP={semi['tp']} {semi['profile']}: "
            f"{_seconds(s)} vs {_seconds(t)} -> {'met' if ok else 'MISSED'}"
        )
    return lines


def _selection_outcome(cell: dict) -> str:
    """The goal at one cell, judged by the paired t-test: met (priority resolved better), MISSED
    (resolved worse), or undecided, with the side the mean falls on."""
    resolved = {"priority better": "met", "priority worse": "MISSED"}
    side = "ahead" if better(cell["metric"], cell["priority"], cell["random"]) else "behind"
    return resolved.get(cell["verdict"], f"undecided (priority's mean {side}, within noise)")


def _needed(cell: dict) -> str:
    """How many paired seeds would resolve the selection goal's difference at this cell's spread."""
    if cell["seeds_needed"] is None:
        return ""
    unit = "0.5 point" if cell["metric"] == "val_acc" else "0.5 % of perplexity"
    return f"; resolving {unit} with 80 % power takes ~{cell['seeds_needed']} paired seeds"


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f} s"


COLUMNS = ["tp", "profile", "stragglers", "slowdown", "method", "selection", "imputation"]
TIMES = ["train_wall_s", "time_to_target_s", "total_wall_s", "dropped", "moved_mb"]


def write_results(rows: list[dict], out: Path, name: str, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    parts, main = [], [r for r in rows if not r["repeat"]]
    for model, metric in METRIC.items():
        mine = [{**r, "time_to_target_s": r["time_to_target_s"] or "-"} for r in main if r["model"] == model]
        if mine:
            title = (
                "ViT (MNIST), validation accuracy" if model == "vit" else "GPT (shipped corpus), perplexity"
            )
            metrics = [metric, "val_loss"] if model == "vit" else [metric]  # GPT: ppl = exp(val_loss)
            parts += [f"**{title}**", "", markdown_table(mine, [*COLUMNS, *metrics, *TIMES]), ""]
    comparison = selection_comparison(rows)
    if any("," in c["seeds"] for c in comparison):
        columns = ["model", "tp", "profile", "metric", *SELECTION_COLUMNS]
        parts += ["**Selection policies, mean over seeds**", "", markdown_table(comparison, columns), ""]
    parts += ["Goals (computed from the rows above):", "", *goals(rows), ""]
    text = "\n".join(parts)
    (out / f"{name}.md").write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default="default")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the tables, plots and runs")
    parser.add_argument("--name", default="accuracy_study", help="file name of the table and JSON")
    parser.add_argument(
        "--seed", type=int, default=SEED, help="train.seed of every run (init and data order)"
    )
    parser.add_argument(
        "--selection-seeds",
        default="",
        help="comma-separated extra seeds: every random / priority resizing run again under each, and "
        "'priority >= random' judged on the paired mean (e.g. 7,99: 24 more launches, ~35 min)",
    )
    parser.add_argument("--only", default=None, help="regex: run only configurations whose name matches")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a megahet override for every launch (repeatable), e.g. train.eval_iters=39 to evaluate on "
        "9,984 validation images; give it its own --out",
    )
    parser.add_argument(
        "--priority-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a megahet override for every priority-selection launch (repeatable), to compare priority "
        "policies, e.g. resize.priority_score=snr or resize.priority_temperature=0; give it its own --out",
    )
    parser.add_argument(
        "--resume", action="store_true", help="reuse runs already finished in the runs folder"
    )
    args = parser.parse_args()
    runs = GRIDS[args.grid]()
    runs += selection_repeats(runs, [int(x) for x in args.selection_seeds.split(",") if x.strip()])
    if args.only:
        runs = [r for r in runs if re.search(args.only, r.name)]
    overrides, priority = setting_overrides(args.set, "--set"), setting_overrides(args.priority_set)
    if (overrides or priority) and args.out.resolve() == RESULTS.resolve():
        raise SystemExit(
            "--set / --priority-set change launches: give them their own --out, so that the study's runs "
            f"in {RESULTS} are not replaced"
        )
    folder = args.out / f"{args.name}_runs"
    folder.mkdir(parents=True, exist_ok=True)
    rows, reused, t0 = [], 0, time.perf_counter()
    for i, run in enumerate(runs):
        result = launch(run, folder, args.resume, args.seed, overrides, priority)
        reused += result["reused"]
        rows.append(summarize(run, result))
        r = rows[-1]
        print(
            f"[{i + 1}/{len(runs)}] {run.name}: {run.arm.metric} {r[run.arm.metric]:.4g}, "
            f"train {r['train_wall_s']:.1f} s, total {r['total_wall_s']:.1f} s "
            f"(study so far {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    add_time_to_target(rows)
    meta = {
        "launches_wall_s": sum(r["total_wall_s"] for r in rows),  # the grid's cost, also when resumed
        "reused_runs": reused,
        "grid": args.grid,
        "seed": args.seed,
        "selection_seeds": args.selection_seeds,
        "set": args.set,
        "priority_set": args.priority_set,
        "wall_s": time.perf_counter() - t0,
        "target": TARGET,
        "arms": {r.arm.name: dataclasses.asdict(r.arm) for r in runs},
    }
    write_results(rows, args.out, args.name, meta)
    plot([r for r in rows if not r["repeat"]], args.out)  # the study's seed; repeats are in the table


if __name__ == "__main__":
    main()
