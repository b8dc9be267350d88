"""The balancing planner: estimated speeds in, per-rank work targets out. Pure functions.

Role: policy (pure: speeds in, per-rank work targets out).

For one TP group of N ranks with U units each in every block and speeds s_i (any unit: only ratios
matter), the ideal split gives rank i the share N*U*s_i / sum(s) of the group's work.

The whole step. A rank also does work no TP plan moves: its optimizer step, the embedding, output layer
and loss, reading data (megahet/runtime/timing.py measures it). `fixed` gives it per rank, in units of
the time U units take at speed 1 (the fastest rank's speed), so rank i's step takes w_i / s_i + f_i
for w_i units of U. Every planner then equalizes that whole-step time, not the movable compute alone:
the ideal shares are the water level T with w_i = s_i (T - f_i) (0 for a rank whose fixed work alone
reaches T) summing to N. With no fixed work (`fixed=None`, or all 0) this is the proportional split.

- `plan_resize_only`: no data moves; a rank that would take longer than the fastest drops
  gamma_i = 1 - s_i / max(s) of its units ("every rank does at most what the fastest does").
- `plan_migrate_only`: stragglers hand units to faster ranks until everyone holds its ideal share;
  each helper takes at most its spare capacity (ideal share - U, at most max_extra), so helpers are
  never overloaded.
  A straggler of slowdown k with m equal helpers keeps 1 - (k-1)/(k+1/m) of its units.
- `plan_semi`: a straggler is a rank whose ideal share is below U; it resizes when its gap
  1 - share is under `tolerance` (mild: small gamma, small accuracy cost), else migrates — the most
  lagging first, while helpers have capacity; what capacity cannot absorb is resized. A helper
  hosts at most `max_extra` x U of guest units (their copies cost memory), and no rank both resizes
  and helps. The choice follows the current gap, with a band: a rank that migrates now keeps migrating
  until its gap falls below `tolerance - band`, so a gap that hovers at the tolerance does not flip a
  plan between lossy and lossless every step (`balance` passes its current target and hysteresis).
  and helps.

A target is a `WorkTarget`: per rank, the fraction of its units it drops (gamma) and how many units
it sends to each helper (fractions of U). `hysteresis` keeps the current target unless the new one
moves some rank's work by more than a threshold, so the plan does not flap; a healthy group
(every gap under `healthy_gap`) returns to the even split.

    target = plan_semi([1.0, 1.0, 1.0, 0.25], tolerance=0.3)
    target.gamma, target.moves   # {}, {3: {0: 0.2308, 1: 0.2308, 2: 0.2308}} (fractions of U)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

_EPS = 1e-9  # below this, a share of U is rounding residue


@dataclasses.dataclass(frozen=True)
class WorkTarget:
    """Per TP rank: dropped fraction of its units, and the fraction of its units sent to each helper."""

    gamma: dict[int, float] = dataclasses.field(default_factory=dict)
    moves: dict[int, dict[int, float]] = dataclasses.field(default_factory=dict)

    def work(self, tp_size: int) -> list[float]:
        """Each rank's resulting work in units of U (own kept units plus guests)."""
        work = [1.0 - self.gamma.get(r, 0.0) for r in range(tp_size)]
        for owner, helpers in self.moves.items():
            for helper, fraction in helpers.items():
                work[owner] -= fraction
                work[helper] += fraction
        return work

    @property
    def is_even(self) -> bool:
        return not any(self.gamma.values()) and not any(f for h in self.moves.values() for f in h.values())


def _check(speeds: Sequence[float]) -> list[float]:
    speeds = [float(s) for s in speeds]
    if not speeds or any(s <= 0 for s in speeds):
        raise ValueError(f"speeds must be positive, got {speeds}")
    return speeds


def check_fixed(fixed: Sequence[float] | None, n: int, per: str = "rank") -> list[float]:
    """The fixed work of n ranks (or replicas) as floats, 0 each when None; ValueError naming the problem."""
    if fixed is None:
        return [0.0] * n
    fixed = [float(f) for f in fixed]
    if len(fixed) != n or any(not (f >= 0 and math.isfinite(f)) for f in fixed):
        raise ValueError(f"fixed work must be {n} finite times >= 0 (one per {per}), got {fixed}")
    return fixed


def step_times(
    work: Sequence[float], speeds: Sequence[float], fixed: Sequence[float] | None = None
) -> list[float]:
    """Each rank's whole-step time: its movable work at its speed plus its fixed work."""
    fixed = check_fixed(fixed, len(speeds))
    return [w / s + f for w, s, f in zip(work, speeds, fixed)]


def ideal_shares(speeds: Sequence[float], fixed: Sequence[float] | None = None) -> list[float]:
    """Each rank's balanced work in units of U: the water level T at which the ranks' whole-step times
    w_i / s_i + f_i are all T (a rank whose fixed work alone reaches T gets none); N * s_i / sum(s)
    without fixed work."""
    speeds = _check(speeds)
    fixed = check_fixed(fixed, len(speeds))
    n = len(speeds)
    active = sorted(range(n), key=lambda r: fixed[r])
    while True:  # drop the ranks whose fixed work is above the level, largest first
        level = (n + sum(fixed[r] * speeds[r] for r in active)) / sum(speeds[r] for r in active)
        if fixed[active[-1]] <= level:
            break
        active.pop()
    return [max(level - f, 0.0) * s for s, f in zip(speeds, fixed)]


