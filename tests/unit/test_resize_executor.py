"""Tests of megahet's ResizeExecutor in one process (TP=1, DP=1, gloo): the gradient policy of dropped
units and the optimizer freeze.

- imputation "zero": dropped units' gradients are exactly 0;
- "average": each dropped unit's gradient is the mean of the kept units' gradients of the same
  parameter (fc1 rows / fc1 bias entries / fc2 columns; qkv rows and biases in groups of 3 * head_dim,
  proj columns in groups of head_dim), over several micro-batches;
- "same": a dropped unit's gradient is its gradient from the last step in which it was computed;
- under "zero", AdamW with weight decay leaves dropped units untouched: with a plain torch AdamW, and
  through DeepSpeed ZeRO-1 / ZeRO-2 in the real training path (`megahet.training.setup` of
  pretrain_vit.py, `Trainer.train_step()`): module weights, DeepSpeed's fp32 master copy and AdamW
  moments, both for units dropped from the first step (moments stay 0) and for units frozen after
  they were trained (moments kept as they were), while the kept units train.

The hooks fire on `.backward()`; steps are driven as the Trainer does: `before_step(optimizer)`,
`optimizer.step()`, `after_step(optimizer)`.

Run: ``python -m pytest tests/unit/test_resize_executor.py -q`` (about 20 s).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from resize_gpt import (
    DROPS,
    FFN,
    HEADS,
    HIDDEN,
    SEED,  # noqa: F401  (the world1 fixture seeds this module's world with it)
    backward,
    batches,
    gpt,
    num_units,
    step,
    unit,
    unit_params,
)
from resize_gpt import plan_of as _plan

from megahet.config import load_config
from megahet.tensor_parallel.executor import ResizeExecutor
from megahet.tensor_parallel.plan import ResizePlan

REPO = Path(__file__).resolve().parents[2]

# --- gradient policy -------------------------------------------------------------------------------


def test_zero_imputation_gives_dropped_units_exactly_zero_gradient(world1) -> None:
    model = gpt()
    executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1, imputation="zero")
    executor.apply(_plan(DROPS))
    backward(model, batches(0))
    params = dict(model.named_parameters())
    for key, dropped in DROPS.items():
        for name, dim, width in unit_params(key):
            grad = params[name].grad
            for u in range(num_units(key)):
                g = unit(grad, dim, width, u)
                if u in dropped:
                    assert torch.count_nonzero(g) == 0, (name, u)
                else:
                    assert torch.count_nonzero(g) > 0, (name, u)


def test_uneven_shares_average_a_units_gradient_over_the_samples_that_computed_it(world1) -> None:
    """Replica 1 drops unit 1; the replicas run 3 and 1 of 4 micro-batches. Replica 0's gradient of unit
    1 is the only one; it covers 3 of the 4 micro-batches, so it is scaled by 4 / 3 (not D / k = 2);
    every other unit by 1; evenly split (2, 2) it is 2 again."""
    key = next(iter(DROPS))
    executor = ResizeExecutor(gpt(), dp_rank=0, tp_rank=0, dp_size=2, imputation="zero")
    executor.apply(ResizePlan({key: {(1, 0): (1,)}}))
    expected = np.ones(num_units(key))
    expected[1] = 2.0
    np.testing.assert_allclose(executor._state[key].scale.numpy(), expected)
    executor.set_shares((3, 1))
    expected[1] = 4 / 3
    np.testing.assert_allclose(executor._state[key].scale.numpy(), expected, rtol=1e-6)
    assert executor.num_microbatches == 3
    executor.set_shares((2, 2))
    expected[1] = 2.0
    np.testing.assert_allclose(executor._state[key].scale.numpy(), expected)
    with pytest.raises(ValueError, match="2 shares for 3"):
        ResizeExecutor(gpt(), dp_rank=0, tp_rank=0, dp_size=3).set_shares((2, 2))


def test_average_imputation_is_the_mean_of_kept_units(world1) -> None:
    model, zero_model = gpt(), gpt()
    executor = ResizeExecutor(
        model, dp_rank=0, tp_rank=0, dp_size=1, imputation="average", num_microbatches=2
    )
    zero_executor = ResizeExecutor(zero_model, dp_rank=0, tp_rank=0, dp_size=1, imputation="zero")
    executor.apply(_plan(DROPS))
    zero_executor.apply(_plan(DROPS))
    micro = batches(1)
    backward(model, micro)  # two micro-batches: the hooks impute per micro-batch, the sum stays a mean
    backward(zero_model, micro)
    params, zero_params = dict(model.named_parameters()), dict(zero_model.named_parameters())
    checked = 0
    for key, dropped in DROPS.items():
        kept = [u for u in range(num_units(key)) if u not in dropped]
        for name, dim, width in unit_params(key):
            grad = params[name].grad
            mean = torch.stack([unit(grad, dim, width, u) for u in kept]).mean(dim=0)
            assert mean.abs().max() > 0, name
            for u in dropped:
                torch.testing.assert_close(
                    unit(grad, dim, width, u), mean, rtol=1e-5, atol=1e-6 * mean.abs().max()
                )
                checked += 1
            for u in kept:  # kept units carry their own, unaltered gradient
                assert torch.equal(unit(grad, dim, width, u), unit(zero_params[name].grad, dim, width, u)), (
                    name,
                    u,
                )
    assert checked == 3 * sum(len(d) for d in DROPS.values())
    # Parameters outside the resizable units are untouched by the policy.
    for name, param in params.items():
        if (
            "linear_fc1" not in name
            and "linear_qkv" not in name
            and not name.endswith(("fc2.weight", "proj.weight"))
        ):
            assert torch.equal(param.grad, zero_params[name].grad), name


def test_same_imputation_reuses_the_last_computed_gradient(world1) -> None:
    model = gpt()
    executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1, imputation="same", num_microbatches=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    mlp, attn = ("mlp", 1), ("attn", 2)
    first = {mlp: (0, 1, 2, 3), attn: (1,)}
    second = {mlp: (2, 3, 4, 5), attn: (1, 2)}  # 2, 3 / head 1: dropped twice; 4, 5 / head 2: newly

    # Dropped before ever being computed: nothing measured yet, gradient 0.
    fresh = gpt()
    fresh_executor = ResizeExecutor(
        fresh, dp_rank=0, tp_rank=0, dp_size=1, imputation="same", num_microbatches=2
    )
    fresh_executor.apply(_plan(first))
    g0 = step(fresh, fresh_executor, torch.optim.SGD(fresh.parameters(), lr=0.05), batches(10))

    executor.apply(ResizePlan())
    g_a = step(model, executor, optimizer, batches(11))  # every unit computed
    executor.apply(_plan(first))
    g_b = step(model, executor, optimizer, batches(12))
    executor.apply(_plan(second))
    g_c = step(model, executor, optimizer, batches(13))

    for key in (mlp, attn):
        for name, dim, width in unit_params(key):
            for u in first[key]:
                assert torch.count_nonzero(unit(g0[name], dim, width, u)) == 0, (name, u)
                assert torch.equal(unit(g_b[name], dim, width, u), unit(g_a[name], dim, width, u)), (name, u)
            for u in second[key]:
                last = g_a if u in first[key] else g_b  # the last step that computed u
                assert torch.equal(unit(g_c[name], dim, width, u), unit(last[name], dim, width, u)), (name, u)
                assert unit(last[name], dim, width, u).abs().max() > 0
            # Kept units got fresh gradients (different data each step).
            u = next(u for u in range(num_units(key)) if u not in first[key] + second[key])
            assert not torch.equal(unit(g_c[name], dim, width, u), unit(g_b[name], dim, width, u))


def test_unit_gradient_statistics_input(world1) -> None:
    """The priority statistics' input: per unit, this rank's gradient of the step over all of the
    unit's parameters (column weight rows, column bias, row weight columns), 0 for dropped units."""
    model = gpt()
    executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1, track_gradients=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    executor.apply(_plan(DROPS))
    for i in range(2):
        grads = step(model, executor, optimizer, batches(40 + i))
        for key, dropped in DROPS.items():
            tracked = executor.unit_gradients[key]  # (units, elements)
            for u in range(num_units(key)):
                expected = torch.cat(
                    [unit(grads[n], dim, w, u).reshape(-1) for n, dim, w in unit_params(key)]
                )
                torch.testing.assert_close(tracked[u], expected.float(), rtol=1e-6, atol=0.0)
            assert (tracked[list(dropped)] == 0).all()
            assert (tracked.abs().sum(1) > 0).sum() == num_units(key) - len(dropped)
            assert executor.computed_units(key).tolist() == [u not in dropped for u in range(num_units(key))]


