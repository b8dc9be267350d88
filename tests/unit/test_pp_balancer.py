"""The pipeline balancer's decisions (megahet/runtime/pp_balancer.py) on hand-made measurements, in one
process: a slow stage is asked to give up layers after `hetero.pp_patience` decisions in a row and not
before; noise within `hetero.healthy_gap`, gains within `hetero.hysteresis` and declared splits move no
layer; its telemetry (console line, trace and PNG, tools/plot_balance.py).

    python -m pytest tests/unit/test_pp_balancer.py -q
"""

from __future__ import annotations

import json
import time
import types
from pathlib import Path

import pytest
import torch

from megahet.config import load_config
from megahet.logging import format_console_line
from megahet.policy.stage_split import measured_stage_times
from megahet.runtime.pp_balancer import PipelineBalancer
from megahet.runtime.timing import StepTimes

# PP=2 x DP=2 (TP=1), megatron-core's order: rank = dp + 2 * pp
COORDS = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]


class _Done:
    def wait(self) -> None:
        pass


def _balancer(
    *args: str, split=(4, 4), trace: Path | None = None, build_s: float = 0.0, said: list | None = None
) -> tuple[PipelineBalancer, list]:
    argv = ["--parallel.pp", "2", "--model.num_layers", str(sum(split)), "--hetero.pp_split", "measured"]
    argv += ["--hetero.window", "1", "--hetero.pp_patience", "2", *args]
    if trace is not None:
        argv += ["--balance.trace", str(trace)]
    cfg = load_config(argv)
    requests: list = []
    layout = types.SimpleNamespace(rank=0)
    ctx = types.SimpleNamespace(  # measurements are fed by _feed
        times=StepTimes(0.0, 0.0, 0.0), step_t0=time.perf_counter(), num_microbatches=2,
        request_split=requests.append, build_s=build_s, shares=(2, 2),
    )  # fmt: skip
    say = said.append if said is not None else print
    return PipelineBalancer(cfg, layout, split, ctx, COORDS, say=say), requests


def _feed(balancer: PipelineBalancer, step: int, layer_s: list[float], extra_s: float = 0.0) -> None:
    """Step `step` measured: each rank's layers took layer_s[stage] per layer and micro-batch (2 of
    them), the last stage's output layer `extra_s` per micro-batch; then the next step starts."""
    rows = []
    for _dp, stage, _tp in COORDS:
        layers = layer_s[stage] * balancer.split[stage] * 2
        extra = extra_s * 2 if stage == len(balancer.split) - 1 else 0.0
        rows.append(torch.tensor([2.0, layers, layers + extra, 0.0], dtype=torch.float64))
    balancer._pending = (_Done(), rows, step, 1.0)
    balancer.before_forward_backward(step + 1)


def test_a_slow_stage_gives_up_layers_after_patience_decisions():
    balancer, requests = _balancer()
    _feed(balancer, 0, [1.0, 1.0])
    assert requests == [] and balancer.proposal is None
    _feed(balancer, 1, [1.0, 2.0])  # stage 1 twice as slow per layer: 5,3 takes 6 (4,4 takes 8)
    assert requests == [] and balancer.proposal == (5, 3) and balancer.streak == 1
    _feed(balancer, 2, [1.0, 2.0])
    assert requests == [(5, 3)] and balancer.requested == (5, 3)
    _feed(balancer, 3, [1.0, 2.0])  # asked once: the runtime re-splits after this step
    assert requests == [(5, 3)]