def plan_resize_only(
    speeds: Sequence[float], max_gamma: float = 0.9, fixed: Sequence[float] | None = None
) -> WorkTarget:
    """Every rank's whole step takes at most what the quickest rank's takes with all of its units: rank i
    drops gamma_i = 1 - s_i (T - f_i), T = min_j (1 / s_j + f_j)."""
    speeds = _check(speeds)
    fixed = check_fixed(fixed, len(speeds))
    quickest = min(step_times([1.0] * len(speeds), speeds, fixed))
    gamma = {}
    for r, (s, f) in enumerate(zip(speeds, fixed)):
        drop = 1 - s * (quickest - f)
        if drop > _EPS:
            gamma[r] = min(drop, max_gamma)
    return WorkTarget(gamma=gamma)


def _migrate(
    shares: list[float], owners: list[int], capacity: dict[int, float]
) -> tuple[dict, dict[int, float]]:
    """Move work from `owners` (most lagging first: the smallest ideal share) to helpers in proportion
    to their spare capacity; returns (moves, what each owner could not shed)."""
    moves, unshed = {}, {}
    for owner in sorted(owners, key=lambda r: (shares[r], r)):
        excess = 1.0 - shares[owner]
        spare = sum(c for c in capacity.values() if c > _EPS)
        sent = min(excess, spare)
        if sent > _EPS:
            moves[owner] = {h: sent * c / spare for h, c in capacity.items() if c > _EPS}
            for h in capacity:
                capacity[h] -= moves[owner].get(h, 0.0)
        unshed[owner] = excess - (sent if sent > _EPS else 0.0)
    return moves, unshed


def _helper_capacity(shares: list[float], exclude, max_extra: float) -> dict[int, float]:
    """Spare capacity of every rank whose ideal share exceeds U, capped at max_extra units of U."""
    return {
        r: min(share - 1.0, max_extra) for r, share in enumerate(shares) if share > 1.0 and r not in exclude
    }


def plan_migrate_only(
    speeds: Sequence[float], max_extra: float = 1.0, fixed: Sequence[float] | None = None
) -> WorkTarget:
    shares = ideal_shares(speeds, fixed)
    owners = [r for r, share in enumerate(shares) if share < 1.0]
    moves, _ = _migrate(shares, owners, _helper_capacity(shares, owners, max_extra))
    return WorkTarget(moves=moves)


def plan_semi(
    speeds: Sequence[float],
    tolerance: float = 0.3,
    max_gamma: float = 0.9,
    max_extra: float = 1.0,
    fixed: Sequence[float] | None = None,
    migrating: Sequence[int] = (),
    band: float = 0.0,
) -> WorkTarget:
    """Stragglers (ideal share below U) with gap 1 - share under `tolerance` resize by their gap;
    heavier ones migrate, most lagging first, while helpers have capacity; the rest resize. A rank in
    `migrating` (an owner in the current target) migrates down to a gap of `tolerance - band`."""
    shares = ideal_shares(speeds, fixed)
    gap = [1.0 - share for share in shares]
    heavy = [r for r in range(len(shares)) if gap[r] >= (tolerance - band if r in migrating else tolerance)]
    mild = [r for r in range(len(shares)) if 0 < gap[r] and r not in heavy]
    moves, unshed = _migrate(shares, heavy, _helper_capacity(shares, heavy + mild, max_extra))
    gamma = {r: min(gap[r], max_gamma) for r in mild}
    for owner, rest in unshed.items():
        if rest > _EPS:  # capacity ran out: shed the rest by resizing, relative to the owner's units
            gamma[owner] = min(rest, max_gamma)
    return WorkTarget(gamma=gamma, moves=moves)


def hysteresis(
    current: WorkTarget, proposed: WorkTarget, tp_size: int, threshold: float = 0.05
) -> WorkTarget:
    """Keep `current` unless `proposed` changes some rank's work by more than `threshold` (of U)."""
    before, after = current.work(tp_size), proposed.work(tp_size)
    return proposed if max(abs(a - b) for a, b in zip(before, after)) > threshold else current


def balance(
    speeds: Sequence[float],
    mode: str,
    current: WorkTarget | None = None,
    *,
    tolerance: float = 0.3,
    healthy_gap: float = 0.05,
    hysteresis_threshold: float = 0.05,
    fixed: Sequence[float] | None = None,
) -> WorkTarget:
    """One planning decision: even split when healthy (every rank's whole step with all its units within
    `healthy_gap` of the quickest one's), else the mode's target, with hysteresis."""
    speeds = _check(speeds)
    if mode not in ("static", "resize", "migrate", "semi"):
        raise ValueError(f"balance mode must be static, resize, migrate or semi, got {mode!r}")
    full = step_times([1.0] * len(speeds), speeds, fixed)
    if mode == "static" or max(1 - min(full) / t for t in full) < healthy_gap:
        return WorkTarget()
    proposed = {
        "resize": lambda: plan_resize_only(speeds, fixed=fixed),
        "migrate": lambda: plan_migrate_only(speeds, fixed=fixed),
        "semi": lambda: plan_semi(
            speeds,
            tolerance,
            fixed=fixed,
            migrating=tuple(current.moves) if current else (),
            band=hysteresis_threshold,
        ),
    }[mode]()
    if current is None:
        return proposed
    return hysteresis(current, proposed, len(speeds), hysteresis_threshold)
