"""Long context (issue 45), part (a): the longest document that trains within a fixed per-rank memory cap,
at context parallelism CP = 1, 2 and 4.

    python benchmarks/long_context.py                     # ~2 min on 2 cores
    python benchmarks/long_context.py --cap-mib 96 --cps 1,2 --fixed 4096 --granule 256

For each CP, one torchrun launch of CP gloo ranks (CP x DP 1) builds pretrain_gpt.py's model, engine and
Trainer (megahet.training.setup) for a small Llama-shaped GPT (rotary positions, RMSNorm, SwiGLU,
grouped-query attention, fp32) and runs full training steps (forward, backward and the ZeRO optimizer
step) on one synthetic document of a given length, CP-split by pretrain_gpt's own forward step. Memory is
the tensor memory the step holds, counted op by op (benchmarks/memory_tracker.py, not process RSS): a
rank's *peak* counts every tensor alive at its highest point, the resident weights, gradients and
optimizer state included; its *activation bytes* are the storages autograd saved for the backward (the
model's own count), and of those the core attention's share (what its forward saved first: SDPA's inputs,
output and any mask, the gathered keys and values).

The longest length per CP is searched on a grid of `--granule` tokens (a multiple of 2 x cp): grown or
shrunk from a start (CP > 1: CP times CP 1's longest) until bracketed, then bisected; a length fits when
every rank's peak is within `--cap-mib`. The goal: the longest trainable document grows >= 1.8x from CP 1
to CP 2 and >= 3.4x to CP 4. At `--fixed` tokens every CP's peak and activation bytes are reported too,
so that what does not shrink with CP (a mask quadratic in the chunk, the gathered keys) shows.

Writes benchmarks/results/long_context.{json,md}: "memory" holds the rows, "summary" the ratios (shared
with parts (b) and (c) of the benchmark, to come), "meta" the settings and every probed length.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import inspect
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from benchmarks.common import RESULTS, markdown_table
from benchmarks.memory_tracker import MemoryTracker

MiB = 2**20
GOAL = {2: 1.8, 4: 3.4}
"""The longest trainable document at CP c over CP 1's, at least."""

# harness.LLAMA_MODEL's shape at 2 layers and hidden 128, on the 1024-token vocabulary.
MODEL = {
    "model.num_layers": 2, "model.hidden_size": 128, "model.num_attention_heads": 4, "model.num_query_groups": 2,
    "model.ffn_hidden_size": 352, "model.position_embedding_type": "rope", "model.normalization": "RMSNorm",
    "model.activation": "swiglu", "model.untie_embeddings_and_output_weights": "true",
    "model.add_bias_linear": "false", "model.hidden_dropout": 0, "model.attention_dropout": 0,
    "data.vocab_size": 1024, "train.precision": "fp32", "train.micro_batch_size": 1,
    "train.global_batch_size": 1, "train.train_iters": 1000, "train.eval_iters": 1, "train.lr_warmup_iters": 1,
    "train.log_interval": 10**6, "train.eval_interval": 10**6, "logging.wandb": "false",
}  # fmt: skip


def longest_fitting(
    peak: Callable[[int], int], cap: int, granule: int, start: int, limit: int
) -> tuple[int, dict[int, int]]:
    """The longest multiple of `granule` up to `limit` whose `peak(length)` is within `cap` (0 if none),
    for a peak that grows with the length, and every length measured with its peak. From `start` (on the
    grid) it grows by half or halves until the answer is bracketed, then bisects on the grid."""
    top = limit // granule * granule
    seen: dict[int, int] = {}

    def fits(length: int) -> bool:
        if length not in seen:
            seen[length] = peak(length)
        return seen[length] <= cap

    def on_grid(length: float) -> int:
        return min(top, max(granule, round(length / granule) * granule))

    lo, hi = 0, top + granule  # fits at lo (0: none yet), not at hi (top + granule: past the limit)
    length = on_grid(start)
    while True:
        if fits(length):
            lo = length
        else:
            hi = length
        if hi - lo <= granule:
            break
        if hi > top:  # none too long yet: grow by half
            length = on_grid(lo * 1.5)
        elif lo == 0:  # none fits yet: halve
            length = on_grid(hi / 2)
        else:  # bracketed: bisect
            length = (lo + hi) // 2 // granule * granule
    return lo, seen


