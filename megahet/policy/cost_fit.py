"""Fit the document cost model t = a*sum(s^2) + b*sum(s) + c*micro-batches to measured times. Pure.

Role: policy (issue 28; the runtime measures, megahet/runtime/packing_runtime.py, and this fits).

A sample is one measured run of v packed micro-batches: the features (sum over its documents of s^2,
sum of s, v) and its seconds. The fit is non-negative least squares on relative error (each row
divided by its time, so that short and long micro-batches count alike), exact for three unknowns:
the unconstrained solution of every subset of the features, the best one with no negative
coefficient wins.

    samples = [CostSample.of([512, 512], 0.031), CostSample.of([1024], 0.044), ...]
    cost = fit_doc_cost(samples)                     # DocCost(a, b, c)
    mean_abs_pct_error(cost, held_out)               # 0.04 = 4 %
    cost = refit_doc_cost(profile_cost, probes, measured_steps)   # a profile refined by measured times
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from megahet.policy.packing import DocCost


@dataclasses.dataclass(frozen=True)
class CostSample:
    sum_sq: float
    """Sum of s^2 over the documents."""
    tokens: float
    """Sum of s."""
    micro_batches: float
    seconds: float

    @classmethod
    def of(cls, lengths: Sequence[int], seconds: float, micro_batches: int = 1) -> CostSample:
        s = np.asarray(lengths, dtype=np.float64)
        return cls(float((s * s).sum()), float(s.sum()), float(micro_batches), float(seconds))

    def predict(self, cost: DocCost) -> float:
        return cost.a * self.sum_sq + cost.b * self.tokens + cost.c * self.micro_batches


def fit_doc_cost(samples: Sequence[CostSample]) -> DocCost:
    """Non-negative least squares of relative error over the samples (at least three, with positive times)."""
    if len(samples) < 3:
        raise ValueError(f"fitting a, b, c needs at least 3 timed samples, got {len(samples)}")
    x = np.array([[s.sum_sq, s.tokens, s.micro_batches] for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    if not (y > 0).all() or not np.isfinite(x).all():
        raise ValueError("cost samples need positive measured times and finite features")
    xw, yw = x / y[:, None], np.ones_like(y)  # relative error: (x @ p - y) / y
    scale = np.abs(xw).max(axis=0)
    scale[scale == 0] = 1.0
    xs = xw / scale  # columns of comparable size
    best, best_residual = None, np.inf
    for k in (3, 2, 1):
        for subset in itertools.combinations(range(3), k):
            cols = list(subset)
            coef, *_ = np.linalg.lstsq(xs[:, cols], yw, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(3)
            full[cols] = coef
            residual = float(((xs @ full - yw) ** 2).sum())
            if full[0] + full[1] > 0 and residual < best_residual - 1e-15:
                best, best_residual = full, residual
    if best is None:
        raise ValueError("no non-negative cost model fits these samples: time more lengths")
    a, b, c = (best / scale).tolist()
    return DocCost(a=a, b=b, c=c)


def mean_abs_pct_error(cost: DocCost, samples: Sequence[CostSample]) -> float:
    """Mean over the samples of |predicted - measured| / measured (0.1 = 10 %)."""
    if not samples:
        raise ValueError("no samples to score")
    return float(np.mean([abs(s.predict(cost) - s.seconds) / s.seconds for s in samples]))


def probe_lengths(cap: int, shortest: int = 64) -> list[list[int]]:
    """The packs a start-up profiling pass times: every power-of-two split of `cap` tokens into equal
    documents (one of cap, two of cap/2, ...) down to `shortest`, and half-full packs of the longest two, so
    that s^2, s and the per-micro-batch term are told apart."""
    if cap < 2:
        raise ValueError(f"the token cap {cap} is too small to profile")
    packs, length = [], cap
    while length >= max(1, min(shortest, cap // 4)):
        packs.append([length] * (cap // length))
        length //= 2
    packs += [[cap // 2], [cap // 4]]
    return packs


def refit_doc_cost(base: DocCost, probes: Sequence[CostSample], measured: Sequence[CostSample]) -> DocCost:
    """A start-up profile refined by measured samples. Measured steps alone hardly tell a, b and c apart
    (every step holds a similar mix), so the profile keeps the shape: rescaled by the median measured /
    predicted ratio, and refitted with the rescaled probes and the measured samples together; the refit
    wins when it predicts the measured samples better than the rescaled profile."""
    if not measured:
        raise ValueError("refining a cost model needs measured samples")
    ratio = float(np.median([s.seconds / s.predict(base) for s in measured]))
    scaled = DocCost(base.a * ratio, base.b * ratio, base.c * ratio)
    rescaled = [CostSample(p.sum_sq, p.tokens, p.micro_batches, p.seconds * ratio) for p in probes]
    try:
        joint = fit_doc_cost([*rescaled, *measured])
    except ValueError:
        return scaled
    return joint if mean_abs_pct_error(joint, measured) < mean_abs_pct_error(scaled, measured) else scaled
