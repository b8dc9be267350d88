"""Pipeline stage splits: transformer layers per stage from stage speeds. Pure.

Role: policy (issue 17: heterogeneous pipeline stages; the runtime that measures stage times and
re-splits the model builds on it, megahet/runtime/pp_balancer.py).

A pipeline runs at its slowest stage's pace. Stage s holds n_s consecutive transformer layers (every
n_s >= 1, sum n_s = L) and, where it sits, the embedding (first stage) or the output layer and loss
(last stage). Its time per micro-batch is modeled as

    t_s = n_s * layer_s[s] + extra_s[s]

with `layer_s` one layer's forward + backward time on that stage's devices and `extra_s` the rest of
its compute (embedding, output layer, loss). `best_split` minimizes max_s t_s in whole layers (the
smallest feasible time over the P x L candidate values, by bisection; each stage then takes at most
floor((T - extra_s) / layer_s) layers), and among the splits that reach it keeps the one closest to
`prefer` (the current split: a re-split moves no layer it need not move).

megatron-core builds uneven stages from `pipeline_model_parallel_layout` (`megatron_layout`):

    split = best_split(layer_s=[1.0, 1.0, 1.0, 2.0], extra_s=[0, 0, 0, 0], num_layers=16)   # (5, 5, 4, 2)
    megatron_layout((3, 5))     # [["embedding", "decoder" x 3], ["decoder" x 5, "loss"]]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

from megahet.policy.dp_shares import slowest_groups
from megahet.policy.flops import output_layer_flops, transformer_layer_flops


class StageSplit(tuple):
    """Layers per pipeline stage: a tuple of positive ints, e.g. StageSplit((3, 5)) (what the planners
    return and the run plan holds; a type beside the TP plan, megahet/tensor_parallel/plan.py)."""

    def __new__(cls, layers: Iterable[int]) -> StageSplit:  # noqa: PYI034 (Python 3.10: no typing.Self)
        split = super().__new__(cls, (int(n) for n in layers))
        if not split or min(split) < 1:
            raise ValueError(f"a stage split needs at least one layer per stage, got {list(split)}")
        return split

    def __str__(self) -> str:
        return format_split(self)

    def __repr__(self) -> str:
        return f"StageSplit(({format_split(self)}))"

    @property
    def uneven(self) -> bool:
        """Stages hold different numbers of layers (megatron-core then needs a layout)."""
        return len(set(self)) > 1


def parse_stage_layers(text: str, num_layers: int, pp: int) -> StageSplit:
    """'L0,L1,...' -> layers per stage, checked by `check_split`. Raises ValueError naming the fix."""
    try:
        split = tuple(int(part) for part in str(text).replace(" ", "").split(","))
    except ValueError:
        raise ValueError(f"{text!r} is not comma-separated layer counts, one per stage (e.g. 3,5)") from None
    check_split(split, num_layers, pp, shown=text)
    return StageSplit(split)


def check_split(split: Sequence[int], num_layers: int, pp: int, shown: str | None = None) -> None:
    """One count per stage, each >= 1, summing to num_layers; else ValueError naming the fix (`shown`:
    how the user wrote the split)."""
    shown = format_split(split) if shown is None else shown
    if len(split) != pp:
        raise ValueError(
            f"{shown!r} gives {len(split)} stage(s), parallel.pp is {pp}: give one count per stage"
        )
    if min(split) < 1:
        raise ValueError(f"{shown!r} leaves a stage with no layers: every stage needs at least one")
    if sum(split) != num_layers:
        raise ValueError(
            f"{shown!r} sums to {sum(split)} layers, model.num_layers is {num_layers}: the counts must sum to it"
        )


def even_split(num_layers: int, pp: int) -> StageSplit:
    """L / P layers per stage (as megatron-core splits without a layout; P must divide L)."""
    if num_layers % pp:
        raise ValueError(f"{num_layers} layers do not split evenly over {pp} stages")
    return StageSplit((num_layers // pp,) * pp)


def format_split(split: Sequence[int]) -> str:
    return ",".join(map(str, split))


def megatron_layout(split: Sequence[int]) -> list[list[str]]:
    """megatron-core's `pipeline_model_parallel_layout` for this split: the embedding on the first
    stage, the loss (output layer) on the last, the decoder layers in order."""
    layout = [["decoder"] * n for n in split]
    layout[0].insert(0, "embedding")
    layout[-1].append("loss")
    return layout


def layer_ranges(split: Sequence[int]) -> list[range]:
    """The global (0-based) layer indexes each stage holds."""
    starts = [0]
    for n in split:
        starts.append(starts[-1] + n)
    return [range(a, b) for a, b in itertools.pairwise(starts)]


def split_times(split: Sequence[int], layer_s: Sequence[float], extra_s: Sequence[float]) -> list[float]:
    """Modeled time per micro-batch of every stage."""
    return [n * a + b for n, a, b in zip(split, layer_s, extra_s, strict=True)]


def _check_times(layer_s: Sequence[float], extra_s: Sequence[float], num_layers: int) -> None:
    if len(layer_s) != len(extra_s) or not layer_s:
        raise ValueError(
            f"one layer time and one extra time per stage, got {len(layer_s)} and {len(extra_s)}"
        )
    if not all(a > 0 and math.isfinite(a) for a in layer_s):
        raise ValueError(f"layer times must be positive and finite, got {list(layer_s)}")
    if not all(b >= 0 and math.isfinite(b) for b in extra_s):
        raise ValueError(f"extra times must be >= 0 and finite, got {list(extra_s)}")
    if num_layers < len(layer_s):
        raise ValueError(f"{num_layers} layers cannot give each of {len(layer_s)} stages one")


def _caps(limit: float, layer_s: Sequence[float], extra_s: Sequence[float], num_layers: int) -> list[int]:
    """The most layers each stage can take within `limit` (a relative epsilon absorbs rounding)."""
    return [
        min(num_layers, math.floor((limit * (1 + 1e-9) - b) / a)) if limit >= b else 0
        for a, b in zip(layer_s, extra_s)
    ]


def best_time(layer_s: Sequence[float], extra_s: Sequence[float], num_layers: int) -> float:
    """The smallest max stage time any split into whole layers reaches."""
    _check_times(layer_s, extra_s, num_layers)
    candidates = sorted({n * a + b for a, b in zip(layer_s, extra_s) for n in range(1, num_layers + 1)})

    def feasible(limit: float) -> bool:
        caps = _caps(limit, layer_s, extra_s, num_layers)
        return min(caps) >= 1 and sum(caps) >= num_layers

    lo, hi = 0, len(candidates) - 1  # the largest candidate is always feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def best_split(
    layer_s: Sequence[float],
    extra_s: Sequence[float],
    num_layers: int,
    prefer: Sequence[int] | None = None,
) -> StageSplit:
    """The split minimizing the slowest stage's modeled time; among those, the one closest to `prefer`
    (default: the even split, rounded) in layers moved."""
    limit = best_time(layer_s, extra_s, num_layers)
    caps = _caps(limit, layer_s, extra_s, num_layers)
    pp = len(layer_s)
    if prefer is None:
        prefer = [num_layers // pp + (s < num_layers % pp) for s in range(pp)]
    split = [max(1, min(cap, want)) for cap, want in zip(caps, prefer)]

    def times(s: int) -> float:
        return split[s] * layer_s[s] + extra_s[s]

    while sum(split) > num_layers:  # give back from the slowest stage that can spare one
        s = max((s for s in range(pp) if split[s] > 1), key=times)
        split[s] -= 1
    while sum(split) < num_layers:  # take on the stage whose time stays smallest
        s = min((s for s in range(pp) if split[s] < caps[s]), key=lambda s: times(s) + layer_s[s])
        split[s] += 1
    return StageSplit(split)


def next_split(
    current: Sequence[int],
    layer_s: Sequence[float],
    extra_s: Sequence[float],
    hysteresis: float = 0.0,
) -> StageSplit:
    """The split to run next: the best one, unless it cuts the slowest stage's modeled time by no more
    than `hysteresis` (a fraction) against the current split, which is then kept (noise and ties move
    no layers back and forth)."""
    current = StageSplit(current)
    best = best_split(layer_s, extra_s, sum(current), prefer=current)
    now = max(split_times(current, layer_s, extra_s))
    then = max(split_times(best, layer_s, extra_s))
    return best if then < now * (1 - hysteresis) else current


def layers_moved(old: Sequence[int], new: Sequence[int]) -> int:
    """Layers that change stage between two splits of the same layers (each counted once)."""
    bounds_old = list(itertools.accumulate(old))[:-1]
    bounds_new = list(itertools.accumulate(new))[:-1]
    moved = set()
    for a, b in zip(bounds_old, bounds_new, strict=True):
        moved |= set(range(min(a, b), max(a, b)))
    return len(moved)


def resplit_gain_s(
    current: Sequence[int],
    proposal: Sequence[int],
    layer_s: Sequence[float],
    extra_s: Sequence[float],
    microbatches: int,
) -> float:
    """Seconds a step saves under `proposal`: a 1F1B step takes (M + P - 1) slowest-stage micro-batch
    times (M micro-batches, P stages)."""
    now = max(split_times(current, layer_s, extra_s))
    then = max(split_times(proposal, layer_s, extra_s))
    return (microbatches + len(current) - 1) * (now - then)


def resplit_pays(gain_s: float, steps: int, cost_s: float) -> bool:
    """Whether a re-split saving `gain_s` a step over `steps` steps (the horizon, or the steps left if
    fewer) pays its `cost_s`."""
    return gain_s > 0 and gain_s * steps > cost_s


def predicted_resplit_cost(build_s: float, transfer_s_per_layer: float, layers: int) -> float:
    """A re-split's cost: the stages' rebuild (it does not grow with what moves) plus the transfer of the
    `layers` that change stage, at the last re-split's measured seconds per layer."""
    return build_s + transfer_s_per_layer * layers


