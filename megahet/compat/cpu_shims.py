"""CPU/gloo shims for the few megatron-core and DeepSpeed calls that assume CUDA (private API).

megatron-core 0.16 runs on CPU with the gloo backend except for a handful of calls that name the
CUDA device directly. `apply_cpu_shims()` patches exactly those, and only when CUDA is absent, so
the same code runs unchanged on GPUs with NCCL. Every shim states why it exists and has a test in
tests/unit/test_platform.py, which also checks that the installed versions still have each name it
replaces.

    from megahet.compat.cpu_shims import apply_cpu_shims
    apply_cpu_shims()          # no-op when torch.cuda.is_available()

Private API replaced (CPU only): `torch.cuda.current_device` / `synchronize`, `Tensor.cuda`,
megatron-core's `get_default_causal_mask` (transformer.utils and fusions.fused_softmax) and
`get_pos_emb_on_this_cp_rank` (rope_utils and rotary_pos_embedding), the `torch`
module global of `pipeline_parallel.schedules`, `tensor_parallel.random`'s `_CUDA_RNG_STATE_TRACKER`,
`_CUDA_RNG_STATE_TRACKER_INITIALIZED` and `initialize_rng_tracker`, and DeepSpeed's
`deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"]`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types

import torch

_APPLIED: list[str] = []


def _cpu_device(device_arg):
    """Map a CUDA device spec to the CPU; leave anything else alone."""
    if device_arg is None:
        return None
    if isinstance(device_arg, int) or str(device_arg).startswith("cuda"):
        return torch.device("cpu")
    return device_arg


class _CudaToCpuTorch(types.ModuleType):
    """`torch` as seen by one module, with `device="cuda"` factory calls moved to the CPU.

    megatron-core's pipeline schedules allocate their token counter with `device="cuda"`. Rather
    than install a process-wide TorchFunctionMode (a Python call per op), we give those modules a
    `torch` whose factory functions rewrite the device; every other attribute is torch's own.
    """

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in self._FACTORIES:
            return attr

        @functools.wraps(attr)
        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return attr(*args, **kwargs)

        return factory


def _cpu_current_device() -> str:
    # Reason: megatron-core writes `device=torch.cuda.current_device()` in its TP layers, p2p
    # communication, attention and GPT model; on a CPU-only build that call raises.
    return "cpu"


def _cpu_synchronize(device=None) -> None:
    # Reason: parallel_state and p2p_communication call torch.cuda.synchronize(); nothing to wait
    # for on the CPU.
    return None


def _cpu_tensor_cuda(self, device=None, non_blocking=False, **kwargs):
    # Reason: LanguageModule.setup_embeddings_and_output_layer() calls `weight.data.cuda()` before
    # all-reducing the tied embedding across the first and last pipeline stage.
    return self


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    # Reason: megatron-core builds the chunk index in pinned memory and moves it with .cuda(): pinned
    # memory needs an accelerator. The same head-tail chunks (r, 2cp - 1 - r), indexed on the embedding's device.
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[(seq_dim + 1) :])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2) :])


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    # Reason: megatron.core.transformer.utils.get_default_causal_mask builds its mask with
    # device="cuda"; the local (non-TE) attention path uses it for causal softmax.
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


class CpuRNGStatesTracker:
    """megatron-core's RNG tracker API (add / fork / get_states / set_states) on CPU generators.

    Reason: megatron-core's CudaRNGStatesTracker stores CUDA generator states. Tensor-parallel
    regions (dropout inside attention) fork a TP-rank-specific stream; on the CPU we swap torch's
    default CPU generator state the same way.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def reset(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def apply_cpu_shims() -> list[str]:
    """Patch megatron-core for CPU execution; idempotent; returns the names of applied shims."""
    if torch.cuda.is_available() or _APPLIED:
        return list(_APPLIED)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _cpu_synchronize
    torch.Tensor.cuda = _cpu_tensor_cuda
    _APPLIED.extend(["torch.cuda.current_device", "torch.cuda.synchronize", "Tensor.cuda"])

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    transformer_utils.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    _APPLIED.append("get_default_causal_mask")

    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    rope_utils.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank
    _APPLIED.append("get_pos_emb_on_this_cp_rank")

    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _CudaToCpuTorch()
    _APPLIED.append("schedules.torch")

    import deepspeed.ops

    # Reason: DeepSpeed's CPU comm backend JIT-compiles a shared-memory all-reduce (40-110 s on a
    # fresh 2-core machine) that only `inference_all_reduce` uses; training never calls it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    _APPLIED.append("skip deepspeed_shm_comm build")

    from megatron.core.tensor_parallel import random as tp_random

    tp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tp_random.initialize_rng_tracker = _keep_cpu_tracker
    _APPLIED.append("rng_tracker")
    return list(_APPLIED)


def _keep_cpu_tracker(*args, force_reset: bool = False, **kwargs) -> None:
    # Reason: model_parallel_cuda_manual_seed() re-creates the CUDA tracker; keep the CPU one.
    from megatron.core.tensor_parallel import random as tp_random

    if force_reset or tp_random._CUDA_RNG_STATE_TRACKER is None:
        tp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
