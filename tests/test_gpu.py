"""GPU smoke tests (marked `gpu`, skipped without CUDA): the same scripts on NCCL, in bf16."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
def test_vit_trains_on_one_gpu_in_bf16(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "pretrain_vit.py", "--train.train_iters", "40", "--train.precision", "bf16",
           "--train.log_interval", "10", "--train.eval_interval", "40", "--logging.wandb", "false",
           "--logging.metrics_file", str(metrics)]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0]
