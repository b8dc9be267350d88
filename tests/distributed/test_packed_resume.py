"""Kill and resume with packed documents on (issue 28), 2 ranks, the real pretrain_gpt path.

DP=2, whole documents packed into micro-batches of up to 128 tokens, the document cost profiled at
start-up and refitted every 2 steps, replica 1 declared 0.5x as fast (the planner gives it less):
1. uninterrupted, 8 steps, saving every 2;
2. the same, slowed, SIGKILLed (launcher and every rank) once its first checkpoint is complete;
3. the killed command again: it resumes from the latest checkpoint, with the saved cost model (no new
   profile) and the data stream at the saved step.
Every resumed step must hold exactly the uninterrupted run's documents (the same token count per step),
planned with the killed run's saved cost model (not a new profile), and its loss, gradient norm and LR
must match the uninterrupted run's to fp32 tolerance: each run profiles its own cost model, so documents
may go to other replicas and micro-batches, and the per-token loss makes that a change of summation
order only.

Run: ``python -m pytest tests/distributed/test_packed_resume.py -q``   (about 40 s on 2 idle cores)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import GPT_MODEL, compare, read_records, torchrun, wait_until_quiet
from test_checkpoint_resume import _run, killed_launch

STEPS = 8
COMMON = [
    *GPT_MODEL,
    "--model.seq_length", "128",
    "--data.packing", "documents",
    "--data.max_tokens", "128",
    "--train.micro_batch_size", "1",
    "--train.global_batch_size", "12",
    "--train.train_iters", str(STEPS),
    "--train.lr_warmup_iters", "2",
    "--train.log_interval", "1",
    "--train.eval_interval", "100",
    "--train.eval_iters", "2",
    "--hetero.interval", "2",
    "--logging.wandb", "false",
]  # fmt: skip
PACKED = "--parallel.zero_stage 1 --hetero.dp_shares declared --hetero.speeds 1,0.5"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, gpt_data: list[str]) -> Path:
    out = tmp_path_factory.mktemp("packed_ckpt")
    common = [*COMMON, *gpt_data]
    (out / "busy").write_text(str(wait_until_quiet(before="the uninterrupted packed run")))
    full = ["--job", _run("full", out, PACKED, save="full")]
    torchrun("workers/ckpt_train.py", 2, ["--out", str(out), *full, "--", *common], cwd=out)
    killed_launch(out, common, PACKED, ckpt="ck")
    resumed = ["--job", _run("resumed", out, PACKED, save="ck", load="ck")]
    torchrun("workers/ckpt_train.py", 2, ["--out", str(out), *resumed, "--", *common], cwd=out)
    return out


def test_packed_resume_continues_with_the_same_documents(runs: Path) -> None:
    full, resumed = read_records(runs / "full.jsonl"), read_records(runs / "resumed.jsonl")
    start = torch.load(runs / "resumed_rank0.pt", weights_only=False)["start"]
    assert 2 <= start < STEPS and sorted(resumed) == list(range(start + 1, STEPS + 1))
    steps = sorted(resumed)
    assert [resumed[s]["tokens_dp0"] + resumed[s]["tokens_dp1"] for s in steps] == [
        full[s]["tokens_dp0"] + full[s]["tokens_dp1"] for s in steps
    ]
    first = steps[0]
    assert resumed[first]["tokens_dp0"] > resumed[first]["tokens_dp1"]  # the 0.5x replica gets less
    killed = read_records(runs / "killed.jsonl")
    assert resumed[first]["cost_a"] == killed[start]["cost_a"]  # the saved model, not a new profile
    last = full[STEPS]  # telemetry: per replica, and the refitted model's error on steps it never saw
    assert all(
        last[f"{k}_dp{r}"] > 0 for k in ("pred_s", "meas_s", "sum_sq", "micro_batches") for r in (0, 1)
    )
    # cost_mape is a fraction (0.1 = 10 %). This run is short, its replicas share 2 cores and one is emulated
    # at half speed: measured 0.28 on a quiet host (benchmarks/varlen_cost_fit.py: 2.2 % on its own runs);
    # a model that does not fit (a wrong sign, a lost term) is off by far more than 0.6. The times are the
    # host's: with other processes on the cores (wait_until_quiet gave up before the run) they scatter, and
    # the bound is 1.0, which such a model still misses (0.636 measured with a busy process on each core).
    busy = float((runs / "busy").read_text())
    bound = 0.6 if busy < 1.0 else 1.0
    print(
        f"cost model error on unseen steps: {last['cost_mape']:.3f} (bound {bound}: {busy:.1f} other runnable)"
    )
    assert 0 <= last["cost_mape"] < bound and last["cost_a"] + last["cost_b"] > 0
    for key in ("loss", "grad_norm", "lr"):
        actual = torch.tensor([resumed[s][key] for s in steps], dtype=torch.float64)
        expected = torch.tensor([full[s][key] for s in steps], dtype=torch.float64)
        compare("packed_resume", f"{key}, steps {first}..{STEPS}", actual, expected, rtol=1e-5)