def test_sampled_statistics_follow_the_same_elements_of_every_unit(world1) -> None:
    """score_samples=k: each unit's tracked gradient (and weights) is the full one at k fixed coordinates (the same
    for every unit, and for every executor: seeded by the block), so memory and time do not grow with
    the model; k >= a unit's size (or 0) is every element."""
    from megahet.tensor_parallel.executor import _sample_elements

    model = gpt()
    full = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1, track_gradients=True, track_weights=True)
    sampled = ResizeExecutor(
        model, dp_rank=0, tp_rank=0, dp_size=1, track_gradients=True, track_weights=True, score_samples=40
    )
    no_weights = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1, track_gradients=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for executor in (full, sampled):
        executor.apply(_plan(DROPS))
    backward(model, batches(50))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}  # the forward pass's weights
    for executor in (full, sampled, no_weights):
        executor.before_step(optimizer)
        executor.after_step(optimizer)
    assert no_weights.unit_weights == {}  # only the taylor score needs the weights: none sampled
    for key, block in full.blocks.items():
        for u in range(num_units(key)):  # the taylor term's weights: the unit's, as gradients are laid out
            weights = torch.cat([unit(params[n], dim, w, u).reshape(-1) for n, dim, w in unit_params(key)])
            torch.testing.assert_close(full.unit_weights[key][u], weights.float(), rtol=0.0, atol=0.0)
        sizes = [up.units(up.param).shape[1:].numel() for up in block.unit_params]
        index = _sample_elements(block, 40)
        assert sum(len(ix[0]) for ix in index.values()) == 40
        again = _sample_elements(sampled.blocks[key], 40).values()  # another executor's blocks
        assert all(torch.equal(a, b) for x, y in zip(index.values(), again) for a, b in zip(x, y))
        offsets = torch.tensor([0, *sizes[:-1]]).cumsum(0).tolist()
        columns = torch.cat(
            [
                off
                + torch.tensor(
                    np.ravel_multi_index([i.numpy() for i in index[up]], up.units(up.param).shape[1:])
                )
                for up, off in zip(block.unit_params, offsets)
            ]
        )
        torch.testing.assert_close(sampled.unit_gradients[key], full.unit_gradients[key][:, columns])
        torch.testing.assert_close(sampled.unit_weights[key], full.unit_weights[key][:, columns])
        assert sampled.unit_gradients[key].shape == (num_units(key), 40)
        assert set(_sample_elements(block, sum(sizes)).values()) == {None}  # the whole unit
        assert set(_sample_elements(block, 0).values()) == {None}


