"""How a rank ends on a failure (runtime): bad inputs in one line, printed once; a lost peer named.

- A `ConfigError` raised before the process groups start comes from the configuration and files
  every rank of a node sees alike: only the node's first rank (LOCAL_RANK 0) prints it. After they
  start, a failure can be one rank's own, so every failing rank prints its line.
- A dead peer (its process killed, its node lost) makes the survivors' next collective fail at once
  on gloo ("Connection closed by peer"), or after NCCL's watchdog timeout on GPUs. `record_peers`
  (at start-up) gathers every rank's host and pid; `lost_peer_message` then names the ranks of this
  host whose process is gone, and says the job stops and how to resume. The launcher (torchrun, the
  deepspeed launcher) ends the node's other ranks as soon as one exits and names the failed rank in
  its summary.

    record_peers()                          # once, after init_process_group
    except RuntimeError as err: sys.exit(lost_peer_message(err)) if is_peer_loss(err) else raise
"""

from __future__ import annotations

import os
import socket
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
    """The ranks on `host` whose process is gone."""
    return [rank for rank, (h, pid) in enumerate(peers) if h == host and not _alive(pid)]


EXIT_GRACE_S = 2.0
"""How long to wait for a killed peer to show as gone: its sockets close (the survivors' error) before
its process has finished exiting."""


def _wait_for_dead(peers: list[tuple[str, int]], host: str, grace_s: float = EXIT_GRACE_S) -> list[int]:
    deadline = time.monotonic() + grace_s
    while not (dead := dead_ranks(peers, host)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return dead


def lost_peer_message(err: BaseException) -> str:
    """One line: which rank this is, which peers are gone (those of this host, by their pid), the
    cause as torch.distributed reported it, and how to go on."""
    rank = dist.get_rank()  # is_peer_loss: the process group is up
    host = socket.gethostname()
    dead = _wait_for_dead(_PEERS, host)
    if dead:
        who = f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} died"
    elif any(h != host for h, _ in _PEERS):
        who = "a rank on another host stopped (its node's launcher names it)"
    else:
        who = "a peer rank closed its connection (the launcher's summary names it)"
    cause = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    return (
        f"megahet: error: rank {rank}: {who} ({cause}); the job stops: run the same command with "
        f"--train.load set to resume from the last checkpoint (torchrun --max-restarts does it by itself)"
    )
