"""megahet/failures.py's two decisions, with fake errors (the end-to-end dead-rank test is in
tests/distributed/test_failures.py): which torch.distributed errors mean a lost peer, and the one line
that names it.

Run: ``python -m pytest tests/unit/test_peer_loss.py -q`` (the name differs from the distributed test_failures.py: pytest
imports test modules by basename)
"""

from __future__ import annotations

import socket

import pytest

from megahet import failures


@pytest.mark.parametrize("sign", failures.PEER_LOSS)
def test_every_peer_loss_sign_is_recognized_once_the_group_is_up(world1, sign: str) -> None:
    assert failures.is_peer_loss(RuntimeError(f"[../gloo/transport] {sign}: 127.0.0.1:1234"))


def test_other_errors_and_no_group_are_not_a_peer_loss(world1, monkeypatch) -> None:
    assert not failures.is_peer_loss(RuntimeError("CUDA out of memory"))
    assert not failures.is_peer_loss(ValueError("shapes do not match"))
    monkeypatch.setattr(failures.dist, "is_initialized", lambda: False)
    assert not failures.is_peer_loss(RuntimeError("Connection closed by peer"))


def _message(monkeypatch, peers, dead) -> str:
    monkeypatch.setattr(failures, "_PEERS", peers)
    monkeypatch.setattr(failures, "_wait_for_dead", lambda peers, host: dead)
    err = RuntimeError("Connection closed by peer [10.0.0.2]:4242\nsecond line of the trace")
    return failures.lost_peer_message(err)


def test_the_line_names_the_dead_ranks_of_this_host_and_how_to_resume(world1, monkeypatch) -> None:
    here = socket.gethostname()
    line = _message(monkeypatch, [(here, 1), (here, 2), (here, 3)], [1, 2])
    assert line.startswith(
        "megahet: error: rank 0: ranks 1, 2 died (Connection closed by peer [10.0.0.2]:4242)"
    )
    assert "\n" not in line and "--train.load" in line and "--max-restarts" in line
    assert "rank 2 died" in _message(monkeypatch, [(here, 1), (here, 2)], [2])


def test_without_a_dead_rank_here_the_line_says_where_to_look(world1, monkeypatch) -> None:
    here = socket.gethostname()
    assert "a rank on another host stopped" in _message(monkeypatch, [(here, 1), ("node-b", 7)], [])
    assert "a peer rank closed its connection" in _message(monkeypatch, [(here, 1), (here, 2)], [])
