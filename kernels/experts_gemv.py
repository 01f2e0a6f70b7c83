"""The experts block for a token or two: two launches, no routing prep.

Computes what `experts_gemm.py` computes (`experts_reference.py` has the math, layouts and
rounding) as two GEMV kernels that read top_k_index directly. At decode an eager call's host
time is often what a generate loop waits for: the grouped path sorts the pairs into blocks,
launches four kernels and allocates six tensors; this one launches two and allocates h. At one
token (and at two on small experts) it also takes less GPU time than the grouped kernels, so the
rules give it captured calls too (`rules.EXPERTS_RULES`).

- `_experts_gated_gemv_kernel`, one program per (pair p = t * TOP_K + j, BLOCK_N columns of I):
  the BLOCK_N gate rows and BLOCK_N up rows of expert e = top_k_index[t, j] against x[t],
  accumulated in two fp32 [BLOCK_N, BLOCK_K] tiles over K and reduced once after the loop (no
  cross-thread reduction per step, as the dense `gated_gemv.py`); then the bias, the epilogue in
  fp32 and h[p] rounded once to x's dtype. A sentinel pair (e >= E) stores nothing.
- `_experts_down_combine_kernel`, one program per (token t, BLOCK_N rows of K_out): all TOP_K
  slots at once, one fp32 [SLOTS, BLOCK_N, BLOCK_K] tile (SLOTS: TOP_K rounded up to a power of
  2) of Wd[e_j]'s rows times h[t * TOP_K + j], stepping BLOCK_K over I and reduced once; per
  slot y_j = w[t, j] * (sum + bd[e_j]) rounded to x's dtype, as the grouped down GEMM rounds it;
  then out[t] = sum of y_j over the slots in order, in fp32, rounded once (the grouped path's
  combine, in registers: `experts_jit.combine_slots`). Sentinel slots add nothing.

No tensor cores and no shared memory: a pair's rows are a matrix-vector product, and many small
programs per SM keep the weight's bytes in flight as a pure read does. So the weights' rows must
be contiguous along the reduction axis (`can_run`: gate_up [E, 2I, K] and down [E, K_out, I] with
unit inner strides, chunked or interleaved gate/up, any other strides); a transposed layout
(gpt-oss) has its own GEMV, `experts_gemv_transposed.py`, which shares this file's launcher of
the gated kernel (`gated_launcher`). Biases, every epilogue, any dtype the interpreter or the
GPU takes, any strides of x, the routing tensors and out. No pre-activation store and no
low-rank segment: the planner gives this file plain inference calls only (`CAPABILITY`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .configs import ExpertsConfig, KernelCapability, ceil_div
from .experts_jit import combine_slots, experts_epilogue
from .launcher import FastLaunch


@triton.jit
def _experts_gated_gemv_kernel(
    x_ptr, idx_ptr, w_ptr, b_ptr, h_ptr,
    K, I, UP_SHIFT, NUM_EXPERTS, COLUMN_BLOCKS,
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
    pair = tl.program_id(0) // COLUMN_BLOCKS
    token = pair // TOP_K
    expert = tl.load(idx_ptr + token * stride_it + (pair % TOP_K) * stride_ij).to(tl.int64)
    if expert < NUM_EXPERTS:
        offs_n = (tl.program_id(0) % COLUMN_BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)
        gate_rows = (offs_n * GATE_STEP).to(tl.int64)
        up_rows = gate_rows + UP_SHIFT  # int64: I rows on in a chunked layout
        w_base = w_ptr + expert * stride_we + offs_k[None, :] * stride_wk
        g_ptrs = w_base + gate_rows[:, None] * stride_wn
        u_ptrs = w_base + up_rows[:, None] * stride_wn
        x_ptrs = x_ptr + token.to(tl.int64) * stride_xm + offs_k * stride_xk
        acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # reduced over K once, after the loop
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            mask_k = offs_k < K - k * BLOCK_K
            xk = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            mask = mask_n[:, None] & mask_k[None, :]
            acc_gate += tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32) * xk
            acc_up += tl.load(u_ptrs, mask=mask, other=0.0).to(tl.float32) * xk
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
            x_ptrs += BLOCK_K * stride_xk
        gate = tl.sum(acc_gate, axis=1)
        up = tl.sum(acc_up, axis=1)
        if HAS_BIAS:
            b_base = b_ptr + expert * stride_be
            gate += tl.load(b_base + gate_rows * stride_bn, mask=mask_n, other=0.0).to(tl.float32)
            up += tl.load(b_base + up_rows * stride_bn, mask=mask_n, other=0.0).to(tl.float32)
        h = experts_epilogue(gate, up, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT, ALPHA)
        tl.store(h_ptr + pair.to(tl.int64) * stride_hm + offs_n, h.to(h_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _experts_down_combine_kernel(
    h_ptr, idx_ptr, rw_ptr, d_ptr, db_ptr, out_ptr,
    I, K_OUT, NUM_EXPERTS, ROW_BLOCKS,
    stride_hm,
    stride_it, stride_ij,
    stride_rt, stride_rj,
    stride_de, stride_dn, stride_di,
    stride_dbe, stride_dbn,
    stride_om, stride_on,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    token = (tl.program_id(0) // ROW_BLOCKS).to(tl.int64)
    offs_n = (tl.program_id(0) % ROW_BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < K_OUT
    slot = tl.arange(0, SLOTS)
    expert = tl.load(idx_ptr + token * stride_it + slot * stride_ij, mask=slot < TOP_K, other=NUM_EXPERTS)
    real = expert < NUM_EXPERTS  # [SLOTS]: slots past TOP_K and sentinels read nothing
    expert = tl.where(real, expert, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    d_ptrs = (d_ptr + expert[:, None, None] * stride_de + offs_n.to(tl.int64)[None, :, None] * stride_dn
              + offs_k[None, None, :] * stride_di)  # [SLOTS, BLOCK_N, BLOCK_K]
    h_ptrs = h_ptr + (token * TOP_K + slot)[:, None] * stride_hm + offs_k[None, :]  # [SLOTS, BLOCK_K]
    mask_d = real[:, None, None] & mask_n[None, :, None]
    acc = tl.zeros((SLOTS, BLOCK_N, BLOCK_K), dtype=tl.float32)  # reduced over I once, after the loop
    for k in range(0, tl.cdiv(I, BLOCK_K)):
        mask_k = offs_k < I - k * BLOCK_K
        hv = tl.load(h_ptrs, mask=real[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        wd = tl.load(d_ptrs, mask=mask_d & mask_k[None, None, :], other=0.0).to(tl.float32)
        acc += wd * hv[:, None, :]
        h_ptrs += BLOCK_K
        d_ptrs += BLOCK_K * stride_di
    combine_slots(tl.sum(acc, axis=2), token, slot, expert, real, offs_n, mask_n, rw_ptr, db_ptr, out_ptr,
                  stride_rt, stride_rj, stride_dbe, stride_dbn, stride_om, stride_on, TOP_K, HAS_BIAS, BLOCK_N)


CAPABILITY = KernelCapability("experts_gemv", ops=("experts",), unit_stride_rows=True)


def can_run(x, gate_up, down, layout) -> bool:
    """Weights whose rows are contiguous along the reduction axis (K for gate_up, I for down):
    every layout but the transposed one, on any device Triton runs on, at any sizes."""
    return layout.gate_up_strides(gate_up)[2] == 1 and layout.down_strides(down)[2] == 1


def gated_launcher(gated_kernel, config: ExpertsConfig, epilogue: dict, layout, has_bias: bool, top_k: int):
    """A launcher `(x [T, K], top_k_index [T, TOP_K], gate_up, gate_up_bias or None) -> h
    [T * TOP_K, I]` (x's dtype, allocated) of a gated GEMV kernel taking `_experts_gated_gemv_kernel`'s
    arguments (`experts_gemv_transposed.py` passes its own): config.block_n columns of I and
    config.block_k steps along K per program, config.num_warps and num_stages."""
    gated = FastLaunch(gated_kernel, dict(
        TOP_K=top_k, GATE_STEP=1 if layout.concatenated else 2, HAS_BIAS=has_bias, **epilogue,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages))
    transposed, concatenated = layout.transposed, layout.concatenated

    def launch(x, top_k_index, gate_up, gate_up_bias):
        tokens, k = x.shape
        inter = gate_up.shape[1 + transposed] >> 1
        h = x.new_empty((tokens * top_k, inter))
        bias = gate_up if gate_up_bias is None else gate_up_bias  # not read without HAS_BIAS
        column_blocks = ceil_div(inter, config.block_n)
        gated(tokens * top_k * column_blocks, x.get_device(), x, top_k_index, gate_up, bias, h,
              k, inter, inter if concatenated else 1, gate_up.shape[0], column_blocks, *x.stride(),
              *top_k_index.stride(), *layout.gate_up_strides(gate_up), bias.stride(0), bias.stride(1), h.stride(0))
        return h

    return launch


def make_launcher(config: ExpertsConfig, epilogue: dict, layout, has_bias: bool, top_k: int):
    """A launcher `(x [T, K], top_k_index [T, TOP_K], top_k_weights [T, TOP_K], gate_up, down,
    gate_up_bias or None, down_bias or None, out [T, K_out]) -> out` for one (config, epilogue
    constexprs plus APPROX_TANH, `ExpertsLayout`, bias, TOP_K); arguments are checked by the caller
    (`experts.experts_forward`).

    config: block_n columns of I and block_k steps along K per gated program; down_block_n rows
    of K_out and down_block_k steps along I per down program (each step a [SLOTS, down_block_n,
    down_block_k] tile); num_warps (the gated kernel's) and down_num_warps (the down kernel's,
    None: num_warps); num_stages (the gated kernel's software pipelining); block_m and group_m
    are not used."""
    gated = gated_launcher(_experts_gated_gemv_kernel, config, epilogue, layout, has_bias, top_k)
    down_combine = FastLaunch(_experts_down_combine_kernel, dict(
        TOP_K=top_k, SLOTS=1 << (top_k - 1).bit_length(), HAS_BIAS=has_bias, BLOCK_N=config.down_block_n,
        BLOCK_K=config.down_block_k, num_warps=config.down_num_warps or config.num_warps, num_stages=1))

    def launch(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, out):
        h = gated(x, top_k_index, gate_up, gate_up_bias)
        k_out = out.shape[1]
        dbias = down if down_bias is None else down_bias  # not read without HAS_BIAS
        row_blocks = ceil_div(k_out, config.down_block_n)
        down_combine(x.shape[0] * row_blocks, x.get_device(), h, top_k_index, top_k_weights, down, dbias, out,
                     h.shape[1], k_out, down.shape[0], row_blocks, h.stride(0), *top_k_index.stride(),
                     *top_k_weights.stride(), *layout.down_strides(down), dbias.stride(0), dbias.stride(1),
                     *out.stride())
        return out

    return launch
