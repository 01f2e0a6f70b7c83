"""The experts GEMV path for transposed weights (gpt-oss): gate_up [E, K, 2I] and down [E, I, K_out],
whose unit stride runs along the output axis, in three launches and two allocations (the grouped
path: four and six), for eager decode calls (`rules.EXPERTS_RULES`).

`experts_gemv.py` reads each weight row along its reduction axis; here each step reads a
[BLOCK_K, columns] tile whose rows are contiguous along the output columns, and the reduction
over K (or I) is one sum after the loop, as there.

- `_experts_gated_gemv_t_kernel`, one program per (pair p = t * TOP_K + j, BLOCK_N columns of I):
  interleaved pairs (gpt-oss: gate at column 2i, up at 2i + 1) are read as one [BLOCK_K,
  2 * BLOCK_N] tile of contiguous columns and split into gate and up after the loop; chunked
  [gate; up] as two [BLOCK_K, BLOCK_N] tiles, I columns apart. fp32 accumulators times x[t],
  reduced over K once; then the bias, the epilogue in fp32 and h[p] rounded once to x's dtype.
  A sentinel pair (e >= E) stores nothing.
- `_experts_down_t_partial_kernel`, one program per (token t, BLOCK_N columns of K_out, split of
  SPLIT_I rows of I): every slot at once, one fp32 [SLOTS, BLOCK_K, BLOCK_N] tile of Wd[e_j]'s
  rows (contiguous along K_out) times h[t * TOP_K + j], reduced over I once; the [SLOTS, BLOCK_N]
  sums go to an fp32 buffer [splits, T * TOP_K, K_out]. Columns of a row are what one load reads
  contiguously, so the tile is wide in K_out and few programs would cover K_out: the split along I
  gives the read its parallelism (`config.down_split_i`).
- `_experts_down_t_combine_kernel`, one program per (token, BLOCK_N columns): the splits summed
  (SPLIT_CHUNK of them per load, the chunks in order), then `experts_jit.combine_slots` (bias,
  routing weight, each slot's y rounded, the slots summed in order, rounded once): the chunked
  GEMV's numerics, deterministic.

The numerics are `experts_gemv.py`'s (`experts_reference.py`: fp32 accumulation, h rounded
once, each slot's y rounded as the grouped kernels round it, the slots summed in order in fp32).
Biases, every epilogue, any dtype the interpreter or the GPU takes, any strides of x, the
routing tensors and out; plain inference calls only (`CAPABILITY`), as `experts_gemv.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import ExpertsConfig, KernelCapability
from .configs import ceil_div
from .experts_gemv import gated_launcher
from .experts_jit import combine_slots, experts_epilogue
from .launcher import FastLaunch


@triton.jit
def _experts_gated_gemv_t_kernel(
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
        first = (tl.program_id(0) % COLUMN_BLOCKS) * BLOCK_N
        offs_n = first + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert * stride_we + offs_k[:, None].to(tl.int64) * stride_wk
        x_ptrs = x_ptr + token.to(tl.int64) * stride_xm + offs_k * stride_xk
        if GATE_STEP == 2:  # interleaved pairs: 2 * BLOCK_N contiguous columns, split after the loop
            offs_c = 2 * first + tl.arange(0, 2 * BLOCK_N)
            w_ptrs = w_base + offs_c[None, :] * stride_wn
            mask_c = offs_c < 2 * I
            acc = tl.zeros((BLOCK_K, 2 * BLOCK_N), dtype=tl.float32)  # reduced over K once, after the loop
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                mask_k = offs_k < K - k * BLOCK_K
                xk = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)[:, None]
                acc += tl.load(w_ptrs, mask=mask_k[:, None] & mask_c[None, :], other=0.0).to(tl.float32) * xk
                w_ptrs += BLOCK_K * stride_wk
                x_ptrs += BLOCK_K * stride_xk
            gate, up = tl.split(tl.reshape(tl.sum(acc, axis=0), (BLOCK_N, 2)))
        else:  # chunked: gate columns n, up columns UP_SHIFT + n
            g_ptrs = w_base + offs_n[None, :] * stride_wn
            u_ptrs = w_base + (offs_n + UP_SHIFT).to(tl.int64)[None, :] * stride_wn
            acc_gate = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                mask_k = offs_k < K - k * BLOCK_K
                xk = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)[:, None]
                mask = mask_k[:, None] & mask_n[None, :]
                acc_gate += tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32) * xk
                acc_up += tl.load(u_ptrs, mask=mask, other=0.0).to(tl.float32) * xk
                g_ptrs += BLOCK_K * stride_wk
                u_ptrs += BLOCK_K * stride_wk
                x_ptrs += BLOCK_K * stride_xk
            gate = tl.sum(acc_gate, axis=0)
            up = tl.sum(acc_up, axis=0)
        if HAS_BIAS:
            gate_cols = (offs_n * GATE_STEP).to(tl.int64)
            b_base = b_ptr + expert * stride_be
            gate += tl.load(b_base + gate_cols * stride_bn, mask=mask_n, other=0.0).to(tl.float32)
            up += tl.load(b_base + (gate_cols + UP_SHIFT) * stride_bn, mask=mask_n, other=0.0).to(tl.float32)
        h = experts_epilogue(gate, up, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT, ALPHA)
        tl.store(h_ptr + pair.to(tl.int64) * stride_hm + offs_n, h.to(h_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _experts_down_t_partial_kernel(
    h_ptr, idx_ptr, d_ptr, part_ptr,
    I, K_OUT, NUM_EXPERTS, ROW_BLOCKS, SPLITS, SPLIT_I, PAIRS,
    stride_hm,
    stride_it, stride_ij,
    stride_de, stride_dn, stride_di,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    split = tl.program_id(0) % SPLITS
    rest = tl.program_id(0) // SPLITS
    token = (rest // ROW_BLOCKS).to(tl.int64)
    offs_n = (rest % ROW_BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < K_OUT
    slot = tl.arange(0, SLOTS)
    expert = tl.load(idx_ptr + token * stride_it + slot * stride_ij, mask=slot < TOP_K, other=NUM_EXPERTS)
    real = expert < NUM_EXPERTS  # [SLOTS]: slots past TOP_K and sentinels read nothing
    expert = tl.where(real, expert, 0).to(tl.int64)
    first = split * SPLIT_I
    offs_k = tl.arange(0, BLOCK_K)
    d_ptrs = (d_ptr + expert[:, None, None] * stride_de + (first + offs_k).to(tl.int64)[None, :, None] * stride_di
              + offs_n[None, None, :] * stride_dn)  # [SLOTS, BLOCK_K, BLOCK_N]
    h_ptrs = h_ptr + (token * TOP_K + slot)[:, None] * stride_hm + (first + offs_k)[None, :]  # [SLOTS, BLOCK_K]
    mask_d = real[:, None, None] & mask_n[None, None, :]
    acc = tl.zeros((SLOTS, BLOCK_K, BLOCK_N), dtype=tl.float32)  # reduced over I once, after the loop
    for k in range(0, tl.cdiv(SPLIT_I, BLOCK_K)):
        mask_k = offs_k < tl.minimum(I - first, SPLIT_I) - k * BLOCK_K
        hv = tl.load(h_ptrs, mask=real[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        wd = tl.load(d_ptrs, mask=mask_d & mask_k[None, :, None], other=0.0).to(tl.float32)
        acc += wd * hv[:, :, None]
        h_ptrs += BLOCK_K
        d_ptrs += BLOCK_K * stride_di
    rows = split * PAIRS + token * TOP_K + slot  # [SLOTS] rows of the [splits * T * TOP_K, K_out] buffer
    tl.store(part_ptr + rows[:, None] * K_OUT + offs_n[None, :], tl.sum(acc, axis=1),
             mask=(slot < TOP_K)[:, None] & mask_n[None, :])


@triton.jit
def _experts_down_t_combine_kernel(
    part_ptr, idx_ptr, rw_ptr, db_ptr, out_ptr,
    K_OUT, NUM_EXPERTS, ROW_BLOCKS, SPLITS, PAIRS,
    stride_it, stride_ij,
    stride_rt, stride_rj,
    stride_dbe, stride_dbn,
    stride_om, stride_on,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
):
    token = (tl.program_id(0) // ROW_BLOCKS).to(tl.int64)
    offs_n = (tl.program_id(0) % ROW_BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < K_OUT
    slot = tl.arange(0, SLOTS)
    expert = tl.load(idx_ptr + token * stride_it + slot * stride_ij, mask=slot < TOP_K, other=NUM_EXPERTS)
    real = expert < NUM_EXPERTS
    expert = tl.where(real, expert, 0).to(tl.int64)
    split = tl.arange(0, SPLIT_CHUNK)
    part_ptrs = (part_ptr + (split[:, None, None] * PAIRS + token * TOP_K + slot[None, :, None]) * K_OUT
                 + offs_n[None, None, :])  # [SPLIT_CHUNK, SLOTS, BLOCK_N]
    mask = real[None, :, None] & mask_n[None, None, :]
    part = tl.zeros((SLOTS, BLOCK_N), dtype=tl.float32)
    for first in range(0, SPLITS, SPLIT_CHUNK):  # SPLIT_CHUNK splits a load, the chunks in order: a fixed order
        part += tl.sum(tl.load(part_ptrs, mask=mask & (split < SPLITS - first)[:, None, None], other=0.0), axis=0)
        part_ptrs += SPLIT_CHUNK * PAIRS * K_OUT
    combine_slots(part, token, slot, expert, real, offs_n, mask_n, rw_ptr, db_ptr, out_ptr,
                  stride_rt, stride_rj, stride_dbe, stride_dbn, stride_om, stride_on, TOP_K, HAS_BIAS, BLOCK_N)


COMBINE_BLOCK_N = 64  # columns per combine program, which loads COMBINE_SPLITS splits of them at once
COMBINE_SPLITS = 8


CAPABILITY = KernelCapability("experts_gemv_transposed", ops=("experts",), unit_stride_columns=True)


def can_run(x, gate_up, down, layout) -> bool:
    """Weights whose rows are contiguous along the output axis (2I for gate_up, K_out for down):
    the transposed layout with unit-stride columns, on any device Triton runs on, at any sizes."""
    return layout.transposed and layout.gate_up_strides(gate_up)[1] == 1 and layout.down_strides(down)[1] == 1


def make_launcher(config: ExpertsConfig, epilogue: dict, layout, has_bias: bool, top_k: int):
    """A launcher `(x [T, K], top_k_index [T, TOP_K], top_k_weights [T, TOP_K], gate_up, down,
    gate_up_bias or None, down_bias or None, out [T, K_out]) -> out`, as `experts_gemv.make_launcher`'s,
    of three launches: the gated GEMV (config.block_n columns of I, config.block_k steps along K,
    num_warps), the down partial sums (config.down_block_n columns of K_out, down_block_k steps
    along I, config.down_split_i rows of I per program, down_num_warps) and their combine. It
    allocates h and the fp32 buffer of partial sums, [ceil(I / down_split_i), T * TOP_K, K_out]."""
    gated = gated_launcher(_experts_gated_gemv_t_kernel, config, epilogue, layout, has_bias, top_k)
    slots = 1 << (top_k - 1).bit_length()
    down_warps = config.down_num_warps or config.num_warps
    partial = FastLaunch(_experts_down_t_partial_kernel, dict(
        TOP_K=top_k, SLOTS=slots, BLOCK_N=config.down_block_n, BLOCK_K=config.down_block_k, num_warps=down_warps,
        num_stages=1))
    combine = FastLaunch(_experts_down_t_combine_kernel, dict(
        TOP_K=top_k, SLOTS=slots, HAS_BIAS=has_bias, BLOCK_N=COMBINE_BLOCK_N, SPLIT_CHUNK=COMBINE_SPLITS, num_warps=4,
        num_stages=1))

    def launch(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, out):
        h = gated(x, top_k_index, gate_up, gate_up_bias)
        tokens, device = x.shape[0], x.get_device()
        pairs, inter = h.shape
        k_out = out.shape[1]
        split_i = inter if config.down_split_i is None else config.down_split_i
        splits = ceil_div(inter, split_i)
        part = h.new_empty((splits * pairs, k_out), dtype=torch.float32)
        row_blocks = ceil_div(k_out, config.down_block_n)
        partial(tokens * row_blocks * splits, device, h, top_k_index, down, part, inter, k_out, down.shape[0],
                row_blocks, splits, split_i, pairs, h.stride(0), *top_k_index.stride(), *layout.down_strides(down))
        dbias = down if down_bias is None else down_bias  # not read without HAS_BIAS
        combine_blocks = ceil_div(k_out, COMBINE_BLOCK_N)
        combine(tokens * combine_blocks, device, part, top_k_index, top_k_weights, dbias, out, k_out, down.shape[0],
                combine_blocks, splits, pairs, *top_k_index.stride(), *top_k_weights.stride(), dbias.stride(0),
                dbias.stride(1), *out.stride())
        return out

    return launch
