"""Tensor memory as the model uses it, counted op by op: live storage bytes, their peak, and the bytes
autograd saves for the backward (a model's own activation count). Device-independent, so it measures on CPU
what a GPU's allocator would hold (less the allocator's rounding and caching), and it ignores process RSS.

    tracker = MemoryTracker()
    with tracker, tracker.saved():              # every torch op inside is seen
        loss = model(x).sum()                   # tracker.saved_bytes: what backward will read
        loss.backward()
    tracker.peak, tracker.live                  # bytes, of storages created inside

Each untyped storage is counted once (views, in-place and out= results of an input share it and add
nothing), from the op that creates it until it is freed (a weakref.finalize on the storage). Storages that
existed before the tracker started (the model's weights, say) are not counted, nor kernels' internal
scratch buffers that never leave the kernel. Bytes are attributed to a *region*: `tracker.region` as the
caller sets it (e.g. "attention" while the core attention's forward runs), "backward" while autograd runs
a backward node.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclasses.dataclass
class _Storage:
    nbytes: int
    region: str
    op: str


def _storages(tree) -> list[torch.UntypedStorage]:
    out = []
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
            out.append(leaf.untyped_storage())
    return out


class MemoryTracker(TorchDispatchMode):
    """Live bytes of the tensor storages created while it is active, their peak, and at the peak the live
    bytes by region and by the op that created them (`reset()` starts a new peak from the live bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.region = "other"
        """Where the ops running now belong (set by the caller; "backward" overrides it in backward)."""
        self.live = 0
        self.peak = 0
        self._tracked: dict[int, _Storage] = {}  # id(storage) -> what it holds, while it lives
        self._live_by: collections.Counter = collections.Counter()  # (region, op) -> live bytes
        self.at_peak: dict[tuple[str, str], int] = {}
        """Live bytes by (region, creating op) at the peak."""
        self._saved: dict[int, _Storage] = {}  # id(storage) -> the first region that saved it, while it lives
        self._saved_freed: list[_Storage] = []  # saved storages since freed (backward ran, or the graph went)
        self.saved_bytes = 0

    # -- storages ----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {s.data_ptr() for s in _storages((args, kwargs)) if s.nbytes()}
        out = func(*args, **kwargs)
        for storage in _storages(out):
            self._track(storage, func, inputs)
        return out

    def _track(self, storage: torch.UntypedStorage, func, inputs: set[int]) -> None:
        key, nbytes = id(storage), storage.nbytes()
        known = self._tracked.get(key)
        if known is not None:  # a result in place or a view: only a resize_ changes its bytes
            self._add(known, nbytes - known.nbytes)
            return
        if nbytes == 0 or storage.data_ptr() in inputs:  # an input's storage that existed before us
            return
        region = "backward" if torch._C._current_autograd_node() is not None else self.region
        entry = _Storage(0, region, str(func.overloadpacket.__name__))
        self._tracked[key] = entry
        self._add(entry, nbytes)
        weakref.finalize(storage, self._free, key)

    def _add(self, entry: _Storage, delta: int) -> None:
        if not delta:
            return
        entry.nbytes += delta
        self.live += delta
        self._live_by[entry.region, entry.op] += delta
        if self.live > self.peak:
            self.peak = self.live
            self.at_peak = {k: v for k, v in self._live_by.items() if v}

    def _free(self, key: int) -> None:
        entry = self._tracked.pop(key, None)
        if entry is not None:
            self._add(entry, -entry.nbytes)
        if key in self._saved:  # its id may be reused by a new storage
            self._saved_freed.append(self._saved.pop(key))

    def reset(self) -> None:
        """A new peak from now: peak = live; the saved-tensor count starts over."""
        self.peak = self.live
        self.at_peak = {k: v for k, v in self._live_by.items() if v}
        self._saved.clear()
        self._saved_freed.clear()
        self.saved_bytes = 0

    # -- saved for backward --------------------------------------------------------------------------
    @contextlib.contextmanager
    def saved(self):
        """Count the storages autograd saves for the backward inside (each once, only those this tracker
        created: not the weights), in `saved_bytes` and `saved_by()`."""

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            key = id(storage)
            entry = self._tracked.get(key)
            if entry is not None and key not in self._saved:
                self._saved[key] = _Storage(storage.nbytes(), self.region, entry.op)
                self.saved_bytes += storage.nbytes()
            return tensor.detach()  # the tensor, without its grad_fn: no reference cycle through it

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield self

    def saved_by(self, field: str = "region", region: str | None = None) -> dict[str, int]:
        """Saved bytes by the region that first saved each storage ("region") or by its creating op ("op"),
        largest first; `region`: of that region's saves only."""
        out: collections.Counter = collections.Counter()
        for entry in [*self._saved.values(), *self._saved_freed]:
            if region is None or entry.region == region:
                out[getattr(entry, field)] += entry.nbytes
        return dict(out.most_common())

    def peak_by(self, field: str = "region") -> dict[str, int]:
        """Live bytes at the peak by region or by creating op, largest first."""
        index = 0 if field == "region" else 1
        out: collections.Counter = collections.Counter()
        for key, nbytes in self.at_peak.items():
            out[key[index]] += nbytes
        return dict(out.most_common())
