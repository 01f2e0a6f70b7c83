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
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, int):
            key.append((a == 1, a % 16 == 0, -(2**31) <= a < 2**31))
        else:
            key.append(type(a))
    return tuple(key)


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
        if not self._fast or knobs.runtime.launch_enter_hook is not None:
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
