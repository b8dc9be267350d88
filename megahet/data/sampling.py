"""Deterministic micro-batch streams for one data-parallel rank, resumable from any sample.

Role: data.

Global batch g covers samples [start + g*G, start + (g+1)*G) of the (optionally per-epoch shuffled)
dataset order, G / m micro-batches of m samples. By default DP rank r takes the r-th contiguous G/DP
slice of it. With data-parallel shares (heterogeneous replicas, megahet/policy/dp_shares.py) replica r
takes the contiguous micro-batches [n_0 + ... + n_(r-1), ... + n_r) instead: the global batch and the
order of its samples are the same, every sample is used once. So any DP size and any split sees the
same samples per step, and DP=2 trains on exactly what DP=1 does.

    it = micro_batches(dataset, global_batch_size=16, micro_batch_size=4, dp_rank=0, dp_size=2)
    batch = to_device(next(it))      # in a forward_step: onto this process's GPU (or the CPU)
    it.set_shares((3, 1))            # from the next global batch on: 3 micro-batches here, 1 on replica 1
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from megahet.config import ConfigError
from megahet.platform import device as process_device
from megahet.policy.dp_shares import even_shares, share_slices


def _collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}


def to_device(batch: dict[str, torch.Tensor], device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The batch's tensors on `device` (default: this process's GPU, else the CPU), as megatron's
    get_batch does with `.cuda(non_blocking=True)`; the model and its loss live there. A GPU copy starts
    from pinned host memory, so that it runs asynchronously and the host can run ahead."""
    device = process_device() if device is None else device
    pin = device.type == "cuda"
    return {
        key: (value.pin_memory() if pin else value).to(device, non_blocking=True)
        if hasattr(value, "to")
        else value
        for key, value in batch.items()
    }


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
) -> MicroBatchStream:
    """This DP rank's micro-batches, forever, cycling epochs (reshuffled when a seed is given), from
    `start_sample` (a resumed run's Trainer moves it with `seek`).

    A dataset smaller than one global batch is a ConfigError here, when the stream is created.
    """
    n = len(dataset)
    if n < global_batch_size:
        raise ConfigError(
            f"the dataset has {n} samples, fewer than one global batch ({global_batch_size}): "
            f"lower train.global_batch_size or use more data"
        )
    return MicroBatchStream(
        dataset, global_batch_size, micro_batch_size, dp_rank, dp_size, start_sample, shuffle_seed
    )


class MicroBatchStream:
    """An iterator over one DP rank's micro-batches whose share of each global batch can change between
    global batches (`set_shares`). It reads the shares when it starts a global batch: a change made
    between two optimizer steps applies from the next step's first micro-batch."""

    def __init__(
        self, dataset, global_batch_size, micro_batch_size, dp_rank, dp_size, start_sample, shuffle_seed
    ):
        self.dataset, self.micro_batch_size, self.dp_rank = dataset, micro_batch_size, dp_rank
        self.global_batch_size, self.shuffle_seed = global_batch_size, shuffle_seed
        self.num_microbatches = global_batch_size // micro_batch_size
        """Micro-batches in one global batch (M), over all replicas."""
        self.shares = even_shares(self.num_microbatches, dp_size)
        self._stream = self._generate(start_sample)

    def set_shares(self, shares: Sequence[int]) -> None:
        """Micro-batches per replica of every global batch from the next one on (they sum to M)."""
        if sum(shares) != self.num_microbatches or len(shares) != len(self.shares) or min(shares) < 1:
            raise ValueError(
                f"shares {list(shares)} must give each of {len(self.shares)} replicas at least one of "
                f"the {self.num_microbatches} micro-batches of a global batch"
            )
        self.shares = tuple(shares)

    def seek(self, *, iteration: int, consumed_samples: int) -> None:
        """Go on from a resumed step: the next micro-batch is the first of the global batch that starts
        after `consumed_samples` samples (`iteration`: the step, unused here)."""
        self._stream = self._generate(consumed_samples)

    def __iter__(self) -> MicroBatchStream:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return next(self._stream)

    def _generate(self, sample: int) -> Iterator[dict[str, torch.Tensor]]:
        n, m = len(self.dataset), self.micro_batch_size
        epoch, order = None, None
        while True:
            mine = share_slices(self.shares)[self.dp_rank]  # read per global batch
            for micro in mine:
                items = []
                for i in range(sample + micro * m, sample + (micro + 1) * m):
                    if epoch != i // n:
                        epoch = i // n
                        order = sample_order(n, epoch, self.shuffle_seed)
                    items.append(self.dataset[int(order[i % n])])
                yield _collate(items)
            sample += self.global_batch_size
