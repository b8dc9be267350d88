"""Does megahet's measurement see a GPU that another tenant really slows down? One rank, one GPU.

    python benchmarks/gpu_contention.py [--layers 12 --hidden 1024 --seq 1024 --micro 8] [--steps 30]

pretrain_gpt's trainer with the balancer measuring (`--balance.trace`, mode static: it measures, never
plans) on one GPU, in bf16. Three phases of `--steps` steps each: alone; while a second process runs
bf16 matrix products on the same GPU (multi-tenant contention, no emulation anywhere); alone again.
Per phase, the medians of what the balancer reads (the transformer layers' own compute, `busy_s` in its
trace, timed with CUDA events) and of the step's wall time. Detection means the measured compute rises
with the step time during contention and falls back after it. On CPU it runs as a smoke test (the
competitor then loads the CPU). Writes benchmarks/results/gpu_contention.{md,json}.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

import pretrain_gpt
from benchmarks.common import save_results
from benchmarks.gpu_throughput import base_args, model_parser
from megahet.config import load_config
from megahet.platform import cuda_available
from megahet.training import setup

COMPETITOR = """
import sys, torch
dev = "cuda" if torch.cuda.is_available() else "cpu"
a = torch.randn(8192 if dev == "cuda" else 512, 8192 if dev == "cuda" else 512, device=dev, dtype=torch.bfloat16)
a @ a
print("ready", flush=True)
while True:
    for _ in range(20):
        a @ a
    if dev == "cuda":
        torch.cuda.synchronize()
"""


def main() -> None:
    parser = model_parser(__doc__.split("\n")[0], layers=12, seq=1024, micro=8, accum=1)
    parser.add_argument("--steps", type=int, default=30, help="steps per phase")
    args = parser.parse_args()

    trace = Path(tempfile.mkdtemp()) / "trace.jsonl"
    trainer = setup(load_config([*base_args(args), "--balance.trace", str(trace)]), pretrain_gpt.SPEC)
    for _ in range(3):  # warm-up
        trainer.train_step()
    phases: dict[str, list[dict]] = {}
    for phase in ("alone", "contended", "alone_after"):
        competitor = None
        if phase == "contended":
            competitor = subprocess.Popen(
                [sys.executable, "-c", COMPETITOR], stdout=subprocess.PIPE, text=True
            )
            assert competitor.stdout.readline().strip() == "ready", "the competing process did not start"
        try:
            phases[phase] = [{"step": trainer.iteration, **trainer.train_step()} for _ in range(args.steps)]
        finally:
            if competitor is not None:
                competitor.kill()
                competitor.wait()
    for hook in trainer.step_hooks:
        hook.close()
    busy = {}
    for line in trace.read_text().splitlines():
        row = json.loads(line)
        busy[row["step"]] = row["busy_s"][0][0]  # DP replica 0, TP rank 0: this rank's layers
    rows = []
    for phase, records in phases.items():
        layers = [busy[r["step"]] for r in records if r["step"] in busy]
        rows.append({
            "phase": phase, "steps": len(records), "step_s": statistics.median(r["step_time_s"] for r in records),
            "compute_s": statistics.median(r["compute_s"] for r in records),
            "layers_busy_s": statistics.median(layers) if layers else float("nan"),
        })  # fmt: skip
    for row in rows:
        row["step_vs_alone"] = row["step_s"] / rows[0]["step_s"]
        row["busy_vs_alone"] = row["layers_busy_s"] / rows[0]["layers_busy_s"]
    meta = {
        "layers": args.layers, "hidden": args.hidden, "seq": args.seq, "micro": args.micro,
        "device": torch.cuda.get_device_name() if cuda_available() else "cpu", "trace_rows": len(busy),
    }  # fmt: skip
    columns = ["phase", "steps", "step_s", "compute_s", "layers_busy_s", "step_vs_alone", "busy_vs_alone"]
    save_results("gpu_contention", rows, columns, meta)


if __name__ == "__main__":
    main()
