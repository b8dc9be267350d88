"""Virtual heterogeneous devices: per-rank speed profiles; a device only slows its rank down.

Role: runtime (emulation: a virtual device slows its rank; the balancer never reads it).

Real mixed clusters are not available here, so each rank can run on a *virtual device* whose speed
s(t) comes from a profile. The work the rank actually executes (the FLOPs of the units it computed,
migrated-in units included, from the resizable layers' counters; backward = 2 x forward) is charged
`work / (rate x s(t))`, and just before every collective of a compute region (megahet/runtime/timing.py) the
device sleeps what the step's charge so far owes beyond the charged work's real compute and the time
already slept. Accounting over the step keeps a busy machine out of the emulated speed: a sleep that
wakes late is taken off the next ones, and where the host runs the charged work slower than `rate` the
charge is the real compute / speed, so the speed ratios hold whatever the host's load.
So the delay sits inside the rank's compute, before the collective that ends the block, and its TP
peers wait in that collective exactly as they do behind a really slow GPU. Resizing and migration
change the delay because they change the work. Nothing reads the profile or the charge to balance:
the balancer measures every rank's own compute (megahet/runtime/timing.py), so emulated and real slowness go
through one measurement path.

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
    attach_virtual_device(model, device, trainer.clock)   # pays before each collective it times
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from megahet.platform import cuda_available, synchronize
from megahet.policy.speed_profile import SpeedProfile
from megahet.runtime.hooks import StepHook
from megahet.runtime.timing import CommClock
from megahet.tensor_parallel.blocks import find_blocks


class VirtualDevice:
    """Slows this rank down to `speed x rate`: before every collective of a compute region it sleeps
    what the work done since the last collective owes beyond the compute it really took."""

    def __init__(self, profile: SpeedProfile, tp_rank: int, tp_size: int, rate_gflops: float):
        if rate_gflops <= 0:
            raise ValueError(f"rate_gflops must be positive, got {rate_gflops}")
        profile.check(tp_size)
        self.profile, self.tp_rank, self.tp_size = profile, tp_rank, tp_size
        self.rate = rate_gflops * 1e9
        self.step = 0
        # This step so far: its emulated compute (charge_s), the charge on a host as fast as rate
        # (nominal_s), the real compute beyond it (overrun_s > 0: rate is too high for this host), and the
        # charged work's real compute and the time really slept.
        self.charge_s = self.nominal_s = self.overrun_s = self._real_s = self._slept_s = 0.0
        self.work: Callable[[], int] = lambda: 0
        """FLOPs executed so far (forward + backward), cumulative."""
        self.clock: CommClock | None = None
        self._last = (0.0, 0, 0.0)  # (perf_counter, work, clock.blocked_host_s) at the last payment

    def attach(self, work: Callable[[], int], clock: CommClock) -> None:
        """Count `work` (cumulative FLOPs) and pay before each collective of `clock`'s regions."""
        self.work, self.clock = work, clock
        self._last = (0.0, work(), clock.blocked_host_s)
        clock.before_collective.append(self.pay)
        clock.sync_host = cuda_available()

    def detach(self) -> None:
        """Stop paying in the clock's regions (its model was rebuilt: a re-split attaches a new device)."""
        if self.clock is not None and self.pay in self.clock.before_collective:
            self.clock.before_collective.remove(self.pay)

    def set_step(self, step: int) -> None:
        self.step = step
        self.charge_s = self.nominal_s = self.overrun_s = self._real_s = self._slept_s = 0.0

    @property
    def speed(self) -> float:
        return self.profile.speed(self.tp_rank, self.step, self.tp_size)

    def charge(self, flops: int, real_s: float) -> float:
        """Account `flops` that really took `real_s`; sleep what the step owes so far; return it.

        Accounted over the step so far: it is charged `work / (rate x speed)`, or `real / speed` where the
        host ran the charged work slower than `rate` (a busy machine: the rank then stays 1/speed times
        slower than its real compute, so a slow virtual device is still slow when every rank's real
        compute is slow). Each payment sleeps the charge less the real compute and the time already slept:
        a sleep that wakes late (a busy machine) is taken off the next ones, so a step's many short sleeps
        add up to its charge, not to the charge plus every wake-up's delay."""
        if not flops:
            return 0.0  # compute outside the blocks (embedding, loss) is not charged
        self.nominal_s += flops / (self.rate * self.speed)
        self._real_s += real_s
        self.overrun_s = max(self._real_s - self.nominal_s, 0.0)
        self.charge_s = max(self.nominal_s, self._real_s / self.speed)
        rest = self.charge_s - self._real_s - self._slept_s
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

    def close(self, final: bool = True) -> None:
        self.device.detach()

    def metrics(self) -> dict[str, float]:
        d = self.device
        return {"device_speed": d.speed, "device_charge_s": d.charge_s, "device_overrun_s": d.overrun_s}
