"""Migration composes with pipeline parallelism: TP=2 x PP=2 pretrain_gpt, TP rank 0 of every stage
migrating half of its units to TP rank 1, follows the unmigrated run step for step (real
`pretrain_gpt.py` launches; per-step losses and grad norms from --logging.metrics_file)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from harness import torchrun

STEPS = 10
COMMON = (
    "--parallel.tp 2 --parallel.pp 2 --model.num_layers 4 --model.hidden_size 64 --model.num_attention_heads 4 "
    "--model.seq_length 32 --train.micro_batch_size 4 --train.global_batch_size 16 --train.lr 3e-3 "
    f"--train.train_iters {STEPS} --train.log_interval 1 --train.eval_interval {STEPS} --train.eval_iters 2 "
    "--logging.wandb false"
).split()


def _records(path: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if "loss" in r], next(r for r in rows if "val_loss" in r)


@pytest.fixture(scope="module")
def runs(gpt_data: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("migration_pp")
    results = {}
    # The plain run measures with the balancer (a trace, never a plan): its layer timers ride the 1F1B
    # schedule of every stage without changing a number.
    trace = ["--balance.trace", str(out / "trace.jsonl")]
    for name, extra in (
        ("plain", ["--resize.enabled", "true", *trace]),
        ("migrate", ["--resize.migrate", "0:0.5"]),
    ):
        metrics = out / f"{name}.jsonl"
        args = [
            *COMMON,
            *gpt_data,
            *extra,
            "--logging.metrics_file",
            str(metrics),
            "--logging.log_dir",
            str(out),
        ]
        torchrun("../../pretrain_gpt.py", 4, args, cwd=out, timeout=300)
        results[name] = _records(metrics)
    results["traces"] = [_trace(out / f"trace_stage{stage}.jsonl") for stage in (0, 1)]
    return results


def _trace(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_migration_under_pipeline_parallelism_is_lossless(runs: dict) -> None:
    (plain, plain_val), (migrated, migrated_val) = runs["plain"], runs["migrate"]
    assert len(plain) == len(migrated) == STEPS
    for a, b in zip(plain, migrated):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (
            a["step"],
            a["grad_norm"],
            b["grad_norm"],
        )
    assert math.isclose(plain_val["val_loss"], migrated_val["val_loss"], rel_tol=1e-5)
    # The migration really ran: units moved every step, and the helper did more of the work.
    assert all(r["migration_mb_step_max"] > 0 for r in migrated)
    assert migrated[-1]["block_gflops_max"] > 1.2 * migrated[-1]["block_gflops_min"]
    assert plain[-1]["block_gflops_max"] == plain[-1]["block_gflops_min"]


def test_balancer_measures_every_pipeline_stage(runs: dict) -> None:
    for trace in runs["traces"]:
        assert [r["step"] for r in trace] == list(range(STEPS))
        for r in trace[1:]:
            layers, compute = r["busy_s"][0], r["compute_s"][0]
            assert all(0 < a <= b for a, b in zip(layers, compute)), r
            assert all(w >= 0 for w in r["wait_s"][0]) and r["step_s"] > max(compute)
            assert all(0 < o <= f for o, f in zip(r["optimizer_s"][0], r["fixed_s"][0])), r  # its part
