"""Lightweight migration in the real training path (pretrain_gpt / pretrain_vit, gloo, CPU), two launches
of workers/migration_train.py, each running several jobs in the same processes:

TP=4 x DP=2, ZeRO-1 (8 ranks; 2 layers, hidden 64, ffn 256, 8 heads = 2 per TP rank, dropout 0):
- one TP rank migrating 50 % and 85 % of its units (MLP units and heads) to the others, GPT and ViT
  on MNIST: the loss at each of 14 steps, the evaluation loss and every rank's final weights equal
  the unmigrated run (same seed, resizable layers, nothing moved) within fp32 tolerance;
- the plan changing mid-run (migrate, move back, other owners and helpers per DP replica via
  `controller.moves`, and a hand-written plan swapping scattered units between two ranks applied
  with `executor.apply()` between steps): the same equality;
- migration composed with resizing (TP rank 0 drops half its units, TP rank 1 migrates half of
  its own): trains, the units no replica computed stay bit-for-bit frozen, and the run equals the
  resize-only run with the same drops;
- bytes: `bytes_plan_change` and `bytes_last_step` of every rank at every step are exactly the
  migrated units' parameter bytes (owner: weights out once per plan change and once per step;
  helper: its guests' gradients back per step), and the logged migration_mb_step follows.

TP=4 x DP=1 (4 ranks): with TP rank 0 migrating to 1 and 2 and TP rank 3 migrating 85 % to 0, each
rank's executed forward FLOPs per block differ from the unmigrated run by exactly (units hosted -
units migrated away) * the hand-computed FLOPs of one unit (MLP unit, attention head).

Numerical note: the K part of linear_qkv's bias has an analytically zero gradient (softmax is
invariant to a per-query constant), so its gradient is pure fp32 rounding noise that AdamW turns
into steps of order lr whose sign depends on the summation order. Those elements are compared with
a loose bound; every other element with the fp32 tolerance.

Run: python -m pytest tests/distributed/test_migration_distributed.py -q   (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import math

import pytest
import torch
from harness import compare, compare_updates, torchrun

ITERS = 14
WEIGHT_REL, WEIGHT_ATOL = 1e-4, 2e-4
HIDDEN, FFN, HEADS, TP = 64, 256, 8, 4
HN = HIDDEN // HEADS
MODEL = [
    "--model.num_layers", "2", "--model.hidden_size", str(HIDDEN), "--model.ffn_hidden_size", str(FFN),
    "--model.num_attention_heads", str(HEADS), "--model.hidden_dropout", "0",
    "--model.attention_dropout", "0", "--model.seq_length", "16",
]  # fmt: skip
TRAIN = [
    "--parallel.tp", str(TP), "--parallel.zero_stage", "1", "--train.lr", "3e-3",
    "--train.lr_warmup_iters", "4", "--train.eval_iters", "1", "--train.micro_batch_size", "8",
    "--train.global_batch_size", "16", "--train.seed", "1234",
]  # fmt: skip
RESIZE = "--resize.gamma 0:0.5 --resize.selection random --resize.reselect_interval 1000"
JOBS8 = {  # name: (task, mode, extra overrides)
    "gpt_base": ("gpt", "plain", "--resize.enabled true"),
    "gpt_m50": ("gpt", "plain", "--resize.migrate 0:0.5"),
    "gpt_m85": ("gpt", "plain", "--resize.migrate 2:0.85@0+3"),
    "gpt_sched": ("gpt", "schedule", "--resize.migrate 0:0.5 --resize.reselect_interval 3"),
    "gpt_resize": ("gpt", "plain", RESIZE),
    "gpt_resize_mig": ("gpt", "plain", RESIZE + " --resize.migrate 1:0.5"),
    "vit_base": ("vit", "plain", "--resize.enabled true"),
    "vit_m50": ("vit", "plain", "--resize.migrate 1:0.5"),
    "vit_m85": ("vit", "plain", "--resize.migrate 3:0.85"),
}
ITERS4 = 6
JOBS4 = {
    "flops_base": ("gpt", "plain", "--resize.enabled true"),
    "flops_mig": ("gpt", "plain", "--resize.migrate 0:0.5@1+2,3:0.85@0"),
}


def _launch(nproc: int, jobs: dict, iters: int, gpt_data: list[str], out) -> dict:
    args = ["--out", str(out)]
    for name, (task, mode, extra) in jobs.items():
        args += ["--job", f"{name}={task}:{mode}:{extra}"]
    args += ["--", *MODEL, *TRAIN, "--train.train_iters", str(iters), *gpt_data]
    args += ["--logging.wandb", "false", "--logging.log_dir", str(out / "runs")]
    torchrun("workers/migration_train.py", nproc, args, cwd=out, timeout=360)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in jobs}


@pytest.fixture(scope="module")
def tp4dp2(gpt_data: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _launch(8, JOBS8, ITERS, gpt_data, tmp_path_factory.mktemp("migration_tp4dp2"))


@pytest.fixture(scope="module")
def tp4dp1(gpt_data: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _launch(4, JOBS4, ITERS4, gpt_data, tmp_path_factory.mktemp("migration_tp4dp1"))


# --- helpers --------------------------------------------------------------------------------------------


def _split_k_bias(weights: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(weights with linear_qkv.bias reduced to its q and v parts, {name: k part})."""
    rest, k_bias = {}, {}
    for name, value in weights.items():
        if name.endswith("linear_qkv.bias"):
            per_head = value.view(-1, 3, HN)  # megatron-core's per-head [q, k, v] layout
            rest[name] = per_head[:, [0, 2]].flatten()
            k_bias[name] = per_head[:, 1].flatten()
        else:
            rest[name] = value
    return rest, k_bias


