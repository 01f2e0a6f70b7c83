"""Count the tensor storages an aten op creates until they die: the CPU stand-in for CUDA's peak.

`LiveTensors` (a TorchDispatchMode plus a weakref finalizer per storage) keeps the peak of the
bytes alive at once, as the CUDA caching allocator's ``max_memory_allocated()`` does. What it
cannot see is memory inside one op (SDPA's log-sum-exp, a grouped GEMM's workspace).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensors(TorchDispatchMode):
    """Peak bytes of simultaneously live tensor storages created inside the context.

    Storages whose data pointers are in ``existing`` (weights, the input) are never counted: a
    view of one (``weight.transpose``) is not a new tensor.
    """

    def __init__(self, existing: set[int] = frozenset()) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {ptr: 0 for ptr in existing}

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes == 0 or key in self._seen:
                    continue  # a view, or an in-place result
                self._seen[key] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, nbytes)
        return out


def cpu_measure(fn, *existing: torch.Tensor) -> int:
    """The CPU stand-in for the profiler's CUDA `measure_peak`: warm up, then count one call.

    ``existing`` tensors' storages (weights, inputs) are left out of the count.
    """
    fn()
    with LiveTensors({t.untyped_storage().data_ptr() for t in existing}) as tracker:
        out = fn()
        del out
    return tracker.peak
