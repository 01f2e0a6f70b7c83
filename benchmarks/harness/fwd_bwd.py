"""One forward + backward of a way, as the training benchmarks run and measure it.

A way is `fn() -> out` (one forward); `leaves` are the tensors that receive gradients, by name
(the input x, parameters, adapters); `dout` is the fixed gradient of out, out's shape and dtype.

- `step_fn`: a training step: every leaf's grad set to None (as a Trainer's zero_grad does),
  the forward, the backward of dout.
- `memory_of`: saved MiB (allocated after the forward, less the output) and peak MiB (max
  allocated during forward + backward, the gradients included) above what was allocated
  before the forward, on CUDA (None on another device).
- `grad_errors`: each leaf's gradient against a float64 reference, relative.
"""

from __future__ import annotations

import gc
from typing import Callable

import torch

MIB = 2**20


def _clear(leaves: dict) -> None:
    for t in leaves.values():
        t.grad = None


def step_fn(fn: Callable[[], torch.Tensor], leaves: dict, dout: torch.Tensor) -> Callable[[], None]:
    """One training step of a way: gradients cleared, forward, backward."""
    def step():
        _clear(leaves)
        fn().backward(dout)
    return step


def memory_of(fn: Callable[[], torch.Tensor], leaves: dict, dout: torch.Tensor) -> dict:
    """{"saved_mib", "peak_mib"} of one forward + backward (see the module docstring); the leaves'
    gradients are cleared before and after."""
    if not dout.is_cuda:
        return {"saved_mib": None, "peak_mib": None}
    _clear(leaves)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    out.backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    _clear(leaves)
    return {"saved_mib": saved / MIB, "peak_mib": peak / MIB}


def grad_errors(leaves: dict, ref: dict) -> dict[str, float]:
    """{name: ||grad - ref||_F / ||ref||_F} of every leaf's gradient against ref[name] (float64,
    the leaf's shape); a zero reference counts as 1e-30."""
    return {k: float((t.grad.double() - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)) for k, t in leaves.items()}
