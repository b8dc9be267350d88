"""Training runs under real multi-tenant contention, for the tests that check what the balancers do with a
real straggler (test_real_straggler.py) and what the escalation does (test_real_escalation.py).

`contended_run` launches pretrain_gpt on two ranks pinned to their own cores (tools/pin_ranks.py) and, part-way
through, starts busy processes on one rank's core (`Tenants`: another tenant's jobs); what each rank got of its
core is read from the kernel (/proc/PID/schedstat) at every step. Outside load on the contended core dilutes
the tenants: their number is scaled by one over the calm share, so that the contention is the planned one on a
busy machine too.

    run = contended_run(out, gpt_data, "--parallel.tp 2 --balance.mode migrate")   # ContendedRun
    run.rows[step]["speed_tp1"], run.slow, run.contended_shares, run.log
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import GPT_MODEL, REPO, finish, skip_or_fail, start_torchrun, wait_until_quiet

from benchmarks.contention import competing_process, core_share, rank_pid, schedstat, two_cores

CALM_STEPS, STEPS = 6, 26
CONTENDERS = 2
"""Busy processes on the contended core: with two, a busy process elsewhere on the machine that the
kernel moves to the other core (it balances the cores' loads) still leaves the contended rank slower."""


CALM_SHARE = 0.8
"""A rank that got less of its core than this in some calm step (its main thread, while it wanted to run)
had another process competing with it: the calm phase was disturbed, and its checks are relaxed."""
SKEW = 0.85
"""Calm shares further apart than this ratio: outside load left one rank slower for the whole calm phase.
That rank is the one contended next (contending the other would even them out)."""


@dataclass(frozen=True)
class Tenants:
    """Busy processes that compete for the contended rank's core from the step after `after` on (until the
    next `Tenants` of the run replace them, or the run ends)."""

    after: int
    processes: int = CONTENDERS
    nice: int = 0


@dataclass
class ContendedRun:
    """A run's metrics and how much of its core each rank got, per phase (kernel scheduler statistics)."""

    rows: dict[int, dict]  # step -> metrics row
    contended_from: int  # the calm phase's last step; the competing processes start after it
    slow: int  # the rank whose core the competing processes shared
    calm_shares: list[float]  # per rank, over steps 3..contended_from
    calm_lowest: float  # the lowest share of any rank in any calm step
    contended_shares: list[float]  # per rank, from contended_from to the run's last step
    phases: list[tuple[int, list[float]]]  # per Tenants: the step they started after, each rank's share
    last: int = STEPS
    log: str = ""  # the launch's output

    @property
    def fast(self) -> int:
        return 1 - self.slow

    @property
    def disturbed(self) -> bool:
        """Whether outside load competed with a rank during the calm phase (said in the test log)."""
        return self.calm_lowest < CALM_SHARE

    @property
    def fast_disturbed(self) -> bool:
        """Whether outside load also competed with the fast rank while the slow one was contended: both
        ranks' speeds then move from step to step, and a plan made on the last steps' medians fits the
        next step less well."""
        return self.contended_shares[self.fast] < CALM_SHARE

    @property
    def skewed(self) -> bool:
        """Whether outside load left the slow rank with less of its core for the whole calm phase."""
        return min(self.calm_shares) < SKEW * max(self.calm_shares)

    def steps(self, first: int, last: int | None = None) -> list[dict]:
        return [self.rows[s] for s in range(first, (last or self.last) + 1)]

    def first_step(self, after: int, test, **default) -> int | None:
        """The first step after `after` whose row passes `test` (StopIteration, or `default=`, if none)."""
        return next((s for s in range(after + 1, self.last + 1) if test(self.rows[s])), *default.values())


def run_args(out: Path, gpt_data: list[str], extra: str, steps: int, metrics: Path) -> list[str]:
    """pretrain_gpt's arguments of a contended run (and of its uncontended reference): a GPT of hidden 512,
    2 layers, 128-token sequences, 16 sequences a step, a log line and a metrics row per step, then `extra`."""
    return [
        *GPT_MODEL,
        *gpt_data,
        *["--model.hidden_size", "512", "--model.num_attention_heads", "8", "--model.num_layers", "2"],
        *["--model.seq_length", "128", "--train.log_interval", "1"],
        *["--train.micro_batch_size", "4", "--train.global_batch_size", "16"],
        *(f"--train.train_iters {steps} --train.eval_interval {steps} --train.eval_iters 1").split(),
        *(f"--logging.wandb false --logging.metrics_file {metrics} --logging.log_dir {out}").split(),
        *extra.split(),
    ]


def contended_run(
    out, gpt_data, extra: str, tenants: tuple[Tenants, ...] = (Tenants(CALM_STEPS),), steps: int = STEPS
) -> ContendedRun:
    """A 2-rank run whose slower rank (rank 1 on a quiet machine) shares its core with busy processes
    after the calm phase (`tenants[0].after` steps), the next `Tenants` replacing them at their step;
    each rank's schedstat is read as each step's metrics appear."""
    cores = two_cores()
    if cores is None:
        skip_or_fail("needs two CPU cores to pin the two ranks to (os.sched_getaffinity)")
    metrics = out / "metrics.jsonl"
    wait_until_quiet()
    args = [str(REPO / "pretrain_gpt.py"), *run_args(out, gpt_data, extra, steps, metrics)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGAHET_CORES", ",".join(map(str, cores)))  # rank r on cores[r]
        proc, cmd = start_torchrun("../../tools/pin_ranks.py", 2, args, cwd=out)
    readings: dict[int, list[tuple[float, float]]] = {}  # step -> per rank (on-CPU s, waiting s)
    pids: list[int | None] = [None, None]
    started: list[int] = []  # the step each Tenants started after
    counts: list[int] = []  # how many busy processes each Tenants started (scaled to outside load)
    slow = 1
    deadline = time.monotonic() + 300
    with contextlib.ExitStack() as contention:
        while proc.poll() is None and time.monotonic() < deadline:
            step = max((json.loads(line).get("step", 0) for line in jsonl_lines(metrics)), default=0)
            if step and step not in readings:
                pids = [pid or rank_pid(r, launcher=proc.pid) for r, pid in enumerate(pids)]
                with contextlib.suppress(OSError, TypeError):  # a rank not found yet, or ending
                    readings[step] = [schedstat(pid) for pid in pids]
            if len(started) < len(tenants) and step >= tenants[len(started)].after and step in readings:
                if not started:  # the slower rank of the calm phase, if outside load left one slower
                    shares = shares_between(readings, 3, step)
                    slow = shares.index(min(shares)) if min(shares) < SKEW * max(shares) else 1
                    scale = _outside_load_scale(shares[slow])
                contention.close()  # the last tenants leave as the next arrive
                now = tenants[len(started)]
                processes = round(now.processes * scale)
                contention.enter_context(competing_process(cores[slow], processes, now.nice))
                started.append(step)
                counts.append(processes)
            time.sleep(0.05)
        log = finish(proc, cmd, "pretrain_gpt.py", 2, timeout=30)
    if len(started) < len(tenants):
        pytest.fail("the run ended or stalled before the contention could start")
    rows = {r["step"]: r for r in map(json.loads, jsonl_lines(metrics)) if "loss" in r}
    contended_from = started[0]
    calm = [s for s in readings if 3 <= s <= contended_from]
    ends = [*started[1:], max(readings)]
    run = ContendedRun(
        rows=rows,
        contended_from=contended_from,
        slow=slow,
        calm_shares=shares_between(readings, 3, contended_from),
        calm_lowest=min(min(shares_between(readings, a, b)) for a, b in itertools.pairwise(calm)),
        contended_shares=shares_between(readings, contended_from, max(readings)),
        phases=[(a, shares_between(readings, a, b)) for a, b in zip(started, ends)],
        last=steps,
        log=log,
    )
    print(
        f"core shares (schedstat): calm {fmt(run.calm_shares)} (lowest step {run.calm_lowest:.2f}), "
        f"contended {fmt(run.contended_shares)}; rank {slow} contended after step {contended_from} by "
        f"{counts[0]} busy process(es)"
        + (f" (scaled to the outside load: {scale:.2f}x)" if counts[0] != tenants[0].processes else "")
        + "".join(f"; from step {a}: {fmt(shares)}" for a, shares in run.phases[1:])
        + ("; calm phase disturbed by outside load: calm checks relaxed" if run.disturbed else "")
    )
    if not min(run.contended_shares) < SKEW * max(run.contended_shares):
        skip_or_fail(
            f"outside load evened out the ranks' cores while rank {slow} was contended (core shares "
            f"{fmt(run.contended_shares)}): no straggler to balance; rerun on a quieter machine"
        )
    return run


def _outside_load_scale(calm_share: float) -> float:
    """How many times the planned tenants the contended core needs so that the contention is what the test
    plans whatever else the machine runs: outside load that left the rank `calm_share` of its core when calm
    is worth (1 / calm_share - 1) tenants of its own on each core, and dilutes n planned tenants' effect
    (the rank over its peer: 1 / (1 + n) quiet, (1 + k) / (1 + k + m) with k outside) unless they become
    m = n (1 + k) = n / calm_share. At most 3x (a rank left under a third of its core when calm is on a
    machine too busy to plan contention on; the checks then follow the kernel's shares)."""
    return 1 / max(calm_share, 1 / 3) if calm_share < CALM_SHARE else 1.0


def shares_between(readings: dict[int, list[tuple[float, float]]], first: int, last: int) -> list[float]:
    """Each rank's share of its core between the readings nearest after step `first` and at `last`."""
    start = min(s for s in readings if s >= first)
    return [core_share(a, b) for a, b in zip(readings[start], readings[last], strict=True)]


def fmt(shares: list[float]) -> str:
    return "/".join(f"{s:.2f}" for s in shares)


def jsonl_lines(path) -> list[str]:
    """The complete lines of a JSONL file another process may be writing (a line still being written, with
    no newline yet, is left for the next read)."""
    text = path.read_text() if path.exists() else ""
    return text[: text.rfind("\n") + 1].splitlines()
