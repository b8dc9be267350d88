"""Two hosts for real on one machine: a 4-rank pretrain_gpt job across two Linux network namespaces.

The `hosts` fixture creates two namespaces (each its own network stack: no shared loopback, nothing
reachable but the other end of the link), joins them with a veth pair, 10.77.0.1/24 and 10.77.0.2/24,
and deletes them afterwards:

    ip netns add A; ip netns add B
    ip link add mhveth0 netns A type veth peer name mhveth1 netns B
    ip -n A addr add 10.77.0.1/24 dev mhveth0; ip -n A link set mhveth0 up; ip -n A link set lo up
    (the same for B with 10.77.0.2)

In each, `ip netns exec` starts one launcher for 2 of the 4 ranks of a TP=1 x PP=2 x DP=2 (ZeRO-1)
tiny GPT, the pipeline stages on different hosts:
- torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint 10.77.0.1:PORT;
- deepspeed --hostfile HF --no_ssh --node_rank N --master_addr 10.77.0.1 (HF: the two addresses).
Per-step losses and gradient norms and the validation loss must equal the single-host 4-rank torchrun
run's (allowed: 1e-6 absolute; measured: bit-identical), and each host must have sent its share of the
traffic over the veth link.

The namespaces share the machine's hostname (which resolves to 127.0.0.1 here), so each launcher also
gets what a real node finds from its hostname: GLOO_SOCKET_IFNAME=<its veth> (else gloo binds the
hostname's address and the peers are refused: "connectFullMesh failed ... remote=[127.0.0.1]");
for torchrun, --local_addr=<its address> (else MASTER_ADDR is the hostname and host B's ranks dial
localhost) and, on the endpoint's host, --rdzv_conf is_host=1 (else no agent recognises the endpoint
as its own, nobody hosts the c10d store, and both time out connecting to it).

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; skipped, saying so, without them.
Run: python -m pytest tests/distributed/test_multinode.py -q   (about 60 s on 2 idle CPU cores)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from harness import (
    GPT_MODEL,
    compare,
    deepspeed_cmd,
    launch,
    metrics_curves,
    metrics_job,
    short_run,
    skip_or_fail,
    torchrun_curves,
)

STEPS = 5
SCRIPT = "../../pretrain_gpt.py"  # relative to tests/distributed, as the harness takes workers
TRAIN = [*short_run(STEPS, eval_iters=1, lr="5e-3"), "--parallel.pp", "2", "--parallel.zero_stage", "1"]
WORLD = "world 4 = TP 1 x PP 2 x DP 2"  # pretrain_gpt's first line
NEEDS = "needs root / CAP_NET_ADMIN and iproute2 to create network namespaces"
MIN_SENT = 1_000_000  # bytes each host sends (measured: 3.6 MB): activations, gradients, tied embedding


@dataclass(frozen=True)
class Host:
    netns: str
    addr: str
    ifname: str

    def run(self, *cmd: str) -> list[str]:
        """cmd on this host: in its namespace, gloo bound to its veth interface."""
        return ["ip", "netns", "exec", self.netns, "env", f"GLOO_SOCKET_IFNAME={self.ifname}", *cmd]

    def sent_bytes(self) -> int:
        path = f"/sys/class/net/{self.ifname}/statistics/tx_bytes"
        return int(subprocess.check_output(["ip", "netns", "exec", self.netns, "cat", path], text=True))


def _ip(*args: str) -> None:
    """Run `ip args`; skip the module (the machine cannot make the hosts) when it fails (fail in CI)."""
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        skip_or_fail(f"{NEEDS}: `ip {' '.join(args)}` failed: {done.stderr.strip()}")


@pytest.fixture(scope="module")
def hosts():
    """Two namespace hosts joined by a veth pair (names unique to this pid); deleted afterwards."""
    if shutil.which("ip") is None:
        skip_or_fail(f"{NEEDS}: `ip` not found")
    tag = f"megahet{os.getpid()}"
    a, b = Host(f"{tag}a", "10.77.0.1", "mhveth0"), Host(f"{tag}b", "10.77.0.2", "mhveth1")
    made = []
    try:
        for host in (a, b):
            _ip("netns", "add", host.netns)
            made.append(host.netns)
        _ip(
            "link",
            "add",
            a.ifname,
            "netns",
            a.netns,
            "type",
            "veth",
            "peer",
            "name",
            b.ifname,
            "netns",
            b.netns,
        )
        for host in (a, b):
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for netns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", netns], check=False, capture_output=True)


def job_args(gpt_data: list[str], out: Path, name: str) -> tuple[list[str], Path]:
    """pretrain_gpt's arguments for run `name` in `out`, and its metrics file."""
    return metrics_job(out, name, [*GPT_MODEL, *TRAIN, *gpt_data])


@pytest.fixture(scope="module")
def reference(gpt_data: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same job, 4 ranks on this host under torchrun."""
    out = tmp_path_factory.mktemp("multinode_single_host")
    return torchrun_curves(SCRIPT, 4, [*GPT_MODEL, *TRAIN, *gpt_data], STEPS, cwd=out, timeout=300)


def run_on_hosts(test: str, hosts, launchers, reference, gpt_data: list[str], out: Path) -> None:
    """Run the job with launchers(port) (one per host); check its curves and the traffic between hosts."""
    args, metrics = job_args(gpt_data, out, "two_hosts")
    before = [host.sent_bytes() for host in hosts]
    outputs = launch(launchers, SCRIPT, 4, args, cwd=out, timeout=300)
    sent = [host.sent_bytes() - start for host, start in zip(hosts, before)]
    assert any(WORLD in output for output in outputs), f"no launcher printed '{WORLD}'"
    assert min(sent) > MIN_SENT, f"the hosts sent {sent} bytes over the veth link, expected > {MIN_SENT} each"
    run = metrics_curves(metrics, STEPS)
    for key, expected in reference.items():
        compare(test, f"2 hosts x 2 vs 1 host x 4 {key}", run[key], expected, rtol=0.0, atol=1e-6)


def test_torchrun_c10d_two_netns_hosts_match_single_host(hosts, reference, gpt_data, tmp_path: Path):
    head = hosts[0]

    def launchers(port: int) -> list[list[str]]:
        return [
            host.run(
                *[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2"],
                *["--rdzv_backend=c10d", f"--rdzv_endpoint={head.addr}:{port}", f"--rdzv_id={head.netns}"],
                f"--local_addr={host.addr}",
                *(["--rdzv_conf=is_host=1"] if host == head else []),
            )
            for host in hosts
        ]

    run_on_hosts("torchrun c10d, 2 netns hosts", hosts, launchers, reference, gpt_data, tmp_path)


def test_deepspeed_no_ssh_two_netns_hosts_match_single_host(hosts, reference, gpt_data, tmp_path: Path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{host.addr} slots=2\n" for host in hosts))

    def launchers(port: int) -> list[list[str]]:
        return [
            host.run(*deepspeed_cmd(hostfile, hosts[0].addr, port, "--no_ssh", f"--node_rank={node}"))
            for node, host in enumerate(hosts)
        ]

    run_on_hosts("deepspeed no_ssh, 2 netns hosts", hosts, launchers, reference, gpt_data, tmp_path)