def document(length: int, vocab: int, generator: torch.Generator) -> dict:
    """pretrain_gpt's micro-batch of one document of `length` random tokens."""
    tokens = torch.randint(0, vocab, (1, length + 1), generator=generator)  # (1, s + 1)
    return {
        "tokens": tokens[:, :-1],  # (1, s)
        "labels": tokens[:, 1:],  # (1, s)
        "loss_mask": torch.ones(1, length),  # (1, s)
        "position_ids": torch.arange(length)[None],  # (1, s)
    }


def synthetic_documents(length: list[int], vocab: int, seed: int = 0) -> Iterator[dict]:
    """Micro-batches of one document of `length[0]` tokens (read at every draw; none kept after it)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield document(length[0], vocab, generator)


class StepProbe:
    """One rank's Trainer with a MemoryTracker on every op of its steps: `measure(length)` runs a training
    step on one document of `length` tokens and returns this rank's figures."""

    def __init__(self, trainer, tracker: MemoryTracker, vocab: int):
        self.trainer, self.tracker = trainer, tracker
        self.length = [0]
        trainer.task.train_data = synthetic_documents(self.length, vocab)
        for name, module in trainer.task.model.named_modules():
            if name.endswith("core_attention"):
                module.register_forward_pre_hook(lambda *_: self._enter("attention"))
                module.register_forward_hook(lambda *_: self._enter("forward"))
        engine_step = trainer.engine.step

        def step(*args, **kwargs):
            self._enter("optimizer")
            return engine_step(*args, **kwargs)

        trainer.engine.step = step

    def _enter(self, region: str) -> None:
        self.tracker.region = region

    def measure(self, length: int) -> dict:
        self.length[0] = length
        for module in self.trainer.task.model.modules():  # a run at one length caches its rotary table once
            forward = getattr(type(module), "forward", None)
            if hasattr(forward, "cache_clear"):
                forward.cache_clear()
        gc.collect()
        tracker = self.tracker
        self._enter("forward")
        tracker.reset()
        resident = tracker.live
        t0 = time.perf_counter()
        with tracker, tracker.saved():
            self.trainer.train_step()
        seconds = time.perf_counter() - t0
        saved_by = tracker.saved_by()
        return {
            "length": length, "peak": tracker.peak, "resident": resident, "saved": tracker.saved_bytes,
            "attention_saved": saved_by.get("attention", 0), "saved_by_region": saved_by,
            "saved_by_op": _top(tracker.saved_by("op")),
            "attention_saved_by_op": _top(tracker.saved_by("op", region="attention")),
            "peak_by_region": tracker.peak_by(),
            "peak_by_op": _top(tracker.peak_by("op")), "step_s": seconds,
        }  # fmt: skip


def _top(by: dict[str, int], n: int = 6) -> dict[str, int]:
    return dict(list(by.items())[:n])


def make_bias_outside_modes() -> None:
    """The CP attention's SDPA path makes a `causal_lower_right` bias per call: a tensor subclass that cannot
    be created under a dispatch mode (its empty base tensor comes back through Python). Make it outside the
    tracker (it holds no bytes; the mask SDPA materializes from it is made, and counted, inside)."""
    from megahet.models import context_parallel

    make = getattr(context_parallel, "causal_lower_right", None)
    if make is None:
        return

    def outside(*size):
        with _disable_current_modes():
            return make(*size)

    context_parallel.causal_lower_right = outside


def choose_cp_attention(variant: str) -> None:
    """--cp-attention: `default` runs what megahet chooses; `sdpa` / `blocks` pass merge=False / True to
    cp_attention (SDPA with a lower-right causal bias / key blocks merged by log-sum-exp), where it takes it."""
    if variant == "default":
        return
    from megahet.models import attention

    if "merge" not in inspect.signature(attention.cp_attention).parameters:
        raise SystemExit(f"--cp-attention {variant}: this cp_attention has no `merge` choice; use default")
    attention.cp_attention = functools.partial(attention.cp_attention, merge=variant == "blocks")


