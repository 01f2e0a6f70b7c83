"""Timers: the median seconds per call of a zero-argument callable.

GPU: `triton.testing.do_bench` (return_mode="median"), which before every timed call zeroes
a 256 MB buffer, so L2 (50 MB on H100) holds nothing of the inputs when the call starts. That
is the right state for this benchmark: in a real forward pass a layer's MLP weight was last
read one whole layer ago and is long gone from L2, and every weight here is larger than L2
anyway (Llama-3.2-1B's gate+up is 64 MiB, Llama-3-8B's 224 MiB), so no buffer rotation is
needed on top. CUDA events bracket the call alone: the flush is not timed, and the host
enqueues a multi-kernel way (HF eager: 4 kernels) while the GPU is still flushing, so launch
overhead is hidden and the time is GPU time.

CPU (--dry-run only): perf_counter around each call, a fixed number of calls.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


def gpu_timer(warmup_ms: float, rep_ms: float) -> Callable[[Callable[[], object]], float]:
    """A timer that runs `triton.testing.do_bench(fn, warmup_ms, rep_ms)` and returns seconds."""
    from triton.testing import do_bench

    def timer(fn: Callable[[], object]) -> float:
        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") / 1e3

    return timer


def cpu_timer(reps: int = 5) -> Callable[[Callable[[], object]], float]:
    """A timer for CPU tensors: one warm-up call, then the median of `reps` timed calls."""

    def timer(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return timer
