"""What a layout change costs: today's rank-0 path against the reshard plan's, by model size (issue 32).

    python benchmarks/reshard_cost.py [--sizes 10M,100M] [--layers 8,16] [--old-sizes 10M,100M] [--repeats 3]
                                      [--resplit-ranks 4] [--name reshard_cost]
    python benchmarks/reshard_cost.py --sizes 10M,100M,400M --old-sizes none --resplit-ranks 2   # 400M on 24 GiB

Rank 0's path runs only at the `--old-sizes` (it gathers the whole model on one host). `--sizes 400M`
at 4 ranks needs a host with more memory than the 24 GiB of a 2-core CI machine: four ranks' engines
plus, during the plan's re-split, the old engine beside the new state (2.5 GB a rank at peak measured at
100M in fp32; 400M has 3.7x the parameters). `--resplit-ranks 2` runs the re-split at PP=2 x DP=1 (each
rank holds its whole stage's optimizer state; no elastic case, which needs the 4-rank checkpoint): two
ranks fit 400M.

Two changes, each done both ways in the same processes (so both see the same machine):
- **re-split one layer** at PP=2 x DP=2 (4 ranks), 8 layers, after one training step (Adam's state
  exists): (a) the old way: every rank saves, rank 0 merges the whole checkpoint per parameter and
  writes it resharded, every rank rebuilds and loads it; (b) the online re-split
  (megahet/runtime/resplit.py): the layer moves rank to rank with its optimizer state, the stages are
  rebuilt. 4,4 -> 5,3 one way, 5,3 -> 4,4 the other (one layer each);
- **elastic restart 4 -> 2 ranks**: the step-1 checkpoint of the PP=2 x DP=2 run loads at PP=2 x DP=1:
  (a) rank 0 reshards it and every rank loads the result; (b) every rank builds its engine and reads
  its own slices into it (megahet/checkpointing/elastic.py read_resharded).

Per size and layer count (GPT of hidden 320 / 1024 / 2048 with 8 layers: about 10 M, 100 M, 400 M
parameters; `--layers` adds deeper models of the same width, so that the rebuild's growth with the
layer count shows beside its growth with the width) it reports
the wall time and its parts, every rank's peak resident memory during the change (sampled from
/proc/self/statm every 2 ms) against the rank's own new shard (its weights, fp32 masters and Adam
moments), the bytes moved against the minimum (the bytes whose owner changes: the reshard plan's; the
old path's bytes are those through the disk: the saved and the resharded checkpoint, each written and
read), and, for the re-split, the time a plain send of the same bytes between the same ranks takes and
the rebuild in passes over the rank's own shard (`_copy_s`: every rank copying its shard's bytes into
new memory at once, measured in the same run). A
plot draws each path's time and worst peak memory against the model size and extrapolates them to
7 B and 70 B parameters with straight-line fits (a fixed cost plus the measured cost per parameter). Writes benchmarks/results/<name>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {"10M": (320, 4), "100M": (1024, 8), "400M": (2048, 16)}  # hidden, heads (8 layers)


class PeakRSS:
    """Peak resident memory of this process while the block runs (bytes): in all (`peak`: the kernel's own
    high-water mark, VmHWM, reset at the start through /proc/self/clear_refs, so no allocation is missed;
    where the kernel refuses the reset, sampled every 2 ms), and its anonymous part (`peak_anon`, sampled
    every 2 ms: what the process allocated, not the file pages it has mapped, which the kernel can drop)."""

    def __enter__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.kernel_peak = _reset_peak_rss()
        self.before, self.before_anon = self._rss()
        self.peak, self.peak_anon = self.before, self.before_anon
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> tuple[int, int]:
        with open("/proc/self/statm") as f:
            _, resident, shared, *_ = (int(x) * self.page for x in f.read().split())
        return resident, resident - shared

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._update()

    def _update(self) -> None:
        total, anon = self._rss()
        self.peak, self.peak_anon = max(self.peak, total), max(self.peak_anon, anon)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._update()
        if self.kernel_peak:
            self.peak = max(self.peak, _kernel_peak_rss())


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current resident set (Linux >= 4.0); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _kernel_peak_rss() is not None


def _kernel_peak_rss() -> int | None:
    """VmHWM of /proc/self/status, bytes (None if absent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


@dataclasses.dataclass(frozen=True)
class Shape:
    """The benchmarked GPT (fp32): hidden size, heads, layers."""

    hidden: int
    heads: int
    layers: int = 8


def _args(shape: Shape, out: Path, pp: int = 2) -> list[str]:
    return [
        "--parallel.pp", str(pp), "--model.num_layers", str(shape.layers), "--model.hidden_size", str(shape.hidden),
        "--model.num_attention_heads", str(shape.heads), "--model.seq_length", "32",
        "--train.micro_batch_size", "1", "--train.global_batch_size", "4", "--train.train_iters", "100",
        "--train.eval_interval", "1000", "--logging.wandb", "false", "--logging.log_dir", str(out / "logs"),
    ]  # fmt: skip


def _shard_bytes(trainer) -> int:
    """This rank's own state: its weights, and its ZeRO fragments of the fp32 masters and Adam moments."""
    from megahet.compat import deepspeed_zero as zero

    total = 0
    for param in trainer.engine.module.parameters():
        total += param.numel() * param.element_size()
        fragment = zero.hp_fragment(param)
        if fragment is not None:
            lo, hi = zero.fragment_range(fragment)
            total += 3 * 4 * (hi - lo)
    return total


def _gather(row: dict) -> list[dict]:
    import torch.distributed as dist

    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


def _raw_send_s(plan, rank: int, itemsize: dict) -> float:
    """Seconds to send each (src, dst) pair's bytes of `plan` as one plain message (all pairs at once)."""
    import torch
    import torch.distributed as dist

    pairs: dict[tuple[int, int], int] = {}
    for t in plan.transfers:
        pairs[(t.src, t.dst)] = pairs.get((t.src, t.dst), 0) + t.numel * itemsize[t.key]
    ops = []
    for (src, dst), size in sorted(pairs.items()):
        if rank == src:
            ops.append(dist.P2POp(dist.isend, torch.zeros(size, dtype=torch.uint8), dst))
        elif rank == dst:
            ops.append(dist.P2POp(dist.irecv, torch.empty(size, dtype=torch.uint8), src))
    dist.barrier()
    t0 = time.perf_counter()
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    dist.barrier()
    return time.perf_counter() - t0


def _copy_s(nbytes: int) -> float:
    """Seconds for every rank at once to copy `nbytes` into newly allocated memory (the slowest rank's): the
    cost of one pass over a rank's own shard, as a rebuild makes them (each new buffer's pages are faulted
    in and zeroed by the kernel as it is first written)."""
    import torch
    import torch.distributed as dist

    source = torch.ones(nbytes, dtype=torch.uint8)
    dist.barrier()
    t0 = time.perf_counter()
    torch.empty_like(source).copy_(source)
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def worker_resplit(shape: Shape, out: Path, old_path: bool = True, repeats: int = 1) -> None:
    """4 ranks (PP=2 x DP=2; or 2: PP=2 x DP=1): one step, save the step-1 checkpoint (for the elastic case), then re-split one layer the
    old way (4,4 -> 5,3 at 8 layers) and the plan's way `repeats` times, back and forth (5,3 -> 4,4 -> ...);
    without `old_path`, the plan's way only (4,4 -> 5,3 -> ...)."""
    import torch.distributed as dist

    import pretrain_gpt
    from megahet.checkpointing import checkpoint, finder
    from megahet.checkpointing.elastic import reshard_checkpoint
    from megahet.config import load_config
    from megahet.policy.reshard_plan import KEYS, Layout, reshard_plan
    from megahet.runtime.resplit import _free, live_params, resplit
    from megahet.training import build_trainer, setup

    cfg = load_config([*_args(shape, out), "--train.save", str(out / "ck")])
    trainer = setup(cfg, pretrain_gpt.SPEC)
    spec, layout, logger = pretrain_gpt.SPEC, trainer.layout, trainer.logger
    trainer.train_step()
    checkpoint.save(trainer.checkpoint_parts(), trainer.progress(), out / "ck")
    shard_before = _shard_bytes(trainer)
    half = shape.layers // 2
    split, other = (half, half), (half + 1, half - 1)

    old = None
    if old_path:  # (a) the old way: save -> rank 0 reshards the whole checkpoint -> rebuild and load
        new_plan = trainer.plan.with_split(other)
        with PeakRSS() as rss_a:
            t0 = time.perf_counter()
            root = out / "old_resplit"
            checkpoint.save(trainer.checkpoint_parts(), trainer.progress(), root)
            t_save = time.perf_counter()
            resume = finder.find_resume_in(root)
            _free(trainer)
            resume = reshard_checkpoint(cfg, resume, layout.rank, new_plan.split, root)
            t_reshard = time.perf_counter()
            trainer = build_trainer(new_plan, spec, layout, resume, logger, 1)
            dist.barrier()
            t_done = time.perf_counter()
        disk = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        old = {
            "save_s": t_save - t0, "reshard_s": t_reshard - t_save, "build_s": t_done - t_reshard,
            "total_s": t_done - t0, "peak_rss": rss_a.peak, "rss_before": rss_a.before, "disk_bytes": disk,
        }  # fmt: skip
        split, other = other, split

    # (b) the plan's way, `repeats` times back and forth (5,3 -> 4,4 -> 5,3 ... at 8 layers; 4,4 -> 5,3 first
    # without the old way): each re-split moves one layer rank to rank, right after a plain send of the same
    # bytes between the same ranks, so that every transfer has its reference measured beside it
    def rebuild(p, restore, n):
        return build_trainer(p, spec, layout, None, logger, n, (), restore)

    m, itemsize, runs = cfg.model, dict.fromkeys(KEYS, 4), []
    for _ in range(repeats):
        params = live_params(trainer.engine.module, trainer.layout, split, m.activation == "swiglu", True)
        lay = Layout(trainer.layout.tp_size, 2, trainer.layout.dp_size, split)
        plan = reshard_plan(params, lay, dataclasses.replace(lay, split=other))
        raw_s = _raw_send_s(plan, trainer.layout.rank, itemsize)
        copy_s = _copy_s(_shard_bytes(trainer))
        trainer.pending_split = other
        gc.collect()
        with PeakRSS() as rss_b:
            t0 = time.perf_counter()
            trainer = resplit(trainer, rebuild)
            t_done = time.perf_counter()
        cost = trainer.last_resplit
        runs.append({
            "plan_s": cost.plan_s, "transfer_s": cost.transfer_s, "build_s": cost.build_s, "total_s": t_done - t0,
            "peak_rss": rss_b.peak, "rss_before": rss_b.before, "bytes_moved": cost.bytes_moved,
            "bytes_minimum": plan.bytes_moved(itemsize), "raw_send_s": raw_s, "shard_copy_s": copy_s,
        })  # fmt: skip
        split, other = other, split
    new = {**runs[0], "repeats": runs}
    row = {"rank": trainer.layout.rank, "old": old, "new": new, "shard": _shard_bytes(trainer)}
    row["shard_before"] = shard_before
    rows = _gather(row)
    if trainer.layout.rank == 0:
        total = sum(p.numel for p in params)
        (out / "resplit.json").write_text(json.dumps({"params": total, "ranks": rows}))
    dist.barrier()


def worker_elastic(shape: Shape, out: Path, old_path: bool = True) -> None:
    """2 ranks: the 4-rank step-1 checkpoint at PP=2 x DP=1, resharded by rank 0 (`old_path`) and then read
    in parallel (rank 0's output goes into its own folder: the saved checkpoint is read by both)."""
    import torch.distributed as dist

    import pretrain_gpt
    from megahet.checkpointing.checkpoint import Restore
    from megahet.checkpointing.elastic import read_resharded, reshard_checkpoint
    from megahet.config import load_config
    from megahet.parallel import initialize_parallel
    from megahet.run_plan import plan_run
    from megahet.runtime.resplit import _free
    from megahet.training import build_trainer

    spec = pretrain_gpt.SPEC
    cfg = load_config([*_args(shape, out), "--train.load", str(out / "ck")])
    plan = plan_run(cfg, spec)
    assert plan.reshard, "the benchmark's checkpoint should need a reshard at 2 ranks"
    layout = initialize_parallel(plan.tp, plan.pp, cfg.train.seed, cfg.parallel.distributed_timeout_minutes)
    old = None
    if old_path:
        with PeakRSS() as rss_a:
            t0 = time.perf_counter()
            resume = reshard_checkpoint(plan.cfg, plan.resume, layout.rank, plan.split, out / "old_elastic")
            t_reshard = time.perf_counter()
            trainer = build_trainer(plan, spec, layout, resume)
            dist.barrier()
            t_done = time.perf_counter()
        old = {
            "reshard_s": t_reshard - t0, "build_s": t_done - t_reshard, "total_s": t_done - t0,
            "peak_rss": rss_a.peak, "rss_before": rss_a.before,
        }  # fmt: skip
        _free(trainer)
        gc.collect()
    read = {}

    def restore(trainer):  # the read, into the built engine: its own peak and time
        with PeakRSS() as rss_read:
            t_read = time.perf_counter()
            restored = resumed.restore(trainer)
            read["s"] = time.perf_counter() - t_read
        read["rss"] = rss_read
        return restored

    with PeakRSS() as rss_b:
        t0 = time.perf_counter()
        resumed = read_resharded(plan.cfg, plan.resume, layout, plan.split)
        assert resumed is not None, "the reshard plan should apply"
        trainer = build_trainer(plan, spec, layout, None, restore=Restore(None, restore))
        dist.barrier()
        t_done = time.perf_counter()
    rss_read = read["rss"]
    new = {
        "read_s": read["s"], "build_s": t_done - t0 - read["s"], "total_s": t_done - t0,
        "read_peak_rss": rss_read.peak, "read_rss_before": rss_read.before, "peak_rss": rss_b.peak,
        "rss_before": rss_b.before, "read_peak_anon": rss_read.peak_anon, "read_anon_before": rss_read.before_anon,
    }  # fmt: skip
    rows = _gather({"rank": layout.rank, "old": old, "new": new, "shard": _shard_bytes(trainer)})
    if layout.rank == 0:
        (out / "elastic.json").write_text(json.dumps({"ranks": rows}))
    dist.barrier()


def _run(shape: Shape, out: Path, old_path: bool = True, repeats: int = 1, ranks: int = 4) -> dict:
    from benchmarks.common import torchrun

    out.mkdir(parents=True, exist_ok=True)
    me = str(Path(__file__).resolve())
    common = ["--worker", "--out", str(out)]
    common += ["--hidden", str(shape.hidden), "--heads", str(shape.heads), "--layers", str(shape.layers)]
    common += ["--old-path"] if old_path else []
    common += ["--repeats", str(repeats)]
    t_resplit = torchrun(me, ranks, [*common, "--case", "resplit"], out / "resplit.log")
    resplit = json.loads((out / "resplit.json").read_text())
    resplit["world"] = ranks
    elastic = None
    if ranks == 4:  # the elastic case reads the 4-rank run's checkpoint at 2 ranks
        t_elastic = torchrun(me, 2, [*common, "--case", "elastic"], out / "elastic.log")
        elastic = json.loads((out / "elastic.json").read_text())
    print(
        f"{out.name}: launched in {t_resplit:.0f} s" + (f" and {t_elastic:.0f} s" if elastic else ""),
        flush=True,
    )
    return {"resplit": resplit, "elastic": elastic}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10M,100M", help=f"of {','.join(SIZES)} (400M: see the docstring)")
    parser.add_argument("--layers", default="8", help="layer counts, comma-separated: each size at each")
    parser.add_argument(
        "--old-sizes",
        default="10M,100M",
        help="sizes at which rank 0's path runs too (it holds the whole model on one host: 400M does not fit 24 GiB)",
    )
    parser.add_argument("--repeats", type=int, default=3,
                        help="the plan's re-splits per size, back and forth, each beside its plain send")  # fmt: skip
    parser.add_argument("--resplit-ranks", type=int, choices=(4, 2), default=4,
                        help="4: PP 2 x DP 2, and the elastic 4 -> 2 case; 2: PP 2 x DP 1, the re-split only (400M fits)")  # fmt: skip
    parser.add_argument("--old-path", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--name", default="reshard_cost")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--heads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        shape = Shape(args.hidden, args.heads, int(args.layers))
        if args.case == "resplit":
            worker_resplit(shape, args.out, args.old_path, args.repeats)
        else:
            worker_elastic(shape, args.out, args.old_path)
        return
    from benchmarks.common import RESULTS, save_results
    from benchmarks.reshard_report import _plot, _rows

    sizes, layer_counts = args.sizes.split(","), [int(n) for n in args.layers.split(",")]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes {unknown[0]}: choose from {','.join(SIZES)}")
    if any(n < 4 or n % 2 for n in layer_counts):
        raise SystemExit(
            f"--layers {args.layers}: even counts of at least 4 (two pipeline stages, one layer moves)"
        )
    work = RESULTS / f"{args.name}_runs"
    rows, raw = [], {}
    for size in sizes:
        for layers in layer_counts:
            key = (size if layer_counts == [8] else f"{size}_{layers}L") + (
                "" if args.resplit_ranks == 4 else "_2r"
            )
            shutil.rmtree(work / key, ignore_errors=True)
            try:
                old_path = size in args.old_sizes.split(",")
                raw[key] = _run(
                    Shape(*SIZES[size], layers), work / key, old_path, args.repeats, args.resplit_ranks
                )
            finally:  # the checkpoints: large (20 GB at 400M), and re-made by a rerun
                for folder in ("ck", "old_resplit", "old_elastic"):
                    shutil.rmtree(work / key / folder, ignore_errors=True)
            rows += _rows(size, raw[key], layers)
    columns = ["size", "layers", "ranks", "params_M", "change", "path", "time_s", "parts", "peak_extra_MiB", "shard_MiB",
               "peak_over_shard", "bytes_MiB", "minimum_MiB"]  # fmt: skip
    meta = {
        "sizes": sizes,
        "layers": layer_counts,
        "old_sizes": args.old_sizes,
        "resplit_ranks": args.resplit_ranks,
    }
    meta["raw"] = raw
    save_results(args.name, rows, columns, meta)
    _plot(rows, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    main()
