"""Straggler detection: per-rank compute times in, smoothed speed estimates out. Pure.

Role: policy (pure: measured times in, speed estimates out).

Each step every rank reports its compute time (communication waits excluded) and the work it
executed (FLOPs of the units it computed, so a plan change does not look like a speed change); the
TP group all-gathers these few numbers and every rank feeds the same `SpeedEstimator`. A rank's speed
sample is work / time; the estimate is the median of the last `window` samples, so one outlier
(a GC pause, a noisy neighbour) does not move it; a rank is a straggler when its estimate is below
(1 - threshold) x the group's fastest.

    est = SpeedEstimator(tp_size=4, window=5)
    est.update(work=[w0, w1, w2, w3], time=[t0, t1, t2, t3])
    est.speeds(), est.stragglers(threshold=0.1)

A rank's fixed work (what no plan moves: its optimizer step, embedding, output layer and loss) is
smoothed the same way, by a `MedianWindow`.

Inside the transformer layers a rank's time is not proportional to its work units either (issue 47): the
norms, residual adds, per-layer launches and the attention of the heads it keeps do not move with the
units, and a slow device is slow at them too. Divided by fewer units, that fixed part makes a rank that
gave work away look slower per unit the more it gives (measured: 0.16 for an emulated 0.25), and the
balancer then moves still more. `AffineSpeedEstimator` models each rank's layer time as

    t_r = c_r * (phi_r + u_r)        u_r: its work in units of U (the even split's), c_r: seconds per U,
                                     phi_r: its fixed work in units of U at its own speed

and fits phi_r from the samples the balancer already has at different unit counts: each plan change
gives every rank whose work changed a pair of (work, median time) before and after, and phi_r is the
median of its recent pairs' solutions. A device slowed at everything (a co-tenant, an older generation)
keeps its phi; a virtual device is charged its units' FLOPs only (megahet/runtime/devices.py): while its
real compute fits in that charge its pairs say 0, at any speed. A rank with no pair of its own takes the
group's (its ranks run the same layers), and 0 before any pair (the proportional model). c_r is the
median over the window of t_k / (phi_r + u_k), which does not drift as work moves. The planner gets the
per-unit speeds 1 / c_r and phi_r c_r as fixed work, so its healthy check compares whole layer times; the
telemetry shows the speed at the even split, 1 / (c_r (phi_r + 1)).

    est = AffineSpeedEstimator(tp_size=2, window=3)
    est.update(units=[1.0, 1.0], time=[t0, t1])
    est.speeds()                 # relative speeds at the even split (the telemetry's)
    est.unit_speeds(), est.fixed()   # the planner's: per-unit speeds, fixed work in the fastest's U-time
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence

PHI_MAX = 8.0
"""The largest fixed work a pair may give (in units of U): a pair whose times barely moved (noise, or a
speed change at the plan change) solves to nonsense; clamped, the median of the pairs outvotes it."""
MIN_CHANGE = 0.1
"""A plan change that moved less than this (of U) on a rank gives it no pair: timing noise would dominate."""
SAME_RUN = 0.01
"""Samples whose work differs by at most this fraction are one run of the same plan."""


class MedianWindow:
    """Per rank, the median of its last `window` samples (its fixed work per step, issue 31; speeds
    through `SpeedEstimator`), so that one outlier cannot move it."""

    def __init__(self, size: int, window: int = 5):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.samples = [collections.deque(maxlen=window) for _ in range(size)]

    def update(self, values: Sequence[float]) -> None:
        """One sample per rank; a negative one (nothing measured) is skipped."""
        if len(values) != len(self.samples):
            raise ValueError(f"expected {len(self.samples)} ranks, got {len(values)} values")
        for samples, v in zip(self.samples, values):
            if v >= 0:
                samples.append(float(v))

    @property
    def ready(self) -> bool:
        return all(self.samples)

    def medians(self) -> list[float]:
        if not self.ready:
            raise ValueError("no sample yet for some rank")
        return [statistics.median(s) for s in self.samples]

    def reset(self) -> None:
        for samples in self.samples:
            samples.clear()


class SpeedEstimator(MedianWindow):
    """Per rank, the median of its last `window` speed samples, work / time."""

    def __init__(self, tp_size: int, window: int = 5):
        super().__init__(tp_size, window)

    def update(self, work: Sequence[float], time: Sequence[float]) -> None:
        if len(work) != len(self.samples) or len(time) != len(self.samples):
            raise ValueError(
                f"expected {len(self.samples)} ranks, got {len(work)} work and {len(time)} times"
            )
        super().update([w / t if t > 0 and w > 0 else -1.0 for w, t in zip(work, time)])

    def raw_speeds(self) -> list[float]:
        """Median of each rank's recent speed samples (work per second)."""
        if not self.ready:
            raise ValueError("no speed sample yet for some rank")
        return self.medians()

    def speeds(self) -> list[float]:
        """Median of each rank's recent speed samples (work per second), normalized to the fastest."""
        raw = self.raw_speeds()
        fastest = max(raw)
        return [r / fastest for r in raw]

    def stragglers(self, threshold: float) -> list[int]:
        return [r for r, s in enumerate(self.speeds()) if s < 1.0 - threshold]


