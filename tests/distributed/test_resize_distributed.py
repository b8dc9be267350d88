"""ZERO-resizing across processes (2 ranks, gloo, CPU), two launches:

workers/resize_equivalence.py (numerics, TP=2 then TP=1 x DP=2 in the same processes):
- gamma = 0 at TP=2: the resizable-spec GPT and ViT are bit-for-bit megatron-core's local-spec
  models built from the same seed (parameters, outputs, TP-gathered gradients);
- gamma > 0 at TP=2 with only one TP rank dropping units (rank 0, and rank 1 for the index mapping):
  output and full gradients equal the TP=1 model whose corresponding global units (local unit u of
  TP rank r = global unit r * units_per_rank + u) are zeroed; the dropping rank's FLOPs fall exactly;
- attention through SDPA equals megatron-core's local attention at TP=2 (GPT and ViT), with heads and
  MLP units dropped and migrated (MIXED_PLAN);
- count-aware averaging at DP=2: replicas that drop different units, all-reduce-meaned (as
  DeepSpeed's DP reduction does), give per unit the mean of the gradients of the replicas that
  computed it, and zero for units neither computed.

workers/resize_train.py (the real training path, TP=2, TP rank 0 resized at gamma 0.5):
- pretrain_gpt (random selection) and pretrain_vit on MNIST (priority selection) train: the loss
  falls by a margin noise cannot produce; the plan is the configured one at every step and changes
  only at reselection steps (priority honours its fairness guard); the resized rank executes
  exactly half the resizable FLOPs in training.

Run: python -m pytest tests/distributed/test_resize_distributed.py -q   (about 50 s on 2 CPU cores)
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from harness import torchrun

# --- helpers ----------------------------------------------------------------------------------------


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 1e-5) -> None:
    """fp32 closeness relative to the tensor's magnitude (TP partial sums change the summation order)."""
    atol = 2e-6 * max(expected.abs().max().item(), 1e-12)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def unit_params(block: tuple[str, int], head_dim: int) -> list[tuple[str, int, int]]:
    """(parameter name, unit axis, unit width) of a block's units in the unsharded model."""
    kind, layer = block
    prefix = f"decoder.layers.{layer - 1}."
    if kind == "mlp":
        return [(prefix + "mlp.linear_fc1.weight", 0, 1), (prefix + "mlp.linear_fc1.bias", 0, 1),
                (prefix + "mlp.linear_fc2.weight", 1, 1)]  # fmt: skip
    return [(prefix + "self_attention.linear_qkv.weight", 0, 3 * head_dim),
            (prefix + "self_attention.linear_qkv.bias", 0, 3 * head_dim),
            (prefix + "self_attention.linear_proj.weight", 1, head_dim)]  # fmt: skip


def unit(tensor: torch.Tensor, dim: int, width: int, u: int) -> torch.Tensor:
    return tensor.narrow(dim, u * width, width)


# --- numerics: one launch ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def numerics(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("resize_equivalence")
    torchrun("workers/resize_equivalence.py", 2, ["--out", str(out)], cwd=out, timeout=240)
    return torch.load(out / "resize_equivalence.pt", weights_only=False)


@pytest.mark.parametrize("kind", ["gpt", "vit"])
def test_gamma0_at_tp2_is_bitwise_the_local_spec_model(numerics: dict, kind: str) -> None:
    local, resizable = numerics[f"gamma0_{kind}"]["local"], numerics[f"gamma0_{kind}"]["resizable"]
    for key in ("params", "grads"):
        assert list(resizable[key]) == list(local[key])
        for name, value in resizable[key].items():
            assert torch.equal(value, local[key][name]), (key, name, (value - local[key][name]).abs().max())
    assert torch.equal(resizable["out"], local["out"])
    # The gathered weights are the full (TP=1) tensors: qkv of all 4 heads, fc1 of all units.
    meta = numerics["meta"]
    assert resizable["params"]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (
        3 * meta["hidden"], meta["hidden"])  # fmt: skip
    assert resizable["params"]["decoder.layers.0.mlp.linear_fc1.weight"].shape == (
        meta["ffn"],
        meta["hidden"],
    )


