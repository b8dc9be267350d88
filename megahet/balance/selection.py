"""Which units to drop: random (seeded) and priority selection, with a fairness guard. Pure functions.

Priority follows the paper's prototype: a unit's importance is how much its weights move. After
every step each kept unit's score is updated with the L1 norm of its weight change (an exponential
moving average, `update_scores`); dropped units keep their last score. Selection drops the units
with the lowest scores — those whose updates vary least. The fairness guard keeps any unit that has
been dropped for `max_drop_steps` consecutive steps, so no unit is dropped forever.

    drop = select_priority(scores, drop_age, n_drop=4, max_drop_steps=50)
    drop = select_random(num_units=64, n_drop=16, seed=(1234, step, 3))
"""

from __future__ import annotations

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


def update_scores(
    scores: np.ndarray, weight_change: np.ndarray, computed: np.ndarray, decay: float
) -> np.ndarray:
    """EMA of each computed unit's weight-change norm; units not computed keep their score.

    Scores start at +inf (never measured: never preferred for dropping); a unit's first
    measurement replaces it.
    """
    updated = np.where(np.isinf(scores), weight_change, decay * scores + (1.0 - decay) * weight_change)
    return np.where(computed, updated, scores)


def update_drop_age(drop_age: np.ndarray, dropped: np.ndarray) -> np.ndarray:
    """Consecutive steps each unit has been dropped (reset to 0 when it is computed)."""
    return np.where(dropped, drop_age + 1, 0)


def _check(num_units: int, n_drop: int) -> None:
    if not 0 <= n_drop < num_units:
        raise ValueError(f"cannot drop {n_drop} of {num_units} units: keep at least one")
