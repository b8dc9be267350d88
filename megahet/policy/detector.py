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
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Sequence


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
