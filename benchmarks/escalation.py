"""Escalation against a real straggler (issue 46): TP=2 with a process competing for rank 1's core, where
balancing inside the layout cannot win, against the escalation that moves the job to TP 1 x DP 2.

    python benchmarks/escalation.py                               # all four cases (~40 min on 2 cores)
    python benchmarks/escalation.py --cases steady --steps 40

Cases, each in one invocation, every mode side by side:

- steady: two ranks pinned to two cores (tools/pin_ranks.py), a busy loop pinned to rank 1's core for the
  whole run; modes static (TP 2, no balancing), semi (TP 2, SEMI inside the layout) and escalate (SEMI and
  `escalate.mode on`), plus the runs without the competing process at TP 2 and at TP 1 x DP 2 (static, calm:
  the faster is the capacity ideal's base);
- episode: the same, the competing process started once the job logged step ON and killed at step OFF
  (escalate, then return if the way back pays);
- emulated4: four ranks of a small GPT (not pinned), TP 4, rank 3 a virtual device at full speed that is
  DELAY_MS late to each collective (`device.collective_delay_ms`, the time-sliced rank measured by
  benchmarks/collective_delay.py); modes semi and escalate, and the runs without the delay at TP 4, 2 and 1;
- placed4: the same with ranks 1 and 3 late and TP 1 x DP 4 over the memory a rank may hold
  (`escalate.memory_gib`), so the escalation must pick a TP 2 x DP 2 placement; modes semi, escalate
  (strided TP groups allowed: 1 and 3 in one) and escalate_consecutive (`escalate.placement false`:
  megatron-core's consecutive groups, one late rank in each replica), and the calm runs at TP 4 and 2.

The step time of a run is over the whole run including the move: the mean over every step after the first
two (start-up) of `step_time_s`, with each move's measured cost (`relayout_s`) added to its step. The
capacity ideal is real_contention.py's, from the fastest calm layout: its step scaled by the cores the
ranks really got (the kernel's scheduler statistics; emulated4: whole cores, the delay being pure loss).
The gain captured is (T_base / T - 1) / (T_base / T_capacity - 1), move included, T_base being static's
(emulated4: semi's); `gain_after` is the same of the steady step after the last move (the layout's own
ceiling, the move and the steps before it left out). Goal (steady): escalate >= 0.8, where SEMI
alone captures 0.08-0.3 (benchmarks/results/real_contention.json).

Writes benchmarks/results/escalation.{md,json}; logs and metrics go to benchmarks/results/escalation_runs/.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, save_results, torchrun
from benchmarks.contention import competing_process, pinned_launch, two_cores
from benchmarks.real_contention import DP_BATCH, MODEL, ShareMonitor
from megahet.logging import read_metrics_file

RUNS = RESULTS / "escalation_runs"
DELAY_MS = 2.0
ON, OFF = 10, 40
"""episode: the competing process runs from the job's step ON to its step OFF."""
MODES = {
    "dp": ("--parallel.tp", "1"),
    "static": ("--parallel.tp", "2"),
    "semi": ("--parallel.tp", "2", "--balance.mode", "semi"),
    "escalate": ("--parallel.tp", "2", "--balance.mode", "semi", "--escalate.mode", "on"),
    "escalate_consecutive": (
        *("--parallel.tp", "2", "--balance.mode", "semi", "--escalate.mode", "on"),
        *("--escalate.placement", "false"),
    ),
}
PLACED_MEMORY_GIB = 0.008
"""placed4: the memory a rank may hold, between SMALL's state a rank at TP 2 x DP 2 (6 MB) and at TP 1 x DP 4
(10 MB): the escalation must stay at TP > 1."""
EMULATED = {"emulated4": f"0,0,0,{DELAY_MS}", "placed4": f"0,{DELAY_MS},0,{DELAY_MS}"}
"""Each emulated case's delay per collective on ranks 0-3."""
SMALL = [
    *("--model.num_layers", "4", "--model.hidden_size", "128", "--model.num_attention_heads", "4"),
    *("--model.seq_length", "64", "--data.vocab_size", "1024"),
    *("--train.micro_batch_size", "1", "--train.global_batch_size", "16"),
]
"""emulated4: a GPT small enough for four ranks on two cores."""
COLUMNS = [
    "case",
    "mode",
    "contended",
    "step_s",
    "after_s",
    "capacity_s",
    "gain_captured",
    "gain_after",
    "move_s",
    "layouts",
]


