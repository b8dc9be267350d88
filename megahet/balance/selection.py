"""Which units to drop: random (seeded) and priority selection, with a fairness guard. Pure functions.

Priority: "drop the units whose gradient updates vary least". After every step each computed
unit's gradient is folded into running statistics (EMAs of the gradient and of its squared norm,
`update_gradient_stats`), and a unit's score is the variance of its gradient over recent steps
(`variation_scores`); units not computed keep their statistics. Selection drops the lowest scores.
(The authors' prototype scored the L1 norm of the weight change instead; under Adam that is about
lr per element for every unit, so it carries little signal.) The fairness guard keeps any unit
that has been dropped for `max_drop_steps` consecutive steps, so no unit is dropped forever.

    drop = select_priority(scores, drop_age, n_drop=4, max_drop_steps=50)
    drop = select_random(num_units=64, n_drop=16, seed=(1234, step, 3))
"""

from __future__ import annotations

import dataclasses

import numpy as np


def select_random(num_units: int, n_drop: int, seed) -> tuple[int, ...]:
    """n_drop distinct units drawn uniformly; the same seed gives the same units."""
    _check(num_units, n_drop)
    rng = np.random.default_rng(seed)
    return tuple(sorted(int(u) for u in rng.choice(num_units, size=n_drop, replace=False)))


def select_priority(
    scores: np.ndarray, drop_age: np.ndarray, n_drop: int, max_drop_steps: int
) -> tuple[int, ...]:
    """The n_drop lowest-score units, never one already dropped for max_drop_steps steps in a row.

    Ties break by unit index. If the guard leaves fewer than n_drop candidates, fewer are dropped.
    """
    scores, drop_age = np.asarray(scores, dtype=np.float64), np.asarray(drop_age)
    _check(len(scores), n_drop)
    eligible = np.flatnonzero(drop_age < max_drop_steps)
    order = eligible[np.lexsort((eligible, scores[eligible]))]
    return tuple(sorted(int(u) for u in order[:n_drop]))


@dataclasses.dataclass
class GradientStats:
    """Running statistics of one block's unit gradients: EMA of the gradient and of its squared norm."""

    mean: np.ndarray  # (units, elements per unit)
    sq: np.ndarray  # (units,)
    count: np.ndarray  # (units,) measurements so far

    @classmethod
    def empty(cls, num_units: int, elements: int) -> GradientStats:
        return cls(np.zeros((num_units, elements)), np.zeros(num_units), np.zeros(num_units, int))


def update_gradient_stats(
    stats: GradientStats, grad: np.ndarray, computed: np.ndarray, decay: float
) -> GradientStats:
    """Fold one step's unit gradients (units, elements) into the EMAs of the computed units.

    A unit's first measurement sets its statistics; units not computed keep theirs.
    """
    grad = np.asarray(grad, dtype=np.float64)
    first, later = computed & (stats.count == 0), computed & (stats.count > 0)
    mean, sq = stats.mean.copy(), stats.sq.copy()
    g2 = (grad**2).sum(axis=1)
    mean[first], sq[first] = grad[first], g2[first]
    mean[later] = decay * mean[later] + (1.0 - decay) * grad[later]
    sq[later] = decay * sq[later] + (1.0 - decay) * g2[later]
    return GradientStats(mean, sq, stats.count + computed)


def variation_scores(stats: GradientStats) -> np.ndarray:
    """How much each unit's gradient varies over steps: E||g||^2 - ||E g||^2 (EMA estimates).

    +inf until a unit has two measurements (one sample has no variance), so unmeasured units are
    never preferred for dropping.
    """
    variance = np.maximum(stats.sq - (stats.mean**2).sum(axis=1), 0.0)
    return np.where(stats.count >= 2, variance, np.inf)


def update_drop_age(drop_age: np.ndarray, dropped: np.ndarray) -> np.ndarray:
    """Consecutive steps each unit has been dropped (reset to 0 when it is computed)."""
    return np.where(dropped, drop_age + 1, 0)


def _check(num_units: int, n_drop: int) -> None:
    if not 0 <= n_drop < num_units:
        raise ValueError(f"cannot drop {n_drop} of {num_units} units: keep at least one")
