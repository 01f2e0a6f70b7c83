"""The pointer-load fused gated GEMM: any GPU, any dtype, any strides, any I.

    out[M, I] = epilogue(x @ Wg^T + bg, x @ Wu^T + bu)

Layout (`layout.py`): the weight is the packed ``gate_up_interleaved`` [N = 2*I, K], gate
and up rows interleaved in blocks of GATE_UP_BLOCK = 16 (gate row i at packed row
2*16*(i // 16) + i % 16, up row i right after its block's gate rows; a partial last block
holds r gate rows then r up rows). The optional bias is [2*I] in the same layout.

Each program computes one [BLOCK_SIZE_M, BLOCK_SIZE_N] tile of the output: it loads the
BLOCK_SIZE_N gate rows and the BLOCK_SIZE_N matching up rows of the packed weight (row
indices computed from the layout, so any I works, block-aligned or not), runs two fp32
accumulators over K, adds the bias in fp32, applies the epilogue (`jit_common.gated_epilogue`)
in fp32 and rounds once to x's dtype on the single store of [M, I]. The [M, 2*I]
pre-activation never reaches memory, unless STORE_PREACT asks for it (training's store mode):
then P = x @ W^T + b, in the packed columns' interleaved order ([M, 2*I], gate column i at
2*16*(i // 16) + i % 16 as for the weight's rows), is rounded once to x's dtype and stored
too, before gate_scale or any clamp. With STORE_PREACT off the kernel is the inference kernel
(the branch is on a constexpr; the P pointer and strides go unused).

Low-rank segment (HAS_LOW_RANK, LoRA: `swiglu_patch.low_rank`): P also gets x_lr @ b_lr^T, with
x_lr [M, R] and b_lr [2*I, R] in the packed row layout, added into the same two fp32
accumulators by a second loop over R in BLOCK_SIZE_R steps after the K loop, before the bias:
the GEMM over [x | x_lr] against [W | b_lr] without concatenating them. Any strides, any R >= 1.

dtypes: x and the weight share one of bf16, fp16, fp32; out has x's dtype. fp32 dots use
tf32 only where ``torch.backends.cuda.matmul.allow_tf32`` says so. The bias is read with
unit stride (`dispatch` makes it contiguous).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import LOW_RANK_BLOCK, GatedGemmConfig, KernelCapability, ceil_div
from .jit_common import gated_epilogue, tile_pid
from .launcher import FastLaunch
from .layout import GATE_UP_BLOCK


@triton.jit
def _gated_gemm_fwd_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, p_ptr, xl_ptr, bl_ptr,
    M, I, K, R,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_om, stride_oi,
    stride_pm, stride_pn,
    stride_xlm, stride_xlr,
    stride_bln, stride_blr,
    HAS_BIAS: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    HAS_LOW_RANK: tl.constexpr,
    ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
    GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    BLOCK_SIZE_R: tl.constexpr,
):
    # -- tile ordering: groups of GROUP_SIZE_M row-tiles share weight tiles in L2 --
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    pid_m, pid_n = tile_pid(tl.program_id(0), GROUP_SIZE_M * tl.cdiv(I, BLOCK_SIZE_N), num_pid_m, GROUP_SIZE_M)

    # -- which packed rows hold this tile's gate and up rows --
    offs_m = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    offs_i = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    block_start = (offs_i // GATE_UP_BLOCK) * GATE_UP_BLOCK
    width = tl.minimum(I - block_start, GATE_UP_BLOCK)
    gate_rows = (offs_i + block_start).to(tl.int64)  # 2 * block_start + (offs_i - block_start)
    up_rows = gate_rows + width
    mask_m = offs_m < M
    mask_i = offs_i < I
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_SIZE_M, BLOCK_SIZE_K]
    wg_ptrs = w_ptr + gate_rows[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_SIZE_K, BLOCK_SIZE_N]
    wu_ptrs = w_ptr + up_rows[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_SIZE_K, BLOCK_SIZE_N]

    # -- main loop: two fp32 accumulators over K --
    acc_gate = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_left = K - k * BLOCK_SIZE_K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        wg = tl.load(wg_ptrs, mask=mask_i[None, :] & (offs_k[:, None] < k_left), other=0.0)
        wu = tl.load(wu_ptrs, mask=mask_i[None, :] & (offs_k[:, None] < k_left), other=0.0)
        acc_gate = tl.dot(x, wg, acc_gate, input_precision=INPUT_PRECISION)
        acc_up = tl.dot(x, wu, acc_up, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_SIZE_K * stride_xk
        wg_ptrs += BLOCK_SIZE_K * stride_wk
        wu_ptrs += BLOCK_SIZE_K * stride_wk

    # -- low-rank segment: the same accumulators over x_lr [M, R] and b_lr [2*I, R] --
    if HAS_LOW_RANK:
        offs_r = tl.arange(0, BLOCK_SIZE_R)
        xl_ptrs = xl_ptr + offs_m[:, None] * stride_xlm + offs_r[None, :] * stride_xlr  # [BLOCK_SIZE_M, BLOCK_SIZE_R]
        blg_ptrs = bl_ptr + gate_rows[None, :] * stride_bln + offs_r[:, None] * stride_blr  # [BLOCK_SIZE_R, BLOCK_SIZE_N]
        blu_ptrs = bl_ptr + up_rows[None, :] * stride_bln + offs_r[:, None] * stride_blr
        for r in range(0, tl.cdiv(R, BLOCK_SIZE_R)):
            r_left = R - r * BLOCK_SIZE_R
            xl = tl.load(xl_ptrs, mask=mask_m[:, None] & (offs_r[None, :] < r_left), other=0.0)
            blg = tl.load(blg_ptrs, mask=mask_i[None, :] & (offs_r[:, None] < r_left), other=0.0)
            blu = tl.load(blu_ptrs, mask=mask_i[None, :] & (offs_r[:, None] < r_left), other=0.0)
            acc_gate = tl.dot(xl, blg, acc_gate, input_precision=INPUT_PRECISION)
            acc_up = tl.dot(xl, blu, acc_up, input_precision=INPUT_PRECISION)
            xl_ptrs += BLOCK_SIZE_R * stride_xlr
            blg_ptrs += BLOCK_SIZE_R * stride_blr
            blu_ptrs += BLOCK_SIZE_R * stride_blr

    # -- epilogue: bias, the gated math in fp32, one rounding, one store --
    if HAS_BIAS:
        acc_gate += tl.load(b_ptr + gate_rows, mask=mask_i, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_ptr + up_rows, mask=mask_i, other=0.0).to(tl.float32)[None, :]
    if STORE_PREACT:  # P [M, 2*I], interleaved: the backward's input
        p_rows = p_ptr + offs_m[:, None] * stride_pm
        p_mask = mask_m[:, None] & mask_i[None, :]
        tl.store(p_rows + gate_rows[None, :] * stride_pn, acc_gate.to(p_ptr.dtype.element_ty), mask=p_mask)
        tl.store(p_rows + up_rows[None, :] * stride_pn, acc_up.to(p_ptr.dtype.element_ty), mask=p_mask)
    h = gated_epilogue(acc_gate, acc_up, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_i[None, :] * stride_oi  # [BLOCK_SIZE_M, BLOCK_SIZE_N]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_i[None, :])


CAPABILITY = KernelCapability("pointer", ops=("forward",), features=frozenset({"store_preact", "low_rank"}))


def can_run(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, preact: torch.Tensor | None = None,
            x_lr: torch.Tensor | None = None, b_lr: torch.Tensor | None = None) -> bool:
    """Every call the dispatcher makes: any device Triton runs on, any strides, any I."""
    return True


def make_launcher(config: GatedGemmConfig, epilogue: dict, has_bias: bool, dtype: torch.dtype,
                  store_preact: bool = False, low_rank: bool = False):
    """A launcher `(x [M, K], weight [2*I, K], bias [2*I] contiguous or None, out [M, I], preact,
    x_lr, b_lr) -> out` for one (config, epilogue, bias, dtype, store_preact, low_rank); epilogue:
    `GatedEpilogue.constexprs()` plus APPROX_TANH. With store_preact it also writes preact [M, 2*I]
    (x's dtype, any strides), which must be given; without, preact is None. With low_rank, x_lr
    [M, R] and b_lr [2*I, R] (x's dtype, any strides) must be given; without, they are None.
    Arguments are checked by the caller (`dispatch`)."""
    if dtype is not torch.float32:
        precision = "tf32"  # ignored by tl.dot for 16-bit operands
    else:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    kernel = FastLaunch(_gated_gemm_fwd_kernel, dict(
        HAS_BIAS=has_bias, STORE_PREACT=store_preact, HAS_LOW_RANK=low_rank, **epilogue, INPUT_PRECISION=precision,
        GATE_UP_BLOCK=GATE_UP_BLOCK, **config.meta(),
        BLOCK_SIZE_R=LOW_RANK_BLOCK, num_warps=config.num_warps, num_stages=config.num_stages,
    ))
    bm, bn = config.block_m, config.block_n

    def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
               preact: torch.Tensor | None = None, x_lr: torch.Tensor | None = None,
               b_lr: torch.Tensor | None = None) -> torch.Tensor:
        m, k = x.shape
        i = weight.shape[0] >> 1
        p = out if preact is None else preact  # not read unless STORE_PREACT
        if store_preact and preact is None:
            raise ValueError("gated_gemm_pointer: a STORE_PREACT launcher needs preact")
        if low_rank:
            if x_lr is None or b_lr is None:
                raise ValueError("gated_gemm_pointer: a low-rank launcher needs x_lr and b_lr")
            r, xl, bl = x_lr.shape[1], x_lr, b_lr
        else:  # not read: HAS_LOW_RANK is off
            r, xl, bl = 0, x, weight
        kernel(ceil_div(m, bm) * ceil_div(i, bn), x.get_device(),
               x, weight, weight if bias is None else bias, out, p, xl, bl, m, i, k, r,
               *x.stride(), *weight.stride(), *out.stride(), *p.stride(), *xl.stride(), *bl.stride())
        return out

    return launch