def summarize(case: str, mode: str, contended: bool, metrics: Path, log: Path, shares: list[float]) -> dict:
    """A run's step time over the run (move included), after its last move, its moves and their cost."""
    rows = read_metrics_file(metrics)
    steps = sorted(s for s in rows if "step_time_s" in rows[s])[2:]
    move_s = sum(rows[s].get("relayout_s", 0.0) for s in rows)
    moves = re.findall(
        r"moved (TP \d+ x PP \d+ x DP \d+(?:, TP groups strided)?) -> (TP \d+ x PP \d+ x DP \d+(?:, TP groups "
        r"strided)?) after step (\d+)",
        log.read_text(),
    )
    last = int(moves[-1][2]) if moves else 0
    after = [rows[s]["step_time_s"] for s in steps if s > last + 2] or [float("nan")]
    return {
        "case": case,
        "mode": mode,
        "contended": contended,
        "step_s": (sum(rows[s]["step_time_s"] for s in steps) + move_s) / len(steps),
        "after_s": statistics.median(after),
        "move_s": move_s,
        "layouts": " then ".join(f"{b} after step {s}" for _, b, s in moves) or "-",
        "core_shares": shares,
        "decisions": re.findall(r"escalation step \d+: (?:move|return) .*", log.read_text()),
    }


class Episode(threading.Thread):
    """Starts the competing process on `core` once the metrics file logged step `on`, kills it at `off`."""

    def __init__(self, metrics: Path, core: int, on: int, off: int):
        super().__init__(daemon=True)
        self.metrics, self.core, self.on, self.off = metrics, core, on, off
        self.done = threading.Event()

    def _step(self) -> int:
        if not self.metrics.is_file():
            return 0
        steps = [json.loads(line).get("step", 0) for line in self.metrics.read_text().splitlines() if line]
        return max(steps, default=0)

    def run(self) -> None:
        while not self.done.wait(0.2) and self._step() < self.on:
            pass
        if self.done.is_set():
            return
        with competing_process(self.core):
            while not self.done.wait(0.2) and self._step() < self.off:
                pass


def run_pinned(case: str, mode: str, contended: bool, steps: int, cores: list[int]) -> dict:
    name = f"{case}_{mode}{'' if contended else '_calm'}"
    metrics, log = RUNS / f"{name}.jsonl", RUNS / f"{name}.log"
    metrics.unlink(missing_ok=True)
    args = [
        str(ROOT / "pretrain_gpt.py"), *MODEL, *DP_BATCH, *MODES[mode],
        *("--train.train_iters", str(steps), "--train.log_interval", "1", "--logging.metrics_file", str(metrics)),
        *("--train.eval_interval", str(steps), "--train.eval_iters", "1", "--logging.wandb", "false"),
    ]  # fmt: skip
    monitor = ShareMonitor()
    monitor.start()
    episode = Episode(metrics, cores[1], ON, OFF) if case == "episode" and contended else None
    if episode is not None:
        episode.start()
    try:
        pinned_launch(torchrun, args, cores, log, contended and episode is None)
    finally:
        monitor.done.set()
        monitor.join()
        if episode is not None:
            episode.done.set()
            episode.join()
    return summarize(case, mode, contended, metrics, log, monitor.shares(0.3))


def run_emulated(case: str, mode: str, delayed: bool, steps: int) -> dict:
    """mode: semi or escalate[_consecutive] (from TP 4), or tpN (static at TP N: the calm layouts)."""
    name = f"{case}_{mode}{'' if delayed else '_calm'}"
    metrics, log = RUNS / f"{name}.jsonl", RUNS / f"{name}.log"
    metrics.unlink(missing_ok=True)
    delay = EMULATED[case] if delayed else "0,0,0,0"
    tp4 = ["--parallel.tp", mode[2:]] if mode.startswith("tp") else ["--parallel.tp", "4", *MODES[mode][2:]]
    if case == "placed4" and mode.startswith("escalate"):
        tp4 += ["--escalate.memory_gib", str(PLACED_MEMORY_GIB)]
    args = [
        str(ROOT / "pretrain_gpt.py"), *SMALL, *tp4,
        *("--device.profile", "static:1,1,1,1", "--device.collective_delay_ms", delay, "--device.rate_gflops", "1000"),
        *("--train.train_iters", str(steps), "--train.log_interval", "1", "--logging.metrics_file", str(metrics)),
        *("--train.eval_interval", str(steps), "--train.eval_iters", "1", "--logging.wandb", "false"),
    ]  # fmt: skip
    torchrun(args[0], 4, args[1:], log)
    return summarize(case, mode, delayed, metrics, log, [1.0] * 4)


