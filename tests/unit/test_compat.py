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
