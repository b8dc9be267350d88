"""Data-parallel shares: replica speeds in, micro-batches of every global batch per replica out. Pure.

Role: policy (issue 16: heterogeneous data parallelism; the runtime that measures replica speeds and
feeds these shares to the data streams and the loss scale builds on it).

A global batch has M micro-batches. The even split gives each of the D replicas M / D of them, and the
job runs at its slowest replica's pace. A heterogeneous split gives replica r n_r micro-batches (sum
n_r = M, every n_r >= 1) so that the slowest time n_r / s_r is as small as it can be in whole
micro-batches (water-filling, as `resize_planner.balanced_counts` deals work units). Replica r takes the
contiguous micro-batches [n_0 + ... + n_(r-1), ... + n_r) of each global batch: the global batch and
the order of its samples stay those of the even run, and every sample is used once.

The whole step. A replica also does work that does not move with its micro-batches: its optimizer step
on the parameters its ranks own. `fixed` gives it per replica, in units of one micro-batch's time at
speed 1 (the fastest replica's speed), so replica r's step takes n_r / s_r + f_r, and the split
minimizes the slowest replica's whole step (without `fixed`, its micro-batches alone).

Exact gradients: megatron-core's schedule divides each micro-batch's loss by the replica's own count
n_r, and data parallelism averages over D replicas; scaling replica r's loss by D n_r / M
(`replica_loss_scale`) makes every sample weigh 1 / (M x micro-batch size), as in the even split.

    speeds = replica_speeds({(0, 0, 0): 1.0, (0, 0, 1): 1.0, (1, 0, 0): 0.5, (1, 0, 1): 0.5})  # (dp, pp, tp)
    shares = dp_shares(speeds, num_microbatches=8)          # (6, 2): replica 1 runs at half speed
    share_slices(shares)                                    # [range(0, 6), range(6, 8)]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from megahet.policy.planner import check_fixed

RankCoords = tuple[int, int, int]  # (dp rank, pp rank, tp rank)


class DataParallelShares(tuple):
    """Micro-batches of every global batch per data-parallel replica: a tuple of ints >= 0, e.g.
    DataParallelShares((6, 2)) (what the planner returns and the run plan and the Trainer hold; a type
    beside the TP plan, megahet/tensor_parallel/plan.py). A replica with 0 runs an empty, masked
    micro-batch (packed documents only)."""

    def __new__(cls, counts: Iterable[int]) -> DataParallelShares:  # noqa: PYI034 (Python 3.10: no typing.Self)
        shares = super().__new__(cls, (int(n) for n in counts))
        if not shares or min(shares) < 0:
            raise ValueError(f"data-parallel shares are counts >= 0, one per replica, got {list(shares)}")
        return shares

    def __str__(self) -> str:
        return ",".join(map(str, self))

    @property
    def even(self) -> bool:
        return len(set(self)) == 1


def slowest_groups(
    rank_speeds: Mapping[RankCoords, float], axis: int, size: int | None = None, tp_balanced: bool = True
) -> list[float]:
    """Per index along `axis` of the (dp, pp, tp) coordinates (0: replicas, 1: stages), the speed of its
    slowest TP group, where a TP group runs at its mean speed when a TP balancer evens it out
    (`tp_balanced`), else at its slowest rank. `size`: the number of indexes (default: as many as given,
    numbered 0..N-1). One copy for replicas (a pipeline runs at its slowest stage) and stages (one split
    serves every replica, so a stage runs at its slowest copy)."""
    name = ("replica", "stage")[axis]
    if not rank_speeds:
        raise ValueError("no rank speeds given")
    bad = {coords: s for coords, s in rank_speeds.items() if not (s > 0 and math.isfinite(s))}
    if bad:
        raise ValueError(f"speeds must be positive and finite, got {bad}")
    groups: dict[tuple[int, int], list[float]] = {}
    for (dp, pp, _tp), speed in rank_speeds.items():
        groups.setdefault((dp, pp), []).append(speed)
    group = (lambda s: sum(s) / len(s)) if tp_balanced else min
    slowest: dict[int, float] = {}
    for key, speeds in groups.items():
        slowest[key[axis]] = min(slowest.get(key[axis], math.inf), group(speeds))
    if size is None and sorted(slowest) != list(range(len(slowest))):
        raise ValueError(f"{name}s must be numbered 0..{'DP'[axis]}-1, got {sorted(slowest)}")
    missing = [i for i in range(size or 0) if i not in slowest]
    if missing:
        raise ValueError(f"no rank speeds for {name}(s) {missing}")
    return [slowest[i] for i in range(size or len(slowest))]


def replica_speeds(rank_speeds: Mapping[RankCoords, float], tp_balanced: bool = True) -> list[float]:
    """Each replica's speed from its ranks' speeds: a pipeline runs at its slowest stage; a stage's TP
    group at its mean speed when the TP balancer evens it out (`tp_balanced`), else at its slowest rank."""
    return slowest_groups(rank_speeds, axis=0, tp_balanced=tp_balanced)


def even_shares(num_microbatches: int, dp_size: int) -> DataParallelShares:
    """M / D micro-batches each (M must be a multiple of D, as in an even run)."""
    if num_microbatches % dp_size:
        raise ValueError(f"{num_microbatches} micro-batches do not split evenly over {dp_size} replicas")
    return DataParallelShares((num_microbatches // dp_size,) * dp_size)


def dp_shares(
    speeds: Sequence[float],
    num_microbatches: int,
    current: Sequence[int] | None = None,
    hysteresis: float = 0.0,
    healthy_gap: float = 0.05,
    fixed: Sequence[float] | None = None,
) -> DataParallelShares:
    """Micro-batches per replica for replicas of these speeds (and `fixed` work per replica, see above).

    Even when every replica's whole step at the even split is within `healthy_gap` of the quickest's
    (and M splits evenly), whatever the current shares. Otherwise the whole-micro-batch split that
    minimizes the slowest replica's time, ties to the lower replica; the `current` shares are kept
    unless the new split cuts the slowest replica's time by more than the fraction `hysteresis` (noise
    and ties move no samples).
    """
    d = len(speeds)
    if d == 0 or num_microbatches < d:
        raise ValueError(f"{num_microbatches} micro-batches cannot give each of {d} replicas one")
    if any(not (s > 0 and math.isfinite(s)) for s in speeds):
        raise ValueError(f"replica speeds must be positive and finite, got {list(speeds)}")
    if current is not None and (len(current) != d or sum(current) != num_microbatches):
        raise ValueError(f"current shares {list(current)} are not {d} counts summing to {num_microbatches}")
    fixed = check_fixed(fixed, d, "replica")
    if num_microbatches % d == 0:
        even = [num_microbatches / d / s + f for s, f in zip(speeds, fixed)]
        if all(min(even) >= (1 - healthy_gap) * t for t in even):
            return even_shares(num_microbatches, d)
    new = _water_fill(speeds, num_microbatches, fixed)
    if current is not None and step_time(new, speeds, fixed) >= (1 - hysteresis) * step_time(
        current, speeds, fixed
    ):
        return DataParallelShares(current)
    return DataParallelShares(new)


def _water_fill(speeds: Sequence[float], total: int, fixed: Sequence[float]) -> tuple[int, ...]:
    """Every next micro-batch to the replica whose whole step grows to the smallest time (optimal for the
    slowest replica's time: each replica's time only grows with its count)."""
    counts = [1] * len(speeds)
    for _ in range(total - len(speeds)):
        r = min(range(len(speeds)), key=lambda i: ((counts[i] + 1) / speeds[i] + fixed[i], i))
        counts[r] += 1
    return tuple(counts)


def share_slices(shares: Sequence[int]) -> list[range]:
    """The micro-batch indices of each global batch that each replica computes, contiguous, in order."""
    out, start = [], 0
    for n in shares:
        if n < 1:
            raise ValueError(f"every replica needs at least one micro-batch, got shares {list(shares)}")
        out.append(range(start, start + n))
        start += n
    return out


def replica_loss_scale(share: int, num_microbatches: int, dp_size: int) -> float:
    """Factor on a replica's micro-batch losses so that every sample weighs as in the even split
    (1 exactly when the share is M / D)."""
    return dp_size * share / num_microbatches


def step_time(shares: Sequence[int], speeds: Sequence[float], fixed: Sequence[float] | None = None) -> float:
    """The slowest replica's whole step in micro-batches at speed 1 (what the split minimizes): its
    micro-batches at its speed plus its fixed work."""
    fixed = check_fixed(fixed, len(speeds), "replica")
    return max(n / s + f for n, s, f in zip(shares, speeds, fixed))
