"""Run a training script with this rank pinned to one CPU core (for CPU runs and contention tests).

Usage, as the script torchrun starts on every rank::

    torchrun --nproc_per_node 2 tools/pin_ranks.py pretrain_gpt.py --parallel.tp 2
    MEGAHET_CORES=2,3 torchrun --nproc_per_node 2 tools/pin_ranks.py pretrain_gpt.py --parallel.tp 2

Local rank r runs on the r-th core of MEGAHET_CORES (default: the cores this process may use), so a
process competing for one core (multi-tenant contention) slows exactly one rank down.
"""

from __future__ import annotations

import os
import runpy
import sys


def rank_core(local_rank: int, cores: str | None = None) -> int:
    """The core local rank `local_rank` runs on: from a comma-separated list, else the allowed cores."""
    allowed = sorted(os.sched_getaffinity(0))
    chosen = [int(c) for c in cores.split(",")] if cores else allowed
    if local_rank >= len(chosen):
        raise ValueError(
            f"local rank {local_rank} has no core of its own among {chosen}: "
            f"start fewer ranks or list more cores in MEGAHET_CORES"
        )
    if chosen[local_rank] not in allowed:
        raise ValueError(f"core {chosen[local_rank]} is not available to this process (allowed: {allowed})")
    return chosen[local_rank]


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: torchrun ... tools/pin_ranks.py SCRIPT [ARGS...]")
    try:
        core = rank_core(int(os.environ.get("LOCAL_RANK", "0")), os.environ.get("MEGAHET_CORES"))
    except ValueError as err:
        sys.exit(f"pin_ranks: error: {err}")
    os.sched_setaffinity(0, {core})
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
