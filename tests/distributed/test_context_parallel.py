"""Context parallelism end to end (issue 45, static head-tail CP): pretrain_gpt.py with `--parallel.cp` trains
exactly as the unsplit model does.

Every run trains the same model on the same global batches (shipped data, 4 steps, an evaluation at the
end); the per-step loss and gradient norm and the validation loss of the CP runs equal those of the same
run without CP to fp32 tolerance:
- the GPT (learned positions, tied embeddings) at CP 2 x DP 2 with ZeRO-1 against DP 2 (the evaluation
  reads DP x its iterations' samples): gradients summed over CP and averaged over DP by DeepSpeed (the CP
  ranks are its sequence-parallel ranks); and at CP 2 x PP 2 against PP 2 (a pipeline run initializes
  each stage's layers from its own seed stream, so it is compared with a pipeline run);
- the Llama shape (rotary positions, grouped-query attention, SwiGLU) at TP 2 x CP 2 against one rank;
- CP 2 x DP 2 with uneven DP shares (replica 1 declared at half speed: 3 and 1 micro-batches) against the
  even CP 2 x DP 2 run.

Packed documents (`data.packing documents`): the Llama shape at CP 4 against one rank, each document padded to
a multiple of 8 and split over the 4 ranks (rotary positions per document by megatron-core's thd path); the
CP run also profiles the document cost at start-up on its own chunks. And at TP 2 x CP 2 with dynamic
placement by measured speed (documents whole or cut into blocks, rotary positions per token, keys and values
sent only where needed), which resumes from its step 2 with the measured speeds its checkpoint carries; at
PP 2 x CP 2 against PP 2 (every stage places alike); and at CP 2 x DP 2 with measured DP shares, documents
going to the replicas by speed before each micro-batch is placed over its replica's CP ranks.

Checkpoints do not depend on CP (ZeRO partitions over DP x CP, which DeepSpeed and the reshard see as DP):
the CP 2 x DP 2 run saves at step 2, and resumes from there at CP 2 x DP 2 (bit for bit), at CP 4 x DP 1
(4 ranks: DeepSpeed loads the same 4 ZeRO partitions) and at CP 1 x DP 2 (2 ranks: each reads its own slices of the 4 saved
partitions); steps 3 and 4 follow the uninterrupted run to fp32 tolerance, its validation loss too where
the DP size (how many samples the evaluation reads) is the same.

Run: python -m pytest tests/distributed/test_context_parallel.py -q   (about 5 minutes on 2 cores)
"""

from __future__ import annotations

import pytest
import torch
from harness import (
    GPT_MODEL,
    LLAMA_MODEL,
    compare,
    metrics_job,
    read_records,
    short_run,
    start_from_copy,
    torchrun,
    torchrun_curves,
)

SCRIPT = "../../pretrain_gpt.py"
STEPS = 4