def test_a_resplit_must_pay_its_cost_within_the_horizon():
    """5,3 saves (2 + 2 - 1) x (8 - 6) = 6 s a step against 4,4 (stage 1 twice as slow per layer). Against
    the build time at start (100 s), it pays over 20 steps (120 s), not over 10; the refusal is printed
    once. After a re-split, the cost is the one it measured: its rebuild plus its transfer per layer."""
    said: list[str] = []
    balancer, requests = _balancer("--hetero.resplit_horizon", "10", build_s=100.0, said=said)
    for step in range(4):
        _feed(balancer, step, [1.0, 2.0])
    assert requests == [] and balancer.refused == (5, 3)
    assert len(said) == 1 and "4,4 -> 5,3 saves 6.000 s a step" in said[0] and "keeping 4,4" in said[0], said
    assert "build time at start" in said[0]
    assert balancer.metrics()["resplit_cost_s"] == 100.0
    balancer, requests = _balancer("--hetero.resplit_horizon", "20", build_s=100.0, said=said)
    _feed(balancer, 0, [1.0, 2.0])
    _feed(balancer, 1, [1.0, 2.0])
    assert requests == [(5, 3)] and "re-splitting" in said[-1]
    # measured: plan 5 s, rebuild 25 s, transfer 20 s for 2 layers -> 5,3 (one layer) costs 40 s: pays over 10 steps
    balancer, requests = _balancer("--hetero.resplit_horizon", "10", build_s=100.0, said=said)
    balancer.resplit_done(types.SimpleNamespace(plan_s=5.0, build_s=25.0, transfer_s=20.0, layers_moved=2))
    _feed(balancer, 0, [1.0, 2.0])
    _feed(balancer, 1, [1.0, 2.0])
    assert requests == [(5, 3)] and "cost 40.00 s (measured by the last re-split)" in said[-1]


def test_a_resplit_near_the_end_of_training_does_not_pay():
    """5,3 saves 6 s a step; after step 1 two steps are left (12 s), after step 2 one (6 s): neither pays
    a 20 s re-split, which a 100-step run would make at once."""
    balancer, requests = _balancer("--train.train_iters", "4", build_s=20.0, said=[])
    for step in range(3):
        _feed(balancer, step, [1.0, 2.0])
    assert requests == [] and balancer.refused == (5, 3)
    balancer, requests = _balancer("--train.train_iters", "100", build_s=20.0, said=[])
    for step in range(3):
        _feed(balancer, step, [1.0, 2.0])
    assert requests == [(5, 3)]


def test_a_proposal_must_repeat_in_a_row():
    balancer, requests = _balancer()
    _feed(balancer, 0, [1.0, 2.0])
    _feed(balancer, 1, [1.0, 1.0])  # back to alike: the streak ends
    _feed(balancer, 2, [1.0, 2.0])
    assert requests == [] and balancer.streak == 1
    _feed(balancer, 3, [1.0, 4.0])  # another proposal (7,1) starts its own streak
    assert requests == [] and balancer.proposal == (7, 1) and balancer.streak == 1


def test_the_slowest_replica_sets_its_stage_time():
    """One split serves every replica: stage 1 is as slow as replica 1's copy of it."""
    balancer, requests = _balancer("--hetero.pp_patience", "1")
    rows = [
        torch.tensor([2.0, n * 2 * t, n * 2 * t, 0.0], dtype=torch.float64)
        for n, t in [(4, 1), (4, 1), (4, 1), (4, 4)]
    ]
    balancer._pending = (_Done(), rows, 0, 1.0)
    balancer.before_forward_backward(1)
    assert requests == [(7, 1)]
    assert balancer.stage_speeds() == [1.0, 0.25]


@pytest.mark.parametrize(
    "args, layer_s, extra_s",
    [
        ((), [1.0, 1.04], 0.0),  # within healthy_gap (0.05): alike
        (("--hetero.hysteresis", "0.3"), [1.0, 1.5], 0.0),  # 5,3 cuts the slowest 6 to 5: 17 % < 30 %
        ((), [1.0, 1.0], 0.5),  # the output layer (half a layer) on 4,4: 5,3 would take 5 > 4.5
    ],
)
def test_noise_small_gains_and_a_light_output_layer_move_nothing(args, layer_s, extra_s):
    balancer, requests = _balancer(*args)
    for step in range(6):
        _feed(balancer, step, layer_s, extra_s)
    assert requests == [] and balancer.proposal is None


def test_a_heavy_output_layer_gives_the_last_stage_fewer_layers():
    balancer, requests = _balancer()
    for step in range(2):
        _feed(balancer, step, [1.0, 1.0], 2.0)  # 4,4 takes 6 on the last stage, 5,3 takes 5
    assert requests == [(5, 3)]


