"""Fused gated GEMM on Hopper for few tokens: TMA loads, one program per output tile.

Computes the same function as `gated_gemm.py` (its docstring has the layout, dtypes and
rounding). The persistent kernel of `gated_gemm_tma.py` walks tiles in a loop; at 2 <= M <= 64
the weight read bounds the call, and there a grid with one program per tile lets the hardware
scheduler keep several programs per SM in flight and balance the SMs to the end, as Liger's
inference kernel does.

Per K step a program loads one [BLOCK_SIZE_M, BLOCK_SIZE_K] box of x and the tile's weight,
either
- TWO_DOTS = False: one [2*BLOCK_SIZE_N, BLOCK_SIZE_K] box of packed rows (BLOCK_SIZE_N // 16
  whole gate/up blocks) into one [BM, 2*BN] accumulator, split in registers by the epilogue
  (as `gated_gemm_tma.py` does), or
- TWO_DOTS = True: the gate rows and the up rows as two [BLOCK_SIZE_N // 16, 16, BLOCK_SIZE_K]
  boxes of the packed weight viewed as [I // 16, 32, K] (block b's gate rows at [b, 0:16], its
  up rows at [b, 16:32]) into two [BM, BN] accumulators: no split in the epilogue.

Descriptors are built on the host (default) or by each program on the device. TMA zero-fills
out-of-bounds reads and clips out-of-bounds writes, so any M and K work; I % 16 == 0 and
TMA-aligned tensors are required (`gated_gemm_tma.tma_supported`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .gated_gemm import GatedGemmConfig, _apply_activation, _tile_pid
from .gated_gemm_tma import _ensure_allocator
from .layout import GATE_UP_BLOCK


@triton.jit
def _grid_tile(
    x_desc, w_desc, w3_desc, out_desc, b_ptr, M, I, K,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr, TWO_DOTS: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    """Program p computes output tile p (grouped order): out[offs_m:+BM, pid_n*BN:+BN]."""
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(I, BLOCK_SIZE_N)
    pid_m, pid_n = _tile_pid(tl.program_id(0), GROUP_SIZE_M * num_pid_n, num_pid_m, GROUP_SIZE_M)
    offs_m = pid_m * BLOCK_SIZE_M
    offs_w = pid_n * 2 * BLOCK_SIZE_N  # first packed row of this tile's blocks
    k_tiles = tl.cdiv(K, BLOCK_SIZE_K)
    if TWO_DOTS:
        blk = pid_n * (BLOCK_SIZE_N // GATE_UP_BLOCK)
        gate = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for ki in range(k_tiles):
            x = x_desc.load([offs_m, ki * BLOCK_SIZE_K])  # [BM, BK]
            wg = tl.reshape(w3_desc.load([blk, 0, ki * BLOCK_SIZE_K]), (BLOCK_SIZE_N, BLOCK_SIZE_K))
            gate = tl.dot(x, wg.T, gate)
            wu = tl.reshape(w3_desc.load([blk, GATE_UP_BLOCK, ki * BLOCK_SIZE_K]), (BLOCK_SIZE_N, BLOCK_SIZE_K))
            up = tl.dot(x, wu.T, up)
        if HAS_BIAS:
            cols = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)  # output columns; whole blocks (I % 16 == 0)
            g_rows = 2 * GATE_UP_BLOCK * (cols // GATE_UP_BLOCK) + cols % GATE_UP_BLOCK
            gate += tl.load(b_ptr + g_rows, mask=cols < I, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_ptr + g_rows + GATE_UP_BLOCK, mask=cols < I, other=0.0).to(tl.float32)[None, :]
    else:
        acc = tl.zeros((BLOCK_SIZE_M, 2 * BLOCK_SIZE_N), dtype=tl.float32)
        for ki in range(k_tiles):
            x = x_desc.load([offs_m, ki * BLOCK_SIZE_K])  # [BM, BK]
            w = w_desc.load([offs_w, ki * BLOCK_SIZE_K])  # [2*BN, BK]
            acc = tl.dot(x, w.T, acc)
        if HAS_BIAS:
            offs_b = offs_w + tl.arange(0, 2 * BLOCK_SIZE_N)
            acc += tl.load(b_ptr + offs_b, mask=offs_b < 2 * I, other=0.0).to(tl.float32)[None, :]
        acc = tl.reshape(acc, (BLOCK_SIZE_M, BLOCK_SIZE_N // GATE_UP_BLOCK, 2, GATE_UP_BLOCK))
        gate, up = tl.split(tl.reshape(tl.permute(acc, (0, 1, 3, 2)), (BLOCK_SIZE_M, BLOCK_SIZE_N, 2)))
    h = _apply_activation(gate, ACTIVATION, APPROX_TANH) * up
    out_desc.store([offs_m, pid_n * BLOCK_SIZE_N], h.to(out_desc.dtype))


@triton.jit
def _gated_gemm_tma_grid_kernel(
    x_desc, w_desc, w3_desc, out_desc, b_ptr, M, I, K,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr, TWO_DOTS: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    """Host-built TMA descriptors (w_desc and w3_desc: the same one, whichever TWO_DOTS reads)."""
    _grid_tile(x_desc, w_desc, w3_desc, out_desc, b_ptr, M, I, K, HAS_BIAS, ACTIVATION, APPROX_TANH, TWO_DOTS,
               GATE_UP_BLOCK, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M)


@triton.jit
def _gated_gemm_tma_grid_devdesc_kernel(
    x_ptr, w_ptr, out_ptr, b_ptr, M, I, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr, TWO_DOTS: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    """TMA descriptors built on the device by each program: the host passes plain pointers."""
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_SIZE_M, BLOCK_SIZE_K])
    out_desc = tl.make_tensor_descriptor(out_ptr, [M, I], [stride_om, 1], [BLOCK_SIZE_M, BLOCK_SIZE_N])
    if TWO_DOTS:
        w3_desc = tl.make_tensor_descriptor(w_ptr, [I // GATE_UP_BLOCK, 2 * GATE_UP_BLOCK, K],
                                            [2 * GATE_UP_BLOCK * stride_wn, stride_wn, 1],
                                            [BLOCK_SIZE_N // GATE_UP_BLOCK, GATE_UP_BLOCK, BLOCK_SIZE_K])
        w_desc = w3_desc  # unused
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, [2 * I, K], [stride_wn, 1], [2 * BLOCK_SIZE_N, BLOCK_SIZE_K])
        w3_desc = w_desc  # unused
    _grid_tile(x_desc, w_desc, w3_desc, out_desc, b_ptr, M, I, K, HAS_BIAS, ACTIVATION, APPROX_TANH, TWO_DOTS,
               GATE_UP_BLOCK, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M)


def gated_gemm_tma_grid(
    x: torch.Tensor,
    packed: torch.Tensor,
    activation_code: int,
    approx_tanh: bool,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: GatedGemmConfig,
    two_dots: bool = False,
    device_descriptors: bool = False,
) -> torch.Tensor:
    """Launch one program per [block_m, block_n] output tile; arguments as `gated_gemm`'s,
    already checked by `gated_gemm_tma.tma_supported`.

    x: [M, K]; packed: [2*I, K] (`layout.py`); bias: [2*I] packed, or None; out: [M, I].
    two_dots: the gate rows and the up rows as two boxes per K step (TWO_DOTS above).
    device_descriptors: each program builds its TMA descriptors (the host passes pointers)
    instead of the host building one per operand per call; 3-10% slower on the H100 at
    M <= 128 (benchmarks/results/tune_graph/tune_gridpick_h100_bf16.json), so off by default.
    """
    m, k = x.shape
    i = packed.shape[0] // 2
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    grid = (triton.cdiv(m, bm) * triton.cdiv(i, bn),)
    meta = dict(
        HAS_BIAS=bias is not None, ACTIVATION=activation_code, APPROX_TANH=approx_tanh, TWO_DOTS=two_dots,
        GATE_UP_BLOCK=GATE_UP_BLOCK, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    b = bias if bias is not None else packed
    if device_descriptors:
        _ensure_allocator()
        _gated_gemm_tma_grid_devdesc_kernel[grid](
            x, packed, out, b, m, i, k, x.stride(0), packed.stride(0), out.stride(0), **meta)
        return out
    if two_dots:  # only the weight descriptor the kernel reads: each costs host time per launch
        row = packed.stride(0)
        w3 = packed.as_strided((i // GATE_UP_BLOCK, 2 * GATE_UP_BLOCK, k), (2 * GATE_UP_BLOCK * row, row, 1))
        w_desc = TensorDescriptor.from_tensor(w3, [bn // GATE_UP_BLOCK, GATE_UP_BLOCK, bk])
    else:
        w_desc = TensorDescriptor.from_tensor(packed, [2 * bn, bk])
    _gated_gemm_tma_grid_kernel[grid](
        TensorDescriptor.from_tensor(x, [bm, bk]), w_desc, w_desc, TensorDescriptor.from_tensor(out, [bm, bn]),
        b, m, i, k, **meta)
    return out
