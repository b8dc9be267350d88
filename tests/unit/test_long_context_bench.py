"""benchmarks/long_context.py's pieces: the memory tracker on hand-counted bytes, the search for the longest
length within a cap against a brute-force scan, the ratios against the goal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks import long_context
from benchmarks.long_context import longest_fitting, summary
from benchmarks.memory_tracker import MemoryTracker

F32 = 4


def test_tracker_counts_storages_made_inside_once_and_frees_them():
    w = torch.randn(256, requires_grad=True)  # made outside: never counted
    weight = torch.randn(16, 4, requires_grad=True)
    tracker = MemoryTracker()
    with tracker, tracker.saved():
        b = w.exp()  # 1024 B, saved (exp saves its result)
        c = b.sin()  # 1024 B, saves b: the same storage, counted once
        view = c[:10]  # a view: no new storage
        d = c.sum()  # 4 B, saves nothing
        w.detach()[:8].mul_(1.0)  # a view of a storage from outside, in place: nothing new
        assert tracker.live == tracker.peak == 256 * F32 * 2 + F32
        tracker.region = "attention"
        x = torch.ones(8, 16)  # 512 B
        y = x @ weight  # 128 B; mm saves x and the weight (not ours)
        tracker.region = "other"
        assert tracker.live == 2052 + 8 * 16 * F32 + 8 * 4 * F32
        assert tracker.saved_bytes == 256 * F32 + 8 * 16 * F32
        assert tracker.saved_by() == {"other": 1024, "attention": 512}
        assert tracker.saved_by("op") == {"exp": 1024, "ones": 512}
        assert tracker.saved_by("op", region="attention") == {"ones": 512}
        peak = tracker.live
        del x, y, view, c, d
        assert tracker.live == 1024  # b alone
        assert tracker.peak == peak
        assert tracker.peak_by("op") == {"exp": 1024, "sin": 1024, "ones": 512, "mm": 128, "sum": 4}
        tracker.reset()
        assert tracker.peak == tracker.live == 1024 and tracker.saved_bytes == 0
        b.sum().backward()  # the sum and its seed gradient (4 B each), then w.grad = exp(w) * 1 in the backward
    assert w.grad is not None
    del b
    assert tracker.live == 256 * F32  # w.grad alone
    assert tracker.peak == 1024 + 4 + 4 + 1024
    assert tracker.peak_by() == {"other": 1032, "backward": 1024}


def test_tracker_counts_a_resize_in_place():
    tracker = MemoryTracker()
    with tracker:
        x = torch.empty(0)
        x.resize_(100)
        assert tracker.live == 100 * F32
        x.resize_(10)  # the storage keeps its bytes
    assert tracker.live == 100 * F32


def test_lower_right_bias_runs_under_the_tracker(monkeypatch):
    from megahet.models import context_parallel

    monkeypatch.setattr(context_parallel, "causal_lower_right", context_parallel.causal_lower_right)
    long_context.make_bias_outside_modes()
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 16, dtype=torch.bool).tril(12))
    with MemoryTracker() as tracker:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=context_parallel.causal_lower_right(4, 16))
    torch.testing.assert_close(out, expected)
    assert tracker.peak >= out.numel() * F32


def _brute_force(peak, cap: int, granule: int, limit: int) -> int:
    fitting = [n for n in range(granule, limit + 1, granule) if peak(n) <= cap]
    return max(fitting, default=0)


@pytest.mark.parametrize("cap", [5_000, 60_000, 200_000, 900_000, 10**9])
@pytest.mark.parametrize("start", [256, 2048, 3000, 32768])
def test_search_finds_the_longest_length_within_the_cap(cap, start):
    def peak(n: int) -> int:  # resident + linear + quadratic, as a CP rank's
        return 10_000 + 30 * n + n * n // 250

    longest, seen = longest_fitting(peak, cap, granule=256, start=start, limit=16384)
    assert longest == _brute_force(peak, cap, 256, 16384)
    assert all(n % 256 == 0 and 256 <= n <= 16384 for n in seen)
    assert seen == {n: peak(n) for n in seen}
    assert len(seen) <= 16  # growth by half from far below, then a bisection


def test_search_on_a_grid_of_the_granule_not_past_the_limit():
    longest, seen = longest_fitting(lambda n: n, cap=5000, granule=96, start=100, limit=1000)
    assert longest == 960 and max(seen) <= 960


def test_summary_ratios_against_the_goal():
    out = summary({1: 2000, 2: 4000, 4: 6000})
    assert out["max_len_ratio_cp2"] == 2.0 and out["max_len_goal_met_cp2"]
    assert out["max_len_ratio_cp4"] == 3.0 and not out["max_len_goal_met_cp4"]
    assert summary({1: 0, 2: 10}) == {}
