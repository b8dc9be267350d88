"""Loading a moved or read state into a stage built fresh (a re-split, a parallel elastic read), in two parts:
`load_weights` into the model before DeepSpeed's engine is made, `load_engine_state` for the rest; and
`release_freed_memory`, which gives the freed memory of the old engine back to the system.

- A trained engine's state (weights, fp32 masters, Adam moments: GPT and Llama shapes, ZeRO-1 and 2)
  written into a fresh model and engine this way equals the original bit for bit, and both loaders
  consume what they write: the state is never held twice over.
- Freed heap memory leaves the process's resident set once released (glibc: a subprocess whose heap
  holds 256 MiB of freed 1 MiB tensors).
- The imports frozen at setup stay out of the release's full collection; a cycle made later is collected.

Run: ``python -m pytest tests/unit/test_state_load.py -q`` (a few seconds).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from tiny_models import LLAMA, TINY_GPT

from megahet.checkpointing.state_slices import engine_state, load_engine_state, load_weights
from megahet.compat import deepspeed_zero as zero
from megahet.config import MegahetConfig, apply_overrides
from megahet.engine import build_engine
from megahet.models.common import local_layer_spec
from megahet.models.gpt import build_gpt
from megahet.platform import _malloc_trim
from megahet.policy.reshard_plan import WEIGHT, Layout, rank_holdings, reshard_plan
from megahet.runtime.resplit import live_params

VOCAB, SEQ = 64, 8


def _trained(extra: dict, zero_stage: int):
    cfg = apply_overrides(MegahetConfig(), {**TINY_GPT, **extra, "model.seq_length": SEQ,
                                            "train.global_batch_size": 2, "train.micro_batch_size": 2,
                                            "parallel.zero_stage": zero_stage})  # fmt: skip
    model = build_gpt(cfg, VOCAB, local_layer_spec(normalization=cfg.model.normalization))
    engine = build_engine(cfg, model, 1, {})
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1))
    positions = torch.arange(SEQ).expand(2, SEQ)
    for _ in range(2):  # Adam's moments and step exist, and differ from a fresh engine's
        loss = engine(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
        engine.backward(loss)
        engine.step()
    return cfg, engine


@pytest.mark.parametrize("preload", [True, False], ids=["two_parts", "engine_only"])
@pytest.mark.parametrize("zero_stage", [1, 2])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_a_state_loaded_in_two_parts_equals_the_original_and_is_consumed(
    world1, arch: str, zero_stage: int, preload: bool
):
    cfg, engine = _trained(LLAMA if arch == "llama" else {}, zero_stage)
    m = cfg.model
    tied = not m.untie_embeddings_and_output_weights
    params = live_params(engine.module, world1, (m.num_layers,), m.activation == "swiglu", tied)
    layout = Layout(1, 1, 1, (m.num_layers,), tied=tied)
    holdings = rank_holdings(params, layout, 0, reshard_plan(params, layout, layout).blocks)
    original = {k: v.clone() for k, v in engine_state(engine, holdings).items()}
    step, lrs = zero.adam_step(engine.optimizer), [g["lr"] for g in engine.optimizer.optimizer.param_groups]
    assert step == 2

    flat = {k: v.clone() for k, v in original.items()}
    model = build_gpt(cfg, VOCAB, local_layer_spec(normalization=m.normalization), initialize=False)
    if preload:  # the weights before the engine is built, as a re-split and the elastic read do
        load_weights(model, holdings, flat)
        assert not any(key == WEIGHT for _, key in flat), "load_weights keeps a copy of the weights"
    fresh = build_engine(cfg, model, 1, {})
    load_engine_state(fresh, holdings, flat, step, lrs, weights_loaded=preload)
    assert flat == {}, f"load_engine_state keeps {sorted(flat)[:3]}"
    loaded = engine_state(fresh, holdings)
    assert sorted(loaded) == sorted(original)
    for k, value in original.items():
        assert torch.equal(loaded[k], value), k
    assert zero.adam_step(fresh.optimizer) == step


def test_the_moments_a_state_is_written_into_are_made_unfilled_and_their_padding_zeroed(world1, monkeypatch):
    """load_engine_state makes Adam's moments without filling them (`prepare_adam(written=True)`: their
    memory becomes resident only as each fragment is written, so a read elastic state and the zeros it
    replaces are not held at once; 1.5x -> 1.25x the own shard at DP 1) and zeroes what no fragment covers
    (ZeRO's alignment padding). Here unfilled memory is NaN: every moment element ends up written or zero."""
    cfg, engine = _trained({}, 1)
    m = cfg.model
    params = live_params(engine.module, world1, (m.num_layers,), False, True)
    layout = Layout(1, 1, 1, (m.num_layers,), tied=True)
    holdings = rank_holdings(params, layout, 0, reshard_plan(params, layout, layout).blocks)
    flat = {k: v.clone() for k, v in engine_state(engine, holdings).items()}
    original = {k: v.clone() for k, v in flat.items()}
    fresh = build_engine(cfg, build_gpt(cfg, VOCAB, local_layer_spec(), initialize=False), 1, {})
    made = []

    def unfilled(tensor):
        made.append(tensor.numel())
        return torch.full_like(tensor, float("nan"))

    zeroed = []

    def zero_padding(optimizer, params, keys):  # this GPT has no padding at DP 1: see the next test
        zeroed.append(tuple(keys))
        real_zero_outside_fragments(optimizer, params, keys)

    real_zero_outside_fragments = zero.zero_outside_fragments
    monkeypatch.setattr(torch, "empty_like", unfilled)
    monkeypatch.setattr(zero, "zero_outside_fragments", zero_padding)
    load_engine_state(fresh, holdings, flat, 2, None)
    monkeypatch.undo()
    assert zeroed == [("exp_avg", "exp_avg_sq")], "the moments' padding was not zeroed"
    inner = fresh.optimizer.optimizer
    flats = getattr(fresh.optimizer, zero.FP32_PARTITIONS)
    assert len(made) == 2 * len(flats), "the moments were made filled"
    covered = sum(zero.hp_fragment(p).hp_fragment_address.numel for p in fresh.module.parameters())
    padding = sum(f.numel() for f in flats) - covered
    for key in ("exp_avg", "exp_avg_sq"):
        values = torch.cat([inner.state[f][key] for f in flats])
        assert not values.isnan().any(), f"{key}: elements neither written nor zeroed"
        assert padding <= int((values == 0).sum()), key
    loaded = engine_state(fresh, holdings)
    assert all(torch.equal(loaded[k], v) for k, v in original.items())


def test_zero_outside_fragments_zeroes_only_the_padding(world1) -> None:
    """A model whose no-weight-decay group (two biases, 9 elements) is padded by ZeRO's alignment."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    cfg = apply_overrides(MegahetConfig(), {"train.global_batch_size": 4, "train.micro_batch_size": 4})
    engine = build_engine(cfg, model, 1, {})
    engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
    engine.step()
    flats = getattr(engine.optimizer, zero.FP32_PARTITIONS)
    state = engine.optimizer.optimizer.state
    for f in flats:
        state[f]["exp_avg"].fill_(float("nan"))
    fragments = [zero.hp_fragment(p) for p in model.parameters()]
    for fragment in fragments:
        zero.fragment_optimizer_state(fragment, engine.optimizer)["exp_avg"].fill_(1.0)
    zero.zero_outside_fragments(engine.optimizer, model.parameters(), ["exp_avg"])
    values = torch.cat([state[f]["exp_avg"] for f in flats])
    assert int((values == 1).sum()) == sum(p.numel() for p in model.parameters())  # fragments untouched
    assert int((values == 0).sum()) == values.numel() - 81 > 0, values  # the padding, zeroed


@pytest.mark.skipif(_malloc_trim() is None, reason="malloc_trim is glibc's")
def test_released_heap_memory_leaves_the_resident_set() -> None:
    """torch's CPU tensors under glibc's mmap threshold live in the heap: once freed, their pages stay
    resident (a tensor allocated after them pins the heap's top) until release_freed_memory trims them."""
    script = textwrap.dedent(
        """
        import torch
        from megahet.platform import release_freed_memory

        def anon_mib():
            with open("/proc/self/statm") as f:
                _, resident, shared, *_ = (int(x) * 4096 for x in f.read().split())
            return (resident - shared) / 2**20

        torch.ones(4 * 2**20)  # a 16 MiB chunk freed: glibc's mmap threshold rises to it
        base = anon_mib()
        held = [torch.ones(2**18) for _ in range(256)]  # 256 x 1 MiB, in the heap
        pin = torch.ones(16)
        del held
        freed = anon_mib()
        release_freed_memory()
        print(base, freed, anon_mib())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    base, freed, released = map(float, out.stdout.split())
    assert freed - base > 200, (base, freed, released)  # freed, yet resident
    assert released - base < 64, (base, freed, released)


def test_frozen_imports_leave_full_collections_cheap_and_later_cycles_collected() -> None:
    """setup() freezes what the imports made (freeze_long_lived_objects): the full collection a move's release
    runs then scans only what the run made, and a reference cycle made later (an old engine) is still
    collected. In a subprocess: freezing this process would freeze pytest's objects."""
    script = textwrap.dedent(
        """
        import gc, weakref
        import megahet.training  # what a run imports: torch, megatron-core, DeepSpeed
        from megahet.platform import freeze_long_lived_objects, release_freed_memory

        tracked = len(gc.get_objects())
        freeze_long_lived_objects()
        class Engine:
            pass
        engine, optimizer = Engine(), Engine()
        engine.optimizer, optimizer.engine = optimizer, engine  # a cycle, as DeepSpeed's engine has
        alive = weakref.ref(engine)
        del engine, optimizer
        release_freed_memory()
        print(tracked, gc.get_freeze_count(), len(gc.get_objects()), alive() is None)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    tracked, frozen, after, collected = out.stdout.split()
    assert int(frozen) > 100_000 and int(frozen) >= int(tracked) * 0.9, out.stdout  # the imports, frozen
    assert int(after) < int(tracked) // 10, out.stdout  # what a full collection still scans
    assert collected == "True", out.stdout  # the cycle made after the freeze was freed


def test_a_resplit_frees_the_old_engine_before_it_builds_the_new_one(world1, tmp_path) -> None:
    """resplit drops its own references to the old engine (its module, optimizer and a weight were held
    as locals: at 109 M the old engine then stayed resident beside the new one, peak 2.1x the own shard),
    so that it is garbage by the time the new stage is built (setup froze the imports out of the garbage
    collector, not the engine it built). One rank, a re-split to the same split."""
    import gc
    import weakref

    from test_resize_executor import _pretrain_vit

    from megahet import training
    from megahet.config import load_config
    from megahet.runtime.resplit import resplit

    vit = _pretrain_vit()
    argv = [
        "--model.num_layers", "2", "--model.hidden_size", "32", "--model.num_attention_heads", "4",
        "--model.patch_size", "7", "--train.micro_batch_size", "4", "--train.global_batch_size", "8",
        "--train.train_iters", "4", "--train.eval_interval", "100", "--train.eval_iters", "1",
        "--logging.wandb", "false", "--logging.log_dir", str(tmp_path / "runs"),
    ]  # fmt: skip
    trainer = training.setup(load_config(argv, defaults=vit.default_config()), vit.SPEC)
    assert gc.get_freeze_count() > 100_000  # setup froze the imports out of the collector; the engine is not
    loss = trainer.train_step()["loss"]
    old_engine, old_optimizer = weakref.ref(trainer.engine), weakref.ref(trainer.engine.optimizer)
    alive_at_build = []

    def rebuild(plan, restore, resplits):
        gc.collect()
        alive_at_build.append((old_engine() is not None, old_optimizer() is not None))
        return training.build_trainer(
            plan, vit.SPEC, trainer.layout, None, trainer.logger, resplits, (), restore
        )

    weights = {n: p.detach().clone() for n, p in trainer.task.model.named_parameters()}
    trainer.pending_split = trainer.plan.split
    trainer = resplit(trainer, rebuild)
    assert alive_at_build == [(False, False)]
    # The moved weights are the trained ones, bit for bit (a bad restore, e.g. fresh initial weights or
    # another layer's, fails here: issue 49, item 7); and the run goes on from them.
    rebuilt = dict(trainer.task.model.named_parameters())
    assert rebuilt.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(rebuilt[name].detach(), value), name
    assert trainer.iteration == 1 and trainer.train_step()["loss"] == pytest.approx(loss, rel=0.5)