def worker(args) -> None:
    """One CP's launch: set up the Trainer under the tracker, warm up, measure at --fixed, search."""
    import pretrain_gpt
    from megahet.config import load_config
    from megahet.training import setup

    make_bias_outside_modes()
    choose_cp_attention(args.cp_attention)
    values = {**MODEL, "model.seq_length": args.limit, "parallel.cp": args.cp}
    argv = [part for key, value in values.items() for part in (f"--{key}", str(value))]
    tracker = MemoryTracker()
    tracker.region = "setup"
    with tracker:  # the weights, the engine's buffers and the optimizer state count as resident
        trainer = setup(load_config(argv), pretrain_gpt.SPEC)
    probe = StepProbe(trainer, tracker, vocab=int(MODEL["data.vocab_size"]))
    probes: dict[int, list[dict]] = {}  # length -> every rank's figures

    def everywhere(length: int) -> list[dict]:
        """Every rank's figures at `length` (the same list on every rank)."""
        mine = probe.measure(length)
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        if dist.get_rank() == 0:
            peaks = ", ".join(f"{r['peak'] / MiB:.1f}" for r in ranks)
            print(
                f"cp {args.cp}: {length} tokens, peak MiB per rank {peaks}, {mine['step_s']:.1f} s",
                flush=True,
            )
        return ranks

    everywhere(args.granule)  # warm-up: the optimizer state is made at the first step
    fixed = everywhere(args.fixed) if args.fixed else None

    def peak(length: int) -> int:
        if length not in probes:
            probes[length] = fixed if length == args.fixed else everywhere(length)
        return max(r["peak"] for r in probes[length])

    longest, _ = longest_fitting(peak, int(args.cap_mib * MiB), args.granule, args.first, args.limit)
    if dist.get_rank() == 0:
        out = {"cp": args.cp, "longest": longest, "fixed": fixed, "probes": probes}
        args.out.write_text(json.dumps(out, indent=1))
    dist.barrier()


def row(cp: int, kind: str, ranks: list[dict] | None) -> dict:
    """The table's row of one CP at one length: the binding rank's peak (the largest), every figure in MiB."""
    if not ranks:  # no length fits (or no --fixed)
        return {**dict.fromkeys(COLUMNS, ""), "cp": cp, "kind": kind, "length": 0}
    top = max(ranks, key=lambda r: r["peak"])
    saved, attention = top["saved"], top["attention_saved"]
    return {
        "cp": cp, "kind": kind, "length": top["length"], "tokens_per_rank": top["length"] // cp,
        "peak_mib": top["peak"] / MiB, "resident_mib": top["resident"] / MiB,
        "activation_mib": saved / MiB, "attention_mib": attention / MiB,
        "attention_share": attention / saved if saved else 0.0,
        "peak_top_op": next(iter(top["peak_by_op"]), ""), "step_s": top["step_s"],
        "per_rank_peak_mib": [r["peak"] / MiB for r in ranks],
        "per_rank_activation_mib": [r["saved"] / MiB for r in ranks],
        "per_rank_attention_mib": [r["attention_saved"] / MiB for r in ranks],
        "peak_by_region_mib": {k: v / MiB for k, v in top["peak_by_region"].items()},
        "peak_by_op_mib": {k: v / MiB for k, v in top["peak_by_op"].items()},
        "saved_by_op_mib": {k: v / MiB for k, v in top["saved_by_op"].items()},
        "attention_saved_by_op_mib": {k: v / MiB for k, v in top["attention_saved_by_op"].items()},
    }  # fmt: skip


def summary(longest: dict[int, int]) -> dict:
    """max_len_ratio_cp<c>: the longest length at CP c over CP 1's, and whether it meets the goal."""
    out = {}
    for cp, goal in GOAL.items():
        if cp in longest and longest.get(1):
            out[f"max_len_ratio_cp{cp}"] = longest[cp] / longest[1]
            out[f"max_len_goal_cp{cp}"] = goal
            out[f"max_len_goal_met_cp{cp}"] = longest[cp] / longest[1] >= goal
    return out


COLUMNS = [
    "cp", "kind", "length", "tokens_per_rank", "peak_mib", "resident_mib", "activation_mib", "attention_mib",
    "attention_share", "peak_top_op", "step_s",
]  # fmt: skip


