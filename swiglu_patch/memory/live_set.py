"""A ledger of live tensors: allocate, free, remember the peak and what made it.

With PyTorch's CUDA caching allocator, ``torch.cuda.max_memory_allocated()`` is (to within
512-byte rounding and the odd unsplit block) the largest sum of simultaneously live tensors. So
walking a forward pass tensor by tensor, in the order Python creates and drops them, predicts the
measured peak. :class:`LiveSet` is that walk's bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Peak:
    """The largest live total of a walk.

    Attributes:
        bytes: live bytes at the peak.
        where: the step that reached it (e.g. "layer 1 mlp: act(gate) * up").
        breakdown: live bytes at the peak by kind ("hidden", "mlp", "attention", "kv_cache", ...).
    """

    bytes: int
    where: str
    breakdown: dict[str, int] = field(default_factory=dict)


class LiveSet:
    """Named live tensors and the peak of their total.

    ``alloc`` adds a tensor of ``nbytes`` under a unique name with a kind; ``free`` drops names.
    Zero-byte allocations are ignored (tensors that a dtype no-op did not create).
    """

    def __init__(self) -> None:
        self._live: dict[str, tuple[int, str]] = {}
        self.total = 0
        self._peak = Peak(0, "start", {})

    def alloc(self, name: str, nbytes: int, kind: str, where: str = "") -> None:
        """Record a new tensor.

        Raises:
            ValueError: the name is live already, or nbytes is negative.
        """
        if nbytes < 0:
            raise ValueError(f"LiveSet.alloc: {name} has negative size {nbytes}")
        if nbytes == 0:
            return
        if name in self._live:
            raise ValueError(f"LiveSet.alloc: {name!r} is live already (free it first)")
        self._live[name] = (int(nbytes), kind)
        self.total += int(nbytes)
        if self.total > self._peak.bytes:
            self._peak = Peak(self.total, where or name, self.breakdown())

    def free(self, *names: str) -> None:
        """Drop tensors; names never allocated (zero-byte ones) are ignored."""
        for name in names:
            entry = self._live.pop(name, None)
            if entry is not None:
                self.total -= entry[0]

    def rename(self, old: str, new: str, kind: str) -> None:
        """Give a live tensor a new name and kind (a dtype no-op that returned its input)."""
        nbytes, _ = self._live.pop(old)
        self._live[new] = (nbytes, kind)

    def is_live(self, name: str) -> bool:
        return name in self._live

    def breakdown(self) -> dict[str, int]:
        """Live bytes by kind, now."""
        out: dict[str, int] = {}
        for nbytes, kind in self._live.values():
            out[kind] = out.get(kind, 0) + nbytes
        return out

    @property
    def peak(self) -> Peak:
        return self._peak
