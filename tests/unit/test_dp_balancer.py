"""The data-parallel balancer's decisions from gathered measurements (no process group): replica speeds
and, with balance.whole_step, each replica's fixed work (its optimizer step), folded into the shares;
the affine model of a replica's time (fixed per step + per micro-batch, issue 47): the exact shares of
known fixed and per-micro-batch times, no drift while they hold, straight back to even after a
recovery; the first step is a warm-up and one outlier never moves the shares.

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


def _balancer(whole_step: bool, shares=(4, 4), window: int = 3) -> DataParallelBalancer:
    overrides = {"hetero.dp_shares": "measured", "hetero.window": window, "balance.whole_step": whole_step}
    cfg = apply_overrides(MegahetConfig(), overrides)
    ctx = types.SimpleNamespace(
        times=StepTimes(0.0, 0.0, 0.0), step_t0=time.perf_counter(), shares=shares, set_shares=lambda s: None
    )
    return DataParallelBalancer(cfg, LAYOUT, ctx, COORDS)


def _step(balancer: DataParallelBalancer, step: int, per_micro_s, optimizer_s, fixed_s=(0.0, 0.0)) -> None:
    """One step: each replica's region time is its fixed seconds plus its micro-batches x its time per
    micro-batch (gathered as the runtime gathers it, folded in at the next step's start)."""
    balancer.before_forward_backward(step)
    rows = [
        torch.tensor([n, f + n * t, o], dtype=torch.float64)
        for n, t, o, f in zip(balancer.shares, per_micro_s, optimizer_s, fixed_s)
    ]
    balancer._pending = (_Done(), rows, step, 1.0)


def _run(
    balancer: DataParallelBalancer, per_micro_s: list[float], optimizer_s: list[float]
) -> tuple[int, ...]:
    """Six steps with region times proportional to the micro-batches."""
    for step in range(6):
        _step(balancer, step, per_micro_s, optimizer_s)
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


FIXED_S, PER_MICRO_S, SLOW = 0.2, 0.1, 4.0
"""Both replicas pay 0.2 s per step whatever their share, plus 0.1 s per micro-batch; replica 1 slowed
4x is slow at both."""


def _schedule(
    balancer: DataParallelBalancer, slow_steps: range, steps: int, fixed_s: float = FIXED_S
) -> list[tuple[int, ...]]:
    """The shares every step ran with, replica 1 SLOW x slower during `slow_steps`."""
    ran = []
    for step in range(steps):
        k = SLOW if step in slow_steps else 1.0
        _step(balancer, step, [PER_MICRO_S, k * PER_MICRO_S], [0.0, 0.0], [fixed_s, k * fixed_s])
        ran.append(balancer.shares)
    return ran


def test_fixed_time_per_step_gives_the_exact_shares_and_back_to_even_at_once() -> None:
    """16 micro-batches. While replica 1 is 4x slow the whole steps are equal at (14, 2): 0.2 + 14 x 0.1 =
    0.8 + 2 x 0.4 = 1.6 s. Per micro-batch of the step (the proportional model) the split stops at
    (13, 3), 1.5 s against 2.0 s; and after the recovery replica 1, with 3 micro-batches beside 13, reads
    0.69 of replica 0 and returns to even over several steps (issue 47 measured 11). The affine model
    fits the fixed time from the first share change and is exact: (14, 2) until the recovery, (8, 8) as
    soon as a full window of samples has seen it, and no change after."""
    ran = _schedule(_balancer(False, (8, 8)), range(4, 16), 30)
    assert ran[:5] == [(8, 8)] * 5, ran
    settled = ran.index((14, 2))
    assert settled <= 4 + 3 + 3, ran  # a window of slow samples, then the first change, then its pair
    assert ran[settled:17] == [(14, 2)] * (17 - settled), ran
    back = ran.index((8, 8), 16)
    assert back <= 16 + 3, ran  # a full window of recovered samples
    assert ran[back:] == [(8, 8)] * (30 - back), ran
    assert len({s for s in ran[settled:17]}) == 1  # no drift while the speeds hold


def test_alike_replicas_that_start_uneven_return_to_even() -> None:
    """Alike replicas resumed at (12, 4) with 0.5 s per step besides their micro-batches: back to (8, 8)
    and there for good (per micro-batch of the step, the proportional model reads replica 1 at 0.63,
    then 0.82, 0.91, and stops at (9, 7): the healthy gap is 0.05)."""
    ran = _schedule(_balancer(False, (12, 4)), range(0), 16, fixed_s=0.5)
    assert ran[-8:] == [(8, 8)] * 8, ran


def test_the_first_step_is_a_warm_up_not_a_sample() -> None:
    """A window of one sample: the first step's 10x slow replica 0 (lazy initialization) would move the
    shares on its own; it is not a sample, so alike replicas stay even."""
    balancer = _balancer(False, (8, 8), window=1)
    _step(balancer, 0, [1.0, 0.1], [0.0, 0.0])
    for step in range(1, 6):
        _step(balancer, step, [0.1, 0.1], [0.0, 0.0])
        assert balancer.shares == (8, 8), (step, balancer.shares)


def test_the_report_shows_speeds_once_measured() -> None:
    """Before any sample (a run's first step, or the first after a move) the shares only: a NaN speed printed
    "dp speed nan nan" and wrote NaN, which is not JSON, to the metrics file."""
    balancer = _balancer(False, (8, 8), window=1)
    assert balancer.report() == {"share_dp0": 8.0, "share_dp1": 8.0}
    for step in range(3):
        _step(balancer, step, [0.1, 0.2], [0.0, 0.0])
    report = balancer.report()
    assert report["speed_dp0"] == 1.0 and 0.4 < report["speed_dp1"] < 0.6, report


def test_one_outlier_before_the_window_is_full_moves_nothing() -> None:
    """The first decision waits for a full window (3): an outlier in the first measured step is outvoted
    by the median, where a decision on it alone would have moved the shares."""
    balancer = _balancer(False, (8, 8))
    for step in range(8):
        slow = 1.0 if step == 1 else 0.1
        _step(balancer, step, [slow, 0.1], [0.0, 0.0])
        assert balancer.shares == (8, 8), (step, balancer.shares)


def test_checkpoints_from_before_the_affine_model_load_as_the_same_speeds() -> None:
    """Saved speed samples (micro-batches per second) load as samples of the same speeds."""
    balancer = _balancer(False, (8, 8))
    state = balancer.state_dict() | {"samples": [[10.0, 10.0], [2.5, 2.5]], "shares": [8, 8]}
    balancer.load_state_dict(state)
    assert balancer.replica_speeds() == pytest.approx([1.0, 0.25])
    assert balancer.replica_model()[0] == pytest.approx([0.1, 0.4])  # seconds per micro-batch
