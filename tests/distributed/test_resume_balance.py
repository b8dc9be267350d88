"""Kill and resume with the balancer on, in every mode that acts: the loss curve is the uninterrupted one.

A TP=2 x DP=2 GPT (4 ranks) whose TP rank 1 is a virtual device at a quarter speed (slow enough, at a
nominal 1 GFLOP/s, that its emulated time dominates the CPU's jitter), so that the balancer resizes
(resize; semi with tolerance 0.8: its gap 0.6 is "mild", clear of the tolerance by more than the
measured speeds vary: with 0.7, CI saw a run migrate) or migrates (migrate). (The measuring-only static
balancer changes no plan, so its kill and resume is the plain one of test_checkpoint_resume.py.) Two
launches of workers/ckpt_train.py, three runs each (about 2 min on 2 cores):
1. uninterrupted: `full_<mode>`, STEPS steps, saving every 4;
2. resumed and killed: `ck_<mode>` starts from a copy of full_<mode>'s step-4 checkpoint (its
   balancer state: speed samples, targets, change count, efficiency window; the executed plan; RNG)
   with `--train.save D --train.load D`, under `torchrun --max-restarts 3`. In attempt k one rank of
   the k-th run SIGKILLs itself in the middle of step KILL_STEP (after backward, before the optimizer
   step); torchrun restarts every rank, and each run resumes from its own latest checkpoint (step 8).
Every run's per-step loss, gradient norm and LR from step 5 on, its final validation loss, and the
plan it executed (dropped fraction and migrated units per TP rank, from the balancer's telemetry)
must equal the uninterrupted run's. The hysteresis (0.4 of a rank's units) keeps measurement noise
from moving a plan, so the plan a run executes depends on its restored state, not on timing: a
balancer that lost its state plans again from nothing (even split for `window` steps) and differs.

Run: ``python -m pytest tests/distributed/test_resume_balance.py -q``
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import (
    GPT_MODEL,
    compare_resumed,
    full_and_killed_runs,
    read_records,
    short_run,
)

STEPS, KILL_STEP = 12, 10  # full_and_killed_runs kills in step 10
MODES = ("resize", "migrate", "semi")
COMMON = [
    *GPT_MODEL,
    *short_run(STEPS),
    "--parallel.tp", "2",
    "--train.save_interval", "4",
    "--device.profile", "static:1,0.25",
    "--device.rate_gflops", "1",
    "--balance.hysteresis", "0.4",
    "--balance.tolerance", "0.8",
]  # fmt: skip
PLAN_KEYS = ("gamma_tp0", "gamma_tp1", "moved_tp0", "moved_tp1")


def _job(name: str, mode: str, out: Path, save: str, load: str | None = None) -> list[str]:
    extra = f"--balance.mode {mode} --balance.trace {out / (name + '_trace.jsonl')}"
    extra += f" --logging.metrics_file {out / (name + '.jsonl')} --train.save {out / save}"
    return ["--job", f"{name}={extra}" + (f" --train.load {out / load}" if load else "")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, gpt_data: list[str]) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("resume_balance")
    common = ["--", *COMMON, *gpt_data]

    def job(name: str, mode: str, load: bool) -> list[str]:
        return _job(name, mode, out, name, load=name if load else None)

    output = full_and_killed_runs(out, MODES, job, common, killed_rank=lambda k: k)  # a different rank each
    return out, output


def test_every_fault_was_a_real_kill_and_restart(runs) -> None:
    out, output = runs
    assert output.count("exitcode  : -9") == len(MODES) or output.count("exitcode: -9") >= len(MODES), output[
        -4000:
    ]
    for mode in MODES:
        killed = [
            line for line in (out / f"ck_{mode}.jsonl").read_text().splitlines() if '"step": 9,' in line
        ]
        assert len([line for line in killed if '"loss"' in line]) == 2, f"{mode}: step 9 not run twice"


@pytest.mark.parametrize("mode", MODES)
def test_kill_and_resume_is_exact(runs, mode: str) -> None:
    out, _ = runs
    full, resumed = read_records(out / f"full_{mode}.jsonl"), read_records(out / f"ck_{mode}.jsonl")
    steps = range(5, STEPS + 1)
    assert all(s in resumed and "loss" in resumed[s] for s in steps), sorted(resumed)
    plan = {k: [resumed[s][k] for s in steps] for k in PLAN_KEYS}
    assert plan == {k: [full[s][k] for s in steps] for k in PLAN_KEYS}, f"{mode}: the executed plan differs"
    assert any(v != 0 for values in plan.values() for v in values), f"{mode}: the balancer never acted"
    compare_resumed(f"kill_resume_{mode}", full, resumed, range(5, STEPS + 1))
