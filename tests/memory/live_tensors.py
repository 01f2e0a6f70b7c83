"""Count the tensor storages an aten op creates until they die: the CPU stand-in for CUDA's peak.

`LiveTensors` (a TorchDispatchMode plus a weakref finalizer per storage) keeps the peak of the
bytes alive at once, as the CUDA caching allocator's ``max_memory_allocated()`` does. A storage
resized in place (``untyped_storage().resize_(0)``, which frees it while tensors still point at
it) is seen at the next op. What it cannot see is memory inside one op (SDPA's log-sum-exp, a
grouped GEMM's workspace).
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
        self._seen: dict[int, list | None] = {ptr: None for ptr in existing}  # [storage's weakref, bytes counted]

    def _free(self, key: int, record: list) -> None:
        self.live -= record[1]
        self._seen.pop(key, None)

    def _resized(self) -> None:
        """Count storages resized in place since the last op at their new size."""
        for record in self._seen.values():
            storage = None if record is None else record[0]()
            if storage is not None and storage.nbytes() != record[1]:
                self.live += storage.nbytes() - record[1]
                record[1] = storage.nbytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._resized()
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes == 0 or key in self._seen:
                    continue  # a view, or an in-place result
                self._seen[key] = record = [weakref.ref(storage), nbytes]
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, record)
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