def test_unknown_imputation_is_rejected(world1) -> None:
    with pytest.raises(ValueError, match="imputation must be zero, same or average"):
        ResizeExecutor(torch.nn.Linear(2, 2), dp_rank=0, tp_rank=0, dp_size=1, imputation="mean")


# --- zero policy: AdamW does not move dropped units --------------------------------------------------


def _units_of(tensors: dict[str, torch.Tensor], drops) -> dict[tuple[str, int, int], torch.Tensor]:
    out = {}
    for key, dropped in drops.items():
        for name, dim, width in unit_params(key):
            for u in dropped:
                out[(name, u, dim)] = unit(tensors[name], dim, width, u).clone()
    return out


def _adam_state(optimizer, model, key: str) -> dict[str, torch.Tensor]:
    return {
        n: optimizer.state[p][key] if p in optimizer.state else torch.zeros_like(p)
        for n, p in model.named_parameters()
    }


def test_torch_adamw_with_weight_decay_leaves_dropped_units_untouched(world1) -> None:
    model = gpt()
    executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1, imputation="zero")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    executor.apply(_plan(DROPS))
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    for i in range(3):
        step(model, executor, optimizer, batches(20 + i))
    w = {n: p.detach() for n, p in model.named_parameters()}
    m, v = _adam_state(optimizer, model, "exp_avg"), _adam_state(optimizer, model, "exp_avg_sq")
    for key, dropped in DROPS.items():
        kept = [u for u in range(num_units(key)) if u not in dropped]
        for name, dim, width in unit_params(key):
            for u in dropped:
                assert torch.equal(unit(w[name], dim, width, u), unit(w0[name], dim, width, u)), (name, u)
                assert torch.count_nonzero(unit(m[name], dim, width, u)) == 0, (name, u)
                assert torch.count_nonzero(unit(v[name], dim, width, u)) == 0, (name, u)
            for u in kept:
                assert not torch.equal(unit(w[name], dim, width, u), unit(w0[name], dim, width, u)), (name, u)
                assert torch.count_nonzero(unit(v[name], dim, width, u)) > 0, (name, u)

    # Control: the same steps without the executor's freeze let weight decay shrink the dropped units.
    control = gpt()
    control_executor = ResizeExecutor(control, dp_rank=0, tp_rank=0, dp_size=1, imputation="zero")
    control_executor.apply(_plan(DROPS))
    control_opt = torch.optim.AdamW(control.parameters(), lr=1e-2, weight_decay=0.5)
    for i in range(3):
        control_opt.zero_grad()
        backward(control, batches(20 + i))
        control_opt.step()
    name, dim, width = unit_params(("mlp", 1))[0]
    u = DROPS[("mlp", 1)][0]
    moved = unit(dict(control.named_parameters())[name].detach(), dim, width, u)
    assert not torch.equal(moved, unit(w0[name], dim, width, u))


