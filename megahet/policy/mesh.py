"""Where a global rank sits in the TP x PP x DP mesh, as megatron-core lays it out. Pure.

Role: policy (shared by the process groups, megahet/parallel.py, and the layout planner).

    coords_of(rank=5, tp=2, dp=2)    # (0, 1, 1): DP replica 0, pipeline stage 1, TP rank 1

megatron-core's default order "tp-cp-ep-dp-pp": TP fastest, then CP, then DP, then PP. So TP groups are
runs of consecutive ranks (inside a node when TP divides the ranks per node), and pipeline stage s holds the
ranks s*TP*CP*DP .. (s+1)*TP*CP*DP-1. With context parallelism (`cp`) the CP ranks of a position share its
(dp, pp, tp): `coords_of(rank=1, tp=1, dp=2, cp=2)` is (0, 0, 0), replica 0's second CP rank.

`strided` is megatron-core's order STRIDED_ORDER: DP fastest, then TP, then PP. A TP group then takes every
DP-th rank of its stage (TP 2 x DP 2: TP groups 0,2 and 1,3), so ranks that consecutive TP groups would split
share one: the escalation places two late ranks so (megahet/policy/escalation.py), one replica late instead
of two.

    coords_of(rank=1, tp=2, dp=2, strided=True)    # (1, 0, 0): DP replica 1, stage 0, TP rank 0
"""

from __future__ import annotations

STRIDED_ORDER = "cp-ep-dp-tp-pp"
"""megatron-core's `order` of a strided mesh (CP 1, EP 1): DP fastest."""


def coords_of(rank: int, tp: int, dp: int, strided: bool = False, cp: int = 1) -> tuple[int, int, int]:
    """(dp, pp, tp) coordinates of global rank `rank` (CP ranks of one position share them)."""
    if strided:
        if cp > 1:
            raise ValueError(f"strided TP groups are laid out with CP 1, got CP {cp}")
        return rank % dp, rank // (tp * dp), (rank // dp) % tp
    return (rank // (tp * cp)) % dp, rank // (tp * cp * dp), rank % tp


def rank_of(dp: int, pp: int, tp: int, tp_size: int, dp_size: int, strided: bool = False) -> int:
    """The global rank at (dp, pp, tp): `coords_of`'s inverse."""
    inner = dp + dp_size * tp if strided else tp + tp_size * dp
    return inner + tp_size * dp_size * pp
