"""torch.distributed's collectives, wrapped for the length of a block (and megatron-core's own names).

The balancer measures each rank's own compute as its compute regions minus the time it was blocked in
collectives (megahet/runtime/timing.py). megatron-core, DeepSpeed and megahet all call collectives
through the `torch.distributed` module, so the clock replaces those module attributes with timed
wrappers, and points megatron-core's module-level copies of two of them (`dist_all_gather_func`,
`dist_reduce_scatter_func`, bound at import) at the same wrappers. `collectives_wrapped` does it for one
block only and restores every original after it: nothing stays replaced outside a training step.

Private API used (checked by tests/unit/test_compat.py):
- the torch.distributed functions in COLLECTIVES (module attributes, looked up at call time by
  megatron-core and DeepSpeed);
- megatron-core's module-level names in BOUND.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator

import torch.distributed as dist

# torch.distributed entry points that wait on peers. Those returning a Work (async_op=True) can have
# their Work wrapped too (the wrapper decides).
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather_coalesced",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "reduce",
    "broadcast",
    "broadcast_object_list",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
)
# Not wrapped: isend / irecv / batch_isend_irecv (P2POp checks `op` against the originals). megatron-core's
# pipeline sends and receives run outside the compute regions, and migration's between steps.

BOUND = {
    "megatron.core.tensor_parallel.mappings": ("dist_all_gather_func", "dist_reduce_scatter_func"),
    "megatron.core.tensor_parallel.layers": ("dist_all_gather_func", "dist_reduce_scatter_func"),
    "megatron.core.transformer.multi_token_prediction": ("dist_all_gather_func",),
}
"""megatron-core modules that bind a collective to a name of their own when imported."""

WRAPPED = "__wrapped_by_megahet__"


@contextlib.contextmanager
def collectives_wrapped(wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Within the block, each collective of COLLECTIVES, in torch.distributed and where megatron-core
    bound it, is `wrap(original)`; the originals are back after it (a name someone else replaced in the
    meantime is left as they set it). Nested blocks leave the outer wrappers in place."""
    wrappers: dict[Callable, Callable] = {}
    replaced: list[tuple[object, str, Callable, Callable]] = []  # (owner, name, original, wrapper)
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, WRAPPED, False):
            continue
        wrapper = wrappers[fn] = wrap(fn)
        setattr(wrapper, WRAPPED, True)
        replaced.append((dist, name, fn, wrapper))
    for module_name, names in BOUND.items():
        module = importlib.import_module(module_name)
        for name in names:
            fn = getattr(module, name, None)
            if fn in wrappers:
                replaced.append((module, name, fn, wrappers[fn]))
    for owner, name, _, wrapper in replaced:
        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        for owner, name, original, wrapper in replaced:
            if getattr(owner, name) is wrapper:
                setattr(owner, name, original)
