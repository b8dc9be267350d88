"""Documents placed on context-parallel ranks, predicted: static head-tail CP against the power-of-two rule,
DCP-style blocks and megahet's dynamic placement by cost and speed (megahet/policy/cp_placement.py).

    python benchmarks/cp_placement.py [--batches 64 --cap 4096 --longest 8192 --block 512 --seed 0]

The machine-independent half of issue 45's long-context benchmark, parts (b) and (c): from the same
micro-batches of a long-tail length mix, each planner's per-rank predicted seconds and what crosses ranks.
The step-time half needs the dynamic placement in the runtime (the next step of issue 45).
- **Lengths.** `data.length_mix long` (megahet/data/documents.py): most documents are short (log-normal
  around 256 tokens), and one in 16 comes from a Pareto tail up to `--longest` (8192: 32x the median).
  A micro-batch takes documents until the next would pass
  `--cap` x the ranks' summed speeds (relative to the fastest) tokens: with a slow rank there is room on
  the others for the share it cannot take.
- **Cost.** Costs are megahet's packing cost model, a s^2 + b s seconds per document, with a and b as
  `benchmarks/varlen_cost_fit.py` measured on this CPU (refined row of results/varlen_cost_fit.json).
  A query slice [q0, q1) of a causal document costs a (q1^2 - q0^2) + b (q1 - q0).
- **Exchange.** A K/V token received costs `--kv` x b, i.e. that fraction of computing the token.
- **Ranks.** All at speed 1, or rank 0 at half speed (the 2x slow rank of part (c)).
- **Reported, per CP size, speeds and planner:**
  - the predicted step (the slowest rank, summed over micro-batches) and its speed-up over static CP;
  - the per-rank max / mean of work over speed;
  - E = the capacity ideal (all work over the summed speeds) / the predicted step;
  - the K/V tokens received against static CP's;
  - the largest per-rank token count against the cap;
  - the fraction of documents kept whole (no exchange).

Writes benchmarks/results/cp_placement.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np

from benchmarks.common import RESULTS, save_results
from megahet.data.documents import generated_lengths
from megahet.policy.cp_placement import (
    CPPlan,
    block_plan,
    cp_times,
    dynamic_cp_plan,
    power_of_two_plan,
    slice_cost,
    static_cp_plan,
)
from megahet.policy.packing import DocCost

PLANNERS = ("static", "power_of_two", "block", "dynamic")


def measured_cost() -> DocCost:
    """The CPU's fitted a, b (results/varlen_cost_fit.json's refined row); the micro-batch constant c does
    not move work between CP ranks (every rank runs every micro-batch) and is left out."""
    rows = json.loads((RESULTS / "varlen_cost_fit.json").read_text())["rows"]
    row = next(r for r in rows if r["model"].startswith("profile refined"))
    return DocCost(a=row["a"], b=row["b"], c=0.0)


def long_tail_batches(args, speeds) -> list[list[int]]:
    """Micro-batches of the long-context mix's document lengths (see the module docstring), up to cap x the
    summed speeds (of the fastest's) tokens each: what the ranks' caps hold when each rank's share follows
    its speed."""
    budget = int(args.cap * sum(speeds) / max(speeds))
    lengths = generated_lengths(
        "long", 4 * args.batches * budget, args.seed, longest=min(args.longest, budget)
    )
    batches, current = [], []
    for n in lengths.tolist():
        if current and sum(current) + n > budget:
            batches.append(current)
            if len(batches) == args.batches:
                break
            current = []
        current.append(n)
    return batches


def plan(name: str, lengths: list[int], cp: int, speeds, cost: DocCost, args, kv: float) -> CPPlan:
    if name == "static":
        return static_cp_plan(lengths, cp)
    if name == "power_of_two":
        return power_of_two_plan(lengths, cp, args.cap, cost, speeds)
    fn = block_plan if name == "block" else dynamic_cp_plan
    return fn(lengths, cost, speeds, args.cap, block=args.block, kv_seconds=kv)


def study(args, cp: int, speeds: tuple[float, ...], cost: DocCost) -> list[dict]:
    kv = args.kv * cost.b
    batches = long_tail_batches(args, speeds)
    ideal = sum(slice_cost(cost, 0, n) for b in batches for n in b) / sum(speeds)
    rows = []
    for name in PLANNERS:
        step = kv_tokens = 0.0
        ratios, peak_tokens, whole, docs = [], 0, 0, 0
        for lengths in batches:
            p = plan(name, lengths, cp, speeds, cost, args, kv)
            times = cp_times(p, cost, speeds, kv)
            step += max(times)
            ratios.append(max(times) / (sum(times) / cp))
            kv_tokens += sum(p.kv_tokens())
            peak_tokens = max(peak_tokens, max(p.tokens()))
            whole += sum(p.whole())
            docs += len(lengths)
        rows.append({
            "cp": cp, "speeds": ",".join(f"{v:g}" for v in speeds), "planner": name, "step_s": step,
            "max_mean": float(np.mean(ratios)), "E": ideal / step, "kv_tokens": kv_tokens,
            "max_tokens_vs_cap": peak_tokens / args.cap, "whole_docs": whole / docs,
        })  # fmt: skip
    static = rows[0]
    for row in rows:
        row["speedup_vs_static"] = static["step_s"] / row["step_s"]
        row["kv_vs_static"] = row["kv_tokens"] / static["kv_tokens"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=64, help="micro-batches per CP size")
    parser.add_argument("--cap", type=int, default=4096, help="tokens per CP rank (its activation memory)")
    parser.add_argument("--longest", type=int, default=8192, help="the longest document, tokens")
    parser.add_argument("--block", type=int, default=512, help="block of the block and dynamic planners")
    parser.add_argument("--kv", type=float, default=0.05, help="seconds of a received K/V token, x b")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cost = measured_cost()
    rows = []
    for cp in (2, 4):
        for speeds in ((1.0,) * cp, (0.5,) + (1.0,) * (cp - 1)):
            rows += study(args, cp, speeds, cost)
    columns = ["cp", "speeds", "planner", "speedup_vs_static", "max_mean", "E", "kv_vs_static",
               "max_tokens_vs_cap", "whole_docs"]  # fmt: skip
    save_results("cp_placement", rows, columns, {**vars(args), "a": cost.a, "b": cost.b})


if __name__ == "__main__":
    main()
