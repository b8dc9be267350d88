"""A plan's configuration starts and trains (issue 30; real torchrun launch of pretrain_gpt.py, 4 ranks).

tools/plan.py plans a 4-rank "cluster" of two nodes of 2 GPUs, one node twice as fast as the other, for
the test GPT. The fastest plan's written configuration (`--config plan_01.yaml`) then runs for 4 steps:
the run's layout is the plan's, each replica runs the plan's share of every global batch (more for the
fast node's replicas), and the loss falls.

Run: ``python -m pytest tests/distributed/test_layout_plan.py -q`` (about 30 s on 2 cores)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml
from harness import GPT_MODEL, REPO, torchrun

sys.path.insert(0, str(REPO / "tools"))


def test_the_fastest_plans_config_starts_and_trains(tmp_path: Path, gpt_data: list[str]) -> None:
    from plan import main

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        "nodes:\n"
        "  - {name: fast, gpus: 2, memory_gib: 2, tflops: 0.004, intra_gbps: 1}\n"
        "  - {name: slow, gpus: 2, memory_gib: 2, tflops: 0.002, intra_gbps: 1}\n"
        "network_gbps: 0.5\n"
    )
    common = [*GPT_MODEL, *gpt_data, "--train.global_batch_size", "16", "--plan.micro_batches", "2"]
    assert main(["--cluster", str(cluster), *common, "--top", "1", "--out", str(tmp_path / "plans")]) == 0
    config = tmp_path / "plans" / "plan_01.yaml"
    planned = yaml.safe_load(config.read_text())
    assert planned["hetero"]["dp_shares"] == "declared", planned  # the slow node's replicas get less
    metrics = tmp_path / "metrics.jsonl"
    args = [
        "--config", str(config), *gpt_data, "--train.train_iters", "4", "--train.log_interval", "1",
        "--train.lr", "3e-3", "--train.lr_warmup_iters", "1", "--train.eval_interval", "100",
        "--train.eval_iters", "1", "--logging.wandb", "false", "--logging.metrics_file", str(metrics),
        "--logging.log_dir", str(tmp_path / "runs"),
    ]  # fmt: skip
    output = torchrun(str(REPO / "pretrain_gpt.py"), 4, args, cwd=tmp_path, timeout=300)
    tp, pp = planned.get("parallel", {}).get("tp", 1), planned.get("parallel", {}).get("pp", 1)
    assert f"world 4 = TP {tp} x PP {pp}" in output, output[-2000:]
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    dp = 4 // (tp * pp)
    shares = [int(rows[-1][f"share_dp{r}"]) for r in range(dp)]
    assert sum(shares) == 8 and max(shares) > min(shares), shares  # 16 samples in micro-batches of 2
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
