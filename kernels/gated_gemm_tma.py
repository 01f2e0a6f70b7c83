"""Fused gated GEMM for prefill on Hopper: TMA tensor descriptors, one 2*BLOCK_SIZE_N-wide MMA.

Computes the same function as `gated_gemm.py` (read its docstring for the layout, dtypes and
rounding), organised for large M:

- x [M, K] and the packed weight [2*I, K] are read through TMA descriptors: per K step one
  [BLOCK_SIZE_M, BLOCK_SIZE_K] box of x and one [2*BLOCK_SIZE_N, BLOCK_SIZE_K] box of packed
  rows. Since BLOCK_SIZE_N is a multiple of GATE_UP_BLOCK, that box holds BLOCK_SIZE_N // 16
  whole blocks: the gate rows of output columns pid_n*BLOCK_SIZE_N .. +BLOCK_SIZE_N and
  their up rows, interleaved by 16.
- one fp32 accumulator [BLOCK_SIZE_M, 2*BLOCK_SIZE_N] (a 128x256 tile: one wgmma N=256);
  the epilogue views it as [BM, BN/16, 2, 16], moves the gate/up axis last and splits it.
  Gate column j and up column j sit 16 columns apart, inside one thread's accumulator
  registers, so the split moves no data.
- persistent programs (one per SM) walk the tiles in grouped order for L2 reuse.

TMA zero-fills out-of-bounds reads and clips out-of-bounds writes, so any M and K work; it
needs I % 16 == 0 (whole blocks; every real model), unit inner strides and 16-byte-aligned
row strides and base pointers. `tma_supported` says whether a call qualifies; otherwise
`gated_gemm` uses the pointer kernel.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation
from triton.tools.tensor_descriptor import TensorDescriptor

from .gated_gemm import GatedGemmConfig, _apply_activation, _tile_pid
from .layout import GATE_UP_BLOCK


@triton.jit
def _gated_gemm_tma_tiles(
    x_desc, w_desc, out_desc, b_ptr, M, I, K,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """The persistent tile loop, shared by the host- and device-descriptor kernels."""
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(I, BLOCK_SIZE_N)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_SIZE_K)
    for tile_id in tl.range(start_pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
        offs_m = pid_m * BLOCK_SIZE_M
        offs_w = pid_n * 2 * BLOCK_SIZE_N  # first packed row of this tile's blocks

        # -- main loop: one [BM, 2*BN] accumulator, gate and up columns interleaved by 16 --
        acc = tl.zeros((BLOCK_SIZE_M, 2 * BLOCK_SIZE_N), dtype=tl.float32)
        for ki in range(k_tiles):
            x = x_desc.load([offs_m, ki * BLOCK_SIZE_K])  # [BLOCK_SIZE_M, BLOCK_SIZE_K]
            w = w_desc.load([offs_w, ki * BLOCK_SIZE_K])  # [2 * BLOCK_SIZE_N, BLOCK_SIZE_K]
            acc = tl.dot(x, w.T, acc)

        # -- epilogue: bias, split gate/up in registers, act(gate) * up, one TMA store --
        if HAS_BIAS:
            offs_b = offs_w + tl.arange(0, 2 * BLOCK_SIZE_N)
            acc += tl.load(b_ptr + offs_b, mask=offs_b < 2 * I, other=0.0).to(tl.float32)[None, :]
        acc = tl.reshape(acc, (BLOCK_SIZE_M, 2 * BLOCK_SIZE_N // (2 * GATE_UP_BLOCK), 2, GATE_UP_BLOCK))
        acc = tl.permute(acc, (0, 1, 3, 2))
        gate, up = tl.split(tl.reshape(acc, (BLOCK_SIZE_M, BLOCK_SIZE_N, 2)))  # [BLOCK_SIZE_M, BLOCK_SIZE_N] each
        h = _apply_activation(gate, ACTIVATION) * up
        out_desc.store([offs_m, pid_n * BLOCK_SIZE_N], h.to(out_desc.dtype))


@triton.jit
def _gated_gemm_tma_kernel(
    x_desc, w_desc, out_desc, b_ptr, M, I, K,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, GATE_UP_BLOCK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, FLATTEN: tl.constexpr,
):
    """Host-built TMA descriptors."""
    _gated_gemm_tma_tiles(
        x_desc, w_desc, out_desc, b_ptr, M, I, K, HAS_BIAS, ACTIVATION, GATE_UP_BLOCK,
        BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, NUM_PROGRAMS, WARP_SPECIALIZE, FLATTEN,
    )


@triton.jit
def _gated_gemm_tma_devdesc_kernel(
    x_ptr, w_ptr, out_ptr, b_ptr, M, I, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, GATE_UP_BLOCK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, FLATTEN: tl.constexpr,
):
    """TMA descriptors built on the device: the host passes plain pointers (less launch overhead)."""
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_SIZE_M, BLOCK_SIZE_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, [2 * I, K], [stride_wn, 1], [2 * BLOCK_SIZE_N, BLOCK_SIZE_K])
    out_desc = tl.make_tensor_descriptor(out_ptr, [M, I], [stride_om, 1], [BLOCK_SIZE_M, BLOCK_SIZE_N])
    _gated_gemm_tma_tiles(
        x_desc, w_desc, out_desc, b_ptr, M, I, K, HAS_BIAS, ACTIVATION, GATE_UP_BLOCK,
        BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, NUM_PROGRAMS, WARP_SPECIALIZE, FLATTEN,
    )


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for device-built TMA descriptors (128 bytes each)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Give Triton a scratch allocator unless the caller set one (it is per thread: a ContextVar)."""
    current = getattr(_allocation, "_allocator", None)
    if current is None or current.get() is getattr(_allocation, "_NULL_ALLOCATOR", None):
        triton.set_allocator(_scratch)


@lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tma_ok(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def tma_supported(x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether `gated_gemm_tma` can run these tensors (16-bit, whole blocks, TMA-aligned)."""
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and (packed.shape[0] // 2) % GATE_UP_BLOCK == 0
        and _tma_ok(x) and _tma_ok(packed) and (out is None or _tma_ok(out))
        and ((packed.shape[0] // 2) * x.element_size()) % 16 == 0
    )


def gated_gemm_tma(
    x: torch.Tensor,
    packed: torch.Tensor,
    activation_code: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: GatedGemmConfig,
    flatten: bool = True,
    device_descriptors: bool = True,
) -> torch.Tensor:
    """Launch the TMA kernel; arguments as `gated_gemm`'s, already checked by `tma_supported`.

    device_descriptors: build the TMA descriptors in the kernel (default; the host passes
    pointers: about 23 µs less host time per call on the H100 machine's host, for about 2 µs
    more GPU time, benchmarks/results/overhead/) instead of on the host.
    """
    m, k = x.shape
    i = packed.shape[0] // 2
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    # one program per SM, whatever the tile count: a constant NUM_PROGRAMS compiles once
    programs = _num_sms(x.device.index or 0) if x.is_cuda else 4
    meta = dict(
        HAS_BIAS=bias is not None, ACTIVATION=activation_code, GATE_UP_BLOCK=GATE_UP_BLOCK,
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=config.group_m,
        NUM_PROGRAMS=programs, WARP_SPECIALIZE=config.warp_specialize, FLATTEN=flatten,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    b = bias if bias is not None else packed
    if device_descriptors:
        _ensure_allocator()
        _gated_gemm_tma_devdesc_kernel[(programs,)](
            x, packed, out, b, m, i, k, x.stride(0), packed.stride(0), out.stride(0), **meta
        )
    else:
        x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        w_desc = TensorDescriptor.from_tensor(packed, [2 * bn, bk])
        out_desc = TensorDescriptor.from_tensor(out, [bm, bn])
        _gated_gemm_tma_kernel[(programs,)](x_desc, w_desc, out_desc, b, m, i, k, **meta)
    return out
