"""The collective-delay benchmark (benchmarks/collective_delay.py): its arithmetic (the time neither rank
computes, per iteration, and what contention adds to it), its one-line errors, and a short real run of
two pinned gloo ranks."""

from __future__ import annotations

import pytest
from machine import skip_or_fail

from benchmarks.collective_delay import added, main, measure, summarize
from benchmarks.contention import two_cores


def test_idle_time_is_the_iteration_less_the_slower_product_per_iteration():
    # Rank 0's iterations 10 and 20 ms; products (4, 6) then (12, 5): idle 4 and 8 ms, median 6.
    calm = summarize("calm", [([0.004, 0.012], [0.010, 0.020], 0.9), ([0.006, 0.005], [], 0.8)])
    assert calm["idle_ms"] == pytest.approx(6.0)
    assert calm["iteration_ms"] == pytest.approx(15.0)
    assert calm["product_ms"] == [8.0, 5.5] and calm["core_share"] == [0.9, 0.8]
    busy = summarize("contended", [([0.004], [0.020], 0.9), ([0.010], [], 0.5)])
    assert busy["idle_ms"] == pytest.approx(10.0)  # 20 - max(4, 10): the slower product is rank 1's
    wide = summarize("calm", [([0.004], [0.005], 0.9), ([0.004], [], 0.9)], ffn=8192)
    rows = [calm, busy, wide]
    added(rows)  # against the calm run of the same width
    assert [r["added_ms"] for r in rows] == pytest.approx([0.0, 4.0, 0.0])


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--iters", "0"], "--iters must be at least 1"), (["--ffn", "2k"], "give widths as integers")],
)
def test_bad_arguments_are_one_line_errors(argv, message, monkeypatch):
    import benchmarks.collective_delay as bench

    monkeypatch.setattr(bench, "measure", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_two_pinned_ranks_time_their_products_and_iterations():
    if two_cores() is None:
        skip_or_fail("needs two cores to pin the ranks to")
    gathered = measure(iters=3, cores=two_cores(), contended=False, ffn=1024)
    assert len(gathered) == 2
    for products, iterations, share in gathered:
        assert len(products) == len(iterations) == 3
        assert all(i >= p > 0 for p, i in zip(products, iterations))
        assert 0 < share <= 1.01
    row = summarize("calm", gathered)
    assert row["idle_ms"] > 0  # an all-reduce is never free


def test_a_rank_that_dies_stops_the_run_with_its_exit_code():
    if two_cores() is None:
        skip_or_fail("needs two CPU cores")
    # Rank 1 cannot pin itself to a core that does not exist: it exits, and rank 0, waiting for it at
    # the rendezvous, is stopped instead of waiting out the timeout.
    with pytest.raises(RuntimeError, match=r"a rank failed \(exit codes"):
        measure(iters=1, cores=[two_cores()[0], 4096], contended=False, ffn=64)
