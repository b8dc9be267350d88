"""Tests of megahet.data.sampling: per-DP-rank micro-batch streams.

Any DP size must train on exactly the same samples per step (DP=2's ranks, concatenated by rank,
are DP=1's global batch), streams resume from a sample index, and per-epoch shuffling is a
reproducible function of the seed.

Run: ``python -m pytest tests/unit/test_sampling.py -q`` (a second or two; no megatron import).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from megahet.config import ConfigError
from megahet.data.sampling import micro_batches, sample_order


class Indexed:
    """A dataset whose sample i is {"idx": i, "x": (2,) floats, "label": i % 3}; counts accesses."""

    def __init__(self, n: int):
        self.n = n
        self.reads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.reads += 1
        return {"idx": i, "x": torch.tensor([float(i), -float(i)]), "label": i % 3}


def _step_indices(data, *, G: int, M: int, dp: int, steps: int, **kw) -> list[list[list[int]]]:
    """[step][dp rank] -> the sample indices that rank sees in that step, micro-batches concatenated."""
    per_rank = G // dp
    streams = [
        micro_batches(data, global_batch_size=G, micro_batch_size=M, dp_rank=r, dp_size=dp, **kw)
        for r in range(dp)
    ]
    out = []
    for _ in range(steps):
        ranks = []
        for stream in streams:
            batches = list(itertools.islice(stream, per_rank // M))
            ranks.append([int(i) for b in batches for i in b["idx"]])
        out.append(ranks)
    return out


def test_micro_batch_shapes_and_collation() -> None:
    it = micro_batches(Indexed(40), global_batch_size=8, micro_batch_size=4, dp_rank=0, dp_size=1)
    batch = next(it)
    assert set(batch) == {"idx", "x", "label"}
    assert batch["idx"].tolist() == [0, 1, 2, 3]
    assert batch["x"].shape == (4, 2) and batch["x"].dtype == torch.float32
    assert batch["x"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert batch["label"].tolist() == [0, 1, 2, 0]
    assert next(it)["idx"].tolist() == [4, 5, 6, 7]


def test_dp1_sequential_order_cycles_epochs() -> None:
    # 10 samples, G=4: steps cover 0-3, 4-7, then 8, 9, 0, 1 across the epoch boundary.
    steps = _step_indices(Indexed(10), G=4, M=2, dp=1, steps=4)
    assert [s[0] for s in steps] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5]]


def test_dp_rank_takes_its_contiguous_slice() -> None:
    steps = _step_indices(Indexed(64), G=8, M=2, dp=2, steps=2)
    assert steps[0] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert steps[1] == [[8, 9, 10, 11], [12, 13, 14, 15]]


@pytest.mark.parametrize("shuffle_seed", [None, 7])
@pytest.mark.parametrize("n", [64, 37])  # 37: global batches straddle epoch boundaries
@pytest.mark.parametrize("dp, M", [(2, 2), (2, 4), (4, 2)])
def test_dp_ranks_together_see_exactly_dp1s_samples(shuffle_seed, n: int, dp: int, M: int) -> None:
    G, steps = 16, 7
    one = _step_indices(Indexed(n), G=G, M=M, dp=1, steps=steps, shuffle_seed=shuffle_seed)
    many = _step_indices(Indexed(n), G=G, M=M, dp=dp, steps=steps, shuffle_seed=shuffle_seed)
    for step in range(steps):
        assert all(len(r) == G // dp for r in many[step])
        # Concatenated by rank, DP=dp's step is DP=1's step in the same order.
        assert [i for rank in many[step] for i in rank] == one[step][0], step


def test_dp1_micro_batch_size_does_not_change_the_samples() -> None:
    a = _step_indices(Indexed(50), G=12, M=2, dp=1, steps=5, shuffle_seed=3)
    b = _step_indices(Indexed(50), G=12, M=6, dp=1, steps=5, shuffle_seed=3)
    assert a == b


@pytest.mark.parametrize("shuffle_seed", [None, 11])
@pytest.mark.parametrize("dp_rank", [0, 1])
def test_resume_from_start_sample(shuffle_seed, dp_rank: int) -> None:
    G, M, dp, n, skip = 8, 2, 2, 30, 5  # 5 steps = 40 samples: resumes inside epoch 1
    kw = {
        "global_batch_size": G,
        "micro_batch_size": M,
        "dp_rank": dp_rank,
        "dp_size": dp,
        "shuffle_seed": shuffle_seed,
    }
    full = micro_batches(Indexed(n), **kw)
    per_step = G // dp // M
    expected = [b["idx"].tolist() for b in itertools.islice(full, per_step * (skip + 4))][per_step * skip :]
    resumed = micro_batches(Indexed(n), start_sample=skip * G, **kw)
    got = [b["idx"].tolist() for b in itertools.islice(resumed, per_step * 4)]
    assert got == expected
    sought = micro_batches(Indexed(n), **kw)  # what a resumed Trainer does after loading the checkpoint
    next(sought)
    sought.seek(iteration=skip, consumed_samples=skip * G)
    assert [b["idx"].tolist() for b in itertools.islice(sought, per_step * 4)] == expected


def test_resume_does_not_read_skipped_samples() -> None:
    data = Indexed(10_000)
    it = micro_batches(
        data, global_batch_size=8, micro_batch_size=4, dp_rank=0, dp_size=1, start_sample=9_000
    )
    assert next(it)["idx"].tolist() == [9000, 9001, 9002, 9003]
    assert data.reads == 4


def test_sample_order_is_a_reproducible_permutation_per_epoch() -> None:
    n = 100
    assert sample_order(n, 0, None).tolist() == list(range(n))
    assert sample_order(n, 5, None).tolist() == list(range(n))
    e0, e0_again, e1 = sample_order(n, 0, 1), sample_order(n, 0, 1), sample_order(n, 1, 1)
    assert sorted(e0.tolist()) == list(range(n)) and sorted(e1.tolist()) == list(range(n))
    np.testing.assert_array_equal(e0, e0_again)  # same seed, same epoch -> same order
    assert not np.array_equal(e0, e1)  # a new order every epoch
    assert not np.array_equal(e0, sample_order(n, 0, 2))  # and per seed
    assert not np.array_equal(e0, np.arange(n))


def test_shuffled_stream_reproducible_per_seed_and_reshuffled_per_epoch() -> None:
    n, G = 24, 8  # 3 steps per epoch

    def epochs(seed: int, count: int) -> list[list[int]]:
        steps = _step_indices(Indexed(n), G=G, M=4, dp=1, steps=3 * count, shuffle_seed=seed)
        flat = [i for s in steps for i in s[0]]
        return [flat[e * n : (e + 1) * n] for e in range(count)]

    a, b, c = epochs(5, 3), epochs(5, 3), epochs(6, 3)
    assert a == b
    assert a != c
    for epoch in a:
        assert sorted(epoch) == list(range(n))  # every sample exactly once per epoch
    assert a[0] != a[1] != a[2] and a[0] != a[2]
    assert a[0] != list(range(n))
    assert a[0] == sample_order(n, 0, 5).tolist() and a[1] == sample_order(n, 1, 5).tolist()


def test_dataset_smaller_than_global_batch_is_an_error_when_the_stream_is_created() -> None:
    with pytest.raises(ConfigError) as err:
        micro_batches(Indexed(7), global_batch_size=8, micro_batch_size=4, dp_rank=0, dp_size=1)
    msg = str(err.value)
    assert "7" in msg and "8" in msg and "train.global_batch_size" in msg and "\n" not in msg


def test_dataset_of_exactly_one_global_batch_is_fine() -> None:
    steps = _step_indices(Indexed(8), G=8, M=4, dp=2, steps=2)
    assert steps == [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 2
