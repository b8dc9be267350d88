"""Escalation with rank placement (issue 46), end to end on 4 ranks: a TP 4 job whose ranks 1 and 3 are late to
every collective, with TP 1 x DP 4 over the memory a rank may hold, moves to TP 2 x DP 2 with strided TP groups
(ranks 0,2 and 1,3: megatron-core's order cp-ep-dp-tp-pp), so that one replica is late instead of two, and
stays on the unmoved TP 4 run's loss curve; the checkpoint it saves at the end records the placement.

Two launches of pretrain_gpt on 4 ranks (about 1 min on 2 cores): the reference (TP 4, STEPS steps) and the
escalating job (`--escalate.mode on`, ranks 1 and 3 virtual devices at full speed, DELAY_MS late to each
collective they join, `escalate.memory_gib` between TP 2 x DP 2's state a rank and TP 1 x DP 4's). The moved
run's weights, optimizer state and data must land where megatron-core's strided groups put each rank: a
rank that took another's shard, or a replica that read the other's micro-batches, would leave the curve.
The benchmark, not this test, checks the speed.

Run: ``python -m pytest tests/distributed/test_escalation_placement.py -q``
"""

from __future__ import annotations

import json
import re

import pytest
from harness import GPT_MODEL, compare_steps, late_ranks, metrics_job, read_records, short_run, torchrun

STEPS, DELAY_MS = 14, 3
MEMORY_GIB = 0.0022
"""Between the test GPT's weights, gradients and optimizer state a rank at TP 2 x DP 2 (~1.8 MB, fp32) and at
TP 1 x DP 4 (~2.9 MB)."""
COMMON = [*GPT_MODEL, *short_run(STEPS), "--parallel.tp", "4", "--train.micro_batch_size", "1"]
"""8 micro-batches of one sequence a step: the late replica's lateness (30 collectives a micro-batch) outweighs
its compute on a busy host too, and the shares are fine enough that the strided groups predict strictly faster.
With 4 micro-batches of 2 the shares are 3/1 or 2/2, and at 2/2 both placements tie (the consecutive groups
win the tie): the test failed once so in a run after the other escalation tests, and never alone."""
ESCALATE = [
    *("--escalate.mode", "on", "--escalate.window", "3", "--escalate.memory_gib", str(MEMORY_GIB)),
    *late_ranks(0, DELAY_MS, 0, DELAY_MS),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, gpt_data: list[str]) -> dict:
    out = tmp_path_factory.mktemp("placement")
    ref_args, ref = metrics_job(out, "ref", [*COMMON, *gpt_data])
    torchrun("../../pretrain_gpt.py", 4, ref_args, cwd=out, timeout=400)
    save = ["--train.save", str(out / "ck"), "--train.save_interval", str(STEPS)]
    esc_args, esc = metrics_job(out, "esc", [*COMMON, *gpt_data, *ESCALATE, *save])
    log = torchrun("../../pretrain_gpt.py", 4, esc_args, cwd=out, timeout=400)
    meta = json.loads((out / "ck" / f"iter_{STEPS:07d}" / "megahet.json").read_text())
    return {"ref": read_records(ref), "esc": read_records(esc), "log": log, "saved": meta["layout"]}


def test_two_late_ranks_share_one_tp_group_after_the_move_on_the_loss_curve(runs: dict) -> None:
    log = runs["log"]
    assert re.search(r"escalation: TP 1 x DP 4 needs [\d.e-]+ GiB a rank, over the [\d.e-]+ GiB allowed", log)
    decision = re.search(
        r"escalation step \d+: move .*: TP 4 x DP 1 .*TP 2 x DP 2 \(shares (\d+)/(\d+)\), TP groups 0,2 \| 1,3",
        log,
    )
    assert decision, log[-4000:]
    assert int(decision.group(1)) > int(decision.group(2)), decision.group(0)  # the calm replica takes more
    moved = re.findall(
        r"moved TP 4 x PP 1 x DP 1 -> TP 2 x PP 1 x DP 2, TP groups strided after step (\d+)", log
    )
    assert len(moved) == 1, log[-4000:]
    assert "megahet gpt: world 4 = TP 2 x PP 1 x DP 2 (TP groups strided)" in log, log[-4000:]
    # the checkpoint saved on the strided groups says so (a resume reshards it: tests/unit/test_elastic.py)
    assert runs["saved"] == {"tp": 2, "pp": 1, "dp": 2, "zero_stage": 1, "strided": True}, runs["saved"]
    compare_steps(
        "escalation_placement",
        runs["esc"],
        runs["ref"],
        range(1, STEPS + 1),
        what=f", moved after {moved[0]}",
    )
