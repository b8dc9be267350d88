"""Checks that the installed libraries still have every private API megahet/compat/ relies on.

One test per reach into another library, each failing with a line that names what changed: a version
bump of DeepSpeed, megatron-core or torch then fails here, not deep inside training.

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
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert "self.checkpoint_engine.load(" in inspect.getsource(DeepSpeedEngine), (
        "DeepSpeedEngine no longer reads its checkpoint files through self.checkpoint_engine.load"
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


def test_zero_to_fp32_reads_through_its_module_torch() -> None:
    from deepspeed.utils import zero_to_fp32

    assert _has(zero_to_fp32, "torch", "zero_to_fp32") is torch
    _has(zero_to_fp32, "get_fp32_state_dict_from_zero_checkpoint", "zero_to_fp32")
    assert "torch.load(" in inspect.getsource(zero_to_fp32), "zero_to_fp32 no longer calls torch.load"


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


def test_deepspeed_gradient_norm_reads_pipe_replicated() -> None:
    import deepspeed.runtime.utils as ds_utils

    assert "ds_pipe_replicated" in inspect.getsource(ds_utils), (
        "DeepSpeed's gradient norm no longer skips parameters flagged `ds_pipe_replicated`"
    )


# --- megatron-core's timer names and bound collectives, torch.distributed's collectives -------------


def test_megatron_schedules_time_the_compute_regions_by_these_names() -> None:
    from megatron.core.pipeline_parallel import schedules

    from megahet.compat.megatron_timers import COMPUTE_REGIONS

    source = inspect.getsource(schedules)
    for name in COMPUTE_REGIONS:
        for call in (f"config.timers('{name}', log_level=2).start()", f"config.timers('{name}').stop()"):
            assert call in source, (
                f"megatron-core's schedules no longer call {call}: the clock would time nothing"
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
