"""Spawned gloo ranks for context-parallel unit tests: CP 4 over 4 ranks, then CP 2 over ranks 0 and 1, in
one launch (tests/unit/test_cp_attention.py, test_cp_placed.py).

    mp.spawn(on_cp4_and_cp2, args=(4, free_port(), check), nprocs=4, join=True)   # check(group) per size
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch.distributed as dist


def on_cp4_and_cp2(rank: int, world: int, port: int, check: Callable) -> None:
    """Run `check(group)` on the whole world (CP 4), then on ranks 0 and 1 (CP 2)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        pair = dist.new_group([0, 1])  # every rank takes part in creating it
        check(dist.group.WORLD)
        if rank < 2:
            check(pair)
    finally:
        dist.destroy_process_group()
