"""ZERO-resizing planner: per-rank gammas -> a ResizePlan. Pure functions.

Role: policy (pure: targets and gammas in, the ResizePlan's units out; the one bridge from WorkTarget fractions to the plan).

Resizing a rank by gamma drops floor(gamma * units) of its units in every resizable block, unless a
per-block override gives that block its own gamma. Which units: a `choose(block, rank, n_drop)`
callback (random or priority selection, see selection.py).

    gammas = parse_rank_gammas("0:0.5", dp_size=2, tp_size=4)   # TP rank 0 of every DP replica
    plan = plan_resize(block_units, gammas, choose, overrides={("mlp", 2): 0.25}, mlp_multiple=8)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from megahet.tensor_parallel.plan import BlockKey, RankKey, ResizePlan, parse_block_name

Choose = Callable[[BlockKey, RankKey, int], tuple[int, ...]]


def units_to_drop(num_units: int, gamma: float, multiple: int = 1) -> int:
    """floor(gamma * units), keeping at least one unit; with `multiple` > 1 the kept count is rounded up
    to a multiple of it (at most all units): GPU GEMMs whose width is not a multiple of 8 leave the
    tensor-core path (measured on an H200: keeping 3100 of 3584 MLP units ran 2.6x slower than all
    3584, keeping 3072 ran 0.88x; see benchmarks/resize_compute.py)."""
    if not 0.0 <= gamma < 1.0:
        raise ValueError(f"gamma must be in [0, 1), got {gamma}")
    if multiple < 1:
        raise ValueError(f"the unit multiple must be >= 1, got {multiple}")
    n_drop = min(math.floor(gamma * num_units + 1e-9), num_units - 1)
    kept = min(-(-(num_units - n_drop) // multiple) * multiple, num_units)
    return num_units - kept


def parse_rank_gammas(
    text: str | None, dp_size: int, tp_size: int, what: str = "resize"
) -> dict[RankKey, float]:
    """'TP:GAMMA' (every DP replica of that TP rank) or 'DP.TP:GAMMA', comma-separated."""
    gammas: dict[RankKey, float] = {}
    for item in filter(None, (text or "").replace(" ", "").split(",")):
        rank, sep, value = item.partition(":")
        try:
            gamma = float(value)
            if "." in rank:
                dp, tp = (int(x) for x in rank.split("."))
                ranks = [(dp, tp)]
            else:
                tp = int(rank)
                ranks = [(dp, tp) for dp in range(dp_size)]
        except ValueError:
            name = "GAMMA" if what == "resize" else "FRACTION"
            raise ValueError(
                f"bad {what} entry {item!r}: use TP_RANK:{name} or DP_RANK.TP_RANK:{name}"
            ) from None
        for dp, tp in ranks:
            if not (0 <= dp < dp_size and 0 <= tp < tp_size) or not sep:
                raise ValueError(f"{what} entry {item!r} names no rank of DP {dp_size} x TP {tp_size}")
            if not 0.0 <= gamma < 1.0:
                value_name = "gamma" if what == "resize" else "the fraction"
                raise ValueError(f"{what} entry {item!r}: {value_name} must be in [0, 1)")
            gammas[(dp, tp)] = gamma
    return gammas


def parse_block_gammas(text: str | None) -> dict[BlockKey, float]:
    """'mlp:3=0.25,attn:1=0': per-block gamma overrides for every resized rank."""
    overrides: dict[BlockKey, float] = {}
    for item in filter(None, (text or "").replace(" ", "").split(",")):
        name, sep, value = item.partition("=")
        try:
            block, gamma = parse_block_name(name), float(value)
        except ValueError:
            raise ValueError(
                f"bad block override {item!r}: use mlp:LAYER=GAMMA or attn:LAYER=GAMMA"
            ) from None
        if not sep or not 0.0 <= gamma < 1.0:
            raise ValueError(f"bad block override {item!r}: gamma must be in [0, 1)")
        overrides[block] = gamma
    return overrides


def plan_resize(
    block_units: Mapping[BlockKey, int],
    rank_gammas: Mapping[RankKey, float],
    choose: Choose,
    overrides: Mapping[BlockKey, float] | None = None,
    mlp_multiple: int = 1,
) -> ResizePlan:
    """Dropped units per block for every resized rank (gamma > 0); other ranks drop nothing. An MLP
    block keeps a multiple of `mlp_multiple` units (attention units are whole heads already)."""
    overrides = overrides or {}
    blocks = {}
    for block, num_units in sorted(block_units.items()):
        entry = {}
        for rank, gamma in sorted(rank_gammas.items()):
            if gamma <= 0.0:
                continue
            multiple = mlp_multiple if block[0] == "mlp" else 1
            n_drop = units_to_drop(num_units, overrides.get(block, gamma), multiple)
            if n_drop:
                entry[rank] = tuple(choose(block, rank, n_drop))
        blocks[block] = entry
    return ResizePlan(blocks)


def parse_migrations(
    text: str | None, dp_size: int, tp_size: int
) -> dict[RankKey, tuple[float, tuple[int, ...]]]:
    """'TP:FRACTION[@H+H...]' or 'DP.TP:FRACTION[@...]': migrate that fraction of an owner's units to
    the listed helpers of its TP group (default: all the others), comma-separated."""
    moves: dict[RankKey, tuple[float, tuple[int, ...]]] = {}
    for item in filter(None, (text or "").replace(" ", "").split(",")):
        spec, _, helper_text = item.partition("@")
        try:
            helpers = tuple(int(h) for h in helper_text.split("+")) if helper_text else None
        except ValueError:
            raise ValueError(f"bad migrate entry {item!r}: use TP:FRACTION or TP:FRACTION@H1+H2") from None
        gammas = parse_rank_gammas(spec, dp_size, tp_size, "migrate")  # errors name the rank or fraction
        for (dp, tp), fraction in gammas.items():
            chosen = helpers if helpers is not None else tuple(h for h in range(tp_size) if h != tp)
            if not chosen or tp in chosen or any(not 0 <= h < tp_size for h in chosen):
                raise ValueError(
                    f"migrate entry {item!r}: helpers must be other TP ranks of 0..{tp_size - 1}"
                )
            moves[(dp, tp)] = (fraction, chosen)
    return moves


def plan_migration(
    block_units: Mapping[BlockKey, int],
    moves: Mapping[RankKey, tuple[float, tuple[int, ...]] | Mapping[int, float]],
    mlp_multiple: int = 1,
    unit_work: Mapping[BlockKey, float] | None = None,
) -> dict[BlockKey, dict[RankKey, dict[int, tuple[int, ...]]]]:
    """An owner's highest units, in contiguous chunks per helper (in helper order).

    A move is (fraction, helpers) — floor(fraction * units) split evenly — or {helper: fraction of the
    owner's units} (a balancer's target, rounded to whole units by `balanced_counts`). Which units
    move does not matter for the result (migration is lossless); contiguous chunks keep the messages
    simple. At least one unit stays with the owner. With `mlp_multiple` m > 1 (and a multiple of m
    units per rank), every MLP chunk is a multiple of m units (`round_to_multiple`), so the owner's kept
    width and each helper's own-plus-guest width stay multiples of m (GEMM widths on the tensor-core path).

    `unit_work`: the work of one unit of each block (any common scale, e.g. `Block.unit_work()`). A
    balancer's target is then met per layer, not per block: a layer's attention moves in whole heads
    (2 per rank at TP=2 on a 4-head model: a rank keeps 1/2 or all of them, where the target may be
    0.4), and its MLP, in units a hundred times finer, absorbs the heads' rounding (`carry_rounding`).
    """
    explicit = {rank: move for rank, move in moves.items() if isinstance(move, tuple)}
    targets = {rank: move for rank, move in moves.items() if not isinstance(move, tuple)}
    migrated = {}
    carried: dict[tuple[int, int], dict[int, float]] = {}
    """(dp, layer) -> per TP rank, the work its attention's rounding gave it beyond the target (in units
    of unit_work), for the layer's MLP to take off."""
    for block, num_units in sorted(block_units.items()):  # "attn" sorts before "mlp"
        counts = {rank: _helper_counts(num_units, move) for rank, move in explicit.items()}
        for dp in sorted({dp for dp, _ in targets}):
            group = {tp: move for (d, tp), move in targets.items() if d == dp}
            if unit_work is None:
                dealt = balanced_counts(num_units, group)
            else:
                dealt = carry_rounding(
                    num_units, group, unit_work[block], carried.setdefault((dp, block[1]), {})
                )
            counts.update({(dp, tp): c for tp, c in dealt.items()})
        if block[0] == "mlp":
            counts = {rank: round_to_multiple(c, num_units, mlp_multiple) for rank, c in counts.items()}
        entry = {}
        for rank, per_helper in sorted(counts.items()):
            start, split = num_units - sum(per_helper.values()), {}
            for helper, n in sorted(per_helper.items()):
                if n:
                    split[helper] = tuple(range(start, start + n))
                start += n
            if split:
                entry[rank] = split
        migrated[block] = entry
    return migrated


