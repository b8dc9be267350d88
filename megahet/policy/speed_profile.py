"""Speed profiles of virtual devices: the speed of each rank at each step (pure; parsed from
`--device.profile`, inline or a YAML/JSON file).

Role: policy (data and its parser: configuration validation checks a profile before any rank starts,
and megahet/runtime/devices.py runs the virtual devices that follow it).

    static:1,1,1,0.25               TP rank 3 runs at a quarter speed
    static:1,1,0.5,0.5              at TP 2 x DP 2: DP replica 1 (global ranks 2, 3) runs at half speed
    schedule:0=1,1,1,1;50=1,0.25,1,1  speeds from step 0, then from step 50
    rotating:4,20                   a 4x straggler that moves to the next TP rank every 20 steps
    contention:4,20,7               every 20 steps each rank is 4x slow with probability 1/2 (seed 7)

    profile = parse_profile("schedule:0=1,1;10=1,0.25")
    profile.speed(tp_rank=1, step=12, tp_size=2)     # 0.25
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import yaml


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


def parse_collective_delays(text: str, tp_size: int, world_size: int) -> tuple[float, ...]:
    """device.collective_delay_ms 'D0,D1,...' -> seconds per TP rank (or per global rank): one per TP rank or
    one per rank of the world, each >= 0."""
    try:
        delays = tuple(float(x) / 1e3 for x in str(text).split(","))
    except ValueError:
        delays = ()
    if len(delays) not in (tp_size, world_size) or any(not math.isfinite(d) or d < 0 for d in delays):
        raise ValueError(
            f"{text!r} must list {tp_size} delays in ms (one per TP rank) or {world_size} (one per rank), "
            "each >= 0, e.g. 0,2"
        )
    return delays