def _all_weights(result: dict, which: str = "final") -> dict[str, torch.Tensor]:
    """Every rank's shard, named 'dp.tp/parameter' (both runs share the layout)."""
    return {f"{dp}.{tp}/{name}": t for (dp, tp), r in result.items() for name, t in r[which].items()}


def _assert_lossless(test: str, result: dict, reference: dict) -> None:
    """Per-step training loss and gradient norm, evaluation loss and every rank's final weights equal
    the reference's.

    Weights: ||a - b|| <= WEIGHT_REL * ||b - init|| per tensor (how far training moved it), and
    elementwise |a - b| <= WEIGHT_ATOL * max |b|: AdamW divides each gradient element by its own
    running RMS, so the few elements whose gradient is tiny carry the fp32 summation-order noise of the
    partial sums into steps a thousand times larger than their gradient error; norms are not dominated
    by them.
    """
    assert set(result) == set(reference)
    for records in (result, reference):  # every rank reports the same (DP-averaged) loss
        assert len({tuple(s["loss"] for s in r["steps"]) for r in records.values()}) == 1
    steps, ref_steps = result[(0, 0)]["steps"], reference[(0, 0)]["steps"]
    assert len(steps) == ITERS
    for key in ("loss", "grad_norm"):
        actual = torch.tensor([s[key] for s in steps], dtype=torch.float64)
        compare(
            test, f"{key} per step", actual, torch.tensor([s[key] for s in ref_steps], dtype=torch.float64)
        )
    val = next(r["val"] for r in result.values() if r["val"])
    ref_val = next(r["val"] for r in reference.values() if r["val"])
    compare(test, "val loss", torch.tensor(val["val_loss"]), torch.tensor(ref_val["val_loss"]))
    rest, k_bias = _split_k_bias(_all_weights(result))
    rest_ref, k_bias_ref = _split_k_bias(_all_weights(reference))
    rest_init, _ = _split_k_bias(_all_weights(reference, "init"))
    compare_updates(
        test, "final weights (norms), every rank's shard", rest, rest_ref, rest_init, rel=WEIGHT_REL
    )
    compare(test, "final weights, every rank's shard", rest, rest_ref, rtol=1e-5, atol_scale=WEIGHT_ATOL)
    qkv_scale = max(t.abs().max().item() for n, t in _all_weights(reference).items() if "qkv.bias" in n)
    compare(
        test, "final K bias (zero gradient, noise-driven)", k_bias, k_bias_ref, rtol=0, atol=0.02 * qkv_scale
    )
    # The weights did train (the comparison is not between two untouched models).
    assert max((t - rest_init[n]).abs().max().item() for n, t in rest_ref.items()) > 1e-2


def _unit_bytes(kind: str) -> int:
    """fp32 bytes of one unit's parameters: MLP fc1 row + fc1 bias + fc2 column; attention head:
    3 * hn qkv rows + their biases + hn proj columns."""
    floats = 2 * HIDDEN + 1 if kind == "mlp" else 3 * HN * HIDDEN + 3 * HN + HIDDEN * HN
    return 4 * floats


def _expected_bytes(plan: dict, dp: int, tp: int) -> tuple[int, int]:
    """(bytes this rank sends on a plan change, bytes it sends per step) under `plan` (a dict)."""
    pushed = pulled = 0
    for name, owners in plan.get("migrated", {}).items():
        per_unit = _unit_bytes(name.partition(":")[0])
        for key, helpers in owners.items():
            owner_dp, owner_tp = (int(x) for x in key.split(","))
            if owner_dp != dp:
                continue
            for helper, units in helpers.items():
                if owner_tp == tp:
                    pushed += len(units) * per_unit  # weights out
                if int(helper) == tp:
                    pulled += len(units) * per_unit  # its guests' gradients back
    return pushed, pushed + pulled


