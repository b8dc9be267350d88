"""Which units to drop: random (seeded) and priority selection, with a fairness guard. Pure functions.

Role: policy (which units to drop); its GradientStats are the one piece of policy state kept as tensors, on the gradients' device.

Priority: "drop the units that matter least, more often". After every step each computed unit's
gradient (a fixed sample of its elements) is folded into running statistics (`update_gradient_stats`:
EMAs of the gradient, of its squared norm and of the squared first-order removal cost (g . w)^2);
units not computed keep theirs. `priority_scores` turns them into one score per unit
(`resize.priority_score`: variance, snr, signal or taylor). Selection (`select_priority`) ages a
dropped unit's stale score by how long it has been dropped, then either drops the lowest scores
(temperature 0) or samples the dropped units with probability proportional to score^(-1/t), so every
unit still trains now and then and the low scores are dropped most often. (The authors' prototype
scored the L1 norm of the weight change instead; under Adam that is about lr per element for every
unit, so it carries little signal.) The fairness guard keeps any unit that has been dropped for
`max_drop_steps` consecutive steps, so no unit is dropped forever.

    drop = select_priority(scores, drop_age, n_drop=4, max_drop_steps=50, temperature=1.0, seed=(1234, step))
    drop = select_random(num_units=64, n_drop=16, seed=(1234, step, 3))
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Literal

import numpy as np
import torch


def select_random(num_units: int, n_drop: int, seed) -> tuple[int, ...]:
    """n_drop distinct units drawn uniformly; the same seed gives the same units."""
    _check(num_units, n_drop)
    rng = np.random.default_rng(seed)
    return tuple(sorted(int(u) for u in rng.choice(num_units, size=n_drop, replace=False)))


def select_priority(
    scores: np.ndarray,
    drop_age: np.ndarray,
    n_drop: int,
    max_drop_steps: int,
    age_scale: float = 0.0,
    temperature: float = 0.0,
    seed=None,
) -> tuple[int, ...]:
    """n_drop units, the low scores first, never one already dropped for max_drop_steps steps in a row.

    Aging (age_scale > 0): a dropped unit's score counts (1 + drop_age / age_scale) times, so a unit
    that has missed one selection period (age_scale = the reselect interval) counts double. A dropped
    unit's statistics stop moving while the rest of the model trains; without aging the same
    low-variance units would be dropped again at every selection until the guard, a frozen slice of
    the model.

    temperature 0: the n_drop lowest (aged) scores; ties break by unit index. temperature t > 0: n_drop
    units sampled without replacement, each with probability proportional to score^(-1/t)
    (Gumbel-top-k, drawn from `seed`, so every rank that plans draws the same units): a unit with
    half the score of another is 2^(1/t) times as likely to be dropped, and t -> inf is uniform
    random selection. Unmeasured (+inf) units count as the highest measured score (every unit alike
    before the first measurement). If the guard leaves fewer than n_drop candidates, fewer are dropped.
    """
    scores, drop_age = np.asarray(scores, dtype=np.float64), np.asarray(drop_age)
    _check(len(scores), n_drop)
    if temperature < 0:
        raise ValueError(f"priority temperature must be >= 0, got {temperature}")
    if age_scale > 0:
        scores = scores * (1.0 + drop_age / age_scale)
    eligible = np.flatnonzero(drop_age < max_drop_steps)
    keys = scores
    if temperature > 0:
        keys = np.log(_measured(scores)) / temperature - np.random.default_rng(seed).gumbel(size=len(scores))
    order = eligible[np.lexsort((eligible, keys[eligible]))]
    return tuple(sorted(int(u) for u in order[:n_drop]))


def _measured(scores: np.ndarray) -> np.ndarray:
    """Scores with +inf (unmeasured) as the highest finite positive score and 0 as the lowest one
    (all ones when none is measured), so that their logarithms are finite."""
    positive = scores[np.isfinite(scores) & (scores > 0)]
    low, high = (positive.min(), positive.max()) if len(positive) else (1.0, 1.0)
    return np.where(np.isinf(scores), high, np.where(scores > 0, scores, low))


@dataclasses.dataclass
class GradientStats:
    """Running statistics of one block's unit gradients, on the gradients' device: EMA of the gradient
    and of its squared norm, float32, over the elements the executor samples (`resize.score_samples`)."""

    mean: torch.Tensor  # (units, sampled elements per unit)
    sq: torch.Tensor  # (units,)
    count: torch.Tensor  # (units,) int64, measurements so far
    taylor: torch.Tensor  # (units,) EMA of (g . w)^2, the first-order loss change of removing the unit

    @classmethod
    def empty(cls, num_units: int, elements: int, device=None) -> GradientStats:
        zeros = functools.partial(torch.zeros, device=device)
        return cls(
            zeros(num_units, elements), zeros(num_units), zeros(num_units, dtype=torch.long), zeros(num_units)
        )

    @classmethod
    def from_saved(cls, saved: dict, device=None) -> GradientStats:
        """From a checkpoint's `dataclasses.asdict(stats)` (tensors, or numpy arrays of older ones;
        checkpoints from before the taylor term restart it at zero)."""
        mean, sq, count = (torch.as_tensor(saved[k], device=device) for k in ("mean", "sq", "count"))
        taylor = (
            torch.as_tensor(saved["taylor"], device=device) if "taylor" in saved else torch.zeros_like(sq)
        )
        return cls(mean.float(), sq.float(), count.long(), taylor.float())


def update_gradient_stats(stats: GradientStats, grad, computed, decay: float, weight=None) -> GradientStats:
    """Fold one step's unit gradients (units, elements) into the EMAs of the computed units, in place
    (no new buffers every step); returns `stats`. `weight` (units, elements): the units' weights at the
    same elements in that step's forward pass, for the taylor term (left as it is without).

    A unit's first measurement sets its statistics; units not computed keep theirs.
    """
    grad = torch.as_tensor(grad, device=stats.mean.device).to(stats.mean.dtype)  # (units, elements)
    computed = torch.as_tensor(computed, device=grad.device)  # (units,) bool
    new = torch.where(stats.count == 0, 1.0, 1.0 - decay)  # (units,) weight of this step's sample
    new = torch.where(computed, new, 0.0).to(grad.dtype)  # a dropped unit's gradient is not data
    stats.mean.lerp_(grad, new[:, None])  # mean + new * (grad - mean)
    stats.sq.lerp_(grad.square().sum(dim=1), new)
    if weight is not None:
        weight = torch.as_tensor(weight, device=grad.device).to(grad.dtype)  # (units, elements)
        stats.taylor.lerp_((grad * weight).sum(dim=1).square(), new)
    stats.count += computed.long()
    return stats


PriorityScore = Literal["variance", "snr", "signal", "taylor"]
PRIORITY_SCORES: tuple[str, ...] = typing.get_args(PriorityScore)


def priority_scores(stats: GradientStats, score: PriorityScore = "variance") -> np.ndarray:
    """Each unit's priority from its EMA statistics; the lowest are dropped first. A few floats per
    unit, returned on the host.

    - "variance": E||g||^2 - ||E g||^2, how much the unit's gradient varies over steps;
    - "signal": ||E g||^2, the steady part of the gradient (plain SGD's expected loss decrease per
      unit of learning rate);
    - "snr": ||E g||^2 / E||g||^2 in [0, 1], the steady share of the gradient. Adam divides every
      element's step by its RMS gradient, so a unit's expected update size follows this share, not
      the gradient's scale: a low-SNR unit's Adam updates mostly cancel out, and freezing it costs
      least;
    - "taylor": E[(g . w)^2], the squared first-order change of the loss when the unit is removed from
      the forward pass (Molchanov et al., "Importance Estimation for Neural Network Pruning", 2019).
      A dropped unit is absent from the straggler's forward pass, so this ranks units by what their
      absence costs, where the others rank by what their frozen update costs.

    +inf until a unit has two measurements (one sample has neither variance nor a mean): greedy
    selection never prefers an unmeasured unit for dropping, sampling counts it as the highest
    measured score (`select_priority`).
    """
    if score not in PRIORITY_SCORES:
        raise ValueError(f"priority score must be one of {', '.join(PRIORITY_SCORES)}, got {score!r}")
    signal = stats.mean.square().sum(dim=1)  # (units,)
    if score == "variance":
        value = (stats.sq - signal).clamp(min=0.0)
    elif score == "signal":
        value = signal
    elif score == "taylor":
        value = stats.taylor
    else:
        value = signal / stats.sq.clamp(min=torch.finfo(stats.sq.dtype).tiny)
    scores = torch.where(stats.count >= 2, value, torch.inf)
    return scores.double().cpu().numpy()


def update_drop_age(drop_age: np.ndarray, dropped: np.ndarray) -> np.ndarray:
    """Consecutive steps each unit has been dropped (reset to 0 when it is computed)."""
    return np.where(dropped, drop_age + 1, 0)


def _check(num_units: int, n_drop: int) -> None:
    if not 0 <= n_drop < num_units:
        raise ValueError(f"cannot drop {n_drop} of {num_units} units: keep at least one")