def declared_stage_times(
    stage_speeds: Sequence[float], extra_layers: Sequence[float]
) -> tuple[list[float], list[float]]:
    """(layer_s, extra_s) in units of one layer at speed 1, from each stage's relative speed and its
    extra work in layers (`extra_layers`, e.g. `model_extra_layers`)."""
    if not all(v > 0 and math.isfinite(v) for v in stage_speeds):
        raise ValueError(f"stage speeds must be positive and finite, got {list(stage_speeds)}")
    return [1.0 / v for v in stage_speeds], [e / v for e, v in zip(extra_layers, stage_speeds, strict=True)]


def model_extra_layers(
    hidden: int, ffn: int, seq_length: int, vocab: int, pp: int, head: str = "lm", **layer
) -> list[float]:
    """The first and last stages' extra work in transformer layers, by matmul FLOPs per token
    (megahet.policy.flops; `layer`: its heads, query_groups, gated, causal): a GPT-2 layer is 8 h^2
    (QKV + projection) + 4 h ffn (MLP) + 4 s h (attention scores and values); a language model's output
    layer is 2 h V (its embedding lookup is free); a classifier's head ("cls") is negligible."""
    per_layer = transformer_layer_flops(hidden, ffn, seq_length, **layer)
    extra = [0.0] * pp
    if head == "lm":
        extra[-1] += output_layer_flops(hidden, vocab) / per_layer
    return extra


