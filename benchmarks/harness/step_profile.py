"""Where a `generate` call's time goes: torch.profiler over one call, the MLPs marked.

Each MLP module's forward runs inside a `torch.profiler.record_function("mlp")` range (a forward
pre-hook opens it, a forward hook closes it), so the profile splits both clocks:

- GPU: kernel time under the MLP ranges (`device_time_total` of the ranges: their kernels and
  their children's) against all kernel time of the call;
- host: CPU time inside the MLP ranges against the call's wall time.

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
        ranges), "gpu_busy" (gpu_ms / wall_ms), "mlp_calls"}; GPU figures None on CPU, MLP
        figures None with no module marked.
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
    cpu_events = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    ranges = [e for e in cpu_events if e.name == MLP_RANGE]
    gpu_us = sum(e.self_device_time_total for e in cpu_events) if cuda else 0.0
    mlp_gpu_us = sum(e.device_time_total for e in ranges) if cuda else 0.0
    wall_ms = wall * 1e3
    marked = bool(mlp_modules)
    return {
        "wall_ms": wall_ms,
        "gpu_ms": gpu_us / 1e3 if cuda else None,
        "mlp_gpu_ms": mlp_gpu_us / 1e3 if cuda and marked else None,
        "mlp_host_ms": sum(e.cpu_time_total for e in ranges) / 1e3 if marked else None,
        "gpu_busy": (gpu_us / 1e3) / wall_ms if cuda else None,
        "mlp_calls": len(ranges),
    }
