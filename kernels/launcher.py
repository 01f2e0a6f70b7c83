"""`FastLaunch`: launch a compiled Triton kernel without Triton's per-call argument binding.

`kernel[grid](*args, **constexprs)` binds and specializes every argument, builds a cache key
and checks globals on every call: 20-25 us of host time per call on the H100 machine's host,
more than the GPU time of a decode-size gated GEMM. A `FastLaunch` holds one kernel's fixed
constexprs; its first call for each specialization goes through Triton (compiling if needed)
and keeps the `CompiledKernel` it returns; later calls with the same specialization call the
compiled kernel's launcher directly (~7 us).

The specialization key covers at least what Triton specializes on: per tensor argument its
dtype and whether its address is 16-byte aligned; per int argument whether it is 1, whether it
is a multiple of 16 and whether it fits in int32. A call that differs in any of these takes
Triton's path again, so a kernel compiled for aligned pointers never runs unaligned ones.
Triton's own path is always taken under the CPU interpreter and while a launch hook (a
profiler such as proton) is installed.

Runtime arguments are passed positionally; all constexprs must follow them in the kernel's
signature (checked on the first call).
"""

from __future__ import annotations

import torch
from triton import knobs
from triton.runtime import driver

from .device import interpreting


def _spec(args: tuple) -> tuple:
    """Per argument: (dtype, 16-byte aligned) for a tensor; bits (== 1, multiple of 16, outside
    int32) for an int; the type of anything else."""
    return tuple([
        (a.dtype, (a.data_ptr() & 15) == 0) if isinstance(a, torch.Tensor)
        else (a == 1) | (((a & 15) == 0) << 1) | ((not -0x80000000 <= a < 0x80000000) << 2) if type(a) is int
        else type(a)
        for a in args
    ])


def _hooks_installed() -> bool:
    """A launch hook is set (Triton 3.6 keeps an empty HookChain when there is none)."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLaunch:
    """A Triton kernel with fixed constexprs and launch options, launched at low host cost.

    Args:
        kernel: the `@triton.jit` function.
        constexprs: its constexpr arguments and launch options (num_warps, num_stages, ...).
    """

    def __init__(self, kernel, constexprs: dict):
        self.kernel = kernel
        self.constexprs = constexprs
        self._compiled: dict[tuple, object] = {}  # specialization -> triton CompiledKernel
        self._nones: tuple | None = None
        self._fast = not interpreting()

    def __call__(self, grid: int, device_index: int, *args) -> None:
        """Launch `grid` programs (1-D grid) on the current stream of CUDA device `device_index`."""
        if not self._fast or _hooks_installed():
            self.kernel[(grid,)](*args, **self.constexprs)
            return
        key = _spec(args)
        compiled = self._compiled.get(key)
        if compiled is None:
            self._compiled[key] = self.kernel[(grid,)](*args, **self.constexprs)
            if self._nones is None:
                params = self.kernel.params
                if any(p.is_constexpr for p in params[: len(args)]) or not all(
                        p.is_constexpr for p in params[len(args):]):
                    raise TypeError(f"FastLaunch: {self.kernel.__name__} must take its runtime arguments first, "
                                    "then only constexprs")
                self._nones = (None,) * (len(params) - len(args))
            return
        stream = driver.active.get_current_stream(device_index)
        compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *self._nones)
