"""Launching local jobs, shared by the tests and the benchmarks (one copy of each helper).

Role: tooling for tests and benchmarks; training itself never calls it. A free local port, the
environment every local launch sets, and the `torchrun` / `deepspeed` command lines up to the script.

    cmd = [*torchrun_cmd(4, free_port()), "pretrain_gpt.py", "--parallel.tp", "2"]
    subprocess.run(cmd, env=launch_env(), check=True)
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may still take it before it is bound)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env(**extra: str) -> dict[str, str]:
    """os.environ with what every local launch sets (one OpenMP thread per rank, DeepSpeed's CPU
    accelerator, wandb off, the repo importable), then `extra`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="disabled", **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def torchrun_cmd(nproc: int, port: int) -> list[str]:
    """torchrun with nproc ranks on this host (static rendezvous on 127.0.0.1:port), up to the script."""
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    return [*launcher, "--master_addr=127.0.0.1", f"--master_port={port}"]


def deepspeed_cmd(hostfile: Path, master_addr: str, port: int, *flags: str) -> list[str]:
    """The venv's `deepspeed` launcher (deepspeed.launcher.runner) with a hostfile and rank 0's address
    and port, up to the script; flags e.g. "--no_ssh", "--node_rank=1"."""
    script = Path(sys.executable).parent / "deepspeed"
    runner = [str(script)] if script.is_file() else [sys.executable, "-m", "deepspeed.launcher.runner"]
    return [
        *runner,
        f"--hostfile={hostfile}",
        f"--master_addr={master_addr}",
        f"--master_port={port}",
        *flags,
    ]
