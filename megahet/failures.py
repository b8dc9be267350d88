"""How a rank ends on a failure (runtime): bad inputs in one line, printed once; a lost peer named.

- A `ConfigError` raised before the process groups start comes from the configuration and files
  every rank of a node sees alike: only the node's first rank (LOCAL_RANK 0) prints it. After they
  start, a failure can be one rank's own, so every failing rank prints its line.
- A dead peer (its process killed, its node lost) makes the survivors' next collective fail at once
  on gloo ("Connection closed by peer"), or after NCCL's watchdog timeout on GPUs. `record_peers`
  (at start-up) gathers every rank's host and pid; `lost_peer_message` then names the ranks of this
  host whose process is gone, and says the job stops and how to resume. The launcher (torchrun, the
  deepspeed launcher) ends the node's other ranks as soon as one exits (SIGTERM) and names the failed
  rank in its summary; a rank it stops that had not reached a collective yet prints the same line
  (`name_lost_peers_when_stopped`), so every survivor says which rank died.

    record_peers()                          # once, after init_process_group
    except RuntimeError as err: sys.exit(lost_peer_message(err)) if is_peer_loss(err) else raise
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import torch.distributed as dist

_PEERS: list[tuple[str, int]] = []
"""(host name, pid) of every rank, by global rank."""

PEER_LOSS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "connectFullMesh failed",
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",
)
"""What torch.distributed's error says when a peer rank is gone (gloo, NCCL)."""


def first_local_rank() -> bool:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == 0


def record_peers() -> None:
    """Gather (host, pid) of every rank (one small all-gather at start-up)."""
    peers: list = [None] * dist.get_world_size()
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
    _PEERS[:] = peers
    ended_marker(os.getpid()).unlink(missing_ok=True)  # an earlier process's, with this pid
    if first_local_rank():
        _sweep_ended_markers()


def ended_marker(pid: int) -> Path:
    """The file a rank leaves when it ends through megahet's failure handling (naming a lost peer, or
    stopped by its launcher): the other ranks do not count it among the dead."""
    return Path(tempfile.gettempdir()) / f"{_ENDED_PREFIX}{pid}"


_ENDED_PREFIX = "megahet-ended-"
MARKER_AGE_S = 600.0
"""Markers older than this are swept at start-up (by each host's first rank): their jobs have ended."""


def _sweep_ended_markers(max_age_s: float = MARKER_AGE_S) -> None:
    for marker in Path(tempfile.gettempdir()).glob(f"{_ENDED_PREFIX}*"):
        try:
            if time.time() - marker.stat().st_mtime > max_age_s:
                marker.unlink()
        except OSError:  # another host rank swept it first
            pass


def is_peer_loss(err: BaseException) -> bool:
    return dist.is_initialized() and any(sign in str(err) for sign in PEER_LOSS)


def _alive(pid: int) -> bool:
    """Whether the process runs (a killed rank stays a zombie until its launcher reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def dead_ranks(peers: list[tuple[str, int]], host: str) -> list[int]:
    """The ranks on `host` whose process is gone without ending itself (`ended_marker`)."""
    return [
        rank
        for rank, (h, pid) in enumerate(peers)
        if h == host and not _alive(pid) and not ended_marker(pid).exists()
    ]


EXIT_GRACE_S = 2.0
"""How long to wait for a killed peer to show as gone: its sockets close (the survivors' error) before
its process has finished exiting."""


def _wait_for_dead(peers: list[tuple[str, int]], host: str, grace_s: float = EXIT_GRACE_S) -> list[int]:
    deadline = time.monotonic() + grace_s
    while not (dead := dead_ranks(peers, host)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return dead


def _lost_peer_line(rank: int, who: str, cause: str) -> str:
    return (
        f"megahet: error: rank {rank}: {who} ({cause}); the job stops: run the same command with "
        f"--train.load set to resume from the last checkpoint (torchrun --max-restarts does it by itself)"
    )


def _died(dead: list[int]) -> str:
    return f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} died"


def lost_peer_message(err: BaseException) -> str:
    """One line: which rank this is, which peers are gone (those of this host, by their pid), the
    cause as torch.distributed reported it, and how to go on. The caller ends the rank with it."""
    rank = dist.get_rank()  # is_peer_loss: the process group is up
    host = socket.gethostname()
    dead = _wait_for_dead(_PEERS, host)
    if dead:
        who = _died(dead)
    elif any(h != host for h, _ in _PEERS):
        who = "a rank on another host stopped (its node's launcher names it)"
    else:
        who = "a peer rank closed its connection (the launcher's summary names it)"
    cause = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    ended_marker(os.getpid()).touch()  # this rank ends now, having named them (see stopped_message)
    return _lost_peer_line(rank, who, cause)


def stopped_message(peers: list[tuple[str, int]], host: str, pid: int) -> str | None:
    """The line a rank stopped by its launcher prints: which ranks of this host died (gone without naming a
    lost peer themselves: `ended_marker`); None when none did (the job was stopped for another reason,
    e.g. by its user)."""
    dead = dead_ranks(peers, host)
    if not dead or (host, pid) not in peers:
        return None
    return _lost_peer_line(peers.index((host, pid)), _died(dead), "stopped by the launcher: SIGTERM")


_WATCHING = False


def name_lost_peers_when_stopped() -> None:
    """Make this rank print the lost-peer line when its launcher stops it (SIGTERM) after a peer died.

    torchrun and the deepspeed launcher SIGTERM a node's other ranks as soon as one exits: a survivor
    still computing has not reached the collective that would fail, so it would end without saying why.
    The signal's C-level handler writes to a wakeup pipe even while the main thread is blocked (in a
    collective, in a kernel); a daemon thread reading it prints the line (from the peers `record_peers`
    gathered) and exits with 128 + SIGTERM, as a shell reports a process ended by SIGTERM. Call it from
    the main thread of the process a launcher started (`run_cli`), never inside a test runner."""
    global _WATCHING
    if _WATCHING:  # once per process (a test driver may call run_cli many times)
        return
    _WATCHING = True
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the thread below acts on it

    def watch() -> None:
        while signal.SIGTERM not in os.read(read_fd, 64):  # one byte per signal number
            pass
        line = stopped_message(list(_PEERS), socket.gethostname(), os.getpid())
        if _PEERS:
            ended_marker(os.getpid()).touch()  # stopped, not dead: the ranks stopped after it do not name it
        if line is not None:
            os.write(2, (line + "\n").encode())
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="megahet-sigterm", daemon=True).start()


def default_sigterm() -> None:
    """SIGTERM ends this rank at once again (it is ending through an error it has printed: a launcher's
    SIGTERM must not wait for its exit, e.g. gloo's teardown, to finish)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