def stage_speeds(
    rank_speeds: dict[tuple[int, int, int], float], pp: int, tp_balanced: bool = False
) -> list[float]:
    """Each stage's speed from its ranks' ((dp, pp, tp) -> speed): a stage's TP group runs at its
    slowest rank (its mean when a TP balancer evens it out), and the split is one for every replica, so
    a stage is as fast as its slowest replica's copy."""
    return slowest_groups(rank_speeds, axis=1, size=pp, tp_balanced=tp_balanced)


def measured_stage_times(
    per_rank: dict[tuple[int, int, int], tuple[float, float]], pp: int, healthy_gap: float = 0.0
) -> tuple[list[float], list[float]]:
    """(layer_s, extra_s) per stage from every rank's measured ((dp, pp, tp) -> (seconds per layer and
    micro-batch, other compute seconds per micro-batch)): a stage is as slow as its slowest rank (its TP
    group waits for it, and one split serves every replica). Per-layer times within `healthy_gap` of the
    slowest stage's count as equal (their mean): measurement noise moves no layer, and what is left to
    balance is the embedding and output layer where they sit."""
    layer_s, extra_s = [0.0] * pp, [0.0] * pp
    for (_dp, stage, _tp), (layer, extra) in per_rank.items():
        layer_s[stage] = max(layer_s[stage], layer)
        extra_s[stage] = max(extra_s[stage], extra)
    if min(layer_s) <= 0:
        raise ValueError(
            f"no layer time measured for stage(s) {[s for s, a in enumerate(layer_s) if a <= 0]}"
        )
    if min(layer_s) >= (1 - healthy_gap) * max(layer_s):
        layer_s = [sum(layer_s) / pp] * pp
    return layer_s, extra_s