def test_torch_adamw_units_frozen_after_training_keep_weights_and_moments(world1) -> None:
    model = gpt()
    executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1, imputation="zero")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    for i in range(2):
        step(model, executor, optimizer, batches(30 + i))  # every unit trains: moments become nonzero

    def snapshot():
        state = {n: p.detach() for n, p in model.named_parameters()}
        return [_units_of(t, DROPS) for t in (state, _adam_state(optimizer, model, "exp_avg"),
                                               _adam_state(optimizer, model, "exp_avg_sq"))]  # fmt: skip

    before = snapshot()
    assert all(torch.count_nonzero(t) > 0 for t in before[1].values())
    executor.apply(_plan(DROPS))
    for i in range(2):
        step(model, executor, optimizer, batches(32 + i))
    after = snapshot()
    for what, b, a in zip(("weights", "exp_avg", "exp_avg_sq"), before, after):
        for k in b:
            assert torch.equal(a[k], b[k]), (what, k)
    # Lifted: the frozen units train again from where they were.
    executor.apply(ResizePlan())
    step(model, executor, optimizer, batches(34))
    resumed = snapshot()
    for k in before[0]:
        assert not torch.equal(resumed[0][k], before[0][k]), k


# --- zero policy through DeepSpeed ZeRO-1 / ZeRO-2 in the real training path ------------------------


