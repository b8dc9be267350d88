"""A dispatch mode that fails the way a GPU would on tensors of mixed devices, run on the CPU.

On CUDA, an op whose tensor arguments sit on different devices raises ("Expected all tensors to be on
the same device"), except for 0-dim CPU scalars and explicit copies. On the CPU everything shares one
device, so such a defect cannot show. Put the model's parameters on the `meta` device, run a code
path under `StrictDevice()`, and every op that mixes a tensor megahet created on the CPU with a
parameter (or activation) on `meta` raises here as it would on a GPU. Stricter than CUDA in one way,
on purpose: CPU index tensors are refused too (CUDA accepts them for advanced indexing, at the price
of a host-to-device copy and a sync per call).

Also refused: reading a device tensor's values on the host (`.item()`, `.tolist()`, `nonzero` on
`meta`), which on a GPU is a synchronization.

    with StrictDevice():
        executor.apply(plan)                      # raises if it mixes devices
Imported by tests/unit/test_device_placement.py; not a test module.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_COPIES = {
    torch.ops.aten.copy_.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
}


class MixedDevices(RuntimeError):
    pass


class StrictDevice(TorchDispatchMode):
    """Raise MixedDevices on any op (but copies) whose non-scalar tensor arguments span devices."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if func not in _COPIES:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            devices = {t.device for t in tensors if not (t.dim() == 0 and t.device.type == "cpu")}
            if len(devices) > 1:
                shapes = [(tuple(t.shape), str(t.device)) for t in tensors]
                raise MixedDevices(f"{func} mixes devices {sorted(map(str, devices))}: {shapes}")
        return func(*args, **kwargs)