def _assert_bytes(result: dict) -> list[tuple[int, int]]:
    """Every rank's bytes at every step are the hand-computed ones; returns (plan change, step) bytes seen."""
    seen = []
    for (dp, tp), r in result.items():
        for step, record in enumerate(r["steps"]):
            plan_change, per_step = _expected_bytes(record["plan"], dp, tp)
            assert record["bytes_step"] == per_step, (dp, tp, step, record["bytes_step"], per_step)
            if record["changed"]:
                assert record["bytes_plan_change"] == plan_change, (dp, tp, step)
                seen.append((plan_change, per_step))
        assert r["has_bias"]  # the unit size above counts fc1 / qkv biases
        assert r["metrics"]["migration_mb_step"] == r["steps"][-1]["bytes_step"] / 2**20
    return seen


# --- TP=4 x DP=2 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("job", ["gpt_m50", "gpt_m85", "vit_m50", "vit_m85"])
def test_migration_is_lossless(tp4dp2: dict, job: str) -> None:
    task = job.partition("_")[0]
    result = tp4dp2[job]
    owner, fraction = {"gpt_m50": (0, 0.5), "gpt_m85": (2, 0.85), "vit_m50": (1, 0.5), "vit_m85": (3, 0.85)}[
        job
    ]
    plan = result[(0, 0)]["steps"][0]["plan"]
    assert all(r["steps"][s]["plan"] == plan for r in result.values() for s in range(ITERS))  # one plan
    mlp_units, heads = FFN // TP, HEADS // TP
    for dp in (0, 1):
        mlp = plan["migrated"]["mlp:1"][f"{dp},{owner}"]
        attn = plan["migrated"]["attn:2"][f"{dp},{owner}"]
        assert sum(len(u) for u in mlp.values()) == math.floor(fraction * mlp_units)  # 32 or 54 units
        assert sum(len(u) for u in attn.values()) == 1 == heads - 1  # one of the owner's two heads
        helpers = {int(h) for h in mlp}
        assert owner not in helpers and helpers == ({0, 3} if job == "gpt_m85" else set(range(TP)) - {owner})
    assert set(plan["migrated"]) == {"mlp:1", "mlp:2", "attn:1", "attn:2"}
    _assert_lossless(job, result, tp4dp2[f"{task}_base"])
    _assert_bytes(result)
    # The owner sends exactly the weights of its migrated units.
    owner_record = result[(0, owner)]["steps"][0]
    units = math.floor(fraction * mlp_units)
    assert owner_record["bytes_plan_change"] == 2 * (units * _unit_bytes("mlp") + _unit_bytes("attn"))


def test_plan_changes_mid_run_stay_lossless(tp4dp2: dict) -> None:
    result = tp4dp2["gpt_sched"]
    steps = result[(0, 0)]["steps"]
    changed = [s for s, record in enumerate(steps) if record["changed"]]
    assert changed == [0, 3, 6, 7, 9, 12, 13]  # reselections and the hand-applied plans
    owners = [
        sorted({key for owners in r["plan"].get("migrated", {}).values() for key in owners}) for r in steps
    ]
    assert owners[0] == ["0,0", "1,0"]  # migrate
    assert all(not owners[s] for s in range(3, 6))  # moved back: nothing migrated, nothing sent
    assert all(result[rank]["steps"][s]["bytes_step"] == 0 for rank in result for s in range(3, 6))
    assert owners[6] == ["0,2", "1,1"]  # other owners and helpers, per DP replica
    assert owners[7] == owners[13] == ["0,0", "0,1", "1,1", "1,2"]  # scattered swaps, by hand
    assert owners[9] == ["0,1", "1,0"] and owners[12] == ["0,3", "1,3"]
    assert len({str(r["plan"]) for r in steps}) == 6
    _assert_lossless("gpt_sched", result, tp4dp2["gpt_base"])
    _assert_bytes(result)