class AffineTime:
    """One rank's layer time as fixed + per unit, t = c (phi + u), from its recent (u, t) samples.

    Samples come in runs of equal work (one plan each). When the work changes by at least MIN_CHANGE, the
    median times of the previous run and of the current one (refined as it grows) give a pair's
    phi = (u0 t1 - u1 t0) / (t0 - t1); `pairs` keeps the last `pairs` of them, `phi` is their median (None
    without one: the estimator then takes the group's)."""

    def __init__(self, window: int, pairs: int = 5):
        """`pairs` 0: the proportional model, phi 0 (no pair is ever kept)."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self.run: list[float] = []
        """This plan's times so far (its last `window`)."""
        self.run_units: float | None = None
        self.previous: tuple[float, float] | None = None
        """(units, median time) of the run before this one."""
        self.pairs: collections.deque[float] = collections.deque(maxlen=pairs)
        """phi of recent plan changes."""
        self.paired = False
        """Whether `pairs[-1]` is this run's pair (refined as the run grows)."""
        self.run_length = 0
        """Samples in this run (`run` keeps the last `window`)."""

    def update(self, units: float, time: float) -> None:
        """One step's work in units of U and its time; a step that measured nothing (<= 0) is skipped."""
        if not (units > 0 and time > 0):
            return
        self.samples.append((float(units), float(time)))
        if self.run_units is None or abs(units - self.run_units) > SAME_RUN * max(units, self.run_units):
            if self.run:
                self.previous = (self.run_units, statistics.median(self.run))
            self.run, self.run_units, self.paired, self.run_length = [], float(units), False, 0
        self.run_length += 1
        self.run = [*self.run[-(self.window - 1) :], float(time)] if self.window > 1 else [float(time)]
        self._pair()

    def _pair(self) -> None:
        """Solve this run's pair, refined over its first `window` samples, then final (a later speed change
        within the run must not rewrite it)."""
        if self.previous is None or self.run_length > self.window or self.pairs.maxlen == 0:
            return
        (u0, t0), u1, t1 = self.previous, self.run_units, statistics.median(self.run)
        if abs(u1 - u0) < MIN_CHANGE:
            return
        moved = (t0 - t1) * (u0 - u1)
        if moved < 0:  # the time moved against the work: the speed changed with the plan, no pair
            if self.paired:
                self.pairs.pop()
                self.paired = False
            return
        phi = PHI_MAX if moved == 0 else min(max((u0 * t1 - u1 * t0) / (t0 - t1), 0.0), PHI_MAX)
        if self.paired:
            self.pairs[-1] = phi
        else:
            self.pairs.append(phi)
            self.paired = True

    @property
    def phi(self) -> float | None:
        """Its own fixed work in units of U at its own speed: the median of its pairs (None: no pair)."""
        return statistics.median(self.pairs) if self.pairs else None

    @property
    def ready(self) -> bool:
        return bool(self.samples)

    def per_unit(self, phi: float) -> float:
        """Seconds per unit of work with fixed work `phi`: the median over the window of t / (phi + u)."""
        return statistics.median(t / (phi + u) for u, t in self.samples)

    def state_dict(self) -> dict:
        return {
            "samples": [list(s) for s in self.samples],
            "run": list(self.run),
            "run_units": self.run_units,
            "previous": list(self.previous) if self.previous else None,
            "pairs": list(self.pairs),
            "paired": self.paired,
            "run_length": self.run_length,
        }

    def load_state_dict(self, state: dict | list) -> None:
        """A saved state; or, from checkpoints written before the affine model, the list of speed samples
        work / time (read as time 1 / speed for one unit: the same speeds with phi 0)."""
        self.samples.clear()
        self.run, self.run_units, self.previous, self.paired, self.run_length = [], None, None, False, 0
        self.pairs.clear()
        if isinstance(state, list):
            self.samples.extend((1.0, 1.0 / s) for s in state if s > 0)
            return
        self.samples.extend(tuple(s) for s in state["samples"])
        self.run, self.run_units = list(state["run"]), state["run_units"]
        self.previous = tuple(state["previous"]) if state["previous"] else None
        self.pairs.extend(state["pairs"])
        self.paired, self.run_length = state["paired"], state["run_length"]