def add_capacity(rows: list[dict], case: str, base_mode: str) -> None:
    """The capacity ideal of `case`'s runs: the fastest calm layout's step, scaled by the cores the ranks
    really got (real_contention.py's, from the kernel's scheduler statistics; emulated: all whole cores);
    the gain captured over `base_mode`'s contended run, move included."""
    mine = [r for r in rows if r["case"] == case]
    calm = min((r for r in mine if not r["contended"]), key=lambda r: r["step_s"])
    base = next(r for r in mine if r["mode"] == base_mode and r["contended"])
    got = [sum(min(x, 1.0) for x in r["core_shares"]) for r in (calm, *mine)]
    for row, cores in zip(mine, got[1:]):
        row["capacity_s"] = calm["step_s"] * got[0] / cores
        possible = base["step_s"] / row["capacity_s"] - 1
        for key, step in (("gain_captured", "step_s"), ("gain_after", "after_s")):
            row[key] = (base["step_s"] / row[step] - 1) / possible if possible > 0 else float("nan")


def goals(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        if row["contended"] and row["mode"] != "static":
            goal = row["case"] == "steady" and row["mode"] == "escalate"
            lines.append(
                f"{row['case']} {row['mode']}: {row['step_s']:.3f} s/step over the run (move {row['move_s']:.2f} s"
                f" included), {row['after_s']:.3f} after the last move, capacity ideal {row['capacity_s']:.3f}: "
                f"gain captured {row['gain_captured']:.2f} ({row['gain_after']:.2f} after the move); layouts: "
                f"{row['layouts']}"
                + (f" (goal >= 0.8: {'met' if row['gain_captured'] >= 0.8 else 'MISSED'})" if goal else "")
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--cases", nargs="+", default=["steady", "episode", "emulated4", "placed4"])
    parser.add_argument("--name", default="escalation")
    args = parser.parse_args(argv)
    cores = two_cores()
    if cores is None and set(args.cases) - set(EMULATED):
        sys.exit("escalation: error: needs two CPU cores to pin the ranks to (or --cases emulated4 placed4)")
    RUNS.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    for case in args.cases:
        if case == "emulated4":
            runs = [("tp4", False), ("tp2", False), ("tp1", False), ("semi", True), ("escalate", True)]
        elif case == "placed4":  # TP 1 does not fit: not a calm layout either
            runs = [
                ("tp4", False),
                ("tp2", False),
                ("semi", True),
                ("escalate_consecutive", True),
                ("escalate", True),
            ]
        else:
            runs = [("static", False), ("dp", False), ("static", True), ("semi", True), ("escalate", True)]
        for mode, contended in runs:
            if case in EMULATED:
                row = run_emulated(case, mode, contended, args.steps)
            else:
                row = run_pinned(case, mode, contended, args.steps, cores)
            rows.append(row)
            print(
                f"{case} {mode} contended={contended}: {row['step_s']:.3f} s/step, {row['layouts']}",
                flush=True,
            )
    for case in args.cases:
        add_capacity(rows, case, "semi" if case in EMULATED else "static")
    meta = {"steps": args.steps, "on_off": [ON, OFF], "delay_ms": DELAY_MS, "cores": cores,
            "wall_s": time.perf_counter() - t0, "goals": goals(rows)}  # fmt: skip
    save_results(args.name, rows, COLUMNS, meta)
    with (RESULTS / f"{args.name}.md").open("a") as md:
        md.write("\n" + "\n".join(f"- {line}" for line in meta["goals"]) + "\n")
    print("\n".join(meta["goals"]))


if __name__ == "__main__":
    main()
