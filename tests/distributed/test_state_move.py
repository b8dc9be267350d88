"""`exchange` (megahet/runtime/state_move.py) over gloo on 4 ranks: every reshard-plan change of the unit
test that spans 4 ranks gives each rank exactly its new state, with every run its own message, with
every run packed per peer and dtype (small runs: `SMALL_BYTES`), and with a mix of both.

Run: ``python -m pytest tests/distributed/test_state_move.py -q`` (about 20 s).
"""

from __future__ import annotations

from harness import torchrun


def test_exchange_moves_runs_alone_packed_and_mixed(tmp_path) -> None:
    out = torchrun("workers/state_move_worker.py", 4, [], cwd=tmp_path, timeout=300)
    line = next(line for line in out.splitlines() if line.startswith("ok "))
    changes, packed, alone = map(int, line.split()[1:])
    assert changes >= 5, line  # the changes of 4 ranks in the unit test's list
    assert packed > 0 and alone > 0, line  # the mixed run took both paths
