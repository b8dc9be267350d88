"""Virtual heterogeneous devices: profiles, the charge arithmetic, and the delay on a real model,
paid inside the compute before the next collective."""

from __future__ import annotations

import json
import time
import types

import pytest
import torch
import torch.distributed as dist

from megahet.policy.speed_profile import SpeedProfile, parse_profile
from megahet.runtime import devices
from megahet.runtime.devices import DeviceStepHook, VirtualDevice, attach_virtual_device
from megahet.runtime.timing import CommClock
from megahet.tensor_parallel.executor import ResizeExecutor
from megahet.tensor_parallel.plan import ResizePlan

SEED = 99


def test_static_and_schedule_profiles():
    p = parse_profile("static:1,1,0.5,0.25")
    assert [p.speed(r, 0, 4) for r in range(4)] == [1, 1, 0.5, 0.25]
    s = parse_profile("schedule:0=1,1;10=1,0.25;20=1,1")
    assert [s.speed(1, t, 2) for t in (0, 9, 10, 19, 20, 99)] == [1, 1, 0.25, 0.25, 1, 1]


def test_rotating_straggler_moves_every_period():
    p = parse_profile("rotating:4,20")
    slow = [[r for r in range(4) if p.speed(r, t, 4) < 1] for t in (0, 19, 20, 40, 60, 80)]
    assert slow == [[0], [0], [1], [2], [3], [0]]
    assert p.speed(1, 20, 4) == 0.25


def test_contention_is_seeded_and_switches_per_episode():
    a, b = parse_profile("contention:4,20,7"), parse_profile("contention:4,20,7")
    grid = [[a.speed(r, t, 4) for r in range(4)] for t in range(0, 200, 20)]
    assert grid == [[b.speed(r, t, 4) for r in range(4)] for t in range(0, 200, 20)]
    assert all(a.speed(r, t, 4) == a.speed(r, t + 19 - t % 20, 4) for r in range(4) for t in range(0, 100, 7))
    flat = [s for row in grid for s in row]
    assert 0.25 in flat and 1.0 in flat
    assert grid != [
        [parse_profile("contention:4,20,8").speed(r, t, 4) for r in range(4)] for t in range(0, 200, 20)
    ]


def test_profile_from_files(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("kind: schedule\nschedule:\n  0: [1, 1]\n  5: [0.5, 1]\n")
    assert parse_profile(str(path)).speed(0, 7, 2) == 0.5
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"kind": "rotating", "slowdown": 2, "period": 3}))
    assert parse_profile(str(path)).speed(1, 3, 2) == 0.5


@pytest.mark.parametrize(
    "spec", ["static:1,0", "static:", "rotating:0.5,2", "rotating:4", "warp:1", "schedule:x=1"]
)
def test_bad_profiles_are_one_line_errors(spec):
    with pytest.raises(ValueError, match="bad device profile") as err:
        parse_profile(spec)
    assert "\n" not in str(err.value)


def test_profile_width_must_match_tp():
    with pytest.raises(ValueError, match="2 ranks"):
        VirtualDevice(parse_profile("static:1,1,1"), tp_rank=0, tp_size=2, rate_gflops=1)


def test_charge_is_the_work_at_rate_times_speed_and_sleeps_what_real_compute_did_not_use():
    device = VirtualDevice(SpeedProfile("static", speeds=(1.0, 0.5)), tp_rank=1, tp_size=2, rate_gflops=1.0)
    t0 = time.perf_counter()
    slept = device.charge(flops=int(0.02e9), real_s=0.01)  # 0.02 GFLOP at 0.5 GFLOP/s = 0.04 s, 0.01 s real
    assert slept == pytest.approx(0.03)
    assert time.perf_counter() - t0 >= 0.03
    device._slept_s = 0.03  # exactly what was asked (late wake-ups: tested below)
    # Then 0.001 GFLOP (0.002 s) whose real compute took 0.001 s: the rest is slept.
    assert device.charge(flops=int(0.001e9), real_s=0.001) == pytest.approx(0.001)
    assert device.charge_s == pytest.approx(0.042) and device.host_s == pytest.approx(0.011)
    assert device.overrun_s == 0.0
    assert device.charge(flops=0, real_s=0.5) == 0.0  # compute outside the blocks (embedding) is not charged
    assert device.host_s == pytest.approx(0.011) and device.charge_s == pytest.approx(0.042)
    device.set_step(5)
    assert device.charge_s == 0.0 and device.host_s == 0.0


