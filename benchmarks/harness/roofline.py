"""The floor a gated GEMM cannot beat, and the two peaks it is built from.

    flops      = 2 * M * N * K                       (N = 2*I: both halves of the GEMM)
    min bytes  = (M*K + N*K + M*I) * element bytes   (read x and the weight once, write out once)
    floor (s)  = max(flops / matmul peak, min bytes / copy bandwidth)

Both peaks are measured in the same run as the ways they bound: the matmul peak from a large
square matmul on random data in the benchmark's dtype (8192^3 on the GPU), the bandwidth from
a large device-to-device copy counting bytes read plus bytes written, done by an elementwise
kernel (`torch.neg(src, out=dst)`: the same bytes as `dst.copy_(src)`, but a CUDA graph
captures `copy_` as a memcpy node that the copy engine runs at about 2.4 TB/s on the H100,
against 3.0 TB/s for a kernel; a study in `docs/history.md`). So `floor / time` is the
fraction of what this machine, this day, demonstrably does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable

import torch

Timer = Callable[[Callable[[], object]], float]  # fn -> median seconds per call


def gated_flops(m: int, k: int, i: int) -> int:
    """Multiply-adds x2 of x[M, K] @ W[2I, K]^T; the activation and product are not counted."""
    return 2 * m * (2 * i) * k


def gemm_flops(m: int, n: int, k: int) -> int:
    """2*M*N*K, the flops of one [M, K] @ [K, N] product."""
    return 2 * m * n * k


def min_bytes(m: int, k: int, i: int, elem_bytes: int) -> int:
    """Bytes a fused kernel must move at least: read x [M, K] and W [2I, K], write out [M, I]."""
    return (m * k + 2 * i * k + m * i) * elem_bytes


@dataclass(frozen=True)
class Peaks:
    """What the machine measured: matmul in TFLOP/s, copy in TB/s (read + written bytes)."""

    matmul_tflops: float
    copy_tbps: float
    matmul_n: int
    copy_mib: float

    def to_dict(self) -> dict:
        return asdict(self)


def floor_seconds(flops: float, nbytes: float, peaks: Peaks) -> float:
    """max(flops / matmul peak, bytes / copy bandwidth), in seconds.

    Raises:
        ValueError: a peak that is not positive (nothing was measured).
    """
    if peaks.matmul_tflops <= 0 or peaks.copy_tbps <= 0:
        raise ValueError(f"floor_seconds: peaks must be positive, got {peaks}")
    return max(flops / (peaks.matmul_tflops * 1e12), nbytes / (peaks.copy_tbps * 1e12))


def measure_peaks(device: torch.device, dtype: torch.dtype, timer: Timer, matmul_n: int, copy_bytes: int) -> Peaks:
    """Measure the matmul peak and the copy bandwidth with `timer`.

    Args:
        device: where to measure.
        dtype: the matmul's dtype (the benchmark's).
        timer: median seconds of a zero-argument callable.
        matmul_n: side of the square matmul ([n, n] @ [n, n]).
        copy_bytes: size of the copied buffer; bytes moved per copy = 2 * copy_bytes.

    Returns:
        Peaks with the measured TFLOP/s and TB/s.
    """
    a = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
    b = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
    t_mm = timer(partial(torch.mm, a, b))
    del a, b
    src = torch.empty(copy_bytes // 4, device=device, dtype=torch.int32).random_(0, 1 << 20)
    dst = torch.empty_like(src)
    t_copy = timer(partial(torch.neg, src, out=dst))
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    return Peaks(
        matmul_tflops=gemm_flops(matmul_n, matmul_n, matmul_n) / t_mm / 1e12,
        copy_tbps=moved / t_copy / 1e12,
        matmul_n=matmul_n,
        copy_mib=copy_bytes / 2**20,
    )
