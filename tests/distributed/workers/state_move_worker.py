"""Run every reshard-plan change of tests/unit/test_reshard_plan.py (gelu, tied) that spans this world
with `exchange` over gloo, three ways: every run its own message, every run packed per peer, and a mix
(packed below a threshold inside the runs' size range); each rank's new state must equal the state
built independently for the new layout (the unit test's `reference`), and the elements received must be
the plan's. Prints "ok <changes> <mixed runs packed> <mixed runs alone>" on rank 0.

    torchrun --nproc_per_node 4 tests/distributed/workers/state_move_worker.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit"))
from test_reshard_plan import CHANGES, reference, shapes

from megahet.policy.reshard_plan import KEYS, model_params, rank_holdings, reshard_plan
from megahet.runtime.state_move import exchange


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    params = model_params(shapes(untied=False))
    dtypes = dict.fromkeys(KEYS, torch.int64)
    changes, packed, alone = 0, 0, 0
    for what, old, new in CHANGES:
        if max(old.world, new.world) != world:
            continue
        changes += 1
        plan = reshard_plan(params, old, new)
        before_states, expected = reference(params, old, False), reference(params, new, False)
        before = rank_holdings(params, old, rank, plan.blocks) if rank < old.world else {}
        after = rank_holdings(params, new, rank, plan.blocks) if rank < new.world else {}
        sizes = sorted(t.numel * 8 for t in plan.transfers)
        middle = sizes[len(sizes) // 2] if sizes else 0
        for packed_below in (0, 1 << 40, middle):
            got = exchange(
                plan, rank, before, after, before_states.get(rank, {}), dtypes, packed_below=packed_below
            )
            assert got.keys() == expected.get(rank, {}).keys(), (what, rank)
            for k, want in expected.get(rank, {}).items():
                assert torch.equal(got[k], want), (what, packed_below, rank, k)
        packed += sum(s < middle for s in sizes)
        alone += sum(s >= middle for s in sizes)
    if rank == 0:
        print(f"ok {changes} {packed} {alone}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
