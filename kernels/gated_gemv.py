"""Fused gated GEMV for one token: the weight streamed through registers, no tensor cores.

Computes what `gated_gemm_pointer.py` computes (its docstring has the layout, dtypes and
rounding) for M = 1, organised like a pure read of the weight rather than like a GEMM:

- program p owns BLOCKS whole gate/up blocks of the packed weight [2*I, K]: packed rows
  32*BLOCKS*p .. +32*BLOCKS, i.e. output columns 16*BLOCKS*p .. +16*BLOCKS, gate and up rows
  side by side as the layout stores them;
- per K step it loads a [32*BLOCKS, BLOCK_SIZE_K] tile of those rows (16-byte loads along K)
  and the matching BLOCK_SIZE_K inputs and accumulates their products in an fp32 tile of the
  same shape, reduced over K once after the loop (no cross-thread reduction per step);
- the epilogue splits the row sums into gate and up (a register view, as the TMA kernel's),
  adds the bias, applies the gated epilogue in fp32 and rounds once to x's dtype.

Nothing goes through shared memory, so a program needs few registers and many share an SM:
like a pure read of the weight, the hardware keeps enough bytes in flight by
occupancy and balances the SMs to the end of the call with many small programs, where the
tensor-core kernel holds one 1 MB program per SM and drains unevenly.

Low-rank segment (`_gated_gemv_low_rank_kernel`, LoRA inference: `swiglu_patch.low_rank`): the
row sums also get x_lr @ b_lr^T, with x_lr [1, R] and b_lr [2*I, R] in the packed row layout, in
BLOCK_SIZE_R steps after the K loop, in fp32 before the bias, as the pointer kernel adds it. A
kernel of its own, sharing the K loop and the epilogue (`_row_sums`, `_store_gated`), so the
plain GEMV's launch binds no low-rank arguments (each costs host time per call). No
STORE_PREACT: training's forward takes the pointer or TMA kernel.

Needs M = 1 and I % 16 == 0 (whole blocks: every real model); any dtype the pointer kernel
takes, any strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import LOW_RANK_BLOCK, GatedGemmConfig, KernelCapability, ceil_div
from .jit_common import gated_epilogue
from .launcher import FastLaunch
from .layout import GATE_UP_BLOCK


@triton.jit
def _row_sums(x_ptr, w_ptr, rows, mask_r, K, stride_xk, stride_wn, stride_wk,
              ROWS: tl.constexpr, BLOCK_SIZE_K: tl.constexpr):
    """fp32 sums over K of x [1, K] times these packed rows of the weight: [ROWS]."""
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :] * stride_wk  # [ROWS, BLOCK_SIZE_K]
    x_ptrs = x_ptr + offs_k * stride_xk
    acc2d = tl.zeros((ROWS, BLOCK_SIZE_K), dtype=tl.float32)  # reduced over K once, after the loop
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        mask_k = offs_k < K - k * BLOCK_SIZE_K
        xk = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=mask_r[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc2d += w * xk[None, :]
        w_ptrs += BLOCK_SIZE_K * stride_wk
        x_ptrs += BLOCK_SIZE_K * stride_xk
    return tl.sum(acc2d, axis=1)


@triton.jit
def _store_gated(acc, b_ptr, out_ptr, rows, mask_r, I, stride_oi,
                 HAS_BIAS: tl.constexpr,
                 ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
                 GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
                 GATE_UP_BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """Bias, the gated epilogue in fp32 and one rounded store of this program's BLOCKS * 16 outputs."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=mask_r, other=0.0).to(tl.float32)
    # rows are [block, gate/up, 16]: move gate/up last and split it off
    acc = tl.permute(tl.reshape(acc, (BLOCKS, 2, GATE_UP_BLOCK)), (0, 2, 1))
    gate, up = tl.split(tl.reshape(acc, (BLOCKS * GATE_UP_BLOCK, 2)))  # [BLOCKS * 16] each
    h = gated_epilogue(gate, up, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT)
    offs_i = tl.program_id(0) * (BLOCKS * GATE_UP_BLOCK) + tl.arange(0, BLOCKS * GATE_UP_BLOCK)
    tl.store(out_ptr + offs_i * stride_oi, h.to(out_ptr.dtype.element_ty), mask=offs_i < I)


@triton.jit
def _gated_gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    I, K,
    stride_xk, stride_wn, stride_wk, stride_oi,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
    GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
):
    ROWS: tl.constexpr = BLOCKS * 2 * GATE_UP_BLOCK
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # packed rows of this program
    mask_r = rows < 2 * I
    acc = _row_sums(x_ptr, w_ptr, rows, mask_r, K, stride_xk, stride_wn, stride_wk, ROWS, BLOCK_SIZE_K)
    _store_gated(acc, b_ptr, out_ptr, rows, mask_r, I, stride_oi, HAS_BIAS, ACTIVATION, APPROX_TANH, GATE_SCALE,
                 OUT_SCALE, CLAMP, LIMIT, GATE_UP_BLOCK, BLOCKS)


