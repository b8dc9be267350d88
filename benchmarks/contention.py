"""Real multi-tenant contention on CPU: a process that competes for one core, and how much of its core
a rank really got (from the kernel's scheduler statistics). Used by benchmarks/real_contention.py and
tests/distributed/test_real_straggler.py.

    with competing_process(core=1):          # a busy loop pinned to core 1 until the block ends
        ...                                  # ranks pinned with tools/pin_ranks.py
    ran, waited = schedstat(pid)             # seconds on a CPU, seconds runnable but waiting
    pinned_launch(torchrun, args, [0, 1], log, contended=True)   # 2 pinned ranks, rank 1 contended
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

BUSY_LOOP = "import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"


@contextlib.contextmanager
def competing_process(core: int):
    """A pure-Python busy loop pinned to `core` (another tenant's job), killed when the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(core=core)])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of a process's main thread."""
    ran, waited, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
    return int(ran) / 1e9, int(waited) / 1e9


def core_share(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Share of its core a thread got while it wanted to run, between two schedstat readings."""
    ran, waited = after[0] - before[0], after[1] - before[1]
    return ran / (ran + waited) if ran + waited > 0 else float("nan")


def pinned_launch(launch, args: list[str], cores: list[int], log: Path, contended: bool) -> float:
    """`launch("tools/pin_ranks.py", 2, args, log)` (benchmarks.common.torchrun) with rank r pinned to
    cores[r], and a competing process on cores[1] while it runs when `contended`; its wall seconds."""
    os.environ["MEGAHET_CORES"] = ",".join(map(str, cores))  # rank r on cores[r] (tools/pin_ranks.py)
    try:
        with competing_process(cores[1]) if contended else contextlib.nullcontext():
            return launch("tools/pin_ranks.py", 2, args, log)
    finally:
        del os.environ["MEGAHET_CORES"]


def two_cores() -> list[int] | None:
    """Two cores this process may use, or None (then contention cannot be pinned to one rank)."""
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[:2] if len(allowed) >= 2 else None