def round_to_multiple(per_helper: Mapping[int, int], num_units: int, multiple: int) -> dict[int, int]:
    """Units sent to each helper rounded to the nearest multiple of `multiple` (halves up), the owner
    keeping at least `multiple` (the largest chunks shrink first); unchanged when `num_units` is not a
    multiple of it (no rounding could then keep every width a multiple)."""
    if multiple <= 1 or num_units % multiple:
        return dict(per_helper)
    out = {h: multiple * math.floor(n / multiple + 0.5) for h, n in per_helper.items()}
    while sum(out.values()) > num_units - multiple:
        largest = max(out, key=lambda h: (out[h], -h))
        out[largest] -= multiple
    return out


def _helper_counts(num_units: int, move: tuple[float, tuple[int, ...]]) -> dict[int, int]:
    fraction, helpers = move
    share, extra = divmod(units_to_drop(num_units, fraction), len(helpers))
    return {h: share + (1 if i < extra else 0) for i, h in enumerate(helpers)}


def target_work(moves: Mapping[int, Mapping[int, float]]) -> dict[int, float]:
    """Each rank's work under a TP group's fractional target, in units of its own share: 1 minus what it
    sends plus what it hosts."""
    work: dict[int, float] = {}
    for owner, helpers in moves.items():
        for helper, fraction in helpers.items():
            work[owner] = work.get(owner, 1.0) - fraction
            work[helper] = work.get(helper, 1.0) + fraction
    return work