def merge_part(out: Path, key: str, rows: list[dict], summary_: dict, meta: dict) -> None:
    """Part `key`'s rows, summary keys and meta into out/long_context.json, the other parts' kept."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "long_context.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = rows
    data["summary"] = {**data.get("summary", {}), **summary_}
    data.setdefault("meta", {})[key] = meta
    path.write_text(json.dumps(data, indent=1))


def save(out: Path, rows: list[dict], summary_: dict, meta: dict) -> None:
    """long_context.json ({"memory": rows, "summary": ..., "meta": ...}, other parts' keys kept) and .md."""
    merge_part(out, "memory", rows, summary_, meta)
    lines = [
        "## (a) Longest document within the per-rank memory cap",
        "",
        (
            f"Cap {meta['cap_mib']} MiB of tensor memory per rank; {meta['model']}; full training steps, fp32, CPU; "
            f"CP attention: {meta['cp_attention']} (commit {meta['code']['commit'][:10]}, source digest "
            f"{meta['code']['cp_attention_sha256']}). MiB per rank, the largest rank's; `activation`: saved for the "
            "backward, `attention`: of it, what the core attention saved first."
        ),
        "",
        markdown_table(rows, COLUMNS),
        "",
        *(
            f"- max_len_ratio_cp{cp}: {summary_[f'max_len_ratio_cp{cp}']:.3g} (goal >= {goal}: "
            f"{'met' if summary_[f'max_len_goal_met_cp{cp}'] else 'missed'})"
            for cp, goal in GOAL.items()
            if f"max_len_ratio_cp{cp}" in summary_
        ),
    ]
    (out / "long_context.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def code_version() -> dict[str, str]:
    """The commit, and a digest of the CP attention's source as it ran (the working tree may differ)."""
    git = ["git", "rev-parse", "HEAD"]
    commit = subprocess.run(git, check=False, cwd=ROOT, capture_output=True, text=True).stdout
    source = b"".join(
        path.read_bytes() for name in ("context_parallel.py", "block_attention.py", "attention.py")
        if (path := ROOT / "megahet/models" / name).exists()
    )  # fmt: skip
    return {"commit": commit.strip(), "cp_attention_sha256": hashlib.sha256(source).hexdigest()[:16]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cap-mib", type=float, default=128.0, help="tensor memory per rank, MiB")
    parser.add_argument("--cps", default="1,2,4", help="context-parallel sizes, comma-separated (1 first)")
    parser.add_argument("--granule", type=int, default=256, help="search grid, tokens (a multiple of 2 x cp)")
    parser.add_argument("--first", type=int, default=2048, help="CP 1's first probed length")
    parser.add_argument("--limit", type=int, default=32768, help="longest length probed (model.seq_length)")
    parser.add_argument("--fixed", type=int, default=4096, help="length at which every CP is also measured")
    parser.add_argument("--cp-attention", choices=("default", "sdpa", "blocks"), default="default",
                        help="CP > 1: what megahet chooses, or SDPA's lower-right bias / log-sum-exp-merged blocks")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from benchmarks.common import torchrun

    cps = [int(c) for c in args.cps.split(",")]
    if any(args.granule % (2 * cp) or args.fixed % (2 * cp) for cp in cps):
        raise SystemExit(
            f"--granule {args.granule} and --fixed {args.fixed}: multiples of 2 x cp for every cp"
        )
    results, t0 = {}, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="long_context_") as runs:  # a failed launch raises with its log
        for cp in cps:
            start = cp * results[1]["longest"] if 1 in results and results[1]["longest"] else args.first
            out = Path(runs) / f"cp{cp}.json"
            flags = ["--worker", "--cp", str(cp), "--out", str(out), "--first", str(start)]
            for key in ("cap_mib", "granule", "limit", "fixed", "cp_attention"):
                flags += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
            wall = torchrun(str(Path(__file__).resolve()), cp, flags, Path(runs) / f"cp{cp}.log")
            results[cp] = json.loads(out.read_text())
            print(f"cp {cp}: longest {results[cp]['longest']} tokens ({wall:.0f} s)", flush=True)
    rows = [row(cp, "longest", results[cp]["probes"].get(str(results[cp]["longest"]))) for cp in cps]
    rows += [row(cp, "fixed", results[cp]["fixed"]) for cp in cps]
    meta = {
        "cap_mib": args.cap_mib, "cps": cps, "granule": args.granule, "limit": args.limit, "fixed": args.fixed,
        "model": "Llama shape, 2 layers, hidden 128, 4 heads / 2 key-value heads, ffn 352, vocab 1024",
        "cp_attention": args.cp_attention, "code": code_version(), "settings": MODEL, "torch": torch.__version__,
        "wall_s": time.perf_counter() - t0,
        "probes": {cp: {n: [r["peak"] for r in ranks] for n, ranks in results[cp]["probes"].items()} for cp in cps},
    }  # fmt: skip
    save(args.out, rows, summary({cp: results[cp]["longest"] for cp in cps}), meta)


if __name__ == "__main__":
    main()