def test_migration_composes_with_resizing(tp4dp2: dict) -> None:
    resized, both = tp4dp2["gpt_resize"], tp4dp2["gpt_resize_mig"]
    plan = both[(0, 0)]["steps"][0]["plan"]
    assert plan["blocks"] == resized[(0, 0)]["steps"][0]["plan"]["blocks"]  # the same drops
    assert all(set(entry) == {"0,0", "1,0"} for entry in plan["blocks"].values())  # TP rank 0 drops
    assert all(set(owners) == {"0,1", "1,1"} for owners in plan["migrated"].values())  # TP rank 1 migrates
    assert all(r["steps"][s]["plan"] == plan for r in both.values() for s in range(ITERS))
    # Still trains.
    losses = [s["loss"] for s in both[(0, 0)]["steps"]]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses
    # Units dropped by both DP replicas (no replica computes them) stay frozen bit for bit.
    frozen_units = 0
    for name, entry in plan["blocks"].items():
        kind, _, layer = name.partition(":")
        frozen = sorted(set(entry["0,0"]) & set(entry["1,0"]))
        frozen_units += len(frozen) if kind == "mlp" else 0
        prefix = f"decoder.layers.{int(layer) - 1}."
        params = (
            [("mlp.linear_fc1.weight", 0, 1), ("mlp.linear_fc1.bias", 0, 1), ("mlp.linear_fc2.weight", 1, 1)]
            if kind == "mlp"
            else [
                ("self_attention.linear_qkv.weight", 0, 3 * HN),
                ("self_attention.linear_qkv.bias", 0, 3 * HN),
                ("self_attention.linear_proj.weight", 1, HN),
            ]
        )
        for run in (resized, both):
            for dp in (0, 1):
                r = run[(dp, 0)]
                for suffix, dim, width in params:
                    final, init = r["final"][prefix + suffix], r["init"][prefix + suffix]
                    for u in frozen:
                        assert torch.equal(
                            final.narrow(dim, u * width, width), init.narrow(dim, u * width, width)
                        )
                    kept = next(u for u in range(final.shape[dim] // width) if u not in frozen)
                    assert not torch.equal(
                        final.narrow(dim, kept * width, width), init.narrow(dim, kept * width, width)
                    )
    assert frozen_units > 0
    # The migrated part is lossless: the run equals the resize-only run with the same drops.
    _assert_lossless("gpt_resize_mig", both, resized)
    _assert_bytes(both)


# --- TP=4 x DP=1: FLOPs ---------------------------------------------------------------------------------


def test_helpers_execute_exactly_the_migrated_units_flops(tp4dp1: dict) -> None:
    base, mig = tp4dp1["flops_base"], tp4dp1["flops_mig"]
    plan = mig[(0, 0)]["steps"][0]["plan"]
    r = base[(0, 0)]
    seq, batch = r["seq"], r["global_batch"]
    train_tokens = ITERS4 * batch * seq
    eval_tokens = 1 * 8 * seq  # one evaluation micro-batch, whole model, in both runs
    per_token = {
        "mlp": 2 * HIDDEN + 2 * HIDDEN,  # fc1 row + fc2 column
        "attn": 2 * 3 * HN * HIDDEN + 2 * HIDDEN * HN + 4 * seq * HN,  # qkv rows, proj columns, QK^T + AV
    }
    checked = 0
    for tp in range(TP):
        for name, units in base[(0, tp)]["units"].items():
            kind = name.partition(":")[0]
            # The hand formula is what the layers count: every unit of the unmigrated run.
            assert base[(0, tp)]["flops"][name] == units * per_token[kind] * (train_tokens + eval_tokens)
            owners = plan["migrated"][name]
            away = sum(len(u) for u in owners.get(f"0,{tp}", {}).values())
            hosted = sum(len(u) for helpers in owners.values() for h, u in helpers.items() if int(h) == tp)
            delta = mig[(0, tp)]["flops"][name] - base[(0, tp)]["flops"][name]
            # A helper grows by exactly its guests' FLOPs and an owner shrinks by its migrated units'.
            assert delta == (hosted - away) * per_token[kind] * train_tokens, (tp, name, delta)
            checked += bool(hosted or away)
    # Every block's executed FLOPs summed over the TP group are unchanged.
    for name in base[(0, 0)]["units"]:
        assert sum(mig[(0, tp)]["flops"][name] for tp in range(TP)) == sum(
            base[(0, tp)]["flops"][name] for tp in range(TP)
        )
    # Rank 0 both sends (32 MLP units, 1 head to 1 and 2) and hosts (54 MLP units, 1 head of rank 3).
    assert plan["migrated"]["mlp:1"]["0,0"] == {"1": list(range(32, 48)), "2": list(range(48, 64))}
    assert plan["migrated"]["mlp:1"]["0,3"] == {"0": list(range(10, 64))}
    assert checked == 2 * 4 + 2 * 3  # MLP: ranks 0-3; attention: 0 -> 1 and 3 -> 0
    seen = _assert_bytes(mig)
    assert seen
