"""The selection comparison's statistics (benchmarks/selection_stats.py): when a paired mean counts as
resolved (paired t-test at 5 %), and how many seeds a verdict at the study's resolution would take.

    python -m pytest -q tests/unit/test_selection_stats.py
"""

from __future__ import annotations

import pytest

from benchmarks.selection_stats import (
    RESOLUTION,
    resolution,
    seeds_needed,
    standard_error,
    t_critical,
    verdict,
)


def test_a_mean_counts_only_beyond_two_standard_errors():
    steady_gain = [0.010, 0.012, 0.011, 0.009]  # mean 0.0105, se 0.00065
    assert verdict("val_acc", steady_gain) == "priority better"
    assert verdict("val_acc", [-d for d in steady_gain]) == "priority worse"
    noisy = [0.03, -0.02, 0.01, -0.01]  # mean 0.0025, se 0.011
    assert verdict("val_acc", noisy) == "within noise"
    assert verdict("val_acc", [0.05]) == "within noise"  # one pair has no spread to judge by


def test_perplexity_is_better_lower():
    assert verdict("val_ppl", [-3.0, -2.5, -3.5]) == "priority better"
    assert verdict("val_ppl", [3.0, 2.5, 3.5]) == "priority worse"


def test_seeds_needed_follows_the_measured_spread():
    diffs = [0.01, -0.01]  # sd 0.01414: 80 % power at 5 % for 0.5 point takes ((1.96 + 0.84) sd / 0.005)^2
    assert seeds_needed(diffs, RESOLUTION) == 63
    assert seeds_needed([0.02, -0.02], RESOLUTION) == 252  # twice the spread: four times the seeds
    assert seeds_needed([0.0101, 0.0100], RESOLUTION) == 2  # never fewer than a pair gives an se from
    assert seeds_needed([0.01], RESOLUTION) is None
    assert standard_error([0.01, -0.01]) == pytest.approx(0.01)


def test_the_t_threshold_follows_the_number_of_pairs():
    assert t_critical(2) == 12.706 and t_critical(3) == 4.303 and t_critical(7) == 2.447
    assert t_critical(31) == t_critical(500) == 2.042  # beyond the table: its last, conservative value
    with pytest.raises(ValueError, match="at least 2 pairs"):
        t_critical(1)
    # 3 pairs 3.5 standard errors from zero: beyond 2, not beyond t(0.975, 2) = 4.30
    assert verdict("val_acc", [0.01, 0.02, 0.03]) == "within noise"  # mean 0.02, se 0.0058
    assert verdict("val_acc", [0.019, 0.02, 0.021]) == "priority better"


def test_resolution_is_half_a_point_or_half_a_percent_of_perplexity():
    assert resolution("val_acc", 0.64) == 0.005
    assert resolution("val_ppl", 450.0) == pytest.approx(2.25)
