"""Virtual heterogeneous devices: per-rank speed profiles; a device only slows its rank down.

Role: runtime (emulation: a virtual device slows its rank; the balancer never reads it).

Real mixed clusters are not available here, so each rank can run on a *virtual device* whose speed
s(t) comes from a profile. A virtual device computes the FLOPs its rank executes at `rate x s`:

    charge = work / (rate x s)      work: the FLOPs of the units it computed, migrated-in units included
                                    (from the resizable layers' counters; backward = 2 x forward)

and just before every collective of a compute region (megahet/runtime/timing.py) the device sleeps what the
step's charge so far owes beyond the real compute it took and the time already slept (a sleep that wakes
late is taken off the next ones). The rank's real compute (its fixed work too: norms, residual adds,
launches) runs inside that charge. The charge is the work's alone, proportional to it and blind to the
host: a rank at speed s takes 1 / s times a speed-1 rank's time for the same work at any split and on a
busy host, as long as each rank's real compute fits in its charge (the host is faster than the rate).
Where it does not (`overrun_s` > 0: a rate too high for the host, more ranks than cores, heavy other
load) the rank runs at the host's speed instead, the ratios shrink, and the device warns once to lower
`--device.rate_gflops`. (A charge of max(work / rate, real) / s, before issue 47, switched to real / s
wherever a rank that gave units away, or a busy host, or the cold caches after its own sleeps made its
real fixed work exceed its units' work / rate: that switch read as a slower device and moved still more.)
So the delay sits inside the rank's compute, before the collective that ends the block, and its TP
peers wait in that collective exactly as they do behind a really slow GPU. Resizing and migration
change the delay because they change the work. Nothing reads the profile or the charge to balance:
the balancer measures every rank's own compute (megahet/runtime/timing.py), so emulated and real slowness go
through one measurement path.

A time-sliced device (another tenant on its core or GPU) is also late to every collective, whatever its
work: measured at 1.5-2.4 ms per collective on this host (benchmarks/collective_delay.py). With
`--device.collective_delay_ms` the device sleeps that long before each collective its rank joins, in the
compute regions and in the optimizer step's gradient reduction alike, so a TP group (~80 collectives a
step) pays it far more often than a DP replica (one reduction): what the escalation ladder weighs
(megahet/policy/escalation.py).

Profiles (`--device.profile`, parsed by megahet/policy/speed_profile.py, inline or a YAML/JSON file with
the same fields), per TP rank (the same
in every DP replica and pipeline stage), or, for static and schedule profiles listing one speed per
global rank, over the whole mesh (a slow replica, a slow node):

    static:1,1,1,0.25               TP rank 3 runs at a quarter speed
    static:1,1,0.5,0.5              at TP 2 x DP 2: DP replica 1 (global ranks 2, 3) runs at half speed
    schedule:0=1,1,1,1;50=1,0.25,1,1  speeds from step 0, then from step 50
    rotating:4,20                   a 4x straggler that moves to the next TP rank every 20 steps
    contention:4,20,7               every 20 steps each rank is 4x slow with probability 1/2 (seed 7)

    device = VirtualDevice(parse_profile("static:1,0.25"), tp_rank=1, tp_size=2, rate_gflops=20)
    VirtualDevice(profile, 1, 2, 20, collective_delay_s=0.002)   # also 2 ms late to every collective
    attach_virtual_device(model, device, trainer.clock)   # pays before each collective it times
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch

from megahet.platform import cuda_available, synchronize
from megahet.policy.speed_profile import SpeedProfile
from megahet.runtime.hooks import StepHook
from megahet.runtime.timing import CommClock
from megahet.tensor_parallel.blocks import find_blocks

OVERRUN_WARN = 0.1
"""A step whose real compute exceeds its charge by more than this fraction of it warns: the rate is too high."""


class VirtualDevice:
    """Slows this rank down to `speed x rate`: before every collective of a compute region it sleeps what
    the work done since the last collective owes, work / (rate x speed), beyond the compute it took."""

    def __init__(
        self,
        profile: SpeedProfile,
        tp_rank: int,
        tp_size: int,
        rate_gflops: float,
        collective_delay_s: float = 0.0,
    ):
        if rate_gflops <= 0:
            raise ValueError(f"rate_gflops must be positive, got {rate_gflops}")
        if collective_delay_s < 0:
            raise ValueError(f"collective_delay_s must be >= 0, got {collective_delay_s}")
        self.collective_delay_s = collective_delay_s
        """Slept before every collective this rank joins (a time-sliced rank: late to each, whatever its work)."""
        self.delayed_s = 0.0  # this step's
        profile.check(tp_size)
        self.profile, self.tp_rank, self.tp_size = profile, tp_rank, tp_size
        self.rate = rate_gflops * 1e9
        self.step = 0
        # This step so far: its emulated compute (charge_s), the charged work's real compute (host_s), the
        # real compute beyond the charge (overrun_s), and the time slept.
        self.charge_s = self.host_s = self.overrun_s = self._slept_s = 0.0
        self.work: Callable[[], int] = lambda: 0
        """FLOPs executed so far (forward + backward), cumulative."""
        self.clock: CommClock | None = None
        self._last = (0.0, 0, 0.0)  # (perf_counter, work, clock.blocked_host_s) at the last payment
        self.warned = False

    def attach(self, work: Callable[[], int], clock: CommClock) -> None:
        """Count `work` (cumulative FLOPs) and pay before each collective of `clock`'s regions."""
        self.work, self.clock = work, clock
        self._last = (0.0, work(), clock.blocked_host_s)
        clock.before_collective.append(self.pay)
        if self.collective_delay_s > 0:
            clock.on_collective.append(self.delay)
        clock.sync_host = cuda_available()

    def detach(self) -> None:
        """Stop paying in the clock's regions (its model was rebuilt: a re-split attaches a new device)."""
        if self.clock is not None and self.pay in self.clock.before_collective:
            self.clock.before_collective.remove(self.pay)
        if self.clock is not None and self.delay in self.clock.on_collective:
            self.clock.on_collective.remove(self.delay)

    def set_step(self, step: int) -> None:
        self.step = step
        self.charge_s = self.host_s = self.overrun_s = self._slept_s = self.delayed_s = 0.0

    def delay(self) -> None:
        """Before a collective: arrive `collective_delay_s` late (another tenant had the core or the GPU)."""
        t0 = time.perf_counter()
        time.sleep(self.collective_delay_s)
        self.delayed_s += time.perf_counter() - t0

    @property
    def speed(self) -> float:
        return self.profile.speed(self.tp_rank, self.step, self.tp_size)

    def charge(self, flops: int, real_s: float) -> float:
        """Account `flops` whose real compute took `real_s`; sleep what the step owes so far, its work /
        (rate x speed) less the real compute and the time already slept; return it.

        A sleep that wakes late (a busy machine) is taken off the next ones, so a step's many short sleeps
        add up to its charge, not to the charge plus every wake-up's delay."""
        if not flops:
            return 0.0  # compute outside the blocks (embedding, loss) is not charged
        self.charge_s += flops / (self.rate * self.speed)
        self.host_s += real_s
        self.overrun_s = max(self.host_s - self.charge_s, 0.0)
        rest = self.charge_s - self.host_s - self._slept_s
        if rest <= 0:
            return 0.0
        t0 = time.perf_counter()
        time.sleep(rest)
        self._slept_s += time.perf_counter() - t0
        return rest

    def pay(self) -> None:
        """Before a collective (or the end of a compute region): charge the work since the last payment
        against this rank's own compute since then (waits in collectives excluded)."""
        synchronize()  # on a GPU, the kernels must have run for the host clock to see them
        t_last, work_last, blocked_last = self._last
        clock, work = self.clock, self.work()
        real = time.perf_counter() - max(t_last, clock.region_host_start)
        real -= clock.blocked_host_s - blocked_last
        self.charge(work - work_last, max(real, 0.0))
        self._last = (time.perf_counter(), work, clock.blocked_host_s)

    def check_overrun(self) -> None:
        """Warn once when a step's real compute outran its charge: the rank then ran at the host's speed, not
        the device's, and the emulated speed ratios do not hold."""
        if self.warned or self.overrun_s <= OVERRUN_WARN * self.charge_s:
            return
        self.warned = True
        warnings.warn(
            f"virtual device (TP rank {self.tp_rank}): step {self.step}'s real compute {self.host_s:.3f} s "
            f"exceeded its charge {self.charge_s:.3f} s at {self.rate / 1e9:g} GFLOP/s x speed {self.speed:g}, "
            "so the emulated speeds do not hold (a slow host, more ranks than cores, other load): lower "
            "--device.rate_gflops",
            stacklevel=2,
        )


def attach_virtual_device(model: torch.nn.Module, device: VirtualDevice, clock: CommClock) -> None:
    """Make `device` slow this rank's compute regions down by the work its resizable blocks execute."""
    blocks = list(find_blocks(model).values())
    if not blocks:
        raise ValueError(
            "virtual devices need the resizable layers (they count executed FLOPs): enable resize"
        )
    for block in blocks:
        block.count_backward()
    device.attach(lambda: sum(b.executed_flops + b.backward_flops for b in blocks), clock)


class DeviceStepHook(StepHook):
    """Trainer step hook: advances the virtual device's step; reports its speed and charge (never read by
    the balancer)."""

    def __init__(self, device: VirtualDevice):
        self.device = device

    def before_forward_backward(self, step: int) -> None:
        self.device.set_step(step)

    def after_step(self, engine) -> None:
        self.device.check_overrun()

    def close(self, final: bool = True) -> None:
        self.device.detach()

    def metrics(self) -> dict[str, float]:
        d = self.device
        return {
            "device_speed": d.speed, "device_charge_s": d.charge_s, "device_host_s": d.host_s,
            "device_overrun_s": d.overrun_s, "device_delay_s": d.delayed_s,
        }  # fmt: skip
