"""Escalation under real contention (issue 46), no virtual device: a TP 2 job whose rank 1 shares its core
with busy processes moves to TP 1 x DP 2 in place, prints its decisions with their numbers, and stays on the
loss curve of the same job uncontended at TP 2.

Two launches of pretrain_gpt on 2 ranks (about 1.5 min on 2 cores):
1. the reference: TP 2, STEPS steps, nothing contended;
2. the contended job (contended.py: each rank pinned to a core of its own, busy processes on rank 1's from
   the step after CALM on, scaled to the outside load), with `--escalate.mode on` at its defaults and the
   migrating TP balancer inside the layout. 16 micro-batches of one sequence a step, 4 layers: a TP 2 rank
   joins 16 x 30 + 2 collectives a step, and a time-sliced rank is late to each (issue 31 measured 1.5-2.4 ms);
   a replica of TP 1 x DP 2 joins 3.
The move must come once, after the contention started, with its decision line; the losses, gradient norms
and LRs must follow the reference within fp32 reduction noise (the moved job reduces in another order). The
benchmark (benchmarks/escalation.py), not this test, measures the speed and the gain captured.

Run: ``python -m pytest tests/distributed/test_real_escalation.py -q``
"""

from __future__ import annotations

import re

import pytest
from contended import ContendedRun, Tenants, contended_run, run_args
from harness import compare_steps, read_records, torchrun

STEPS, CALM = 16, 4
ONE_SEQUENCE = (
    "--parallel.tp 2 --train.micro_batch_size 1 --model.hidden_size 64 --model.num_attention_heads 4 "
    "--model.num_layers 4 --model.seq_length 32"
)
"""The escalation tests' GPT (harness.GPT_MODEL), not contended.py's wider one: at hidden 512 TP 2 and TP 1 x DP 2
already differ by 7e-6 in gradient norm at step 1 (another reduction order over wider sums), more than the
resume tests' tolerance, which this test holds the move to."""
ESCALATE = f"{ONE_SEQUENCE} --balance.mode migrate --balance.healthy_gap 0.2 --escalate.mode on"
"""healthy_gap 0.2: two pinned ranks on this 2-core machine measure up to ~15 % apart when calm (0.87 seen), which
the default 0.1 flags as a straggler (and TP 1 x DP 2 is faster here even calm); contended, rank 1 reads ~0.25."""
CALM_SHARE = 0.6
"""Calm, each pinned rank gets 0.72-0.76 of its core here (schedstat: its own threads and the launcher's share
the cores); below this outside load slowed a rank enough (a speed under 0.8) to be a straggler in the calm
phase, and a move before the contention is right."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, gpt_data: list[str]) -> tuple[dict, ContendedRun]:
    out = tmp_path_factory.mktemp("real_escalation")
    metrics = out / "ref.jsonl"
    torchrun(
        "../../pretrain_gpt.py", 2, run_args(out / "ref", gpt_data, ONE_SEQUENCE, STEPS, metrics), cwd=out
    )
    run = contended_run(out, gpt_data, ESCALATE, tenants=(Tenants(CALM),), steps=STEPS)
    return read_records(metrics), run


def test_a_contended_tp_rank_moves_the_job_to_dp_on_the_loss_curve(runs: tuple[dict, ContendedRun]) -> None:
    ref, run = runs
    log = run.log
    moved = [
        int(s) for s in re.findall(r"moved TP 2 x PP 1 x DP 1 -> TP 1 x PP 1 x DP 2 after step (\d+)", log)
    ]
    assert len(moved) == 1, log[-4000:]
    print(f"contended after step {run.contended_from}, moved after step {moved[0]}")
    print(
        "\n".join(
            line
            for line in log.splitlines()
            if "escalation step" in line or "moved TP" in line or "priced at" in line
        )
    )
    # outside load during the calm phase is contention too: a move then is right, and allowed
    assert moved[0] > run.contended_from or run.calm_lowest < CALM_SHARE, (
        moved,
        run.calm_lowest,
        log[-4000:],
    )
    # the first move is priced before one is measured (megahet/runtime/move_price.py), once
    priced = re.findall(
        r"escalation: a first move to TP 1 x DP 2 priced at ([\d.]+) s: the rebuild .* \(measured\)", log
    )
    assert len(priced) == 1 and float(priced[0]) > 0, log[-4000:]
    decision = re.search(
        r"escalation step \d+: move \(the straggler persists; gain over the horizon [\d.]+ s, lost [\d.]+ s, "
        r"move [\d.]+ s\): TP 2 x DP 1 [\d.]+ s a step \(predicted [\d.]+\), TP 1 x DP 2 \(shares \d+/\d+\) "
        r"predicted [\d.]+, delay [\d.]+ ms",
        log,
    )
    assert decision, log[-4000:]
    assert "escalation step" in log and not re.search(r"escalation step \d+: return", log), log[-4000:]
    compare_steps("real_escalation", {s: run.rows[s] for s in run.rows}, ref, range(1, STEPS + 1),
                  what=f", moved after {moved[0]}")  # fmt: skip
