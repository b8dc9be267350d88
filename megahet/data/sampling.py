"""Deterministic micro-batch streams for one data-parallel rank, resumable from any sample.

Role: data.

Global batch g covers samples [start + g*G, start + (g+1)*G) of the (optionally per-epoch shuffled)
dataset order; DP rank r takes the r-th contiguous G/DP slice of it, in micro-batches of M. So any
DP size sees the same samples per step, and DP=2 trains on exactly what DP=1 does.

    it = micro_batches(dataset, global_batch_size=16, micro_batch_size=4, dp_rank=0, dp_size=2)
    batch = to_device(next(it))      # in a forward_step: onto this process's GPU (or the CPU)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from megahet.config import ConfigError
from megahet.platform import device as process_device


def _collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}


def to_device(batch: dict[str, torch.Tensor], device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The batch's tensors on `device` (default: this process's GPU, else the CPU), as megatron's
    get_batch does with `.cuda(non_blocking=True)`; the model and its loss live there."""
    device = process_device() if device is None else device
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def sample_order(num_samples: int, epoch: int, shuffle_seed: int | None) -> np.ndarray:
    if shuffle_seed is None:
        return np.arange(num_samples)
    return np.random.default_rng((shuffle_seed, epoch)).permutation(num_samples)


def micro_batches(
    dataset: Sequence[dict[str, Any]],
    *,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    start_sample: int = 0,
    shuffle_seed: int | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """This DP rank's micro-batches, forever, cycling epochs (reshuffled when a seed is given).

    A dataset smaller than one global batch is a ConfigError here, when the stream is created.
    """
    n = len(dataset)
    if n < global_batch_size:
        raise ConfigError(
            f"the dataset has {n} samples, fewer than one global batch ({global_batch_size}): "
            f"lower train.global_batch_size or use more data"
        )
    return _stream(dataset, global_batch_size, micro_batch_size, dp_rank, dp_size, start_sample, shuffle_seed)


def _stream(dataset, global_batch_size, micro_batch_size, dp_rank, dp_size, start_sample, shuffle_seed):
    n, per_rank = len(dataset), global_batch_size // dp_size
    sample, epoch, order = start_sample, None, None
    while True:
        base = sample + dp_rank * per_rank
        for m in range(0, per_rank, micro_batch_size):
            items = []
            for i in range(base + m, base + m + micro_batch_size):
                if epoch != i // n:
                    epoch = i // n
                    order = sample_order(n, epoch, shuffle_seed)
                items.append(dataset[int(order[i % n])])
            yield _collate(items)
        sample += global_batch_size
