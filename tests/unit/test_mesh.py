"""Where a global rank sits in the mesh (megahet/policy/mesh.py, megahet/parallel.py): the coordinates megahet
assumes before any process group starts are megatron-core's own (its RankGenerator, which
initialize_model_parallel builds the groups from), with and without context parallelism; declared speeds of
CP ranks combine per position.

Run: ``python -m pytest tests/unit/test_mesh.py -q`` (a second).
"""

from __future__ import annotations

import pytest
from megatron.core.parallel_state import RankGenerator

from megahet.config import MegahetConfig, apply_overrides
from megahet.parallel import mesh_coords
from megahet.policy.mesh import STRIDED_ORDER, coords_of
from megahet.run_plan import declared_by_coords

DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def _megatron_coords(tp: int, cp: int, dp: int, pp: int, order: str) -> dict[int, tuple[int, int, int]]:
    """(dp, pp, tp) of every rank from megatron-core's groups: a rank's index in its DP, PP and TP group."""
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    index = {}
    for token in ("dp", "pp", "tp"):
        for group in gen.get_ranks(token):
            for i, rank in enumerate(group):
                index.setdefault(rank, {})[token] = i
    return {rank: (c["dp"], c["pp"], c["tp"]) for rank, c in index.items()}


@pytest.mark.parametrize(
    "tp, cp, dp, pp", [(1, 2, 2, 1), (2, 2, 2, 1), (2, 2, 1, 2), (1, 4, 2, 2), (2, 1, 2, 2)]
)
def test_coordinates_are_megatron_cores_with_context_parallelism(tp, cp, dp, pp):
    expected = _megatron_coords(tp, cp, dp, pp, DEFAULT_ORDER)
    world = tp * cp * dp * pp
    assert mesh_coords(world, tp, pp, cp=cp) == [expected[r] for r in range(world)]
    if cp == 1:
        strided = _megatron_coords(tp, 1, dp, pp, STRIDED_ORDER)
        assert [coords_of(r, tp, dp, strided=True) for r in range(world)] == [
            strided[r] for r in range(world)
        ]


def test_strided_groups_with_cp_are_refused():
    with pytest.raises(ValueError, match="strided TP groups are laid out with CP 1, got CP 2"):
        coords_of(0, tp=2, dp=2, strided=True, cp=2)


def test_declared_speeds_of_cp_ranks_count_as_their_slowest():
    """CP 2 x DP 2: ranks 0, 1 are replica 0's CP ranks, 2, 3 replica 1's; a position's CP ranks exchange keys
    and values every layer, so it runs at the slower one."""
    cfg = apply_overrides(
        MegahetConfig(), {"parallel.cp": "2", "hetero.speeds": "1,0.8,0.5,1", "hetero.dp_shares": "declared"}
    )
    assert declared_by_coords(cfg, 4) == {(0, 0, 0): 0.8, (1, 0, 0): 0.5}
