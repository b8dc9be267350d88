"""Where a global rank sits in the TP x PP x DP mesh, as megatron-core lays it out. Pure.

Role: policy (shared by the process groups, megahet/parallel.py, and the layout planner).

    coords_of(rank=5, tp=2, dp=2)    # (0, 1, 1): DP replica 0, pipeline stage 1, TP rank 1

megatron-core's default order "tp-cp-ep-dp-pp": TP fastest, then DP, then PP. So TP groups are runs
of consecutive ranks (inside a node when TP divides the ranks per node), and pipeline stage s holds the
ranks s*TP*DP .. (s+1)*TP*DP-1.
"""

from __future__ import annotations


def coords_of(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(dp, pp, tp) coordinates of global rank `rank`."""
    return (rank // tp) % dp, rank // (tp * dp), rank % tp