def test_real_fixed_work_that_fits_the_charge_is_hidden_at_any_split_and_host_load():
    """The charge is the work's alone: a rank at 0.25 takes 4x a speed-1 rank's time for the same work at
    every split and host load, as long as the real compute fits the charge. A charge of max(work / rate,
    real) / speed (before issue 47) switched to real / speed once a rank that gave units away, a busy host,
    or its own sleeps' cold caches made its real fixed work exceed its units' work / rate."""

    def step_time(speed: float, real_s: float, gflop: float) -> float:
        device = VirtualDevice(SpeedProfile("static", speeds=(speed,)), tp_rank=0, tp_size=1, rate_gflops=5)
        device._slept_s = float("inf")  # account only: nothing sleeps
        device.charge(flops=int(gflop * 1e9), real_s=real_s)
        return max(device.charge_s, device.host_s)  # the rank's compute

    for units in (1.0, 0.4, 0.1):  # the even split, migrated, nearly all given away (0.01 s of work / rate)
        for real_s in (0.002, 0.008, 0.015):  # quiet, busy, and more than the units' work / rate at 0.1
            gflop = 0.5 * units
            assert step_time(0.25, real_s, gflop) == pytest.approx(gflop / 5 / 0.25)  # the work's, 4x
            if real_s <= gflop / 5:
                assert step_time(0.25, real_s, gflop) == pytest.approx(4 * step_time(1.0, real_s, gflop))


def test_real_compute_beyond_the_charge_is_reported_and_warns_once():
    """A rate too high for the host: the rank runs at the host's speed, and the device says so."""
    device = VirtualDevice(SpeedProfile("static", speeds=(1.0,)), tp_rank=0, tp_size=1, rate_gflops=10)
    assert device.charge(flops=int(0.1e9), real_s=0.0105) == 0.0  # charged 0.01 s, 5 % over: no warning
    device.check_overrun()
    assert device.overrun_s == pytest.approx(0.0005) and not device.warned
    device.set_step(1)
    device.charge(flops=int(0.1e9), real_s=0.02)
    assert device.overrun_s == pytest.approx(0.01)
    with pytest.warns(
        UserWarning, match=r"step 1's real compute 0.020 s exceeded its charge 0.010 s.*rate_gflops"
    ):
        device.check_overrun()
    device.check_overrun()  # once


def test_a_late_wake_up_is_taken_off_the_next_sleeps(monkeypatch):
    """Each sleep wakes 4 ms late (a busy machine): the step's sleeps still add up to its charge, but for
    the last wake-up's delay, instead of the charge plus every delay."""
    clock = [0.0]
    fake = types.SimpleNamespace(
        perf_counter=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s + 0.004)
    )
    monkeypatch.setattr(devices, "time", fake)
    device = VirtualDevice(SpeedProfile("static", speeds=(0.5,)), tp_rank=0, tp_size=1, rate_gflops=1.0)
    asked = [device.charge(flops=int(0.005e9), real_s=0.0) for _ in range(3)]  # 0.01 s owed each
    assert asked == pytest.approx([0.01, 0.006, 0.006])
    assert clock[0] == pytest.approx(0.03 + 0.004)
    device.set_step(1)  # a new step owes nothing from the last one
    assert device.charge(flops=int(0.005e9), real_s=0.0) == pytest.approx(0.01)


def _tiny_gpt():
    from megahet.config import MegahetConfig
    from megahet.models.common import resizable_layer_spec
    from megahet.models.gpt import build_gpt

    cfg = MegahetConfig()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads = 2, 32, 4
    cfg.model.seq_length = 8
    return build_gpt(cfg, 128, resizable_layer_spec())


