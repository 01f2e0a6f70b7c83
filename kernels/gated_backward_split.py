"""The gated MLP's backward GEMM split in two: cuBLAS dH = dY @ Wd, then one elementwise pass.

Computes what `gated_backward_pointer.py` computes (its docstring has the math and the layout
of P and dP), in two launches instead of one:

1. cuBLAS writes dH = dY @ Wd (+ dh_in: `torch.addmm`) into the h buffer [M, I], rounded to the
   dtype: one rounding more than the fused kernels, where dH stays in fp32 registers (HF
   eager's backward rounds dH the same way).
2. `_gated_backward_elementwise_kernel` reads, per [BLOCK_SIZE_M, BLOCK_SIZE_N] tile of output
   columns, dH from the h buffer and the tile's gate and up columns of P (gate column i at
   2*16*(i // 16) + i % 16, up w later: w = 16, or the last block's width when I % 16 != 0),
   evaluates h and both derivatives in fp32 (`jit_common.gated_epilogue_grad`), and writes dP
   (may be P itself) and h over dH. Each element is read before it is written, by the same
   program.

Memory traffic beyond the GEMM's: dH written and read (2 * M * I elements) on top of the fused
kernels' P read, dP and h writes (5 * M * I). Any dtype cuBLAS takes, any strides, any I.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import GatedGemmConfig, KernelCapability, ceil_div
from .jit_common import gated_epilogue_grad
from .launcher import FastLaunch
from .layout import GATE_UP_BLOCK


@triton.jit
def _gated_backward_elementwise_kernel(
    p_ptr, dp_ptr, h_ptr, M, I,
    stride_pm, stride_pn, stride_dpm, stride_dpn, stride_hm, stride_hi,
    ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
    GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
):
    num_pid_n = tl.cdiv(I, BLOCK_SIZE_N)
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    offs_m = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    offs_i = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    block_start = (offs_i // GATE_UP_BLOCK) * GATE_UP_BLOCK
    width = tl.minimum(I - block_start, GATE_UP_BLOCK)
    gate_cols = (offs_i + block_start).to(tl.int64)
    up_cols = gate_cols + width
    mask = (offs_m[:, None] < M) & (offs_i[None, :] < I)  # [BLOCK_SIZE_M, BLOCK_SIZE_N]

    h_ptrs = h_ptr + offs_m[:, None] * stride_hm + offs_i[None, :] * stride_hi
    dh = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
    p_rows = p_ptr + offs_m[:, None] * stride_pm
    gate = tl.load(p_rows + gate_cols[None, :] * stride_pn, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(p_rows + up_cols[None, :] * stride_pn, mask=mask, other=0.0).to(tl.float32)
    h, dgate, dup = gated_epilogue_grad(gate, up, dh, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT)
    dp_rows = dp_ptr + offs_m[:, None] * stride_dpm
    tl.store(dp_rows + gate_cols[None, :] * stride_dpn, dgate.to(dp_ptr.dtype.element_ty), mask=mask)
    tl.store(dp_rows + up_cols[None, :] * stride_dpn, dup.to(dp_ptr.dtype.element_ty), mask=mask)
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask)


CAPABILITY = KernelCapability("backward_split", ops=("backward",), features=frozenset({"dh_in"}))


def can_run(dy: torch.Tensor, down_weight: torch.Tensor, preact: torch.Tensor, dpreact: torch.Tensor,
            h: torch.Tensor, dh_in: torch.Tensor | None = None) -> bool:
    """Every call the dispatcher makes: any device, dtype, strides and I."""
    return True


def make_launcher(config: GatedGemmConfig, epilogue: dict, dtype: torch.dtype, has_dh_in: bool = False):
    """A launcher `(dy [M, K], down_weight [K, I], preact [M, 2*I], dpreact [M, 2*I], h [M, I], dh_in)`
    writing dP (may be preact itself) and h; dh_in [M, I] must be given with has_dh_in, None
    without. The elementwise pass takes config.block_m x config.block_n tiles and
    config.num_warps (block_k, group_m and num_stages are unused)."""
    kernel = FastLaunch(_gated_backward_elementwise_kernel, dict(
        **epilogue, GATE_UP_BLOCK=GATE_UP_BLOCK, BLOCK_SIZE_M=config.block_m, BLOCK_SIZE_N=config.block_n,
        num_warps=config.num_warps,
    ))
    bm, bn = config.block_m, config.block_n

    def launch(dy: torch.Tensor, down_weight: torch.Tensor, preact: torch.Tensor, dpreact: torch.Tensor,
               h: torch.Tensor, dh_in: torch.Tensor | None = None) -> None:
        if has_dh_in and dh_in is None:
            raise ValueError("gated_backward_split: a HAS_DH_IN launcher needs dh_in")
        if has_dh_in:
            torch.addmm(dh_in, dy, down_weight, out=h)
        else:
            torch.matmul(dy, down_weight, out=h)
        m, i = h.shape
        kernel(ceil_div(m, bm) * ceil_div(i, bn), dy.get_device(), preact, dpreact, h, m, i,
               *preact.stride(), *dpreact.stride(), *h.stride())

    return launch
