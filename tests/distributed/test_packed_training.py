"""Packed documents in real `pretrain()` runs: any assignment of documents to replicas and micro-batches
trains exactly as one rank running the whole global batch (issue 28).

Every micro-batch's loss is its token sum; the Trainer scales it by DP / the global batch's tokens, so
every token weighs the same whichever replica and micro-batch hold it. The reference is one rank packing
the global batch (8 documents, pieces of at most 128 tokens) into its own micro-batches; against it,
per step loss and gradient norm, and every parameter after 12 steps, within test_training.py's tolerances:
- DP=2, replica 1 declared 0.4x as fast: the cost planner gives it about 0.4 of the predicted work, so the
  replicas run different numbers of micro-batches (checked in the logged shares), and the packing trace
  (run_packing.jsonl / .png) has a row per step with the slow replica's smaller token count;
- DP=2, documents dealt round-robin (another assignment, the same numbers);
- DP=2, replica 1 capped at 64 tokens per micro-batch (less memory): the longer documents go to replica 0;
- PP=2 x DP=2 with the slow replica and uneven stages (1 and 3 layers): each pipeline runs its own
  number of micro-batches of different lengths (stages exchange activation shapes first);
- TP=2 x DP=2, the slow replica's TP rank 1 migrating half its units to TP rank 0.

Run: python -m pytest tests/distributed/test_packed_training.py -q   (about 2 minutes on 2 idle CPU cores)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import GPT_MODEL, read_records
from test_training import _common, _train, check_run

PACKED = [
    *GPT_MODEL, "--model.seq_length", "128", "--data.packing", "documents", "--data.max_tokens", "128",
    "--train.micro_batch_size", "1", "--data.doc_cost", "2e-9,1e-6,1e-4",
]  # fmt: skip
SLOW = "--parallel.zero_stage 1 --hetero.dp_shares declared --hetero.speeds"


@pytest.fixture(scope="module")
def packed_reference(gpt_data: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    import torch

    tmp = tmp_path_factory.mktemp("packed_reference")
    run = _train(tmp, 1, {"ref": ""}, _common(gpt_data, tmp, PACKED))["ref"]
    run["init_file"] = tmp / "init.pt"
    torch.save(run["init"][0], run["init_file"])
    return run


def _counts(metrics: Path) -> list[tuple[int, int]]:
    records = read_records(metrics)
    return [
        (int(r["share_dp0"]), int(r["share_dp1"])) for _, r in sorted(records.items()) if "share_dp0" in r
    ]


def test_packed_dp2_any_assignment_matches_one_rank(packed_reference: dict, gpt_data, tmp_path: Path):
    metrics, trace = tmp_path / "slow.jsonl", tmp_path / "trace.jsonl"
    variants = {
        "slow": f"{SLOW} 1,0.4 --logging.metrics_file {metrics} --balance.trace {trace}",
        "round_robin": "--parallel.zero_stage 1 --data.packing_strategy round_robin",
        "caps": "--parallel.zero_stage 1 --data.replica_max_tokens 128,64",
    }
    runs = _train(tmp_path, 2, variants, _common(gpt_data, tmp_path, PACKED))
    counts = _counts(metrics)
    assert counts and all(a > b for a, b in counts), counts  # the fast replica runs more micro-batches
    rows = [json.loads(line) for line in (tmp_path / "trace_packing.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(12)) and all(len(r["tokens"]) == 2 for r in rows)
    assert all(r["tokens"][0] > r["tokens"][1] for r in rows)  # the 0.4x replica gets fewer tokens
    assert (tmp_path / "trace_packing.png").stat().st_size > 0
    for name, run in runs.items():
        check_run("packed dp2 vs dp1", f"packed dp2 {name}", run, packed_reference, replicas=2, loaded=False)
        assert [r["tokens"] for r in run["history"]] == [r["tokens"] for r in packed_reference["history"]]


@pytest.mark.parametrize(
    "name, extra",
    [
        ("pp2 x dp2 slow, uneven stages", f"--parallel.pp 2 --parallel.stage_layers 1,3 {SLOW} 1,0.4,1,0.4"),
        ("tp2 x dp2 migrating", f"--parallel.tp 2 --resize.migrate 1.1:0.5 {SLOW} 1,1,0.4,0.4"),
    ],
)
def test_packed_four_rank_layouts_with_a_slow_replica_match_one_rank(
    packed_reference: dict, gpt_data, tmp_path: Path, name: str, extra: str
):
    common = _common(gpt_data, tmp_path, PACKED)
    run = _train(tmp_path, 4, {"run": extra}, common, init=packed_reference["init_file"])["run"]
    check_run(f"packed {name}", f"packed {name}", run, packed_reference, replicas=2, loaded=True)
