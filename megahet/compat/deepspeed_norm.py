"""DeepSpeed ZeRO-1/2's gradient norm with one fused norm over the partition (private API, DeepSpeed 0.19).

Role: compat (issue 48: the plain path's host work).

`DeepSpeedZeroOptimizer.get_grad_norm_direct` casts every parameter's gradient to float64 and takes its
norm one parameter at a time: two ATen ops (a copy and a norm; two kernels on a GPU) per parameter per
step, 56 of the 265 ops megahet's plain step dispatched beyond megatron-core's on the 27-parameter CPU
shape (benchmarks/results/host_counts_ops.md). `fused_grad_norm` keeps its rules (parameters flagged
`ds_pipe_replicated` count zero times, replicated parameters only on model-parallel rank 0, the sum over
the data-parallel and model-parallel groups, NaN / inf masked) and takes every counted gradient's norm in
one `torch._foreach_norm` (in fp32, as megatron-core's multi_tensor_l2norm), summing their squares in
float64. Only the L2 norm is replaced; the max norm and CPU offload keep DeepSpeed's.

    install_fused_grad_norm(engine.optimizer)     # megahet/engine.py, after deepspeed.initialize

Private API used (checked by tests/unit/test_compat.py): the method's name and arguments, the optimizer's
`dp_process_group`, `model_parallel_rank`, `_model_parallel_all_reduce`, `cpu_offload`, `device`, and
`deepspeed.runtime.utils.mask_nan_or_inf_with_val_inplace` / `is_model_parallel_parameter`.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from deepspeed.runtime.constants import PIPE_REPLICATED
from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace


def fused_grad_norm(self, gradients, params, norm_type=2):
    """The L2 norm of the partition's gradients over the data- and model-parallel groups (see the module
    docstring); other norms go to DeepSpeed's own method."""
    if float(norm_type) != 2.0:
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    grads = [g for g in gradients if not getattr(g, "_zero_padding", False)]  # lists: no call per element
    counted = [
        g.detach()
        for g, p in zip(grads, params)
        if not getattr(p, PIPE_REPLICATED, False)
        and (is_model_parallel_parameter(p) or self.model_parallel_rank == 0)
    ]
    if counted:
        norms = torch._foreach_norm(counted, 2, dtype=torch.float32)  # one fused op: [||g||] per tensor
        total = torch.stack(norms).double().pow(2).sum().float()
    else:
        total = torch.zeros((), dtype=torch.float32, device=self.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.sqrt()
    mask_nan_or_inf_with_val_inplace(total, device=self.device)
    return total


def install_fused_grad_norm(optimizer) -> bool:
    """Give a ZeRO-1/2 optimizer (not offloading to the CPU) `fused_grad_norm`; whether it did."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.cpu_offload:
        return False
    optimizer.get_grad_norm_direct = types.MethodType(fused_grad_norm, optimizer)
    return True
