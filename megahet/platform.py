"""The device this process computes on, and what differs between CPU and GPU runs.

Role: runtime (CPU / GPU differences, in one place). The CPU shims of megatron-core and DeepSpeed
calls that assume CUDA are in megahet/compat/cpu_shims.py.

    from megahet.platform import cuda_available, device, distributed_backend
    device()                   # cuda:<local GPU>, else cpu
"""

from __future__ import annotations

import ctypes
import functools
import gc

import torch


def synchronize() -> None:
    """Wait for the GPU's queued kernels (timing real compute); nothing to wait for on CPU."""
    if cuda_available():
        torch.cuda.synchronize()


def cuda_available() -> bool:
    return torch.cuda.is_available()


def unit_multiple(configured: int | None) -> int:
    """resize.unit_multiple as set, else 8 on CUDA (tensor-core GEMM widths) and 1 on CPU."""
    if configured is not None:
        return configured
    return 8 if cuda_available() else 1


def device() -> torch.device:
    """The device this process computes on: its local GPU, else the CPU."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def distributed_backend() -> str:
    """gloo on CPU; on GPUs NCCL for CUDA tensors plus gloo for the few host-side numbers (metrics,
    the balancer's measurements, priority scores), as torchtitan does for CPU tensors."""
    return "cuda:nccl,cpu:gloo" if cuda_available() else "gloo"


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library)."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)  # this process's C library


def freeze_long_lived_objects() -> None:
    """Collect what is garbage now, then move every object still alive (the imports of torch, megatron-core
    and DeepSpeed: ~470k objects) out of the garbage collector's sight for the rest of the process
    (CPython's gc.freeze). A full collection, Python's automatic one in the middle of a step or the one a
    re-split or layout move runs to free the old engine, then scans only what the run made since: ~0 ms
    instead of 0.37 s on this host (megatron-core's `--manual-gc` addresses the same pause). What is made
    later (models, engines) is collected as before. setup() calls it once, before any model is built."""
    gc.collect()
    gc.freeze()


def release_freed_memory(collect: bool = True) -> None:
    """Give the memory of freed tensors back to the system: the CUDA caching allocator's unused blocks,
    and on glibc hosts the malloc heap's free pages. Tensors under glibc's dynamic mmap threshold (up to
    32 MiB) live in the heap, whose freed pages otherwise stay resident: a re-split that frees one
    engine and builds another would hold both in RSS. `collect`: first a full garbage collection, for
    objects freed in reference cycles (an engine); it scans what the run made since
    `freeze_long_lived_objects` (0.37 s on this host when it scans the imports too), so tensors freed by
    reference count alone skip it."""
    if collect:
        gc.collect()
    if cuda_available():
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