class AffineSpeedEstimator:
    """Per rank an `AffineTime`: relative speeds 1 / c_r and fixed work phi_r, from (units, time). The ranks
    of a TP group (the TP balancer), or every rank of the job (the DP balancer, units = micro-batches).
    `affine` False: the proportional model (phi 0), for work whose units change every step (packed
    documents), where no pair of plans holds the speed still."""

    def __init__(self, tp_size: int, window: int = 5, affine: bool = True):
        self.ranks = [AffineTime(window, pairs=5 if affine else 0) for _ in range(tp_size)]

    def update(self, units: Sequence[float], time: Sequence[float]) -> None:
        if len(units) != len(self.ranks) or len(time) != len(self.ranks):
            raise ValueError(
                f"expected {len(self.ranks)} ranks, got {len(units)} units and {len(time)} times"
            )
        for rank, u, t in zip(self.ranks, units, time):
            rank.update(u, t)

    @property
    def ready(self) -> bool:
        return all(r.ready for r in self.ranks)

    def samples(self) -> int:
        """The fewest samples any rank has in its window."""
        return min(len(r.samples) for r in self.ranks)

    def phis(self) -> list[float]:
        """Each rank's fixed layer work in units of U at its own speed: its pairs' median, else the group's
        (the median of every rank's pairs), else 0."""
        pairs = [phi for r in self.ranks for phi in r.pairs]
        group = statistics.median(pairs) if pairs else 0.0
        return [group if r.phi is None else r.phi for r in self.ranks]

    def fit(self) -> tuple[list[float], list[float]]:
        """Each rank's (seconds per U, phi)."""
        if not self.ready:
            raise ValueError("no speed sample yet for some rank")
        phis = self.phis()
        return [r.per_unit(phi) for r, phi in zip(self.ranks, phis)], phis

    def per_unit(self) -> list[float]:
        """Each rank's seconds per U."""
        return self.fit()[0]

    def unit_speeds(self) -> list[float]:
        """Each rank's speed at its units (U per second, 1 / c_r), normalized to the fastest: what the planner
        divides the units it moves by (with `fixed()` beside it)."""
        per_unit = self.per_unit()
        quickest = min(per_unit)
        return [quickest / c for c in per_unit]

    def speeds(self) -> list[float]:
        """Each rank's speed at its whole layer work, fixed part included, normalized to the fastest: the
        inverse of the time it would take for the even split, c_r (phi_r + 1), as the model predicts it (what
        the telemetry shows: a device four times slower at everything reads 0.25, whatever its fixed part)."""
        even = [c * (phi + 1.0) for c, phi in zip(*self.fit())]
        quickest = min(even)
        return [quickest / t for t in even]

    def fixed(self) -> list[float]:
        """Each rank's fixed layer work in units of the time the fastest rank takes for U units (the
        planner's `fixed`): phi_r c_r / min c."""
        per_unit, phis = self.fit()
        quickest = min(per_unit)
        return [phi * c / quickest for phi, c in zip(phis, per_unit)]

    def stragglers(self, threshold: float) -> list[int]:
        return [r for r, s in enumerate(self.speeds()) if s < 1.0 - threshold]

    def state_dict(self) -> list[dict]:
        return [r.state_dict() for r in self.ranks]

    def load_state_dict(self, state: Sequence) -> None:
        if len(state) != len(self.ranks):
            raise ValueError(f"saved speeds are for {len(state)} TP ranks, this group has {len(self.ranks)}")
        for rank, saved in zip(self.ranks, state):
            rank.load_state_dict(saved)


def units_of_work(work: Sequence[float], planned: Sequence[float]) -> list[float]:
    """Each rank's executed work in units of U: its FLOPs over U's, U = sum(work) / sum(planned units)
    (the plan's work per rank in units of U; migration conserves it, so U is exact then; resizing rounds
    dropped units down, which moves U by at most a unit's share)."""
    total, planned_total = sum(work), sum(planned)
    if not (total > 0 and planned_total > 0 and math.isfinite(total)):
        return [-1.0] * len(work)
    unit = total / planned_total
    return [w / unit for w in work]
