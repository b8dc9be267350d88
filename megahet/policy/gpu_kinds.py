"""GPU kinds a cluster description may name: spec-sheet peak matmul rates, memory and link bandwidths.

Role: policy (data: the layout planner's starting rates, before a profiling run calibrates them).

    GPU_KINDS["A100-80GB"].tflops("bf16")     # 312.0 (dense, no sparsity)
    gpu_kind("V100-32GB").tflops("bf16")      # None: no bf16 on Volta (train in fp32 there)

Figures are NVIDIA's datasheets, dense tensor-core rates without sparsity (fp32: plain FP32, as torch
runs matmuls by default, TF32 off); bandwidths are per direction, in GB/s (NVLink: the GPU's total over
its links, halved; PCIe: the x16 link of its generation). They are peaks: the cost model scales them by
an efficiency that a profiling run measures (megahet/policy/layout_cost.py).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuKind:
    name: str
    memory_gib: float
    bf16_tflops: float | None
    """Dense bf16 tensor-core peak (None: the card has no bf16)."""
    fp32_tflops: float
    """Plain FP32 peak (torch's default matmul precision, TF32 off)."""
    nvlink_gbps: float | None
    """NVLink bandwidth per direction (None: PCIe only)."""
    pcie_gbps: float

    def tflops(self, precision: str) -> float | None:
        """Peak rate for the run's precision ('bf16' or 'fp32'); None where the card lacks it."""
        return self.bf16_tflops if precision == "bf16" else self.fp32_tflops

    @property
    def intra_node_gbps(self) -> float:
        """GPU-to-GPU bandwidth inside a node: NVLink where the card has it, else PCIe."""
        return self.nvlink_gbps if self.nvlink_gbps is not None else self.pcie_gbps


PCIE3, PCIE4, PCIE5 = 16.0, 32.0, 64.0  # GB/s per direction, x16

GPU_KINDS: dict[str, GpuKind] = {
    k.name: k
    for k in (
        GpuKind("V100-16GB", 16, None, 15.7, 150.0, PCIE3),
        GpuKind("V100-32GB", 32, None, 15.7, 150.0, PCIE3),
        GpuKind("T4", 16, None, 8.1, None, PCIE3),
        GpuKind("A100-40GB", 40, 312.0, 19.5, 300.0, PCIE4),
        GpuKind("A100-80GB", 80, 312.0, 19.5, 300.0, PCIE4),
        GpuKind("A10", 24, 125.0, 31.2, None, PCIE4),
        GpuKind("RTX-3090", 24, 35.6, 35.6, None, PCIE4),
        GpuKind("RTX-4090", 24, 82.6, 82.6, None, PCIE4),
        GpuKind("L4", 24, 121.0, 30.3, None, PCIE4),
        GpuKind("L40S", 48, 362.0, 91.6, None, PCIE4),
        GpuKind("H100-80GB", 80, 989.0, 67.0, 450.0, PCIE5),
        GpuKind("H200", 141, 989.0, 67.0, 450.0, PCIE5),
    )
}


def gpu_kind(name: str) -> GpuKind:
    """The kind called `name` (case-insensitive), or a one-line ValueError listing the known ones."""
    for key, kind in GPU_KINDS.items():
        if key.lower() == name.lower():
            return kind
    raise ValueError(
        f"unknown GPU kind {name!r}: use one of {', '.join(GPU_KINDS)}, or describe the node with "
        f"memory_gib, tflops and intra_gbps instead of kind"
    )
