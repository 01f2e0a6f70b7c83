"""Live tensor bytes on CPU, counted op by op: what a rank allocates and frees inside a block.

CPU tensors have no allocator statistics like CUDA's ``max_memory_allocated``. `LiveBytes` is a
TorchDispatchMode that sees every aten op run inside it: it adds each new storage an op returns
and, before each op, drops the storages that died since (weak references), so ``peak`` is the
largest total of storages made inside the block and alive together (views and in-place results
share their input's storage and add nothing). Storages that existed
before the block can be watched too: when one dies inside the block its bytes count as freed,
so ``peak`` is the net growth (new minus freed), the number that says whether patching holds
more than one layer at a time.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage(t):
    """(key, weak ref, bytes) of a plain CPU tensor's storage, or None (DTensor, meta, no storage)."""
    if not isinstance(t, torch.Tensor) or (type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)):
        return None
    if t.device.type != "cpu":
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    ref = StorageWeakRef(storage)
    return ref.cdata, ref, storage.nbytes()


class LiveBytes(TorchDispatchMode):
    """Net bytes of CPU tensor storage alive inside the block, and their peak.

    Args:
        watch: tensors alive before the block (say, a model's parameters) whose storages count
            as freed when they die inside it.

    Attributes:
        peak: the largest net total seen (bytes made inside and alive, minus watched bytes freed).
        current: the net total at the last op.
    """

    def __init__(self, watch=()):
        super().__init__()
        self.watched = {}
        for t in watch:
            s = _storage(t)
            if s is not None:
                self.watched[s[0]] = s[1:]
        self.new = {}
        self.peak = 0
        self.current = 0

    def _update(self):
        self.new = {k: v for k, v in self.new.items() if not v[0].expired()}
        freed = sum(n for ref, n in self.watched.values() if ref.expired())
        self.current = sum(n for _, n in self.new.values()) - freed
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._update()
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {s[0] for t in tree_leaves((args, kwargs)) if (s := _storage(t)) is not None}
        for t in tree_leaves(out):
            s = _storage(t)
            if s is not None and s[0] not in inputs and s[0] not in self.new and s[0] not in self.watched:
                self.new[s[0]] = s[1:]  # a storage this op made (not a view or in-place result)
        self._update()
        return out

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self._update()
        return result
