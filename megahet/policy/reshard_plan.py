"""Reshard plans as data: which slices of which tensors every rank of a new layout needs, and who holds
them in the old one. Pure (numpy index arithmetic; no torch, no processes).

Role: policy (issue 32: move state the way Tenplex does). The online pipeline re-split
(megahet/runtime/state_move.py) executes a plan rank to rank; tests apply it in one process to real
checkpoints and compare with the rank-0 reshard (megahet/checkpointing/convert.py).

A training job's state is a collection of tensors, each partitioned along the layout:
- the model weights (key "weight"): every parameter of the unsharded model, split over TP along its
  partition dim (SwiGLU's fc1 as [gates; ups]), placed on the stage that holds its layer (the word
  embedding on the first stage, its tied copy `output_layer.weight` also on the last when PP > 1),
  replicated over DP;
- the optimizer state (keys "fp32", "exp_avg", "exp_avg_sq": ZeRO-1/2's fp32 masters and Adam
  moments): the same TP-local tensors, each DP rank holding a flat fragment of them. ZeRO-1 and 2
  partition alike (`zero_fragments`). Adam's step and the learning rates are scalars every rank holds.

Every tensor is indexed in one *frame* shared by both layouts: the unsharded tensor's flat index,
except that a tensor split along dim 1 is taken in column blocks of width cols / G (G = the least common
multiple of both TP degrees), block after block, so that each TP shard is a run of whole blocks.
With the TP degree unchanged, every TP-local tensor and every ZeRO fragment is one run of the frame;
a rank's holding of a (tensor, key) is a list of runs [start, stop).

A `Transfer` moves one run of one key of one tensor from an old rank that holds it to a new rank that
needs it and does not hold it. The plan is minimal: a rank receives only elements it does not already
hold, each exactly once; the bytes moved are the bytes whose owner changes.

    params = model_params([("decoder.layers.0.mlp.linear_fc1.weight", (256, 64)), ...], gated=False)
    plan = reshard_plan(params, Layout(tp=2, pp=2, dp=2, split=(2, 2)), Layout(2, 2, 2, (3, 1)))
    plan.bytes_moved({"weight": 4, "fp32": 4, "exp_avg": 4, "exp_avg_sq": 4})
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from megahet.policy.mesh import coords_of, rank_of
from megahet.policy.stage_split import check_split, format_split

WEIGHT = "weight"
OPTIMIZER_KEYS = ("fp32", "exp_avg", "exp_avg_sq")
KEYS = (WEIGHT, *OPTIMIZER_KEYS)

WORD_EMBEDDING, TIED_COPY = "embedding.word_embeddings.weight", "output_layer.weight"
LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
FIRST_STAGE = ("embedding.", "patch_embedding.", "cls_token", "position_embeddings")
# the parameters the first stage holds besides its layers; the rest but the layers sits on the last stage
# suffix of a parameter name -> its TP partition dim (absent: replicated), as megatron-core shards it
_PARTITION = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc1.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc2.weight": 1,
}

Runs = np.ndarray  # (k, 2) int64: sorted, disjoint [start, stop) runs of a frame


def partition_dim(name: str) -> int | None:
    """TP partition dim of an unsharded (TP=1 PP=1) parameter name, or None (replicated)."""
    match = LAYER_NAME.match(name)
    return _PARTITION.get(match.group(2) if match else name)


def decays(name: str, ndim: int) -> bool:
    """Whether AdamW decays the parameter (its ZeRO group): matrices only, not position tables or [CLS]."""
    return ndim >= 2 and "position_embeddings" not in name and "cls_token" not in name


@dataclasses.dataclass(frozen=True)
class Param:
    """A parameter of the unsharded model: its name, shape, TP partition dim and gated layout."""

    name: str
    shape: tuple[int, ...]
    dim: int | None
    gated: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def layer(self) -> int | None:
        match = LAYER_NAME.match(self.name)
        return int(match.group(1)) if match else None


def model_params(shapes: Iterable[tuple[str, Sequence[int]]], gated: bool = False) -> list[Param]:
    """The unsharded model's parameters, in its order (named_parameters of the TP=1 PP=1 model).
    `gated`: SwiGLU (fc1 holds [gate; up] on every TP rank)."""
    out = []
    for name, shape in shapes:
        is_fc1 = name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"))
        out.append(Param(name, tuple(int(s) for s in shape), partition_dim(name), gated and is_fc1))
    return out


def unsharded_params(
    stages: Sequence[Sequence[tuple[str, Sequence[int]]]],
    tp: int,
    split: Sequence[int],
    gated: bool,
    tied: bool,
) -> list[Param]:
    """The unsharded model's parameters from each stage's TP-local (name, shape) pairs (TP rank 0's), in
    stage order: layer indexes made global, partition dims times `tp`, the last stage's tied copy of the
    word embedding dropped (`tied`)."""
    shapes: dict[str, tuple[int, ...]] = {}
    first = 0
    for stage, named in enumerate(stages):
        for local, shape in named:
            if tied and local == TIED_COPY and stage > 0 and WORD_EMBEDDING in shapes:
                continue
            match = LAYER_NAME.match(local)
            name = f"decoder.layers.{first + int(match.group(1))}.{match.group(2)}" if match else local
            dim = partition_dim(name)
            shapes[name] = tuple(int(n) * tp if i == dim else int(n) for i, n in enumerate(shape))
        first += split[stage]
    return model_params(shapes.items(), gated=gated)


@dataclasses.dataclass(frozen=True)
class Layout:
    """TP x PP x DP with the layers per stage; `tied`: the last stage holds a copy of the word
    embedding as `output_layer.weight` when PP > 1 (a GPT with tied embeddings)."""

    tp: int
    pp: int
    dp: int
    split: tuple[int, ...]
    tied: bool = True
    strided: bool = False
    """TP groups strided over the ranks (megahet/policy/mesh.py): an escalation's placement."""

    def __post_init__(self):
        if min(self.tp, self.pp, self.dp) < 1:
            raise ValueError(f"TP, PP and DP must be >= 1, got {self.tp}, {self.pp}, {self.dp}")
        check_split(self.split, sum(self.split), self.pp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """Global rank of (dp, pp, tp), as megatron-core orders the mesh (megahet/policy/mesh.py)."""
        return rank_of(dp, pp, tp, self.tp, self.dp, self.strided)

    def coords(self, rank: int) -> tuple[int, int, int]:
        return coords_of(rank, self.tp, self.dp, self.strided)


def stage_params(params: Sequence[Param], layout: Layout, stage: int) -> list[tuple[str, Param]]:
    """(local name, parameter) of one pipeline stage, in its module's order: the model's order with the
    layer indexes made local, and the tied copy of the word embedding last on the last stage."""
    first = sum(layout.split[:stage])
    layers = range(first, first + layout.split[stage])
    last = stage == layout.pp - 1
    out = []
    for p in params:
        if p.layer is not None:
            if p.layer in layers:
                out.append((f"decoder.layers.{p.layer - first}.{LAYER_NAME.match(p.name).group(2)}", p))
        elif p.name.startswith(FIRST_STAGE):
            if stage == 0:
                out.append((p.name, p))
        elif last:
            out.append((p.name, p))
    if last and layout.pp > 1 and layout.tied and any(p.name == WORD_EMBEDDING for p in params):
        out.append((TIED_COPY, next(p for p in params if p.name == WORD_EMBEDDING)))
    return out


def zero_fragments(numels: Sequence[Sequence[int]], dp: int) -> list[list[tuple[int, int]]]:
    """DeepSpeed ZeRO-1/2's partition of the flat parameter groups over `dp` ranks: numels[g] are group
    g's parameters' sizes in order; returns [dp rank][parameter, in group order] -> (start, stop) of its
    fragment, as offsets into the parameter's flat elements ((0, 0): none of it on that rank).

    ZeRO flattens each group with no padding between parameters, pads it to a multiple of 2 x dp
    elements, and gives DP rank d the d-th of dp equal partitions (checked against a live engine by
    tests/unit/test_reshard_plan.py)."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(dp)]
    for group in numels:
        total = sum(group)
        size = math.ceil(total / (2 * dp)) * 2 * dp // dp
        offset = 0
        for n in group:
            for d in range(dp):
                lo, hi = max(offset, d * size), min(offset + n, (d + 1) * size)
                out[d].append((lo - offset, hi - offset) if hi > lo else (0, 0))
            offset += n
    return out


def _segments(p: Param, tp: int, t: int, blocks: int) -> np.ndarray:
    """(k, 3) int64 (local start, frame start, length): the TP-local tensor of rank t at TP=tp, in runs
    contiguous both in the local tensor and in the frame (`blocks`: G, the column blocks of dim 1)."""
    if p.dim is None:
        return np.array([[0, 0, p.numel]], dtype=np.int64)
    rows, inner = p.shape[p.dim], math.prod(p.shape[p.dim + 1 :])
    if p.dim == 0:
        if not p.gated:
            n = rows // tp * inner
            return np.array([[0, t * n, n]], dtype=np.int64)
        half = rows // 2 // tp * inner  # [gate_t; up_t] of [gates; ups]
        return np.array([[0, t * half, half], [half, rows // 2 * inner + t * half, half]], dtype=np.int64)
    if p.dim != 1 or len(p.shape) != 2:
        raise ValueError(f"{p.name}: TP partition dim {p.dim} of a {len(p.shape)}-D tensor is not supported")
    height, cols = p.shape
    width, per_rank = cols // blocks, blocks // tp  # a block's columns; blocks per TP rank
    r, j = np.meshgrid(np.arange(height), np.arange(per_rank), indexing="ij")
    local = r * per_rank * width + j * width
    frame = (t * per_rank + j) * height * width + r * width
    seg = np.stack([local.ravel(), frame.ravel(), np.full(local.size, width)], axis=1).astype(np.int64)
    if per_rank == 1:  # the rank's block is contiguous in the frame: one run
        return np.array([[0, t * height * width, height * width]], dtype=np.int64)
    return seg


def _to_frame(segments: np.ndarray, lo: int, hi: int) -> Runs:
    """The frame runs of the local flat range [lo, hi)."""
    start = np.maximum(segments[:, 0], lo)
    stop = np.minimum(segments[:, 0] + segments[:, 2], hi)
    keep = stop > start
    shift = segments[keep, 1] - segments[keep, 0]
    return _normalize(np.stack([start[keep] + shift, stop[keep] + shift], axis=1))


def _normalize(runs: np.ndarray) -> Runs:
    """Sorted, merged runs."""
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    runs = runs[runs[:, 1] > runs[:, 0]]
    if len(runs) < 2:
        return runs
    runs = runs[np.argsort(runs[:, 0], kind="stable")]
    out = [list(runs[0])]
    for s, e in runs[1:]:
        if s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return np.array(out, dtype=np.int64)


def intersect(a: Runs, b: Runs) -> Runs:
    """Runs in both a and b."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i, 0], b[j, 0]), min(a[i, 1], b[j, 1])
        if hi > lo:
            out.append((lo, hi))
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def subtract(a: Runs, b: Runs) -> Runs:
    """Runs in a but not in b."""
    out = []
    j = 0
    for lo, hi in a:
        cur = lo
        while j < len(b) and b[j, 1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k, 0] < hi:
            if b[k, 0] > cur:
                out.append((cur, b[k, 0]))
            cur = max(cur, b[k, 1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def size(runs: Runs) -> int:
    return int((runs[:, 1] - runs[:, 0]).sum()) if len(runs) else 0


@dataclasses.dataclass(frozen=True)
class Holding:
    """What one rank holds of one key of one tensor: the tensor's local name on that rank, the TP-local
    tensor's `segments` in the frame (`_segments`), the local flat range [lo, hi) held (all of it for
    the weights, the ZeRO fragment for the optimizer keys) and that range's frame runs."""

    local_name: str
    segments: np.ndarray
    lo: int
    hi: int
    runs: Runs
    copy: bool = False
    """The last stage's tied copy of the word embedding (the first stage holds the original)."""


State = dict[tuple[str, str], Holding]  # (unsharded name, key) -> Holding, of one rank


def zero_groups(named: Sequence[tuple[str, Param]]) -> list[list[int]]:
    """Indices into a stage's (local name, parameter) list per ZeRO parameter group, decayed then not, each
    in module order: DeepSpeed partitions each group's flat buffer (megahet/engine.py param_groups)."""
    return [[i for i, (n, p) in enumerate(named) if decays(n, len(p.shape)) == g] for g in (True, False)]


def rank_holdings(params: Sequence[Param], layout: Layout, rank: int, blocks: int) -> State:
    """What `rank` of `layout` holds: every key of every tensor of its stage and TP rank (the tied copy
    under the word embedding's name, with its own local name), the optimizer keys as its ZeRO fragments
    over its DP group."""
    d, stage, t = layout.coords(rank)
    named = stage_params(params, layout, stage)
    segments = [_segments(p, layout.tp, t, blocks) for _, p in named]
    numels = [int(seg[:, 2].sum()) for seg in segments]
    groups = zero_groups(named)
    fragments = zero_fragments([[numels[i] for i in group] for group in groups], layout.dp)[d]
    fragment_of = dict(zip([i for group in groups for i in group], fragments))
    mine: State = {}
    for i, (local_name, p) in enumerate(named):
        copy = local_name == TIED_COPY and p.name == WORD_EMBEDDING
        seg, lo, hi = segments[i], *fragment_of[i]
        mine[(p.name, WEIGHT)] = Holding(local_name, seg, 0, numels[i], _to_frame(seg, 0, numels[i]), copy)
        for key in OPTIMIZER_KEYS:
            mine[(p.name, key)] = Holding(local_name, seg, lo, hi, _to_frame(seg, lo, hi), copy)
    return mine


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Send the frame run [start, stop) of `key` of tensor `name` from old rank `src` to new rank `dst`."""

    src: int
    dst: int
    name: str
    key: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def runs(self) -> Runs:
        """The moved run, as a run list (what take / put read and write)."""
        return np.array([[self.start, self.stop]], dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    """The transfers that take the state of layout `old` to layout `new` (global ranks of each; a rank
    in both is the same process), with what every new rank keeps of what it held."""

    old: Layout
    new: Layout
    blocks: int
    """G: dim-1 tensors are framed in G column blocks (the lcm of both TP degrees)."""
    transfers: tuple[Transfer, ...]
    kept: Mapping[str, int]
    """Elements per key that new ranks already held (not moved)."""

    def moved(self, key: str | None = None) -> int:
        """Elements moved (of `key`, or of every key)."""
        return sum(t.numel for t in self.transfers if key is None or t.key == key)

    def bytes_moved(self, itemsize: Mapping[str, int]) -> int:
        """Bytes moved, at `itemsize` bytes per element of each key (weights: the model's dtype)."""
        return sum(t.numel * itemsize[t.key] for t in self.transfers)

    def received_by(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst == rank]

    def sent_by(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src == rank]

    def tensors_moved(self) -> list[str]:
        """The tensors of which some element moves, in plan order."""
        return list(dict.fromkeys(t.name for t in self.transfers))


def _source_order(
    old: Layout, dp: int, tp: int, load: Mapping[int, int], holder: tuple[int, Holding]
) -> tuple:
    """Sort key of an old holder for a new rank at DP replica `dp` and TP rank `tp`: originals before the
    tied copy, then the same TP rank (replicated tensors), then the holder it already takes the fewest
    elements from (`load`: its reads or receives spread over the holders), then the old replica `dp`
    maps to (dp mod old DP), then the lower rank."""
    src, held = holder
    d, _, t = old.coords(src)
    return (held.copy, t != tp, load.get(src, 0), (d - dp) % old.dp, src)


def reshard_plan(params: Sequence[Param], old: Layout, new: Layout, keep: bool = True) -> ReshardPlan:
    """The minimal transfers from layout `old` to layout `new` of every key of every tensor of the model
    `params` (the same tensors and shapes in both). A new rank receives only what it does not hold in
    the old layout; each missing run comes from one holder: the original rather than the tied copy, its
    own TP rank's copy of a replicated tensor, and among the DP replicas that hold a weight, the one it
    takes least from so far (then the one its replica maps to, d mod old DP): a rank's reads spread over
    its sources, and replicas read from different ranks. `keep=False`: the new ranks hold nothing yet (a restart in new
    processes reads everything from the old ranks' files). ValueError when an element has no holder (not
    the same model)."""
    layers = 1 + max((p.layer for p in params if p.layer is not None), default=-1)
    for which, lay in (("old", old), ("new", new)):
        if sum(lay.split) != layers:
            raise ValueError(
                f"the {which} layout's split {format_split(lay.split)} holds {sum(lay.split)} layers, the model "
                f"has {layers}: give splits of the model's layers"
            )
    blocks = math.lcm(old.tp, new.tp)
    before = {r: rank_holdings(params, old, r, blocks) for r in range(old.world)}
    holders: dict[tuple[str, str], list[tuple[int, Holding]]] = {}
    for r, state in before.items():
        for k, h in state.items():
            if len(h.runs):
                holders.setdefault(k, []).append((r, h))
    transfers: list[Transfer] = []
    kept = dict.fromkeys(KEYS, 0)
    for r in range(new.world):
        d, _, t = new.coords(r)
        load: dict[int, int] = {}  # elements r takes from each old rank so far
        for (name, key), h in rank_holdings(params, new, r, blocks).items():
            need = h.runs
            had = before.get(r, {}).get((name, key)) if keep else None
            if had is not None:
                need = subtract(need, had.runs)
                kept[key] += size(h.runs) - size(need)
            order = functools.partial(_source_order, old, d, t, load)
            for src, held in sorted(holders.get((name, key), []), key=order):
                if not len(need):
                    break
                piece = intersect(need, held.runs)
                transfers += [Transfer(src, r, name, key, int(a), int(b)) for a, b in piece]
                load[src] = load.get(src, 0) + size(piece)
                need = subtract(need, piece)
            if len(need):
                raise ValueError(
                    f"{name} ({key}): elements {need[0].tolist()} of rank {r}'s shard are held by no rank of "
                    f"the old layout: the two layouts are not of the same model"
                )
    return ReshardPlan(old, new, blocks, tuple(transfers), kept)


def local_ranges(holding: Holding, runs: Runs) -> np.ndarray:
    """(k, 2) [start, stop) into the rank's held flat range (offset by holding.lo) that hold the frame
    `runs`, in frame order (their concatenation is the runs' elements, one after the other)."""
    seg = holding.segments
    out = []
    for a, b in runs:
        start = np.maximum(seg[:, 1], a)
        stop = np.minimum(seg[:, 1] + seg[:, 2], b)
        hit = np.nonzero(stop > start)[0]
        hit = hit[np.argsort(start[hit], kind="stable")]
        shift = seg[hit, 0] - seg[hit, 1] - holding.lo
        out.append(np.stack([start[hit] + shift, stop[hit] + shift], axis=1))
    return np.concatenate(out).astype(np.int64) if out else np.zeros((0, 2), dtype=np.int64)
