"""megahet/failures.py's decisions, with fake errors (the end-to-end dead-rank test is in
tests/distributed/test_failures.py): which torch.distributed errors mean a lost peer, the one line
that names it, and the same line from a rank its launcher stops (SIGTERM) while its main thread is
busy (a real process, signalled).

Run: ``python -m pytest tests/unit/test_peer_loss.py -q`` (the name differs from the distributed test_failures.py: pytest
imports test modules by basename)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

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
    line = failures.lost_peer_message(err)
    marker = failures.ended_marker(os.getpid())
    assert marker.exists()  # this rank ends having named the lost peer: stopped peers do not count it
    marker.unlink()
    return line


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


def test_a_stopped_rank_names_the_dead_ranks_of_its_host() -> None:
    here = socket.gethostname()
    peers = [(here, 11), (here, 12), ("node-b", 13)]
    alive = {12}
    orig = failures._alive
    try:
        failures._alive = lambda pid: pid in alive
        line = failures.stopped_message(peers, here, 12)
        assert line is not None and line.startswith(
            "megahet: error: rank 1: rank 0 died (stopped by the launcher: SIGTERM)"
        )
        assert "\n" not in line and "--train.load" in line
        marker = failures.ended_marker(11)
        marker.touch()  # rank 0 ended itself, naming a lost peer: it did not die
        try:
            assert failures.stopped_message(peers, here, 12) is None
        finally:
            marker.unlink()
        alive.add(11)
        assert failures.stopped_message(peers, here, 12) is None  # stopped for another reason: no claim
    finally:
        failures._alive = orig


_STOPPED_RANK = textwrap.dedent(
    """
    import os, socket, sys, time
    from megahet import failures
    failures._PEERS[:] = [(socket.gethostname(), int(sys.argv[1])), (socket.gethostname(), os.getpid())]
    failures.name_lost_peers_when_stopped()
    failures.name_lost_peers_when_stopped()  # a second call changes nothing
    print("ready", flush=True)
    time.sleep(120)  # the main thread is busy: the signal's Python-level handler does nothing here
    """
)


@pytest.mark.parametrize("peer_dead", [True, False])
def test_a_rank_stopped_by_its_launcher_prints_the_line_at_once(peer_dead: bool) -> None:
    """A real process, its main thread asleep, gets SIGTERM: it prints the lost-peer line (only when its
    peer is gone) and ends with 143 without waiting for its main thread."""
    peer = subprocess.Popen(["true"] if peer_dead else ["sleep", "120"])
    if peer_dead:
        peer.wait()  # reaped: its pid is gone
    proc = subprocess.Popen(
        [sys.executable, "-c", _STOPPED_RANK, str(peer.pid)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        os.kill(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 60
    finally:
        proc.kill()
        peer.kill()
        peer.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    marker = failures.ended_marker(proc.pid)
    assert marker.exists()  # stopped, not dead: the ranks stopped after it do not name it
    marker.unlink()
    ours = [line for line in err.splitlines() if line.startswith("megahet: error:")]
    if peer_dead:
        assert len(ours) == 1 and ours[0].startswith("megahet: error: rank 1: rank 0 died"), err
    else:
        assert ours == [], err


def test_old_markers_are_swept_and_recent_ones_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(failures.tempfile, "gettempdir", lambda: str(tmp_path))
    old, recent = failures.ended_marker(101), failures.ended_marker(102)
    old.touch()
    recent.touch()
    past = time.time() - failures.MARKER_AGE_S - 60
    os.utime(old, (past, past))
    failures._sweep_ended_markers()
    assert not old.exists() and recent.exists()
