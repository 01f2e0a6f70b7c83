"""Facts about the device a call runs on, each read once and cached (no tensors cached).

- `gpu_name`, `num_sms`, `capability`: from the CUDA device properties;
- `interpreting`: whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1 at
  the time Triton decorated them);
- `tma_aligned`, `tma_operands_ok`: whether tensors can be read or written through TMA descriptors
  (the constraint is `configs.TMA_NEEDS`).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton

from .configs import tma_fits


@lru_cache(maxsize=16)
def gpu_name(device_index: int) -> str:
    """The CUDA device's name, e.g. "NVIDIA H100 80GB HBM3"."""
    return torch.cuda.get_device_name(device_index)


@lru_cache(maxsize=16)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device: the persistent kernels' program count."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@lru_cache(maxsize=16)
def capability(device_index: int) -> tuple[int, int]:
    """(major, minor) compute capability; Hopper is (9, 0)."""
    return torch.cuda.get_device_capability(device_index)


@triton.jit
def _probe_kernel():
    pass


def interpreting() -> bool:
    """True when the kernels run through Triton's CPU interpreter.

    Triton decides when a kernel is decorated, so TRITON_INTERPRET=1 must be set before
    swiglu_patch's kernels are first imported.
    """
    return type(_probe_kernel).__name__ == "InterpretedFunction"


def tma_aligned(t: torch.Tensor) -> bool:
    """A 2-D tensor a TMA descriptor can address: unit inner stride, 16-byte-aligned rows and base."""
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def tma_operands_ok(i: int, *tensors: torch.Tensor | None) -> bool:
    """A call a TMA kernel can run (`configs.TMA_NEEDS`): `configs.tma_fits` for the first
    tensor's dtype and intermediate size i, and every tensor given (None skipped) TMA-aligned.
    Whether the GPU has TMA is the rules' business."""
    if not tma_fits(tensors[0].dtype, i):
        return False
    for t in tensors:  # a loop, not all(generator): this runs on every call's hot path
        if t is not None and not tma_aligned(t):
            return False
    return True
