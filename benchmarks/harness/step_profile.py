"""Where a `generate` call's time goes: torch.profiler over one call, the MLPs marked.

Each MLP module's forward runs inside a `torch.profiler.record_function("mlp")` range (a forward
pre-hook opens it, a forward hook closes it), so the profile splits both clocks:

- GPU: kernel time under the MLP ranges against all kernel time of the call. All kernel time
  is summed over the device-side events. The profiler links a kernel to the range that launched
  it through the launching runtime call; Triton's launcher calls the driver directly, which the
  profiler leaves unlinked, so the fused kernels (names starting `_gated` or `_expert`, launched
  only inside fused MLPs and experts) are added to the MLP time from the device-side events
  unless a range already holds them;
- host: CPU time inside the MLP ranges against the call's wall time.

Every kernel's GPU time is also summed by family (`kernel_family`: our fused kernels, cuBLAS /
CUTLASS GEMMs, attention, Triton kernels such as Inductor's, the rest). That split is what a
compiled forward (static cache) can show, where no MLP can be marked: the GPU time the patch
saves is the difference of the two modes' totals, and the host gap (wall - GPU) is what it
cannot shorten.

The profiler adds host time to every op, so the wall time here is longer than an unprofiled
call's: the shares say where the time goes, the `generate` part says how fast it is. GPU busy =
kernel time / wall time: far below 1, the step waits on the host (Python, launches).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

MLP_RANGE = "mlp"
FUSED_KERNEL_PREFIX = ("_gated", "_expert")  # the names of swiglu_patch's Triton kernels (MLP, MoE experts)
KERNEL_FAMILIES = ("fused", "gemm", "attention", "triton", "other")
_GEMM_MARKS = ("gemm", "nvjet", "xmma", "cutlass", "gemv")
_ATTENTION_MARKS = ("flash", "fmha", "attention", "sdpa")


def kernel_family(name: str) -> str:
    """The family of a kernel by its name, one of KERNEL_FAMILIES. Ours are checked first (a name
    such as `_gated_gemv_kernel` is ours, not a GEMM library's), attention before GEMMs (CUTLASS
    builds attention kernels too)."""
    if name.startswith(FUSED_KERNEL_PREFIX):
        return "fused"
    low = name.lower()
    if any(m in low for m in _ATTENTION_MARKS):
        return "attention"
    if any(m in low for m in _GEMM_MARKS):
        return "gemm"
    if low.startswith("triton"):
        return "triton"
    return "other"


def _linked_kernels(event) -> list:
    """Kernels the profiler linked to `event` or to the ops under it."""
    return list(event.kernels) + [k for child in event.cpu_children for k in _linked_kernels(child)]


class _MarkedMLPs:
    """Forward hooks opening and closing a `record_function(MLP_RANGE)` around each module's forward."""

    def __init__(self, modules: list[torch.nn.Module]):
        self._open: list = []
        self._handles = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._enter))
            self._handles.append(m.register_forward_hook(self._exit))

    def _enter(self, module, args):
        scope = record_function(MLP_RANGE)
        scope.__enter__()
        self._open.append(scope)

    def _exit(self, module, args, output):
        self._open.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def profile_call(fn: Callable[[], object], mlp_modules: list[torch.nn.Module], sync: Callable[[], None],
                 cuda: bool) -> dict:
    """Profile one call of fn with its MLP modules marked (none marked: pass []; for a compiled
    forward, whose hooks would change what is compiled).

    Returns:
        {"wall_ms", "gpu_ms" (all kernels), "mlp_gpu_ms", "mlp_host_ms" (CPU time inside the MLP
        ranges), "gpu_busy" (gpu_ms / wall_ms), "mlp_calls", "family_gpu_ms" ({family: ms} over
        KERNEL_FAMILIES)}; GPU figures None on CPU, MLP figures None with no module marked.
    """
    marks = _MarkedMLPs(mlp_modules)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        sync()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            fn()
            sync()
            wall = time.perf_counter() - t0
    finally:
        marks.remove()
    events = prof.events()
    ranges = [e for e in events if e.device_type == DeviceType.CPU and e.name == MLP_RANGE]
    # device-side events: kernels, copies, and the ranges' GPU spans (named like the range: not work)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and e.name != MLP_RANGE]
    gpu_us = sum(e.time_range.elapsed_us() for e in kernels)
    mlp_gpu_us = sum(e.device_time_total for e in ranges)
    if not any(k.name.startswith(FUSED_KERNEL_PREFIX) for r in ranges for k in _linked_kernels(r)):
        mlp_gpu_us += sum(e.time_range.elapsed_us() for e in kernels if e.name.startswith(FUSED_KERNEL_PREFIX))
    families = dict.fromkeys(KERNEL_FAMILIES, 0.0)
    for k in kernels:
        families[kernel_family(k.name)] += k.time_range.elapsed_us() / 1e3
    wall_ms = wall * 1e3
    marked = bool(mlp_modules)
    return {
        "wall_ms": wall_ms,
        "gpu_ms": gpu_us / 1e3 if cuda else None,
        "mlp_gpu_ms": mlp_gpu_us / 1e3 if cuda and marked else None,
        "mlp_host_ms": sum(e.cpu_time_total for e in ranges) / 1e3 if marked else None,
        "gpu_busy": (gpu_us / 1e3) / wall_ms if cuda else None,
        "mlp_calls": len(ranges),
        "family_gpu_ms": families if cuda else None,
    }
