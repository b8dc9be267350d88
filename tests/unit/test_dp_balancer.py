"""The data-parallel balancer's decisions from gathered measurements (no process group): replica speeds
and, with balance.whole_step, each replica's fixed work (its optimizer step), folded into the shares.

Run: ``python -m pytest tests/unit/test_dp_balancer.py -q`` (about 1 s).
"""

from __future__ import annotations

import time
import types

import pytest
import torch

from megahet.config import MegahetConfig, apply_overrides
from megahet.parallel import ParallelLayout
from megahet.runtime.dp_balancer import DataParallelBalancer
from megahet.runtime.timing import StepTimes

LAYOUT = ParallelLayout(
    rank=0, world_size=2, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=2
)
COORDS = [(0, 0, 0), (1, 0, 0)]


class _Done:
    def wait(self) -> None:
        pass


def _balancer(whole_step: bool) -> DataParallelBalancer:
    overrides = {"hetero.dp_shares": "measured", "hetero.window": 3, "balance.whole_step": whole_step}
    cfg = apply_overrides(MegahetConfig(), overrides)
    ctx = types.SimpleNamespace(
        times=StepTimes(0.0, 0.0, 0.0), step_t0=time.perf_counter(), shares=(4, 4), set_shares=lambda s: None
    )
    return DataParallelBalancer(cfg, LAYOUT, ctx, COORDS)


def _run(
    balancer: DataParallelBalancer, per_micro_s: list[float], optimizer_s: list[float]
) -> tuple[int, ...]:
    """Six steps: each replica's region time is its micro-batches x its time per micro-batch."""
    for step in range(6):
        balancer.before_forward_backward(step)
        rows = [
            torch.tensor([n, n * t, o], dtype=torch.float64)
            for n, t, o in zip(balancer.shares, per_micro_s, optimizer_s)
        ]
        balancer._pending = (_Done(), rows, step, 1.0)
    balancer.before_forward_backward(6)
    return balancer.shares


@pytest.mark.parametrize("whole_step", [True, False])
def test_a_replica_with_a_slower_optimizer_step_runs_fewer_micro_batches(whole_step: bool) -> None:
    """Issue 31: alike replicas, but replica 1's optimizer step takes 2 micro-batches' time more (a slow
    device is slow at its fixed work too): whole-step shares give it fewer micro-batches, so both whole
    steps end together; without balance.whole_step the shares stay even."""
    shares = _run(_balancer(whole_step), [0.1, 0.1], [0.05, 0.25])
    assert shares == ((5, 3) if whole_step else (4, 4))


def test_equal_fixed_work_keeps_the_speed_split() -> None:
    """The same optimizer time on both replicas moves nothing the speeds would not: replica 1 at half
    speed gets a third, with or without it."""
    assert _run(_balancer(True), [0.1, 0.2], [0.3, 0.3])[1] < 4
    assert _run(_balancer(True), [0.1, 0.1], [0.3, 0.3]) == (4, 4)
