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

The hot path, for kernels whose runtime arguments are tensors first and ints after (every
kernel here but the TMA-descriptor ones): the ints themselves, with whether every tensor is
16-byte aligned and the tensors' dtypes, key a second table, so a repeated call costs one
tuple hash instead of a per-argument specialization. Where the Triton version's launcher
layout is known (3.6) and the kernel needs no scratch memory, the launch then calls Triton's
C launch function directly, skipping the Python wrapper around it.
"""

from __future__ import annotations

import torch
import triton
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


# Triton versions whose `CudaLauncher.__call__` forwards (grid, stream, function, cooperative,
# pdl, global scratch, profile scratch, *args) to its C `launch` unchanged: the direct call below
# is that call with both scratch pointers None.
_DIRECT_C_LAUNCH = tuple(int(v) for v in triton.__version__.split(".")[:2]) == (3, 6)
_INT_TAIL_MAX = 1024  # int-keyed entries kept per FastLaunch (distinct M values and strides)


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
        self._by_ints: dict[tuple, tuple] = {}  # (ints, dtypes) -> (launch function, its leading args)
        self._n_tensors: int | None = None  # leading tensor arguments, when all the rest are ints
        self._nones: tuple | None = None
        self._fast = not interpreting()

    def __call__(self, grid: int, device_index: int, *args) -> None:
        """Launch `grid` programs (1-D grid) on the current stream of CUDA device `device_index`."""
        if not self._fast or _hooks_installed():
            self.kernel[(grid,)](*args, **self.constexprs)
            return
        n = self._n_tensors
        if n is not None:
            tensors, ints = args[:n], args[n:]
            aligned = True
            for t in tensors:
                if t.data_ptr() & 15:
                    aligned = False
                    break
            if aligned:
                entry = self._by_ints.get((ints, tuple([t.dtype for t in tensors])))
                if entry is not None:
                    fn, lead = entry
                    fn(grid, 1, 1, driver.active.get_current_stream(device_index), *lead, *args, *self._nones)
                    return
        key = _spec(args)
        compiled = self._compiled.get(key)
        if compiled is None:
            self._compiled[key] = self.kernel[(grid,)](*args, **self.constexprs)
            if self._nones is None:
                self._learn_layout(args)
            return
        if n is not None and all(a[1] for a in key[:n]) and len(self._by_ints) < _INT_TAIL_MAX:
            self._by_ints[(args[n:], tuple([t.dtype for t in args[:n]]))] = _entry(compiled)
        compiled.run(grid, 1, 1, driver.active.get_current_stream(device_index), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *self._nones)

    def _learn_layout(self, args: tuple) -> None:
        """On the first launch: check the constexprs follow the runtime arguments, and whether the
        runtime arguments are tensors first and ints after (the int-keyed hot path)."""
        params = self.kernel.params
        if any(p.is_constexpr for p in params[: len(args)]) or not all(p.is_constexpr for p in params[len(args):]):
            raise TypeError(f"FastLaunch: {self.kernel.__name__} must take its runtime arguments first, "
                            "then only constexprs")
        self._nones = (None,) * (len(params) - len(args))
        n = next((j for j, a in enumerate(args) if not isinstance(a, torch.Tensor)), len(args))
        if all(type(a) is int for a in args[n:]):
            self._n_tensors = n


def _entry(compiled) -> tuple:
    """(function, leading arguments) launching `compiled` as ``function(gx, gy, gz, stream, *leading,
    *kernel args)``: Triton's C launch function where that is safe, else the compiled kernel's run."""
    run = compiled.run
    if (_DIRECT_C_LAUNCH and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0
            and hasattr(run, "launch")):
        return run.launch, (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                            compiled.packed_metadata, None, None, None)
    return run, (compiled.function, compiled.packed_metadata, None, None, None)
