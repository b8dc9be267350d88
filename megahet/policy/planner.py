"""The balancing planner: estimated speeds in, per-rank work targets out. Pure functions.

Role: policy (pure: speeds in, per-rank work targets out).

For one TP group of N ranks with U units each in every block and speeds s_i (any unit: only ratios
matter), the ideal split gives rank i the share N*U*s_i / sum(s) of the group's work.

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


def ideal_shares(speeds: Sequence[float]) -> list[float]:
    """Each rank's balanced work in units of U: N * s_i / sum(s)."""
    speeds = _check(speeds)
    total = sum(speeds)
    return [len(speeds) * s / total for s in speeds]


def plan_resize_only(speeds: Sequence[float], max_gamma: float = 0.9) -> WorkTarget:
    speeds = _check(speeds)
    fastest = max(speeds)
    return WorkTarget(gamma={r: min(1 - s / fastest, max_gamma) for r, s in enumerate(speeds) if s < fastest})


def _migrate(
    speeds: list[float], owners: list[int], capacity: dict[int, float]
) -> tuple[dict, dict[int, float]]:
    """Move work from `owners` (most lagging first) to helpers in proportion to their spare capacity;
    returns (moves, what each owner could not shed)."""
    shares = ideal_shares(speeds)
    moves, unshed = {}, {}
    for owner in sorted(owners, key=lambda r: speeds[r]):
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


def plan_migrate_only(speeds: Sequence[float], max_extra: float = 1.0) -> WorkTarget:
    speeds = _check(speeds)
    shares = ideal_shares(speeds)
    owners = [r for r, share in enumerate(shares) if share < 1.0]
    moves, _ = _migrate(speeds, owners, _helper_capacity(shares, owners, max_extra))
    return WorkTarget(moves=moves)


def plan_semi(
    speeds: Sequence[float], tolerance: float = 0.3, max_gamma: float = 0.9, max_extra: float = 1.0
) -> WorkTarget:
    """Stragglers (ideal share below U) with gap 1 - share under `tolerance` resize by their gap;
    heavier ones migrate, most lagging first, while helpers have capacity; the rest resize."""
    speeds = _check(speeds)
    shares = ideal_shares(speeds)
    gap = [1.0 - share for share in shares]
    heavy = [r for r in range(len(speeds)) if gap[r] >= tolerance]
    mild = [r for r in range(len(speeds)) if 0 < gap[r] < tolerance]
    moves, unshed = _migrate(speeds, heavy, _helper_capacity(shares, heavy + mild, max_extra))
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
) -> WorkTarget:
    """One planning decision: even split when healthy, else the mode's target, with hysteresis."""
    speeds = _check(speeds)
    if mode not in ("static", "resize", "migrate", "semi"):
        raise ValueError(f"balance mode must be static, resize, migrate or semi, got {mode!r}")
    if mode == "static" or max(1 - s / max(speeds) for s in speeds) < healthy_gap:
        return WorkTarget()
    proposed = {
        "resize": lambda: plan_resize_only(speeds),
        "migrate": lambda: plan_migrate_only(speeds),
        "semi": lambda: plan_semi(speeds, tolerance),
    }[mode]()
    if current is None:
        return proposed
    return hysteresis(current, proposed, len(speeds), hysteresis_threshold)
