"""Virtual heterogeneous devices: per-rank speed profiles, and a deterministic charge per compute region.

Real mixed clusters are not available here, so each rank runs on a *virtual device* whose speed
s(t) comes from a profile. Every transformer layer's forward and backward is a compute region: it is
charged the work it actually executed (the FLOPs of the units it computed, migrated-in units
included, from the resizable layers' counters; backward = 2 x forward) divided by `rate x s(t)`, and
the device sleeps for the part of that charge the real compute did not use. Resizing and migration
change the charge because they change the work. The balancer never reads the profile: it sees the
per-step busy time a device reports, as it would see measured kernel time on real hardware.

Profiles (`--device.profile`, inline or a YAML/JSON file with the same fields), per TP rank:

    static:1,1,1,0.25               TP rank 3 runs at a quarter speed
    schedule:0=1,1,1,1;50=1,0.25,1,1  speeds from step 0, then from step 50
    rotating:4,20                   a 4x straggler that moves to the next TP rank every 20 steps
    contention:4,20,7               every 20 steps each rank is 4x slow with probability 1/2 (seed 7)

    device = VirtualDevice(parse_profile("static:1,0.25"), tp_rank=1, rate_gflops=20)
    handles = attach_virtual_device(model, device)     # hooks on every TransformerLayer
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from megatron.core.transformer.transformer_layer import TransformerLayer

from megahet.platform import synchronize
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

    def check(self, tp_size: int) -> None:
        widths = [len(self.speeds)] if self.kind == "static" else [len(s) for _, s in self.schedule]
        if self.kind in ("static", "schedule") and any(w != tp_size for w in widths):
            raise ValueError(f"device profile lists {widths} speeds, but the TP group has {tp_size} ranks")


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
    """Charges compute regions work / (rate x speed) and sleeps what real compute did not use."""

    def __init__(self, profile: SpeedProfile, tp_rank: int, tp_size: int, rate_gflops: float):
        if rate_gflops <= 0:
            raise ValueError(f"rate_gflops must be positive, got {rate_gflops}")
        profile.check(tp_size)
        self.profile, self.tp_rank, self.tp_size = profile, tp_rank, tp_size
        self.rate = rate_gflops * 1e9
        self.step = 0
        self.busy_s = 0.0  # charged compute time of the current step (what a detector measures)
        self.overrun_s = 0.0  # real compute beyond the charge this step: > 0 means rate is too high

    def set_step(self, step: int) -> None:
        self.step, self.busy_s, self.overrun_s = step, 0.0, 0.0

    @property
    def speed(self) -> float:
        return self.profile.speed(self.tp_rank, self.step, self.tp_size)

    def charge(self, flops: int, real_s: float) -> float:
        """Account one region; sleep the rest of its charge; return the seconds slept."""
        charge = flops / (self.rate * self.speed)
        self.busy_s += charge
        rest = charge - real_s
        if rest > 0:
            time.sleep(rest)
        else:
            self.overrun_s -= rest
        return max(rest, 0.0)


def attach_virtual_device(model: torch.nn.Module, device: VirtualDevice) -> list:
    """Hook every TransformerLayer of `model` (its resizable blocks count the work) into `device`."""
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(
            "virtual devices need the resizable layers (they count executed FLOPs): enable resize"
        )
    handles = []
    for layer in (m for m in model.modules() if isinstance(m, TransformerLayer)):
        mine = [b for key, b in blocks.items() if key[1] == layer.layer_number]
        pending: collections.deque[int] = collections.deque()  # forward FLOPs awaiting their backward
        state = {}

        def flops(mine=mine) -> int:
            return sum(b.executed_flops for b in mine)

        def forward_pre(module, args, state=state, flops=flops):
            synchronize()  # on a GPU, time the region's kernels, not their launch
            state["t0"], state["f0"] = time.perf_counter(), flops()

        def forward_post(module, args, output, state=state, flops=flops, pending=pending):
            work = flops() - state["f0"]
            if torch.is_grad_enabled():
                pending.append(work)
            synchronize()
            device.charge(work, time.perf_counter() - state["t0"])

        def backward_pre(module, grad_output, state=state):
            synchronize()
            state["b0"] = time.perf_counter()

        def backward_post(module, grad_input, grad_output, state=state, pending=pending):
            work = 2 * pending.popleft() if pending else 0  # input and weight gradients
            synchronize()
            device.charge(work, time.perf_counter() - state["b0"])

        handles += [
            layer.register_forward_pre_hook(forward_pre),
            layer.register_forward_hook(forward_post),
            layer.register_full_backward_pre_hook(backward_pre),
            layer.register_full_backward_hook(backward_post),
        ]
    return handles


class DeviceStepHook:
    """Trainer step hook: advances the virtual device's clock; reports its speed and busy time."""

    def __init__(self, device: VirtualDevice):
        self.device = device

    def before_forward_backward(self, step: int) -> None:
        self.device.set_step(step)

    def before_step(self, engine) -> None:
        pass

    def after_step(self, engine) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        d = self.device
        return {"device_speed": d.speed, "busy_s": d.busy_s, "device_overrun_s": d.overrun_s}
