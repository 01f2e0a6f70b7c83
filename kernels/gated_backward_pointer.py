"""The pointer-load backward GEMM of the gated MLP: any GPU, any dtype, any strides, any I.

For the MLP y = h @ Wd^T + bd with h = epilogue(gate, up) and the pre-activation
P = x @ W^T + b ([M, 2*I], the gate/up columns interleaved as the packed weight's rows are,
`layout.py`), this kernel takes dY and computes

    dH = dY @ Wd                                 [M, I], fp32, in registers only
    h  = epilogue(gate, up)                      [M, I]       (what dWd = dY^T @ h needs)
    dP = (dH * dh/dgate, dH * dh/dup)            [M, 2*I], interleaved as P

- dY: [M, K]; Wd: the down projection's weight [K, I] (nn.Linear's [out, in]); both in one
  dtype (bf16, fp16, fp32), any strides. P, dP: [M, 2*I] in that dtype, any strides; dP may
  be P itself (each program reads its P tile before it writes the same elements).
- Gate column i of P sits at 2*16*(i // 16) + i % 16, its up column w later (w = 16, or the
  last block's width when I % 16 != 0): the same index arithmetic as the forward kernel's
  weight rows (`gated_gemm_pointer.py`).
- Each program computes one [BLOCK_SIZE_M, BLOCK_SIZE_N] tile of dH with an fp32 accumulator
  over K, loads the tile's gate and up columns of P, and evaluates h and both derivatives in
  fp32 (`jit_common.gated_epilogue_grad`: scales, clamps and act' for silu, gelu_tanh, gelu).
  Rounding: once per stored value, to the dtype, on the stores of h and dP. dH never reaches
  memory.
- HAS_DH_IN: a further gradient of h, dh_in [M, I] (any strides; LoRA on the down projection
  sends one back through h), is added to the fp32 dH tile before the derivative.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import GatedGemmConfig, KernelCapability, ceil_div
from .jit_common import gated_epilogue_grad, tile_pid
from .launcher import FastLaunch
from .layout import GATE_UP_BLOCK


@triton.jit
def _gated_backward_kernel(
    dy_ptr, wd_ptr, p_ptr, dp_ptr, h_ptr, dh_ptr,
    M, I, K,
    stride_dym, stride_dyk,
    stride_wdk, stride_wdi,
    stride_pm, stride_pn,
    stride_dpm, stride_dpn,
    stride_hm, stride_hi,
    stride_dhm, stride_dhi,
    HAS_DH_IN: tl.constexpr,
    ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
    GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    # -- tile ordering: groups of GROUP_SIZE_M row-tiles share Wd tiles in L2 --
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    pid_m, pid_n = tile_pid(tl.program_id(0), GROUP_SIZE_M * tl.cdiv(I, BLOCK_SIZE_N), num_pid_m, GROUP_SIZE_M)

    # -- which columns of P hold this tile's gate and up pre-activations --
    offs_m = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    offs_i = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    block_start = (offs_i // GATE_UP_BLOCK) * GATE_UP_BLOCK
    width = tl.minimum(I - block_start, GATE_UP_BLOCK)
    gate_cols = (offs_i + block_start).to(tl.int64)  # 2 * block_start + (offs_i - block_start)
    up_cols = gate_cols + width
    mask_m = offs_m < M
    mask_i = offs_i < I
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    dy_ptrs = dy_ptr + offs_m[:, None] * stride_dym + offs_k[None, :] * stride_dyk  # [BLOCK_SIZE_M, BLOCK_SIZE_K]
    wd_ptrs = wd_ptr + offs_k[:, None] * stride_wdk + offs_i[None, :].to(tl.int64) * stride_wdi  # [BLOCK_SIZE_K, BLOCK_SIZE_N]

    # -- main loop: dH = dY @ Wd, fp32 --
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_left = K - k * BLOCK_SIZE_K
        dy = tl.load(dy_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        wd = tl.load(wd_ptrs, mask=(offs_k[:, None] < k_left) & mask_i[None, :], other=0.0)
        acc = tl.dot(dy, wd, acc, input_precision=INPUT_PRECISION)
        dy_ptrs += BLOCK_SIZE_K * stride_dyk
        wd_ptrs += BLOCK_SIZE_K * stride_wdk

    # -- epilogue: read P's gate and up columns, h and the derivatives in fp32, one rounding each --
    mask = mask_m[:, None] & mask_i[None, :]
    if HAS_DH_IN:
        dh_ptrs = dh_ptr + offs_m[:, None] * stride_dhm + offs_i[None, :] * stride_dhi
        acc += tl.load(dh_ptrs, mask=mask, other=0.0).to(tl.float32)
    p_rows = p_ptr + offs_m[:, None] * stride_pm
    gate = tl.load(p_rows + gate_cols[None, :] * stride_pn, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(p_rows + up_cols[None, :] * stride_pn, mask=mask, other=0.0).to(tl.float32)
    h, dgate, dup = gated_epilogue_grad(gate, up, acc, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT)
    dp_rows = dp_ptr + offs_m[:, None] * stride_dpm
    tl.store(dp_rows + gate_cols[None, :] * stride_dpn, dgate.to(dp_ptr.dtype.element_ty), mask=mask)
    tl.store(dp_rows + up_cols[None, :] * stride_dpn, dup.to(dp_ptr.dtype.element_ty), mask=mask)
    h_ptrs = h_ptr + offs_m[:, None] * stride_hm + offs_i[None, :] * stride_hi  # [BLOCK_SIZE_M, BLOCK_SIZE_N]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask)


CAPABILITY = KernelCapability("backward_pointer", ops=("backward",), features=frozenset({"dh_in"}))


def can_run(dy: torch.Tensor, down_weight: torch.Tensor, preact: torch.Tensor, dpreact: torch.Tensor,
            h: torch.Tensor, dh_in: torch.Tensor | None = None) -> bool:
    """Every call the dispatcher makes: any device Triton runs on, any strides, any I."""
    return True


def make_launcher(config: GatedGemmConfig, epilogue: dict, dtype: torch.dtype, has_dh_in: bool = False):
    """A launcher `(dy [M, K], down_weight [K, I], preact [M, 2*I], dpreact [M, 2*I], h [M, I], dh_in)`
    for one (config, epilogue, dtype, has_dh_in) writing dP (may be preact itself) and h; dh_in
    [M, I] must be given with has_dh_in and is None without; epilogue: `GatedEpilogue.constexprs()`
    plus APPROX_TANH. Arguments are checked by the caller (`dispatch`)."""
    if dtype is not torch.float32:
        precision = "tf32"  # ignored by tl.dot for 16-bit operands
    else:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    kernel = FastLaunch(_gated_backward_kernel, dict(
        HAS_DH_IN=has_dh_in, **epilogue, INPUT_PRECISION=precision, GATE_UP_BLOCK=GATE_UP_BLOCK, **config.meta(),
        num_warps=config.num_warps, num_stages=config.num_stages,
    ))
    bm, bn = config.block_m, config.block_n

    def launch(dy: torch.Tensor, down_weight: torch.Tensor, preact: torch.Tensor, dpreact: torch.Tensor,
               h: torch.Tensor, dh_in: torch.Tensor | None = None) -> None:
        m, k = dy.shape
        i = down_weight.shape[1]
        if has_dh_in and dh_in is None:
            raise ValueError("gated_backward_pointer: a HAS_DH_IN launcher needs dh_in")
        dh = dh_in if has_dh_in else h  # not read without HAS_DH_IN
        kernel(ceil_div(m, bm) * ceil_div(i, bn), dy.get_device(),
               dy, down_weight, preact, dpreact, h, dh, m, i, k,
               *dy.stride(), *down_weight.stride(), *preact.stride(), *dpreact.stride(), *h.stride(), *dh.stride())

    return launch