def test_device_charges_the_executed_work_at_the_rank_speed(world1):
    """Charge = FLOPs actually executed (forward + 2x backward) / (rate x speed): 4x at speed 1/4, and
    resizing (fewer executed units) shrinks it by exactly the dropped work. The rank's measured own
    compute includes the delay: the device only slows the rank down."""
    model = _tiny_gpt()
    tokens = torch.randint(0, 128, (2, 8))
    positions = torch.arange(8).expand(2, 8)

    def charge(speed: float, plan: ResizePlan | None = None) -> tuple[float, float]:
        clock = CommClock()
        device = VirtualDevice(SpeedProfile("static", speeds=(speed,)), tp_rank=0, tp_size=1, rate_gflops=50)
        attach_virtual_device(model, device, clock)
        executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1)
        executor.apply(plan or ResizePlan())
        hook = DeviceStepHook(device)
        hook.before_forward_backward(0)
        clock.open_region()
        model(tokens, positions, None, labels=tokens).sum().backward()
        clock.close_region()  # pays what is owed
        executor.apply(ResizePlan())
        compute, wait, *_ = clock.read()
        metrics = hook.metrics()
        assert wait == 0 and compute >= metrics["device_charge_s"] == device.charge_s
        assert metrics["device_host_s"] > 0 and metrics["device_overrun_s"] == device.overrun_s
        return device.charge_s, compute

    full, _ = charge(1.0)
    assert charge(0.25)[0] == pytest.approx(4 * full, rel=1e-9)
    ffn = 4 * 32
    half_mlp = {("mlp", n): {(0, 0): tuple(range(ffn // 2))} for n in (1, 2)}
    resized = charge(1.0, ResizePlan(half_mlp))[0]
    # MLP GEMMs: 2 matmuls of 2 * tokens * h * ffn each per layer; half of them are dropped.
    tokens_n, layers = 16, 2
    mlp_flops = layers * 2 * (2 * tokens_n * 32 * ffn)
    dropped_charge = 3 * (mlp_flops / 2) / 50e9  # forward + 2x backward
    assert full - resized == pytest.approx(dropped_charge, rel=1e-9)


def test_device_pays_before_the_collective_not_after(world1):
    """The delay sits inside the rank's compute, before the next collective: its peers would wait in
    that collective. The wait itself is not compute."""
    model = _tiny_gpt()
    clock = CommClock()
    device = VirtualDevice(SpeedProfile("static", speeds=(0.1,)), tp_rank=0, tp_size=1, rate_gflops=5)
    attach_virtual_device(model, device, clock)
    paid_at = []
    clock.before_collective.append(lambda: paid_at.append(device.charge_s))
    with clock.installed():  # the collectives are timed (and paid before) within the block
        try:
            clock.open_region()
            t0 = time.perf_counter()
            model(torch.randint(0, 128, (2, 8)), torch.arange(8).expand(2, 8), None)
            charged = device.charge_s
            dist.all_reduce(torch.ones(1))  # the device pays here, before the collective runs
            assert paid_at[0] > charged == 0.0  # nothing was paid until a collective came
            assert time.perf_counter() - t0 >= paid_at[0]
            clock.close_region()
        finally:
            clock.before_collective.clear()
            clock.sync_host = False
    compute, wait, *_ = clock.read()
    assert compute >= paid_at[0] and wait < compute


def test_attach_needs_resizable_layers():
    with pytest.raises(ValueError, match="resizable layers"):
        attach_virtual_device(
            torch.nn.Linear(2, 2), VirtualDevice(SpeedProfile("static", speeds=(1.0,)), 0, 1, 1), CommClock()
        )


def test_device_config_errors_before_ranks_start():
    from megahet.config import ConfigError, load_config
    from megahet.config_checks import validate

    cfg = load_config(["--device.profile", "static:1,1,1", "--parallel.tp", "2"])
    with pytest.raises(ConfigError, match="device.profile: .*2 ranks"):
        validate(cfg, 2)
    with pytest.raises(ConfigError, match="device.rate_gflops must be positive"):
        validate(load_config(["--device.rate_gflops", "0"]), 1)
    assert validate(load_config(["--device.profile", "rotating:4,20", "--parallel.tp", "2"]), 2) == 1


def test_a_time_sliced_device_is_late_to_every_collective_in_regions_and_phases(world1):
    """device.collective_delay_ms: the device sleeps its delay before each collective it joins, inside a
    compute region and in a phase (the optimizer step's gradient reduction) alike; the delay is the rank's
    own time, not its wait; nothing outside the clock's regions and phases is delayed; detach stops it."""
    model = _tiny_gpt()
    clock = CommClock()
    device = VirtualDevice(
        SpeedProfile("static", speeds=(1.0,)), 0, 1, rate_gflops=1e6, collective_delay_s=0.01
    )
    attach_virtual_device(model, device, clock)
    with clock.installed():
        dist.all_reduce(torch.ones(1))  # outside any region or phase: not timed, not delayed
        assert device.delayed_s == 0.0
        clock.open_region()
        for _ in range(3):
            dist.all_reduce(torch.ones(1))
        clock.close_region()
        with clock.phase("optimizer"):
            dist.all_reduce(torch.ones(1))
    assert device.delayed_s >= 4 * 0.01  # a sleep lasts at least its delay
    compute, wait, *_ = clock.read()
    assert compute >= 3 * 0.01 > wait  # the region's three delays are compute, not wait
    assert DeviceStepHook(device).metrics()["device_delay_s"] == device.delayed_s
    device.detach()
    assert device.delay not in clock.on_collective
    with pytest.raises(ValueError, match="collective_delay_s"):
        VirtualDevice(SpeedProfile("static", speeds=(1.0,)), 0, 1, 1.0, collective_delay_s=-1.0)


@pytest.mark.parametrize(
    "delays, profile, needle",
    [
        ("0,2", None, "set device.profile too"),
        ("0,2,1", "static:1,1", "2 delays in ms"),
        ("0,-2", "static:1,1", "each >= 0"),
        ("zero,two", "static:1,1", "e.g. 0,2"),
    ],
)
def test_a_bad_collective_delay_gets_a_one_line_error(delays, profile, needle):
    from megahet.config import ConfigError, load_config
    from megahet.config_checks import validate

    argv = ["--parallel.tp", "2", "--device.collective_delay_ms", delays]
    cfg = load_config([*argv, *(["--device.profile", profile] if profile else [])])
    with pytest.raises(ConfigError, match="device.collective_delay_ms") as err:
        validate(cfg, 4)
    assert needle in str(err.value) and "\n" not in str(err.value)
