"""DeepSpeed's checkpoint files, read without running code from them.

DeepSpeed reads its files with `torch.load(..., weights_only=False)`: through the engine's
`checkpoint_engine.load` (model and ZeRO optimizer states) and through `deepspeed.utils.zero_to_fp32`
(fp32 masters of a bf16 / fp16 run). Both are routed here through megahet's loader
(`megahet/checkpointing/safe_load.py`: `weights_only=True` and an allow-list), for the length of one
load only; nothing stays replaced.

Private API used (checked by tests/unit/test_compat.py):
- `DeepSpeedEngine.checkpoint_engine.load(path, map_location)`;
- `deepspeed.utils.zero_to_fp32` calling `torch.load` (module global `torch`);
- the classes ZeRO-1/2 pickles into `*_optim_states.pt`: `LossScaler` / `DynamicLossScaler`,
  `ZeroStageEnum`, `fragment_address`.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

SAVED_TYPES: tuple[type, ...] = (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)
"""The classes DeepSpeed's ZeRO-1/2 optimizer pickles into its checkpoint files (plain data)."""

Loader = Callable[..., object]  # (path, map_location=...) -> the file's object


@contextlib.contextmanager
def engine_loads_with(engine, load: Loader) -> Iterator[None]:
    """Within the block, the engine reads every checkpoint file with `load(path, map_location=...)`."""
    ckpt_engine = engine.checkpoint_engine
    original = ckpt_engine.load

    def through(path, map_location=None, *args, **kwargs):
        return load(path, map_location=map_location)

    ckpt_engine.load = through
    try:
        yield
    finally:
        ckpt_engine.load = original


def zero_fp32_state_dict(folder: Path, tag: str, load: Loader) -> dict[str, torch.Tensor]:
    """DeepSpeed's zero_to_fp32 merge of the ZeRO shards in folder/tag into fp32 weights, its reads
    made with `load(path, map_location=..., mmap=...)` (zero_to_fp32 calls the module's `torch.load`)."""
    from deepspeed.utils import zero_to_fp32

    original = zero_to_fp32.torch

    class _Torch:  # zero_to_fp32's view of torch: torch itself, but for load
        def __getattr__(self, name):
            return getattr(original, name)

        @staticmethod
        def load(path, map_location=None, mmap=False, weights_only=None, **kwargs):
            return load(path, map_location=map_location, mmap=mmap)

    zero_to_fp32.torch = _Torch()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its progress
            return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)
    finally:
        zero_to_fp32.torch = original