@triton.jit
def _gated_gemv_low_rank_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, xl_ptr, bl_ptr,
    I, K, R,
    stride_xk, stride_wn, stride_wk, stride_oi, stride_xlr, stride_bln, stride_blr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
    GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    BLOCK_SIZE_R: tl.constexpr,
):
    """`_gated_gemv_kernel` plus x_lr [1, R] against these rows of b_lr [2*I, R] (its own kernel:
    the plain GEMV's launch binds no low-rank arguments)."""
    ROWS: tl.constexpr = BLOCKS * 2 * GATE_UP_BLOCK
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mask_r = rows < 2 * I
    acc = _row_sums(x_ptr, w_ptr, rows, mask_r, K, stride_xk, stride_wn, stride_wk, ROWS, BLOCK_SIZE_K)
    offs_r = tl.arange(0, BLOCK_SIZE_R)
    for r in range(0, tl.cdiv(R, BLOCK_SIZE_R)):
        mask_lr = offs_r < R - r * BLOCK_SIZE_R
        xl = tl.load(xl_ptr + (r * BLOCK_SIZE_R + offs_r) * stride_xlr, mask=mask_lr, other=0.0).to(tl.float32)
        bl = tl.load(bl_ptr + rows[:, None] * stride_bln + (r * BLOCK_SIZE_R + offs_r)[None, :] * stride_blr,
                     mask=mask_r[:, None] & mask_lr[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(bl * xl[None, :], axis=1)
    _store_gated(acc, b_ptr, out_ptr, rows, mask_r, I, stride_oi, HAS_BIAS, ACTIVATION, APPROX_TANH, GATE_SCALE,
                 OUT_SCALE, CLAMP, LIMIT, GATE_UP_BLOCK, BLOCKS)


CAPABILITY = KernelCapability("gemv", ops=("forward",), features=frozenset({"low_rank"}), one_token=True)


def can_run(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, preact: torch.Tensor | None = None,
            x_lr: torch.Tensor | None = None, b_lr: torch.Tensor | None = None) -> bool:
    """One token, whole gate/up blocks, no pre-activation to store."""
    return x.shape[0] == 1 and (weight.shape[0] // 2) % GATE_UP_BLOCK == 0 and preact is None


def make_launcher(config: GatedGemmConfig, epilogue: dict, has_bias: bool, dtype: torch.dtype,
                  store_preact: bool = False, low_rank: bool = False):
    """A launcher `(x [1, K], weight [2*I, K], bias [2*I] contiguous or None, out [1, I]) -> out`;
    with low_rank `(..., out, preact, x_lr, b_lr) -> out` as the low-rank plans call it: preact
    None (no STORE_PREACT), x_lr [1, R] and b_lr [2*I, R] in x's dtype, any strides.

    config: block_n output columns per program (a multiple of 16: block_n // 16 gate/up
    blocks), block_k inputs per step, num_warps; block_m, group_m and num_stages are not used.
    """
    if config.block_n % GATE_UP_BLOCK:
        raise ValueError(f"gated_gemv: block_n {config.block_n} is not a multiple of {GATE_UP_BLOCK}")
    if store_preact:
        raise ValueError("gated_gemv: the GEMV does not store the pre-activation; use the pointer or TMA kernel")
    meta = dict(HAS_BIAS=has_bias, **epilogue, GATE_UP_BLOCK=GATE_UP_BLOCK, BLOCKS=config.block_n // GATE_UP_BLOCK,
                BLOCK_SIZE_K=config.block_k, num_warps=config.num_warps, num_stages=1)
    bn = config.block_n
    if low_rank:
        kernel_lr = FastLaunch(_gated_gemv_low_rank_kernel, dict(meta, BLOCK_SIZE_R=LOW_RANK_BLOCK))

        def launch_low_rank(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                            preact: torch.Tensor | None = None, x_lr: torch.Tensor | None = None,
                            b_lr: torch.Tensor | None = None) -> torch.Tensor:
            if x_lr is None or b_lr is None:
                raise ValueError("gated_gemv: a low-rank launcher needs x_lr and b_lr")
            i = weight.shape[0] >> 1
            kernel_lr(ceil_div(i, bn), x.get_device(), x, weight, weight if bias is None else bias, out, x_lr, b_lr,
                      i, x.shape[1], x_lr.shape[1], x.stride()[1], *weight.stride(), out.stride()[1],
                      x_lr.stride()[1], *b_lr.stride())
            return out

        return launch_low_rank
    kernel = FastLaunch(_gated_gemv_kernel, meta)

    def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        i = weight.shape[0] >> 1
        w_rows, w_cols = weight.stride()
        kernel(ceil_div(i, bn), x.get_device(), x, weight, weight if bias is None else bias, out,
               i, x.shape[1], x.stride()[1], w_rows, w_cols, out.stride()[1])
        return out

    return launch