def _pretrain_vit():
    spec = importlib.util.spec_from_file_location("pretrain_vit", REPO / "pretrain_vit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ds_state(model, names, stepped: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """Module weights, DeepSpeed's fp32 master and AdamW moments (no state, i.e. 0, before any step)."""
    params = dict(model.named_parameters())
    out = {"module": {}, "master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name in names:
        p = params[name]
        out["module"][name] = p.detach().clone()
        out["master"][name] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[key][name] = safe_get_full_optimizer_state(p, key).clone() if stepped else torch.zeros_like(p)
    return out


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_deepspeed_zero_leaves_dropped_units_untouched(world1, tmp_path: Path, zero_stage: int) -> None:
    from megahet.training import setup

    vit = _pretrain_vit()
    argv = [
        "--model.num_layers", "2", "--model.hidden_size", str(HIDDEN), "--model.num_attention_heads",
        str(HEADS), "--model.ffn_hidden_size", str(FFN), "--model.hidden_dropout", "0",
        "--model.attention_dropout", "0", "--train.micro_batch_size", "8", "--train.global_batch_size", "16",
        "--train.train_iters", "10", "--train.lr", "3e-3", "--train.lr_warmup_iters", "1",
        "--train.weight_decay", "0.5", "--parallel.zero_stage", str(zero_stage),
        "--resize.gamma", "0:0.5", "--resize.reselect_interval", "1000",
        "--logging.wandb", "false", "--logging.log_dir", str(tmp_path / "runs"),
    ]  # fmt: skip
    trainer = setup(load_config(argv, defaults=vit.default_config()), vit.SPEC)
    (controller,) = trainer.step_hooks
    model = trainer.task.model
    assert trainer.engine.zero_optimization_stage() == zero_stage
    names = [name for key in DROPS for name, _, _ in unit_params(key)]
    start = _ds_state(model, names, stepped=False)

    losses = [trainer.train_step()["loss"] for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    plan = controller.executor.plan
    drops = {key: plan.dropped(key, 0, 0) for key in DROPS}
    assert {key: len(units) for key, units in drops.items()} == {
        ("mlp", 1): FFN // 2, ("attn", 1): HEADS // 2, ("attn", 2): HEADS // 2, ("mlp", 2): FFN // 2
    }  # fmt: skip
    now = _ds_state(model, names)
    for key, dropped in drops.items():
        kept = [u for u in range(num_units(key)) if u not in dropped]
        for name, dim, width in unit_params(key):
            for u in dropped:
                for what in ("module", "master"):
                    assert torch.equal(unit(now[what][name], dim, width, u), unit(start[what][name], dim, width, u)), (
                        what, name, u)  # fmt: skip
                for what in ("exp_avg", "exp_avg_sq"):
                    assert torch.count_nonzero(unit(now[what][name], dim, width, u)) == 0, (what, name, u)
            for u in kept:
                for what in ("module", "master"):
                    assert not torch.equal(
                        unit(now[what][name], dim, width, u), unit(start[what][name], dim, width, u)
                    )
                assert torch.count_nonzero(unit(now["exp_avg_sq"][name], dim, width, u)) > 0, (name, u)
            assert torch.equal(now["module"][name], now["master"][name]), name  # fp32: module == master

    # Freeze units that have trained (nonzero moments): weights, master and moments stay as they were.
    later = {key: tuple(u for u in range(num_units(key)) if u not in dropped)[-len(dropped) :]
             for key, dropped in drops.items()}  # fmt: skip
    controller.executor.apply(_plan(later))
    before = _ds_state(model, names)
    for _ in range(2):
        trainer.train_step()
    after = _ds_state(model, names)
    for key, frozen in later.items():
        for name, dim, width in unit_params(key):
            for u in frozen:
                for what in ("module", "master", "exp_avg", "exp_avg_sq"):
                    b, a = unit(before[what][name], dim, width, u), unit(after[what][name], dim, width, u)
                    assert torch.equal(a, b), (what, name, u)
                assert torch.count_nonzero(unit(before["exp_avg_sq"][name], dim, width, u)) > 0
            for u in drops[key]:  # computed again: they train
                assert not torch.equal(
                    unit(after["module"][name], dim, width, u), unit(before["module"][name], dim, width, u)
                )