def test_declared_splits_are_measured_but_never_replanned():
    balancer, requests = _balancer("--hetero.pp_split", "declared", "--hetero.speeds", "1,1,1,0.5")
    for step in range(4):
        _feed(balancer, step, [1.0, 2.0])
    assert requests == [] and balancer.stage_speeds() == [1.0, 0.5]


def test_measured_stage_times_take_each_stage_slowest_rank_and_equalize_noise():
    per_rank = {(0, 0, 0): (1.0, 0.0), (0, 0, 1): (1.2, 0.1), (0, 1, 0): (2.0, 0.5), (0, 1, 1): (1.0, 0.7)}
    assert measured_stage_times(per_rank, 2) == ([1.2, 2.0], [0.1, 0.7])
    alike = {(0, 0, 0): (1.0, 0.0), (0, 1, 0): (1.1, 0.3)}
    assert measured_stage_times(alike, 2, healthy_gap=0.1) == ([1.05, 1.05], [0.0, 0.3])
    assert measured_stage_times(alike, 2, healthy_gap=0.05) == ([1.0, 1.1], [0.0, 0.3])
    with pytest.raises(ValueError, match=r"no layer time measured for stage\(s\) \[1\]"):
        measured_stage_times({(0, 0, 0): (1.0, 0.0)}, 2)


def test_report_and_console_line_show_each_stage_speed_and_layers():
    balancer, _ = _balancer(split=(5, 3))
    # before any sample: the layers only (a NaN speed printed "pp speed nan nan" and wrote NaN to the JSONL)
    assert balancer.report() == {"layers_pp0": 5.0, "layers_pp1": 3.0}
    _feed(balancer, 0, [1.0, 2.0])
    report = balancer.report()
    assert report == {"speed_pp0": 1.0, "speed_pp1": 0.5, "layers_pp0": 5.0, "layers_pp1": 3.0}
    assert balancer.metrics() == {"pp_resplits": 0.0}
    line = format_console_line(3, 10, {"loss": 2.0, **report})
    assert line == "step      3/10 | loss 2.0000 | pp speed 1.00 0.50 | pp layers 5 3"


def test_trace_rows_and_png(tmp_path: Path):
    from tools.plot_balance import main as plot_balance

    balancer, _ = _balancer(trace=tmp_path / "run.jsonl")
    for step in range(3):
        _feed(balancer, step, [1.0, 2.0])
    balancer.close()
    rows = [json.loads(line) for line in (tmp_path / "run_pp.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert (
        rows[0]["split"] == [4, 4] and rows[0]["stage_speed"] == [1.0, 0.5] and rows[0]["proposal"] == [5, 3]
    )
    assert rows[2]["layer_s"] == [1.0, 2.0]
    assert (tmp_path / "run_pp.png").stat().st_size > 0
    assert plot_balance([str(tmp_path / "run_pp.jsonl"), "--out", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 0


def test_a_closed_but_not_final_trace_is_not_drawn(tmp_path: Path):
    """A re-split closes the trace for its successor to go on writing: no PNG yet."""
    balancer, _ = _balancer(trace=tmp_path / "run.jsonl")
    _feed(balancer, 0, [1.0, 1.0])
    balancer.close(final=False)
    assert (tmp_path / "run_pp.jsonl").is_file() and not (tmp_path / "run_pp.png").exists()


def test_a_position_runs_at_its_slowest_cp_rank():
    """PP 2 x CP 2: the CP ranks of a position share its (dp, pp, tp) (megatron-core's tp-cp-dp-pp order: rank
    = cp + 2 x pp). CP rank 0 of stage 1 at a quarter speed makes stage 1 slow, whichever CP rank the
    gather lists last (a dict by coordinates kept the fast one: no re-split)."""
    balancer, _ = _balancer()
    balancer.coords = [(0, 0, 0), (0, 0, 0), (0, 1, 0), (0, 1, 0)]
    for stage_times in ([1.0, 1.0, 4.0, 1.0], [1.0, 1.0, 1.0, 4.0]):
        rows = [torch.tensor([2.0, t * 8, t * 8, 0.0], dtype=torch.float64) for t in stage_times]
        balancer._pending = (_Done(), rows, 0, 1.0)
        balancer.before_forward_backward(1)
        assert balancer.stage_speeds() == [1.0, 0.25], stage_times