def _curves(out, gpt_data, model, nproc: int, parallel: list[str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    args = [*model, *short_run(STEPS), *gpt_data, *parallel]
    return torchrun_curves(SCRIPT, nproc, args, STEPS, cwd=out, timeout=420)


def _same(test: str, actual: dict, expected: dict) -> None:
    for key in ("loss", "grad_norm", "val_loss"):
        compare(test, key, actual[key], expected[key], rtol=2e-5, atol_scale=1e-6)


@pytest.fixture(scope="module")
def cp2_dp2(tmp_path_factory, gpt_data):
    """The GPT at CP 2 x DP 2 (4 ranks), saving at steps 2 and 4: (its folder, its curves)."""
    out = tmp_path_factory.mktemp("cp2_dp2")
    saves = ["--train.save", str(out / "ck"), "--train.save_interval", "2"]
    return out, _curves(out / "run", gpt_data, GPT_MODEL, 4, ["--parallel.cp", "2", *saves])


@pytest.mark.parametrize("other", ["dp2", "pp2"])
def test_gpt_at_cp2_trains_as_without_cp(tmp_path, gpt_data, cp2_dp2, other):
    """CP 2 x DP 2 against DP 2; CP 2 x PP 2 against PP 2 (megatron-core's schedule sends each stage's
    sequence chunks: its tensor shapes divide by CP)."""
    parallel = {"dp2": [], "pp2": ["--parallel.pp", "2"]}[other]
    reference = _curves(tmp_path / "ref", gpt_data, GPT_MODEL, 2, parallel)
    if other == "dp2":
        split = cp2_dp2[1]
    else:
        split = _curves(tmp_path / "cp", gpt_data, GPT_MODEL, 4, ["--parallel.cp", "2", *parallel])
    _same(f"gpt cp2 x {other}", split, reference)


def test_replicas_of_cp_ranks_take_shares_of_the_batch_by_speed(tmp_path, gpt_data, cp2_dp2):
    """CP 2 x DP 2 with replica 1's ranks (2 and 3) declared at half speed: replica 0 runs 3 of the 4
    micro-batches, replica 1 one; the DP balancer measures each replica over its CP ranks (megatron-core's
    tp-cp-dp-pp order). The steps equal the even run's (itself equal to DP 2 without CP) to fp32 tolerance."""
    shares = ["--hetero.speeds", "1,1,0.5,0.5", "--hetero.dp_shares", "declared"]
    split = _curves(tmp_path / "shares", gpt_data, GPT_MODEL, 4, ["--parallel.cp", "2", *shares])
    _same("gpt cp2 x dp2 shares 3/1", split, cp2_dp2[1])
    records = read_records(tmp_path / "shares" / "torchrun.jsonl")
    assert all((r["share_dp0"], r["share_dp1"]) == (3, 1) for s, r in records.items() if "loss" in r), records
    assert all("speed_dp1" in r for s, r in records.items() if s > 1 and "loss" in r), records


PACKED = ["--model.seq_length", "128", "--data.packing", "documents", "--data.max_tokens", "128"]
PACKED += ["--train.micro_batch_size", "1"]  # after short_run's
DOC_COST = ["--data.doc_cost", "2e-7,1e-6,1e-4"]
PLACED_BY_MEASURED_SPEED = [
    "--parallel.cp", "2", "--parallel.cp_placement", "dynamic", "--parallel.cp_speeds", "measured",
    "--parallel.cp_block", "16", "--balance.window", "1", *DOC_COST,
]  # fmt: skip
"""Dynamic placement over 2 CP ranks by speeds measured every step, in 16-token blocks."""


@pytest.fixture(scope="module")
def packed_reference(tmp_path_factory, gpt_data):
    """The packed Llama on one rank."""
    out = tmp_path_factory.mktemp("packed_ref")
    return _curves(out, gpt_data, LLAMA_MODEL, 1, [*PACKED, "--data.doc_cost", "2e-9,1e-6,1e-4"])


def test_packed_llama_documents_at_cp4_train_as_one_rank(tmp_path, gpt_data, packed_reference):
    split = _curves(tmp_path / "cp", gpt_data, LLAMA_MODEL, 4, [*PACKED, "--parallel.cp", "4"])
    _same("packed llama cp4", split, packed_reference)


def test_packed_llama_documents_placed_by_measured_speed_at_tp2_x_cp2_train_as_one_rank(
    tmp_path, gpt_data, packed_reference
):
    """Dynamic placement: each micro-batch's documents whole on one CP rank or cut into 16-token blocks
    spread by the CP ranks' measured speeds, rotary positions per token, keys and values sent only where
    needed (each TP rank exchanges its own heads' with its CP peer); ZeRO-1 partitions over the 2 CP
    ranks, which sum their gradients; the evaluation is placed too. Every step logs the speeds it measured
    and the keys and values rank 0 received. Resumed from its step 2, the run places step 3 with the speeds
    the checkpoint carries: the ones the uninterrupted run placed it with."""
    placed = ["--parallel.tp", "2", *PLACED_BY_MEASURED_SPEED]
    saves = ["--train.save", str(tmp_path / "ck"), "--train.save_interval", "2"]
    split = _curves(tmp_path / "placed", gpt_data, LLAMA_MODEL, 4, [*PACKED, *placed, *saves])
    _same("packed llama placed tp2 x cp2", split, packed_reference)
    records = read_records(tmp_path / "placed" / "torchrun.jsonl")
    speeds = {step: (r["speed_cp0"], r["speed_cp1"]) for step, r in records.items() if "speed_cp0" in r}
    measured = [v for step, v in speeds.items() if step > 1]
    assert measured and all(0 < min(v) and max(v) == 1.0 for v in measured), speeds  # the fastest is 1
    assert any(v != (1.0, 1.0) for v in measured), f"the speeds were never measured: {speeds}"
    assert any(r.get("cp_kv_tokens", 0) > 0 for r in records.values()), "no document was cut across ranks"

    start_from_copy(tmp_path / "ck", tmp_path / "resumed_ck", "iter_0000002")
    args = [
        *LLAMA_MODEL,
        *short_run(STEPS),
        *gpt_data,
        *PACKED,
        *placed,
        "--train.load",
        str(tmp_path / "resumed_ck"),
    ]
    args, metrics = metrics_job(tmp_path, "resumed", args)
    torchrun(SCRIPT, 4, args, cwd=tmp_path, timeout=420)
    resumed = read_records(metrics)
    assert (resumed[3]["speed_cp0"], resumed[3]["speed_cp1"]) == speeds[3], (resumed[3], speeds)
    for key in ("loss", "grad_norm"):
        actual = torch.tensor([resumed[s][key] for s in (3, 4)], dtype=torch.float64)
        compare("placed tp2 x cp2 resume", key, actual, split[key][2:], rtol=2e-5, atol_scale=1e-6)


def test_packed_documents_over_measured_replicas_then_cp_ranks_train_as_one_rank(
    tmp_path, gpt_data, packed_reference
):
    """The two-stage assignment at CP 2 x DP 2: each step's documents go to the replicas by their measured
    speed (the DP balancer, over each replica's CP ranks), are packed into micro-batches, and each micro-batch
    is placed over its replica's CP ranks by their measured speed."""
    placed = [*PLACED_BY_MEASURED_SPEED, "--hetero.dp_shares", "measured", "--hetero.window", "1"]
    split = _curves(tmp_path / "two_stage", gpt_data, LLAMA_MODEL, 4, [*PACKED, *placed])
    for key in ("loss", "grad_norm"):  # DP 2 evaluates twice the validation samples
        compare("packed llama cp2 x dp2, measured replicas", key, split[key], packed_reference[key],
                rtol=2e-5, atol_scale=1e-6)  # fmt: skip
    records = read_records(tmp_path / "two_stage" / "torchrun.jsonl")
    steps = [r for s, r in records.items() if s > 2 and "loss" in r]
    assert steps and all("speed_dp1" in r and "speed_cp1" in r for r in steps), records


def test_packed_documents_placed_over_cp_ranks_of_pipeline_stages_train_as_without_cp(tmp_path, gpt_data):
    """Dynamic placement at PP 2 x CP 2: every stage places each micro-batch the same way (one set of
    measured CP speeds, gathered over all ranks: each CP rank at its slowest stage), so a stage's CP rank
    receives from the previous stage the slices it holds (megatron-core's variable-length sends). Against
    the packed Llama at PP 2 (a pipeline run seeds each stage's layers from its own stream)."""
    pp = ["--parallel.pp", "2"]
    reference = _curves(tmp_path / "ref", gpt_data, LLAMA_MODEL, 2, [*PACKED, *pp, *DOC_COST])
    split = _curves(tmp_path / "placed", gpt_data, LLAMA_MODEL, 4, [*PACKED, *pp, *PLACED_BY_MEASURED_SPEED])
    _same("packed llama pp2 x cp2 placed", split, reference)
    records = read_records(tmp_path / "placed" / "torchrun.jsonl")
    assert any(r.get("cp_kv_tokens", 0) > 0 for r in records.values()), "no document was cut across ranks"
    assert any((r["speed_cp0"], r["speed_cp1"]) != (1.0, 1.0) for s, r in records.items() if "speed_cp0" in r)


@pytest.mark.parametrize(
    "nproc, cp, resharded",
    [(4, 2, False), (4, 4, False), (2, 1, True)],
    ids=["cp2_dp2", "cp4_dp1", "cp1_dp2"],
)
def test_a_cp_checkpoint_resumes_at_another_cp(tmp_path, gpt_data, cp2_dp2, nproc: int, cp: int, resharded):
    """At the same CP 2 x DP 2 the resumed run is the uninterrupted one bit for bit (weights, ZeRO state,
    RNG streams restored); DP x CP 4 -> 4: DeepSpeed loads the ZeRO partitions as saved; 4 -> 2: each rank
    reads its slices."""
    out, full = cp2_dp2
    start_from_copy(out / "ck", tmp_path / "ck", "iter_0000002")
    args = [
        *GPT_MODEL,
        *short_run(STEPS),
        *gpt_data,
        "--parallel.cp",
        str(cp),
        "--train.load",
        str(tmp_path / "ck"),
    ]
    args, metrics = metrics_job(tmp_path, "resumed", args)
    output = torchrun(SCRIPT, nproc, args, cwd=tmp_path, timeout=420)
    resumed = read_records(metrics)
    assert sorted(s for s, r in resumed.items() if "loss" in r) == [3, 4], sorted(resumed)
    assert ("resharded from" in output) == resharded, output[-3000:]
    same_dp = nproc // cp == 2
    exact = cp == 2  # the same layout: the same reductions in the same order
    for key in ("loss", "grad_norm"):
        actual = torch.tensor([resumed[s][key] for s in (3, 4)], dtype=torch.float64)
        if exact:
            assert actual.tolist() == full[key][2:].tolist(), (key, actual, full[key])
        compare(f"cp2 -> cp{cp} resume", key, actual, full[key][2:], rtol=2e-5, atol_scale=1e-6)
    if same_dp:
        val = torch.tensor([resumed[STEPS]["val_loss"]], dtype=torch.float64)
        compare(f"cp2 -> cp{cp} resume", "val_loss", val, full["val_loss"], rtol=2e-5, atol_scale=1e-6)


def test_llama_with_rope_and_gqa_at_tp2_cp2_trains_as_one_rank(tmp_path, gpt_data):
    """Rotary positions of each rank's chunks, grouped-query heads split over TP and gathered over CP."""
    reference = _curves(tmp_path / "ref", gpt_data, LLAMA_MODEL, 1, [])
    split = _curves(tmp_path / "cp", gpt_data, LLAMA_MODEL, 4, ["--parallel.cp", "2", "--parallel.tp", "2"])
    _same("llama tp2 x cp2", split, reference)
