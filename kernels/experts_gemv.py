"""The experts block for few tokens (decode): two GEMV kernels that read only the experts hit.

The math and the weight layouts are `experts_reference.py`'s. With few (token, slot) pairs
every expert is hit by about one pair, so no sorting is worth its launches: each kernel reads
top_k_index directly.

- `_experts_gated_gemv_kernel`, grid (S, cdiv(I, BLOCK_N)): pair p = t * TOP_K + j reads
  x[t] and the BLOCK_N gate and BLOCK_N up rows of expert e = top_k_index[t, j], accumulates
  both in fp32 over K in BLOCK_K steps (broadcast multiply and row sums: M = 1 per pair),
  adds the bias, applies the epilogue in fp32 and stores h[p] [BLOCK_N] rounded to x's dtype.
  A sentinel pair (e >= E) stores nothing.
- `_experts_down_gemv_kernel`, grid (T, cdiv(K_out, BLOCK_N)): token t sums, over its TOP_K
  slots in order, w[t, j] * (h[p] @ Wd[e]^T + bd[e]) in fp32 (sentinels skipped) and stores
  out[t] once, rounded to x's dtype: the combine happens in registers, deterministically.

Gate row i of expert e is at element e * stride_we + (i * GATE_STEP) * stride_wn + k * stride_wk
of gate_up, its up row at GATE_STEP * i + UP_SHIFT (chunked: GATE_STEP 1, UP_SHIFT I;
interleaved: 2, 1); the strides of a transposed layout are passed swapped, so one kernel
reads every layout. dtypes: bf16, fp16 or fp32 throughout (no tl.dot: right in the CPU
interpreter for every dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import ceil_div
from .experts_jit import experts_epilogue


@triton.jit
def _experts_gated_gemv_kernel(
    x_ptr, idx_ptr, w_ptr, b_ptr, h_ptr,
    K, I, UP_SHIFT, NUM_EXPERTS,
    stride_xm, stride_xk,
    stride_it, stride_ij,
    stride_we, stride_wn, stride_wk,
    stride_be, stride_bn,
    stride_hm,
    TOP_K: tl.constexpr, GATE_STEP: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
    GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
    ALPHA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    token = pair // TOP_K
    expert = tl.load(idx_ptr + token * stride_it + (pair % TOP_K) * stride_ij).to(tl.int64)
    if expert < NUM_EXPERTS:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        gate_rows = (offs_n * GATE_STEP).to(tl.int64)
        w_base = w_ptr + expert * stride_we
        x_row = x_ptr + token.to(tl.int64) * stride_xm
        if GATE_STEP == 2:
            # interleaved pairs: the tile's gate and up rows are 2 * BLOCK_N consecutive rows
            pair_rows = tl.program_id(1) * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
            mask_pair = pair_rows < 2 * I
            acc = tl.zeros((2 * BLOCK_N,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                xv = tl.load(x_row + offs_k * stride_xk, mask=mask_k, other=0.0).to(tl.float32)  # [BLOCK_K]
                w = tl.load(w_base + pair_rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                            mask=mask_pair[:, None] & mask_k[None, :], other=0.0)  # [2 * BLOCK_N, BLOCK_K]
                acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
            if HAS_BIAS:
                acc += tl.load(b_ptr + expert * stride_be + pair_rows * stride_bn, mask=mask_pair,
                               other=0.0).to(tl.float32)
            acc_gate, acc_up = tl.split(tl.reshape(acc, (BLOCK_N, 2)))
        else:
            acc_gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
            # -- main loop: both halves in fp32 over K --
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                xv = tl.load(x_row + offs_k * stride_xk, mask=mask_k, other=0.0).to(tl.float32)  # [BLOCK_K]
                mask = mask_n[:, None] & mask_k[None, :]
                wg = tl.load(w_base + gate_rows[:, None] * stride_wn + offs_k[None, :] * stride_wk, mask=mask,
                             other=0.0)
                wu = tl.load(w_base + (gate_rows + UP_SHIFT)[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                             mask=mask, other=0.0)  # [BLOCK_N, BLOCK_K]
                acc_gate += tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
                acc_up += tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
            # -- epilogue: bias, the gated math in fp32, one rounding --
            if HAS_BIAS:
                b_base = b_ptr + expert * stride_be
                acc_gate += tl.load(b_base + gate_rows * stride_bn, mask=mask_n, other=0.0).to(tl.float32)
                acc_up += tl.load(b_base + (gate_rows + UP_SHIFT) * stride_bn, mask=mask_n,
                                  other=0.0).to(tl.float32)
        h = experts_epilogue(acc_gate, acc_up, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT, ALPHA)
        tl.store(h_ptr + pair.to(tl.int64) * stride_hm + offs_n, h.to(h_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _experts_down_gemv_kernel(
    h_ptr, idx_ptr, rw_ptr, d_ptr, db_ptr, out_ptr,
    K_OUT, I, NUM_EXPERTS,
    stride_hm,
    stride_it, stride_ij,
    stride_rt, stride_rj,
    stride_de, stride_dn, stride_di,
    stride_dbe, stride_dbn,
    stride_om, stride_on,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < K_OUT
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(TOP_K):  # slots in order: a fixed summation order
        expert = tl.load(idx_ptr + token * stride_it + j * stride_ij).to(tl.int64)
        if expert < NUM_EXPERTS:
            d_base = d_ptr + expert * stride_de
            h_row = h_ptr + (token * TOP_K + j) * stride_hm
            part = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for i0 in range(0, I, BLOCK_I):
                offs_i = i0 + tl.arange(0, BLOCK_I)
                mask_i = offs_i < I
                hv = tl.load(h_row + offs_i, mask=mask_i, other=0.0).to(tl.float32)  # [BLOCK_I]
                wd = tl.load(d_base + offs_n[:, None] * stride_dn + offs_i[None, :] * stride_di,
                             mask=mask_n[:, None] & mask_i[None, :], other=0.0)  # [BLOCK_N, BLOCK_I]
                part += tl.sum(wd.to(tl.float32) * hv[None, :], axis=1)
            if HAS_BIAS:
                part += tl.load(db_ptr + expert * stride_dbe + offs_n * stride_dbn, mask=mask_n, other=0.0).to(tl.float32)
            acc += tl.load(rw_ptr + token * stride_rt + j * stride_rj).to(tl.float32) * part
    tl.store(out_ptr + token * stride_om + offs_n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def experts_gemv(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, *, epilogue: dict,
                 layout, config, out: torch.Tensor) -> torch.Tensor:
    """Launch both decode kernels; `experts_dispatch.experts_forward` checks the arguments.

    x [T, K]; top_k_index, top_k_weights [T, TOP_K]; weights as `experts_reference`; epilogue:
    `ExpertsEpilogue.constexprs()` plus APPROX_TANH; config: an `ExpertsConfig`; out [T, K_out].
    """
    t, k = x.shape
    top_k = top_k_index.shape[1]
    num_experts = gate_up.shape[0]
    s_we, s_wn, s_wk = _gate_up_strides(gate_up, layout)
    inter = (gate_up.shape[2] if layout.transposed else gate_up.shape[1]) // 2
    h = x.new_empty((t * top_k, inter))
    bias = gate_up if gate_up_bias is None else gate_up_bias
    _experts_gated_gemv_kernel[(t * top_k, ceil_div(inter, config.block_n))](
        x, top_k_index, gate_up, bias, h,
        k, inter, inter if layout.concatenated else 1, num_experts,
        *x.stride(), *top_k_index.stride(), s_we, s_wn, s_wk, *bias.stride()[:2], h.stride(0),
        TOP_K=top_k, GATE_STEP=1 if layout.concatenated else 2, HAS_BIAS=gate_up_bias is not None, **epilogue,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=1,
    )
    s_de, s_dn, s_di = _down_strides(down, layout)
    k_out = out.shape[1]
    dbias = down if down_bias is None else down_bias
    _experts_down_gemv_kernel[(t, ceil_div(k_out, config.down_block_n))](
        h, top_k_index, top_k_weights, down, dbias, out,
        k_out, inter, num_experts, h.stride(0), *top_k_index.stride(), *top_k_weights.stride(),
        s_de, s_dn, s_di, *dbias.stride()[:2], *out.stride(),
        TOP_K=top_k, HAS_BIAS=down_bias is not None,
        BLOCK_N=config.down_block_n, BLOCK_I=config.down_block_k, num_warps=config.num_warps, num_stages=1,
    )
    return out


def _gate_up_strides(gate_up: torch.Tensor, layout) -> tuple[int, int, int]:
    """(expert, 2I-axis, K-axis) strides of gate_up in any layout."""
    s = gate_up.stride()
    return (s[0], s[2], s[1]) if layout.transposed else (s[0], s[1], s[2])


def _down_strides(down: torch.Tensor, layout) -> tuple[int, int, int]:
    """(expert, K_out-axis, I-axis) strides of down in any layout."""
    s = down.stride()
    return (s[0], s[2], s[1]) if layout.transposed else (s[0], s[1], s[2])
