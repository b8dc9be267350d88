"""Real multi-tenant contention on CPU: a process that competes for one core, and how much of its core
a rank really got (from the kernel's scheduler statistics). Used by benchmarks/real_contention.py and
tests/distributed/test_real_straggler.py.

    with competing_process(core=1):          # a busy loop pinned to core 1 until the block ends
        ...                                  # ranks pinned with tools/pin_ranks.py
    competing_process(core=1, processes=2)   # two loops: the rank on core 1 gets a third of it
    competing_process(core=1, nice=5)        # one lower-priority loop: a milder straggler
    ran, waited = schedstat(pid)             # seconds on a CPU, seconds runnable but waiting
    pid = rank_pid(1, launcher=proc.pid)     # local rank 1 of a launch (no launcher: any pin_ranks.py)
    pinned_launch(torchrun, args, [0, 1], log, contended=True)   # 2 pinned ranks, rank 1 contended
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

BUSY_LOOP = """import contextlib, os
os.sched_setaffinity(0, {{{core}}})
os.nice({nice})
with contextlib.suppress(OSError):  # with autogroups, a session's weight is its autogroup's nice
    with open("/proc/self/autogroup", "w") as group:
        group.write("{nice}")
while True:
    pass
"""


@contextlib.contextmanager
def competing_process(core: int, processes: int = 1, nice: int = 0):
    """Pure-Python busy loops pinned to `core` (another tenant's jobs: each in a session of its own, so
    the kernel's per-session group scheduling counts each as a tenant), killed when the block ends. A
    `nice` tenant (1-19) takes less of the core than the rank it shares it with (a milder straggler)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUSY_LOOP.format(core=core, nice=nice)], start_new_session=True
        )
        for _ in range(processes)
    ]
    try:
        yield procs[0]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of a process's main thread."""
    ran, waited, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
    return int(ran) / 1e9, int(waited) / 1e9


def descendants(pid: int) -> list[int]:
    """Every live process below pid, each after its parent (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def rank_pid(local_rank: int, launcher: int | None = None) -> int | None:
    """The pid of the rank process with this LOCAL_RANK: the first among the launcher's descendants, or
    (no launcher) among this machine's tools/pin_ranks.py ranks; None while there is none."""
    if launcher is not None:
        pids = descendants(launcher)
    else:
        pids = [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/cmdline") if _pins_a_rank(p)]
    for pid in pids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={local_rank}".encode() in environ:
            return pid
    return None


def _pins_a_rank(cmdline: Path) -> bool:
    """Whether a /proc/PID/cmdline is a rank started through tools/pin_ranks.py (not its launcher)."""
    try:
        text = cmdline.read_bytes()
    except OSError:
        return False
    return b"pin_ranks.py" in text and b"torch.distributed.run" not in text


def core_share(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Share of its core a thread got while it wanted to run, between two schedstat readings."""
    ran, waited = after[0] - before[0], after[1] - before[1]
    return ran / (ran + waited) if ran + waited > 0 else float("nan")


def pinned_launch(launch, args: list[str], cores: list[int], log: Path, contended: bool) -> float:
    """`launch("tools/pin_ranks.py", len(cores), args, log)` (benchmarks.common.torchrun) with rank r pinned
    to cores[r] (a core may be listed for several ranks), and a competing process on cores[1] while it runs
    when `contended`; its wall seconds."""
    pinned = {"MEGAHET_CORES": ",".join(map(str, cores))}  # rank r on cores[r] (tools/pin_ranks.py)
    with (
        mock.patch.dict(os.environ, pinned),
        competing_process(cores[1]) if contended else contextlib.nullcontext(),
    ):
        return launch("tools/pin_ranks.py", len(cores), args, log)


def two_cores() -> list[int] | None:
    """Two cores this process may use, or None (then contention cannot be pinned to one rank)."""
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[:2] if len(allowed) >= 2 else None