def carry_rounding(
    num_units: int, moves: Mapping[int, Mapping[int, float]], unit_work: float, carried: dict[int, float]
) -> dict[int, dict[int, int]]:
    """`balanced_counts` for one block of a layer whose earlier blocks' rounding left each rank
    `carried[r]` work beyond its target: this block's target takes it off (a rank that kept a head too
    many keeps that much less MLP), and its own rounding is added to `carried` for the next block."""
    share = num_units * unit_work  # one rank's even work in this block
    work = {r: w - carried.get(r, 0.0) / share for r, w in target_work(moves).items()}
    # owners stay owners and helpers helpers (the block keeps the rest of the error)
    work = {r: min(w, 1.0) if r in moves else max(w, 1.0) for r, w in work.items()}
    sent = _deal(num_units, work, set(moves))
    for r, w in target_work(moves).items():
        computed = num_units - sum(sent.get(r, {}).values()) + sum(h.get(r, 0) for h in sent.values())
        carried[r] = carried.get(r, 0.0) + (computed - w * num_units) * unit_work
    return sent


def balanced_counts(num_units: int, moves: Mapping[int, Mapping[int, float]]) -> dict[int, dict[int, int]]:
    """Whole units each owner sends each helper, for one TP group's fractional target.

    The target gives every rank involved a work w_r (its own units, minus what it sends, plus what
    it hosts, in units of U = num_units); w_r is proportional to the rank's speed. Rounding each
    fraction down would leave a slow owner one unit too many, which costs it 1/w_r — far more than the
    same unit costs a fast helper. So units are dealt out by water-filling: each rank starts at
    floor(w_r * U) units (an owner keeps at least one) and every remaining unit goes to the rank
    whose time (n_r + 1) / w_r grows least, which minimizes the block's slowest time. Owners then
    hand their surplus to helpers in rank order.
    """
    return _deal(num_units, target_work(moves), set(moves))


def _deal(num_units: int, work: Mapping[int, float], owners: set[int]) -> dict[int, dict[int, int]]:
    """`balanced_counts` on each rank's target work (in units of its share) and the owners among them."""
    work = {r: max(w, 1e-9) for r, w in work.items()}
    counts = {r: math.floor(w * num_units + 1e-9) for r, w in work.items()}
    for owner in owners:
        counts[owner] = max(counts[owner], 1)
    total = num_units * len(work)
    while sum(counts.values()) > total:  # owners kept their last unit: helpers give it up
        helper = max((r for r in counts if counts[r] > num_units), key=lambda r: counts[r] / work[r])
        counts[helper] -= 1
    while sum(counts.values()) < total:
        rank = min(work, key=lambda r: ((counts[r] + 1) / work[r], r))
        counts[rank] += 1
    surplus = {r: counts[r] - num_units for r in sorted(work) if counts[r] > num_units}
    sent: dict[int, dict[int, int]] = {}
    for owner in sorted(r for r in work if counts[r] < num_units):
        deficit = num_units - counts[owner]
        for helper, spare in surplus.items():
            n = min(deficit, spare)
            if n:
                sent.setdefault(owner, {})[helper] = n
                surplus[helper] -= n
                deficit -= n
    return sent
