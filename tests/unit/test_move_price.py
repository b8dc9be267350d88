"""The first move's price (issue 46, megahet/runtime/move_price.py): the busiest rank's bytes under a reshard
plan, and the price's parts. The rehearsal and the bandwidth probe run end to end in
tests/distributed/test_real_escalation.py (the "priced at" line).

Run: ``python -m pytest tests/unit/test_move_price.py -q`` (a second).
"""

from __future__ import annotations

import pytest
from test_reshard_plan import shapes

from megahet.policy.reshard_plan import KEYS, Layout, model_params, reshard_plan
from megahet.runtime.move_price import MovePrice, busiest_bytes

ITEMSIZE = dict.fromkeys(KEYS, 4)


@pytest.mark.parametrize(
    "old, new",
    [
        (Layout(2, 1, 1, (4,)), Layout(1, 1, 2, (4,))),
        (Layout(4, 1, 1, (4,)), Layout(2, 1, 2, (4,), strided=True)),
    ],
)
def test_the_busiest_rank_is_the_one_that_sends_or_receives_the_most(old, new):
    moves = reshard_plan(model_params(shapes(untied=False)), old, new)
    world = old.world
    sent = [sum(t.numel * 4 for t in moves.sent_by(r)) for r in range(world)]
    received = [sum(t.numel * 4 for t in moves.received_by(r)) for r in range(world)]
    assert busiest_bytes(moves, ITEMSIZE, world) == max(*sent, *received) > 0
    assert sum(sent) == sum(received) == moves.bytes_moved(ITEMSIZE)
    # half-precision weights: fewer bytes, the optimizer state's stay fp32
    half = {**ITEMSIZE, KEYS[0]: 2}
    assert busiest_bytes(moves, ITEMSIZE, world) > busiest_bytes(moves, half, world)


def test_a_price_is_the_rebuild_the_planning_and_the_transfer():
    price = MovePrice(rebuild_s=0.4, plan_s=0.25, bytes=64 * 2**20, bandwidth=128 * 2**20)
    assert price.transfer_s == 0.5 and price.total_s == pytest.approx(1.15)
    assert price.describe() == (
        "1.15 s: the rebuild 0.40 s (as at start), planning 0.25 s (rehearsed), 64.0 MiB at 128 MiB/s "
        "rank to rank (measured) 0.50 s"
    )