@pytest.mark.parametrize("dropping", [0, 1])
def test_one_tp_rank_resized_equals_tp1_with_global_units_zeroed(numerics: dict, dropping: int) -> None:
    meta = numerics["meta"]
    resized, reference = numerics[f"tp{dropping}_drops"], numerics[f"ref_tp{dropping}_drops"]
    whole = numerics["gamma0_gpt"]["resizable"]  # same seed, same batch, nothing dropped
    _close(resized["out"], reference["out"], "per-token loss")
    assert (resized["out"] - whole["out"]).abs().max() > 1e-4  # the drops did change the output
    assert list(resized["grads"]) == list(reference["grads"])
    for name, grad in resized["grads"].items():
        _close(grad, reference["grads"][name], f"gradient of {name}")

    # Global index mapping: the zeroed units of the reference are TP rank r's local units + r * per-rank.
    per_rank = {"mlp": meta["ffn"] // 2, "attn": meta["heads"] // 2}
    for block, local in meta["local_drops"].items():
        assert meta["global_drops"][dropping][block] == tuple(
            dropping * per_rank[block[0]] + u for u in local
        )
        for name, dim, width in unit_params(block, meta["head_dim"]):
            for u in meta["global_drops"][dropping][block]:
                assert torch.count_nonzero(unit(resized["grads"][name], dim, width, u)) == 0, (name, u)

    # Only the dropping rank's work shrinks, exactly by the dropped share of each block.
    mine, other = resized["flops"][dropping], resized["flops"][1 - dropping]
    for block, local in meta["local_drops"].items():
        units = per_rank[block[0]]
        assert Fraction(mine[str(block)], other[str(block)]) == Fraction(units - len(local), units), block


@pytest.mark.parametrize("kind", ["gpt", "vit"])
def test_sdpa_equals_local_attention_at_tp2_with_heads_dropped_and_migrated(
    numerics: dict, kind: str
) -> None:
    sdpa, local = numerics[f"mixed_{kind}_sdpa"], numerics[f"mixed_{kind}_local"]
    whole = numerics[f"gamma0_{kind}"]["resizable"]  # same seed and batch, nothing dropped or moved
    _close(sdpa["out"], local["out"], "output")
    assert (sdpa["out"] - whole["out"]).abs().max() > 1e-4  # the plan did change the model
    assert list(sdpa["grads"]) == list(local["grads"])
    for name, grad in sdpa["grads"].items():
        _close(grad, local["grads"][name], f"gradient of {name}")
    # Migrated units' gradients came home: layer 2's head 0 of TP rank 1 (global head 2) has one.
    meta = numerics["meta"]
    qkv = sdpa["grads"]["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert qkv[2 * 3 * meta["head_dim"] : 3 * 3 * meta["head_dim"]].abs().max() > 0


def test_count_aware_averaging_over_dp_replicas_dropping_different_units(numerics: dict) -> None:
    meta = numerics["meta"]
    result = numerics["count_aware"]
    drops = meta["replica_drops"]  # {dp_rank: {block: dropped units}}
    reference = result["replica_reference"]  # {dp_rank: gradients of that replica's zeroed-units model}
    averaged = result["averaged"]
    assert result["plan"]["blocks"]["mlp:1"] == {
        "0,0": list(drops[0][("mlp", 1)]),
        "1,0": list(drops[1][("mlp", 1)]),
    }

    expected = {name: (reference[0][name] + reference[1][name]) / 2 for name in reference[0]}
    kinds = {"both": 0, "one": 0, "none": 0}
    for block in set(drops[0]) | set(drops[1]):
        num_units = meta["ffn"] if block[0] == "mlp" else meta["heads"]
        for name, dim, width in unit_params(block, meta["head_dim"]):
            for u in range(num_units):
                computed_by = [r for r in (0, 1) if u not in drops[r].get(block, ())]
                kinds[{2: "both", 1: "one", 0: "none"}[len(computed_by)]] += 1
                target = unit(expected[name], dim, width, u)
                if computed_by:
                    target.copy_(
                        sum(unit(reference[r][name], dim, width, u) for r in computed_by) / len(computed_by)
                    )
                else:
                    target.zero_()  # computed by neither replica: zero imputation
    assert all(kinds.values()), kinds  # the plan exercises all three cases

    for name, grad in averaged.items():
        _close(grad, expected[name], f"DP-averaged gradient of {name}")
    # Units computed by one replica only: exactly that replica's gradient, not half of it (which a
    # plain DP mean without count-aware scaling would give).
    name, dim, width = unit_params(("mlp", 1), meta["head_dim"])[0]
    u = drops[1][("mlp", 1)][1]  # dropped by replica 1 only
    assert u not in drops[0][("mlp", 1)]
    _close(unit(averaged[name], dim, width, u), unit(reference[0][name], dim, width, u), "one-replica unit")
    assert unit(reference[0][name], dim, width, u).abs().max() > 0
    # Every replica's hooked local gradient: zero for its own dropped units, scaled by 2 = D / k_u for
    # units the other replica dropped.
    hooked = result["replica_hooked"]
    for r in (0, 1):
        for u in drops[r][("mlp", 1)]:
            assert torch.count_nonzero(unit(hooked[r][name], dim, width, u)) == 0
        u = next(u for u in drops[1 - r][("mlp", 1)] if u not in drops[r][("mlp", 1)])
        _close(
            unit(hooked[r][name], dim, width, u), 2 * unit(reference[r][name], dim, width, u), "scaled unit"
        )


# --- training: one launch, GPT and ViT ---------------------------------------------------------------

ITERS, RESELECT = 40, 5
COMMON = [
    "--parallel.tp", "2", "--train.train_iters", str(ITERS), "--train.lr", "3e-3",
    "--train.lr_warmup_iters", "5", "--train.log_interval", "10", "--train.eval_interval", str(ITERS),
    "--train.eval_iters", "4", "--model.num_layers", "2", "--model.hidden_size", "64",
    "--model.num_attention_heads", "4", "--model.ffn_hidden_size", "128", "--model.hidden_dropout", "0",
    "--model.attention_dropout", "0", "--resize.gamma", "0:0.5", "--resize.reselect_interval", str(RESELECT),
]  # fmt: skip
BATCHES = {"gpt": (8, 16), "vit": (16, 32)}  # (micro, global)
JOBS = {
    "gpt": "--model.seq_length 16 --train.micro_batch_size 8 --train.global_batch_size 16 "
    "--resize.selection random",
    "vit": "--train.micro_batch_size 16 --train.global_batch_size 32 --resize.selection priority "
    "--resize.max_drop_steps 10",
}
VOCAB = 1024  # the gpt_data fixture's tokenizer (TP=2 pads to 1024 as well)


@pytest.fixture(scope="module")
def training(gpt_data: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("resize_train")
    args = ["--out", str(out)]
    for name, extra in JOBS.items():
        args += ["--job", f"{name}={name}:{extra}"]
    args += ["--", *COMMON, *gpt_data, "--logging.wandb", "false", "--logging.log_dir", str(out / "runs")]
    torchrun("workers/resize_train.py", 2, args, cwd=out, timeout=300)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in JOBS}


def _check_resized_run(result: dict, task: str) -> list[dict]:
    """Checks common to both tasks; returns TP rank 0's per-step plans."""
    ranks = result["ranks"]
    assert set(ranks) == {(0, 0), (0, 1)}
    resized, whole = ranks[(0, 0)], ranks[(0, 1)]
    assert resized["metrics"]["dropped_frac"] == 0.5 and whole["metrics"]["dropped_frac"] == 0.0
    assert resized["losses"] == whole["losses"]  # both TP ranks see the same loss
    assert len(resized["plans"]) == len(whole["plans"]) == ITERS
    assert whole["plans"] == resized["plans"]  # one plan, identical on every rank
    for step, plan in enumerate(resized["plans"]):
        blocks = plan["blocks"]
        assert set(blocks) == {"attn:1", "mlp:1", "attn:2", "mlp:2"}, step
        for name, entry in blocks.items():
            assert list(entry) == ["0,0"], (step, name)  # only TP rank 0 (of DP replica 0) drops
            assert len(entry["0,0"]) == (32 if name.startswith("mlp") else 1), (step, name)  # of 64 / 2
        if step % RESELECT:
            assert plan == resized["plans"][step - 1], step  # fixed between reselections

    # Work: every block of the resized rank executes exactly half the FLOPs in training; evaluation
    # runs the whole model on both ranks.
    micro, global_batch = BATCHES[task]
    train_samples, eval_samples = ITERS * global_batch, 4 * micro
    ratio = Fraction(train_samples, 2) + eval_samples
    ratio /= train_samples + eval_samples
    for block, flops in resized["flops"].items():
        assert Fraction(flops, whole["flops"][block]) == ratio, block
    return resized["plans"]


def _loss_falls(history: list[dict], initial: float, margin: float) -> None:
    losses = [r["loss"] for r in history]
    assert len(losses) == ITERS and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:4]) / 4, sum(losses[-8:]) / 8
    assert abs(first - initial) < 0.5, (first, initial)  # starts at chance level
    assert first - last > margin, losses
    assert history[-1]["val_loss"] < initial - margin, history[-1]


def test_gpt_trains_with_tp_rank0_resized_random_selection(training: dict) -> None:
    result = training["gpt"]
    plans = _check_resized_run(result, "gpt")
    selections = [plans[s]["blocks"]["mlp:1"]["0,0"] for s in range(0, ITERS, RESELECT)]
    assert len({tuple(s) for s in selections}) == len(selections)  # random: a new draw every time
    _loss_falls(result["history"], math.log(VOCAB), margin=0.6)


def test_vit_trains_with_tp_rank0_resized_priority_selection(training: dict) -> None:
    result = training["vit"]
    plans = _check_resized_run(result, "vit")
    selections = [set(plans[s]["blocks"]["mlp:1"]["0,0"]) for s in range(0, ITERS, RESELECT)]
    assert len(selections[0]) == 32 and selections[0] != set(range(32))  # nothing measured: a uniform draw
    assert selections[1] != selections[0]
    # Fairness guard: max_drop_steps = 10 = two selections, so no unit is dropped three times in a row.
    for a, b, c in zip(selections, selections[1:], selections[2:]):
        assert not a & b & c
    _loss_falls(result["history"], math.log(10), margin=0.4)
    assert result["history"][-1]["val_acc"] > 0.25  # chance is 0.1
