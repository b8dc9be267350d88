"""What a time-sliced participant adds to every collective: two gloo ranks, compute then all-reduce.

    python benchmarks/collective_delay.py                     # four product sizes, calm and contended (~2 min)
    python benchmarks/collective_delay.py --ffn 2048,8192 --iters 300 --name collective_delay_short

Two ranks, each pinned to a core of its own (as benchmarks/real_contention.py pins them), repeat what a
TP=2 layer does: a matrix product of a micro-batch's activations (256 tokens x 512 -> ffn), then an
all-reduce of 256 x 512 fp32 (512 KiB), `--iters` times, for each product width in `--ffn` (the
work between two collectives: about 6-50 ms here). In the contended mode a busy loop shares rank 1's
core (benchmarks/contention.py), as in the real-contention benchmark.

Per iteration, each rank times its product and the whole iteration (the product and its all-reduce). The ranks leave every all-reduce
together, so an iteration lasts as long as the slower rank's product plus the time *neither* rank
computes: the collective itself, and, when one rank's core is time-sliced, the time that rank waits to
be scheduled again at the collective's round trips (it blocks, the busy loop runs). Reported per
width and mode (medians over iterations): the iteration, each rank's product, the time neither
computes (`idle_ms` = iteration - the slower product), `added_ms` (the contended `idle_ms` less the
calm one: what one time-sliced participant adds to each collective, on top of its slower compute; no
split of the work between the ranks takes it back), and each rank's share of its core while it wanted
to run (schedstat; the kernel gives a rank that blocks often more than half of a shared core). Writes
benchmarks/results/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import save_results
from benchmarks.contention import competing_process, core_share, schedstat, two_cores
from megahet.launch import free_port

TOKENS, HIDDEN = 256, 512
FFNS = (2048, 4096, 8192, 16384)
COLUMNS = ["ffn", "mode", "iteration_ms", "product_ms", "idle_ms", "added_ms", "core_share"]


def _rank(rank: int, cores: list[int], port: int, iters: int, ffn: int, out) -> None:
    """One rank: `iters` x (product, all-reduce), timed; puts (products, iterations, core share) in
    `out` (rank 0: every rank's)."""
    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, {cores[rank]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.randn(TOKENS, HIDDEN)  # (s*b, h): a micro-batch's activations
    w = torch.randn(HIDDEN, ffn)  # (h, ffn): a column-parallel weight
    partial = torch.randn(TOKENS, HIDDEN)  # (s*b, h): a row-parallel output to all-reduce
    for _ in range(10):
        x @ w
        dist.all_reduce(partial)
    dist.barrier()
    products, iterations = [], []
    sched0 = schedstat(os.getpid())
    for _ in range(iters):
        t0 = time.perf_counter()
        x @ w  # (s*b, ffn)
        t1 = time.perf_counter()
        dist.all_reduce(partial)
        t2 = time.perf_counter()
        products.append(t1 - t0)
        iterations.append(t2 - t0)  # the all-reduce is the rest: derived where it is needed
    share = core_share(sched0, schedstat(os.getpid()))
    gathered = [None, None]
    dist.all_gather_object(gathered, (products, iterations, share))
    if rank == 0:
        out.put(gathered)
    dist.destroy_process_group()


def measure(iters: int, cores: list[int], contended: bool, ffn: int = FFNS[0]) -> list[tuple]:
    """Run the two ranks (rank 1's core shared with a busy loop when `contended`); every rank's
    (products, iterations, core share)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    with competing_process(cores[1]) if contended else contextlib.nullcontext():
        procs = [ctx.Process(target=_rank, args=(r, cores, port, iters, ffn, out)) for r in range(2)]
        for p in procs:
            p.start()
        gathered = None
        while gathered is None:  # a rank that died never puts: stop its peer instead of waiting forever
            try:
                gathered = out.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode for p in procs):
                    for p in procs:
                        p.kill()
                    codes = [p.exitcode for p in procs]
                    raise RuntimeError(f"collective_delay: a rank failed (exit codes {codes})") from None
        for p in procs:
            p.join()
    return gathered


def summarize(mode: str, gathered: list[tuple], ffn: int = FFNS[0]) -> dict:
    """Medians over iterations (ms): the iteration (rank 0's clock: the ranks leave each all-reduce
    together), each rank's product, and the time neither rank computes (the iteration less the slower
    product, per iteration)."""
    (p0, it0, s0), (p1, _, s1) = gathered
    idle = [it - max(a, b) for it, a, b in zip(it0, p0, p1)]
    return {
        "ffn": ffn,
        "mode": mode,
        "iteration_ms": 1e3 * statistics.median(it0),
        "product_ms": [round(1e3 * statistics.median(p), 3) for p in (p0, p1)],
        "idle_ms": 1e3 * statistics.median(idle),
        "core_share": [round(s0, 3), round(s1, 3)],
    }


def added(rows: list[dict]) -> None:
    """Each row's idle time beyond the calm run's of its product size: what the time-sliced participant
    adds per collective."""
    calm = {r["ffn"]: r["idle_ms"] for r in rows if r["mode"] == "calm"}
    for row in rows:
        row["added_ms"] = row["idle_ms"] - calm[row["ffn"]]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=150)
    parser.add_argument(
        "--ffn",
        default=",".join(map(str, FFNS)),
        help="product widths (comma-separated): the work between collectives",
    )
    parser.add_argument("--name", default="collective_delay")
    args = parser.parse_args(argv)
    if args.iters < 1:
        sys.exit("collective_delay: error: --iters must be at least 1")
    cores = two_cores()
    if cores is None:
        sys.exit("collective_delay: error: needs two CPU cores to pin the ranks to")
    try:
        ffns = [int(f) for f in args.ffn.split(",")]
    except ValueError:
        sys.exit(f"collective_delay: error: --ffn {args.ffn!r}: give widths as integers, e.g. 2048,8192")
    rows = []
    for ffn in ffns:
        for mode in ("calm", "contended"):
            rows.append(summarize(mode, measure(args.iters, cores, mode == "contended", ffn), ffn))
            print(rows[-1], flush=True)
    added(rows)
    save_results(args.name, rows, COLUMNS, {"iters": args.iters, "cores": cores, "ffn": ffns})
    return rows


if __name__ == "__main__":
    main()
