"""Virtual heterogeneous devices: per-rank speed profiles; a device only slows its rank down.

Role: runtime (emulation: a virtual device slows its rank; the balancer never reads it).

Real mixed clusters are not available here, so each rank can run on a *virtual device* whose speed
s(t) comes from a profile. The work the rank actually executes (the FLOPs of the units it computed,
migrated-in units included, from the resizable layers' counters; backward = 2 x forward) is charged
`work / (rate x s(t))`, and just before every collective of a compute region (megahet/runtime/timing.py) the
device sleeps the part of the charge since the previous collective that its real compute did not use.
So the delay sits inside the rank's compute, before the collective that ends the block, and its TP
peers wait in that collective exactly as they do behind a really slow GPU. Resizing and migration
change the delay because they change the work. Nothing reads the profile or the charge to balance:
the balancer measures every rank's own compute (megahet/runtime/timing.py), so emulated and real slowness go
through one measurement path.

Profiles (`--device.profile`, inline or a YAML/JSON file with the same fields), per TP rank (the same
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

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import yaml

from megahet.platform import cuda_available, synchronize
from megahet.runtime.hooks import StepHook
from megahet.runtime.timing import CommClock
from megahet.tensor_parallel.blocks import find_blocks


@dataclasses.dataclass(frozen=True)
class SpeedProfile:
    """Speed of each TP rank at each step (1 = nominal)."""

    kind: str
    speeds: tuple[float, ...] = ()
    schedule: tuple[tuple[int, tuple[float, ...]], ...] = ()
    slowdown: float = 1.0
    period: int = 1
    seed: int = 0

    def speed(self, tp_rank: int, step: int, tp_size: int) -> float:
        if self.kind == "static":
            return self.speeds[tp_rank]
        if self.kind == "schedule":
            current = self.schedule[0][1]
            for start, speeds in self.schedule:
                if step >= start:
                    current = speeds
            return current[tp_rank]
        episode = step // self.period
        if self.kind == "rotating":
            return 1.0 / self.slowdown if episode % tp_size == tp_rank else 1.0
        rng = np.random.default_rng((self.seed, episode, tp_rank))  # contention
        return 1.0 / self.slowdown if rng.random() < 0.5 else 1.0

    @property
    def width(self) -> int | None:
        """How many ranks a static or schedule profile lists (None: rotating and contention, per TP rank)."""
        if self.kind == "static":
            return len(self.speeds)
        return len(self.schedule[0][1]) if self.kind == "schedule" else None

    def check(self, tp_size: int, world_size: int | None = None) -> None:
        """A static or schedule profile lists one speed per TP rank or one per global rank, at every step."""
        if self.kind not in ("static", "schedule"):
            return
        widths = {len(self.speeds)} if self.kind == "static" else {len(s) for _, s in self.schedule}
        allowed = {tp_size, world_size or tp_size}
        if len(widths) > 1 or not widths <= allowed:
            raise ValueError(
                f"device profile lists {sorted(widths)} speeds, but the TP group has {tp_size} ranks"
                + (f" and the world {world_size}" if world_size else "")
                + ": list one speed per TP rank (every replica and stage alike) or one per global rank"
            )

    def index(self, tp_rank: int, tp_size: int, rank: int, world_size: int) -> tuple[int, int]:
        """(which entry, of how many) this rank runs at: its global rank when the profile lists the whole
        world (a slow replica, a slow node), else its TP rank."""
        if self.width == world_size != tp_size:
            return rank, world_size
        return tp_rank, tp_size


def _floats(text: str) -> tuple[float, ...]:
    values = tuple(float(x) for x in text.split(","))
    if any(v <= 0 for v in values):
        raise ValueError("speeds must be positive")
    return values


def parse_profile(spec: str) -> SpeedProfile:
    """An inline profile ('kind:args') or a YAML/JSON file {kind, speeds | schedule | slowdown, period, seed}."""
    path = Path(spec).expanduser()
    try:
        if path.suffix in (".yaml", ".yml", ".json") and path.is_file():
            data = (json.loads if path.suffix == ".json" else yaml.safe_load)(path.read_text())
            schedule = tuple(
                (int(k), tuple(float(x) for x in v)) for k, v in sorted((data.get("schedule") or {}).items())
            )
            return SpeedProfile(
                kind=data["kind"],
                speeds=tuple(float(x) for x in data.get("speeds", ())),
                schedule=schedule,
                slowdown=float(data.get("slowdown", 1.0)),
                period=int(data.get("period", 1)),
                seed=int(data.get("seed", 0)),
            )
        kind, _, args = spec.partition(":")
        if kind == "static":
            return SpeedProfile("static", speeds=_floats(args))
        if kind == "schedule":
            parts = [p.partition("=") for p in args.split(";")]
            return SpeedProfile("schedule", schedule=tuple(sorted((int(s), _floats(v)) for s, _, v in parts)))
        if kind in ("rotating", "contention"):
            fields = args.split(",")
            slowdown, period = float(fields[0]), int(fields[1])
            seed = int(fields[2]) if len(fields) > 2 else 0
            if slowdown < 1 or period < 1:
                raise ValueError("slowdown must be >= 1 and period >= 1")
            return SpeedProfile(kind, slowdown=slowdown, period=period, seed=seed)
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise ValueError(f"bad device profile {spec!r}: {err}") from None
    raise ValueError(
        f"bad device profile {spec!r}: use static:S0,S1,..., schedule:STEP=S0,...;STEP=..., "
        f"rotating:SLOWDOWN,PERIOD, contention:SLOWDOWN,PERIOD[,SEED], or a YAML/JSON file"
    )


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
        self.charge_s = 0.0  # emulated compute of the current step: work / (rate x speed)
        self.overrun_s = 0.0  # real compute beyond the charge this step: > 0 means rate is too high
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
        self.step, self.charge_s, self.overrun_s = step, 0.0, 0.0

    @property
    def speed(self) -> float:
        return self.profile.speed(self.tp_rank, self.step, self.tp_size)

    def charge(self, flops: int, real_s: float) -> float:
        """Account `flops` that really took `real_s`; sleep the rest of their charge; return it."""
        charge = flops / (self.rate * self.speed)
        self.charge_s += charge
        rest = charge - real_s
        if rest > 0:
            time.sleep(rest)
        elif flops:
            self.overrun_s -= rest
        return max(rest, 0.0)

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
