"""Facts about the device a call runs on, each read once and cached (no tensors cached).

- `gpu_name`, `num_sms`, `capability`: from the CUDA device properties;
- `interpreting`: whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1 at
  the time Triton decorated them);
- `interpreter_blocker`: why the installed Triton's interpreter cannot run them, or None;
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


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "3.6.0" -> (3, 6), "2.4.0rc1" -> (2, 4)."""
    major, minor = (version.split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@lru_cache(maxsize=1)
def interpreter_blocker() -> str | None:
    """Why Triton's CPU interpreter cannot run the kernels with the installed packages (a message
    naming the fix), or None.

    Triton 3.6's interpreter turns a kernel's integer arguments into one-element NumPy arrays and
    converts them back with ``int(array)``, which NumPy 2.4 made an error ("only 0-dimensional
    arrays can be converted to Python scalars"); Triton 3.7 squeezes the array first.
    """
    import numpy

    if _release(triton.__version__) < (3, 7) and _release(numpy.__version__) >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter cannot run under NumPy {numpy.__version__} (it converts "
                "one-element arrays to ints, an error since NumPy 2.4): pip install 'numpy<2.4', or 'triton>=3.7'")
    return None


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
