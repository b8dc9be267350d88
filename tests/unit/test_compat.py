"""Checks that the installed libraries still have every private API megahet/compat/ relies on.

One test per reach into another library, each failing with a line that names what changed: a version
bump of DeepSpeed, megatron-core or torch then fails here, not deep inside training. Each exercises the
behaviour megahet relies on (issue 49, item 10), not only that a name exists: DeepSpeed's engine reads
its checkpoint files through the loader megahet routes, zero_to_fp32 through the one it is given; its
ZeRO-1 gradient norm skips a parameter flagged as a pipeline copy; megatron-core's schedule opens and
closes the compute timers by the names megahet's clock listens to; every collective of the list, and
megatron-core's bound copies, run through the wrapper while it is installed and not after.

Run: ``python -m pytest tests/unit/test_compat.py -q``
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from megahet.compat import deepspeed_checkpoint


def _has(owner, name: str, what: str) -> object:
    assert hasattr(owner, name), f"{what}: {getattr(owner, '__name__', owner)} has no `{name}` any more"
    return getattr(owner, name)


def test_deepspeed_checkpoint_engine_load_takes_a_path_and_map_location() -> None:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    load = _has(TorchCheckpointEngine, "load", "DeepSpeed checkpoint engine")
    params = list(inspect.signature(load).parameters)
    assert params[1:3] == ["path", "map_location"], (
        f"TorchCheckpointEngine.load's arguments changed: {params}"
    )


def test_engine_loads_with_routes_and_restores() -> None:
    class _CkptEngine:
        def load(self, path, map_location=None):
            return ("original", path)

    engine = type("Engine", (), {})()
    engine.checkpoint_engine = _CkptEngine()
    with deepspeed_checkpoint.engine_loads_with(engine, lambda path, map_location=None: ("safe", path)):
        assert engine.checkpoint_engine.load("f", map_location="cpu") == ("safe", "f")
    assert engine.checkpoint_engine.load("f") == ("original", "f")


def test_zero_fp32_state_dict_reads_only_through_the_given_loader(tmp_path: Path) -> None:
    """A loader that refuses everything is the only reader zero_to_fp32 uses; torch is restored after."""
    from deepspeed.utils import zero_to_fp32

    (tmp_path / "tag").mkdir()
    torch.save({}, tmp_path / "tag" / "mp_rank_00_model_states.pt")
    torch.save({}, tmp_path / "tag" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    seen = []

    def refuse(path, **kwargs):
        seen.append(Path(path).name)
        raise PermissionError(path)

    with pytest.raises(PermissionError):
        deepspeed_checkpoint.zero_fp32_state_dict(tmp_path, "tag", refuse)
    assert seen and zero_to_fp32.torch is torch


@pytest.mark.parametrize("saved", deepspeed_checkpoint.SAVED_TYPES, ids=lambda t: t.__name__)
def test_deepspeed_saved_types_still_exist_where_its_files_name_them(saved: type) -> None:
    import importlib

    module = importlib.import_module(saved.__module__)
    assert getattr(module, saved.__qualname__, None) is saved, (
        f"{saved.__module__}.{saved.__qualname__} moved"
    )


# --- DeepSpeed ZeRO-1/2's per-parameter links and file layout (megahet/compat/deepspeed_zero.py) ----


@pytest.fixture(scope="module")
def zero_engine(world1):
    """A ZeRO-1 DeepSpeed engine (AdamW, two parameter groups) after two optimizer steps."""
    from megahet.config import MegahetConfig, apply_overrides
    from megahet.engine import build_engine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    cfg = apply_overrides(MegahetConfig(), {"train.global_batch_size": 4, "train.micro_batch_size": 4})
    engine = build_engine(cfg, model, 1, {})
    for _ in range(2):
        engine.zero_grad()
        engine(torch.randn(4, 8)).pow(2).mean().backward()
        engine.step()
    return engine


def test_zero_parameters_link_to_their_fp32_fragment(zero_engine) -> None:
    import numpy as np

    from megahet.compat import deepspeed_zero as zero

    weight = zero_engine.module[0].weight
    fragment = zero.hp_fragment(weight)
    assert fragment is not None, "ZeRO-1 parameters have no `_hp_mapping` any more"
    for name in (
        "lp_fragment_address",
        "hp_fragment_address",
        "hp_fragment",
        "optim_fragment",
        "param_group_index",
    ):
        _has(fragment, name, "ZeRO fragment")
    _has(fragment, "set_optim_state_fragment", "ZeRO fragment")
    local = zero.fragment_local_offsets(fragment, np.array([0, 3, 63]))
    assert local.tolist() == [0, 3, 63], "the fragment's address no longer maps the parameter's offsets"
    assert torch.equal(fragment.hp_fragment.view(-1)[local], weight.detach().view(-1)[[0, 3, 63]])
    states = zero.fragment_optimizer_state(fragment, zero_engine.optimizer)
    assert set(states) >= {"exp_avg", "exp_avg_sq"}, (
        f"fragment optimizer state keys changed: {sorted(states)}"
    )
    bias = zero.hp_fragment(zero_engine.module[0].bias)  # the no-weight-decay group: linked here if needed
    assert set(zero.fragment_optimizer_state(bias, zero_engine.optimizer)) >= {"exp_avg", "exp_avg_sq"}


def test_zero_optimizer_has_partitions_and_lazy_linking(zero_engine) -> None:
    from megahet.compat import deepspeed_zero as zero

    optimizer = zero_engine.optimizer
    _has(optimizer, zero.FP32_PARTITIONS, "ZeRO optimizer")
    _has(optimizer, "optimizer", "ZeRO optimizer")
    _has(optimizer, "_lazy_init_hp_params_optimizer_state", "ZeRO optimizer")
    zero.link_optimizer_state(optimizer)


def test_zero_file_layout_is_what_megahet_reads(zero_engine, tmp_path: Path) -> None:
    from megahet.checkpointing.safe_load import load_file
    from megahet.compat import deepspeed_checkpoint as files
    from megahet.compat import deepspeed_zero as zero

    zero_engine.save_checkpoint(str(tmp_path), tag="t")
    folder = tmp_path / "t"
    model_states = load_file(folder / files.model_states_file(0))
    keys = {"module", "param_shapes", "lr_scheduler", "global_steps"}
    assert keys <= set(model_states), f"DeepSpeed's model states file lost {keys - set(model_states)}"
    shards = files.zero_shard_files(folder, 0)
    assert [(files.zero_dp_rank(f), files.zero_file_kind(f)) for f in shards] == [(0, "")], shards
    saved = load_file(shards[0])
    try:
        partitions = zero.file_partitions(saved)
    except KeyError as missing:
        pytest.fail(f"DeepSpeed's ZeRO file lost the key {missing} (Adam's state or the partition's layout)")
    assert len(partitions) == 2, "ZeRO file: one flat partition per parameter group expected"
    flats, step, mapping = partitions[0]
    assert step == 2, f"Adam's saved step is {step} after two optimizer steps"
    assert set(flats) == {"fp32", "exp_avg", "exp_avg_sq"}
    assert all(a.start + a.numel <= flats["fp32"].numel() for a in mapping.values()), (
        "param_slice_mappings changed"
    )
    assert len(zero.file_group_lrs(saved)) == 2 and zero.file_partition_count(saved, 0) == 1


def test_deepspeed_engine_reads_its_checkpoint_through_the_routed_loader(zero_engine, tmp_path: Path) -> None:
    """`engine_loads_with` is how megahet's safe loader reads DeepSpeed's files: every file
    `load_checkpoint` opens (model states, the ZeRO shard) goes through it."""
    zero_engine.save_checkpoint(str(tmp_path), tag="t")
    seen = []

    def loader(path, map_location=None):
        seen.append(Path(path).name)
        return torch.load(path, map_location=map_location, weights_only=False)

    with deepspeed_checkpoint.engine_loads_with(zero_engine, loader):
        zero_engine.load_checkpoint(str(tmp_path), tag="t")
    assert deepspeed_checkpoint.model_states_file(0) in seen, (
        f"DeepSpeedEngine no longer reads its model states through self.checkpoint_engine.load: {seen}"
    )
    assert any(name.endswith("optim_states.pt") for name in seen), (
        f"DeepSpeedEngine no longer reads its ZeRO shard through self.checkpoint_engine.load: {seen}"
    )


def test_zero_to_fp32_gives_the_engines_weights_through_the_given_loader(zero_engine, tmp_path: Path) -> None:
    from megahet.checkpointing.safe_load import load_file

    zero_engine.save_checkpoint(str(tmp_path), tag="t")
    seen = []

    def loader(path, **kwargs):
        seen.append(Path(path).name)
        return load_file(path)

    weights = deepspeed_checkpoint.zero_fp32_state_dict(tmp_path, "t", loader)
    assert seen, "zero_to_fp32 no longer reads through its module's torch.load"
    for name, param in zero_engine.module.named_parameters():
        assert torch.equal(weights[name], param.detach().float()), (
            f"zero_to_fp32's {name} is not the engine's"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_gradient_norm_is_deepspeeds(zero_engine, dtype) -> None:
    """megahet's fused norm (megahet/compat/deepspeed_norm.py, installed by build_engine) gives DeepSpeed's
    own method's norm, pipeline copies skipped alike, in one fused norm instead of a float64 norm per
    parameter; other norms are DeepSpeed's."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from megahet.compat.deepspeed_norm import fused_grad_norm
    from megahet.compat.deepspeed_zero import mark_pipe_replicated

    optimizer = zero_engine.optimizer
    assert optimizer.get_grad_norm_direct.__func__ is fused_grad_norm  # installed on the engine's optimizer
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (7, 300, 1, 64)]
    mark_pipe_replicated(params[2])
    grads = [torch.randn(p.numel(), generator=g).to(dtype) * 3 for p in params]
    theirs = DeepSpeedZeroOptimizer.get_grad_norm_direct(optimizer, grads, params)
    ours = optimizer.get_grad_norm_direct(grads, params)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6), (ours, theirs)
    inf = float("inf")  # not replaced: DeepSpeed's own
    assert float(optimizer.get_grad_norm_direct(grads, params, inf)) == float(
        DeepSpeedZeroOptimizer.get_grad_norm_direct(optimizer, grads, params, inf)
    )
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Norms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.norms = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.norms += "norm" in str(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    with _Norms() as counted:
        optimizer.get_grad_norm_direct(grads, params)
    assert counted.norms == 1, counted.norms  # one fused norm for the four gradients


def test_deepspeed_gradient_norm_skips_pipeline_copies(zero_engine) -> None:
    """ZeRO-1's gradient norm counts a parameter flagged `ds_pipe_replicated` (megahet's mark for the last
    stage's copy of a tied embedding) zero times."""
    from megahet.compat.deepspeed_zero import mark_pipe_replicated

    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    mark_pipe_replicated(params[1])
    grads = [torch.full((4,), 1.5), torch.full((4,), 100.0)]
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    norm = float(DeepSpeedZeroOptimizer.get_grad_norm_direct(zero_engine.optimizer, grads, params))  # its own
    assert norm == pytest.approx(3.0), (
        f"DeepSpeed's gradient norm no longer skips parameters flagged `ds_pipe_replicated`: {norm}, not 3"
    )


# --- megatron-core's timer names and bound collectives, torch.distributed's collectives -------------


def test_megatron_schedules_time_the_compute_regions_by_these_names(world1) -> None:
    """megatron-core's schedule, run on a tiny GPT, starts and stops a timer of each name in
    COMPUTE_REGIONS once per micro-batch, in that order."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from resize_gpt import batches, gpt

    from megahet.compat.megatron_timers import COMPUTE_REGIONS

    events = []

    class _Timer:
        def __init__(self, name):
            self.name = name

        def start(self, barrier=False):
            events.append(("start", self.name))

        def stop(self, barrier=False):
            events.append(("stop", self.name))

    model = gpt()
    model.config.timers = lambda name, log_level=0: _Timer(name)
    data = iter(batches(0, 2))

    def forward_step(iterator, m):
        b = next(iterator)
        out = m(
            b["tokens"], torch.arange(b["tokens"].shape[1]).expand_as(b["tokens"]), None, labels=b["labels"]
        )
        return out, lambda o: (o.mean(), {})

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=[model], num_microbatches=2,
        seq_length=8, micro_batch_size=2, forward_only=False,
    )  # fmt: skip
    regions = [e for e in events if e[1] in COMPUTE_REGIONS]
    forward, backward = COMPUTE_REGIONS
    once = [("start", forward), ("stop", forward), ("start", backward), ("stop", backward)]
    assert regions == once * 2, (
        f"megatron-core's schedule no longer times {COMPUTE_REGIONS} per micro-batch: {regions}"
    )


def test_collectives_and_megatron_bound_names_exist() -> None:
    import importlib

    import torch.distributed as dist

    from megahet.compat.collectives import BOUND, COLLECTIVES

    missing = [name for name in COLLECTIVES if not hasattr(dist, name)]
    assert not missing, f"torch.distributed no longer has {missing}"
    for module_name, names in BOUND.items():
        module = importlib.import_module(module_name)
        for name in names:
            assert callable(getattr(module, name, None)), f"{module_name}.{name} no longer exists"


def test_collectives_run_through_the_wrapper_only_while_installed(world1) -> None:
    """Calls through torch.distributed and through megatron-core's bound copy reach the wrapper inside
    the block (as megatron-core and DeepSpeed make them: module attributes looked up at call time), and
    the originals after it."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    from megahet.compat.collectives import collectives_wrapped

    calls = []

    def wrap(fn):
        def timed(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)

        return timed

    x = torch.ones(4)
    with collectives_wrapped(wrap):
        dist.all_reduce(x)
        dist.barrier()
        out = torch.empty(4)
        mappings.dist_all_gather_func(out, x)
    assert calls == ["all_reduce", "barrier", "all_gather_into_tensor"], calls
    dist.all_reduce(x)
    mappings.dist_all_gather_func(out, x)
    assert len(calls) == 3, f"a wrapper stayed installed after the block: {calls}"
