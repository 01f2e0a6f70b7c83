"""The experts block for many tokens (prefill): two grouped GEMMs over blocks of pairs sorted by expert.

The math and the weight layouts are `experts_reference.py`'s; the blocks are
`experts_routing.expert_blocks`' (sorted_pairs [capacity], block_expert [capacity / BLOCK_M]).
One program per (block, column tile), in grouped order (`jit_common.tile_pid`) so the blocks
of one expert walk its weight tiles together while they sit in L2:

- `_experts_gated_gemm_kernel`: rows are pairs p of one expert e; x[p // TOP_K] is gathered
  by index in the load (no permuted copy of x); two fp32 accumulators [BLOCK_M, BLOCK_N] run
  over K against e's gate and up columns, or, for interleaved pairs, one [BLOCK_M, 2 * BLOCK_N] accumulator over contiguous
  columns that is split into gate and up after the loop; bias, the epilogue in fp32, and
  h[p] [S, I] stored once in x's dtype; with STORE_PREACT (training's store mode) also the
  pre-activation [S, 2I] (bias added, in the model's gate/up column order) at row p.
- `_experts_down_gemm_kernel`: the same blocks; h[p] rows gathered; y[p] = w_p *
  (h[p] @ Wd[e]^T + bd[e]) in fp32, stored [S, K_out] in x's dtype at row p;
- `_experts_combine_kernel`: out[t] = sum_j y[t * TOP_K + j] over the slots in order, in fp32,
  rounded once: deterministic, and slots of expert-parallel sentinels (ids >= E, rows no
  block wrote) are skipped.

Padding rows (pair id S) and unused blocks (expert E) load nothing and store nothing.

A config with warp_specialized (warp_specialized_preact: for calls storing P) runs the gated GEMM
as `experts_gated_ws.py` (Gluon, Hopper) where that kernel can take the call (its `can_run`:
chunked 16-bit weights, no bias, no low-rank segment); one with down_warp_specialized the down GEMM
as `experts_down_ws.py` likewise.

With HAS_LOW_RANK (LoRA on the experts, `experts_low_rank_jit`), the gated and the down GEMM run
r more K steps after their main loop, x_lr[p] @ B[e]^T and h_lr[p] @ B_d[e]^T, before the bias
and the epilogue; x_lr and h_lr [S, r] come from `project` over the same blocks.

One kernel reads every layout: gate column i of expert e is at element e * stride_we +
(i * GATE_STEP) * stride_wn + k * stride_wk of gate_up, its up column at GATE_STEP * i + UP_SHIFT
(chunked: GATE_STEP 1, UP_SHIFT I; interleaved: 2, 1), and a transposed layout passes its
strides swapped (`ExpertsLayout.gate_up_strides`, `down_strides`).
dtypes: bf16, fp16 or fp32; fp32 dots use tf32 only where torch.backends.cuda.matmul.allow_tf32
says so.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import experts_down_ws, experts_gated_ws
from .configs import ExpertsConfig, KernelCapability, ceil_div
from .experts_jit import experts_epilogue
from .experts_low_rank_jit import _experts_project_kernel, low_rank_segment
from .experts_routing import expert_blocks
from .jit_common import tile_pid
from .launcher import FastLaunch


@triton.jit
def _experts_gated_gemm_kernel(
    x_ptr, pairs_ptr, blocks_ptr, w_ptr, b_ptr, h_ptr, p_ptr, lr_ptr, lb_ptr,
    NUM_PAIRS, NUM_BLOCKS, K, I, UP_SHIFT, NUM_EXPERTS, R,
    stride_xm, stride_xk,
    stride_we, stride_wn, stride_wk,
    stride_be, stride_bn,
    stride_hm, stride_pm,
    stride_lm, stride_lbe, stride_lbn, stride_lbr,
    TOP_K: tl.constexpr, GATE_STEP: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_PREACT: tl.constexpr,
    ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
    GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
    ALPHA: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_LOW_RANK: tl.constexpr = False, BLOCK_R: tl.constexpr = 16,
):
    pid_m, pid_n = tile_pid(tl.program_id(0), GROUP_M * tl.cdiv(I, BLOCK_N), NUM_BLOCKS, GROUP_M)
    expert = tl.load(blocks_ptr + pid_m)
    if expert < NUM_EXPERTS:
        # -- which pairs, tokens and weight columns this tile reads --
        pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = pairs < NUM_PAIRS
        tokens = (pairs // TOP_K).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        gate_cols = (offs_n * GATE_STEP).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        x_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
        if GATE_STEP == 2:
            # interleaved pairs: one [BLOCK_K, 2 * BLOCK_N] tile holds the tile's gate and up columns side by side
            pair_cols = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
            mask_pair = pair_cols < 2 * I
            w_ptrs = w_base + pair_cols.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                k_left = K - k * BLOCK_K
                xt = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
                wt = tl.load(w_ptrs, mask=mask_pair[None, :] & (offs_k[:, None] < k_left), other=0.0)
                acc = tl.dot(xt, wt, acc, input_precision=INPUT_PRECISION)
                x_ptrs += BLOCK_K * stride_xk
                w_ptrs += BLOCK_K * stride_wk
            if HAS_LOW_RANK:  # r more K steps: x_lr[p] @ B[e]^T
                acc = low_rank_segment(acc, lr_ptr, pairs.to(tl.int64), mask_m, stride_lm,
                                       lb_ptr + expert.to(tl.int64) * stride_lbe, stride_lbr, stride_lbn, pair_cols,
                                       mask_pair, R, BLOCK_R, INPUT_PRECISION)
            if HAS_BIAS:
                b_pair = tl.load(b_ptr + expert.to(tl.int64) * stride_be + pair_cols * stride_bn, mask=mask_pair,
                                 other=0.0).to(tl.float32)
                acc += b_pair[None, :]
            if STORE_PREACT:  # the pre-activation row of each pair, in the model's column order
                tl.store(p_ptr + pairs.to(tl.int64)[:, None] * stride_pm + pair_cols[None, :],
                         acc.to(p_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_pair[None, :])
            acc_gate, acc_up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        else:
            wg_ptrs = w_base + gate_cols[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
            wu_ptrs = wg_ptrs + UP_SHIFT * stride_wn
            # -- main loop: two fp32 accumulators over K --
            acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                k_left = K - k * BLOCK_K
                xt = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
                wg = tl.load(wg_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < k_left), other=0.0)
                wu = tl.load(wu_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < k_left), other=0.0)
                acc_gate = tl.dot(xt, wg, acc_gate, input_precision=INPUT_PRECISION)
                acc_up = tl.dot(xt, wu, acc_up, input_precision=INPUT_PRECISION)
                x_ptrs += BLOCK_K * stride_xk
                wg_ptrs += BLOCK_K * stride_wk
                wu_ptrs += BLOCK_K * stride_wk
            if HAS_LOW_RANK:  # r more K steps: x_lr[p] @ B[e]^T, on the gate and the up columns
                lb_base = lb_ptr + expert.to(tl.int64) * stride_lbe
                acc_gate = low_rank_segment(acc_gate, lr_ptr, pairs.to(tl.int64), mask_m, stride_lm, lb_base,
                                            stride_lbr, stride_lbn, gate_cols, mask_n, R, BLOCK_R, INPUT_PRECISION)
                acc_up = low_rank_segment(acc_up, lr_ptr, pairs.to(tl.int64), mask_m, stride_lm, lb_base, stride_lbr,
                                          stride_lbn, gate_cols + UP_SHIFT, mask_n, R, BLOCK_R, INPUT_PRECISION)
            # -- epilogue: bias, the gated math in fp32, one rounding, one store --
            if HAS_BIAS:
                b_base = b_ptr + expert.to(tl.int64) * stride_be
                acc_gate += tl.load(b_base + gate_cols * stride_bn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                acc_up += tl.load(b_base + (gate_cols + UP_SHIFT) * stride_bn, mask=mask_n,
                                  other=0.0).to(tl.float32)[None, :]
            if STORE_PREACT:  # the pre-activation row of each pair, in the model's column order
                p_ptrs = p_ptr + pairs.to(tl.int64)[:, None] * stride_pm + gate_cols[None, :]  # [BLOCK_M, BLOCK_N]
                p_mask = mask_m[:, None] & mask_n[None, :]
                tl.store(p_ptrs, acc_gate.to(p_ptr.dtype.element_ty), mask=p_mask)
                tl.store(p_ptrs + UP_SHIFT, acc_up.to(p_ptr.dtype.element_ty), mask=p_mask)
        h = experts_epilogue(acc_gate, acc_up, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT, ALPHA)
        h_ptrs = h_ptr + pairs.to(tl.int64)[:, None] * stride_hm + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _experts_down_gemm_kernel(
    h_ptr, pairs_ptr, blocks_ptr, rw_ptr, d_ptr, db_ptr, y_ptr, lr_ptr, lb_ptr,
    NUM_PAIRS, NUM_BLOCKS, K_OUT, I, NUM_EXPERTS, R,
    stride_hm,
    stride_rt, stride_rj,
    stride_de, stride_dn, stride_di,
    stride_dbe, stride_dbn,
    stride_ym,
    stride_lm, stride_lbe, stride_lbn, stride_lbr,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_LOW_RANK: tl.constexpr = False, BLOCK_R: tl.constexpr = 16,
):
    pid_m, pid_n = tile_pid(tl.program_id(0), GROUP_M * tl.cdiv(K_OUT, BLOCK_N), NUM_BLOCKS, GROUP_M)
    expert = tl.load(blocks_ptr + pid_m)
    if expert < NUM_EXPERTS:
        pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = pairs < NUM_PAIRS
        rows = pairs.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < K_OUT
        offs_k = tl.arange(0, BLOCK_K)
        d_base = d_ptr + expert.to(tl.int64) * stride_de
        h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        d_ptrs = d_base + offs_n[None, :] * stride_dn + offs_k[:, None] * stride_di  # [BLOCK_K, BLOCK_N]
        # -- main loop over I --
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(I, BLOCK_K)):
            k_left = I - k * BLOCK_K
            ht = tl.load(h_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            wd = tl.load(d_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < k_left), other=0.0)
            acc = tl.dot(ht, wd, acc, input_precision=INPUT_PRECISION)
            h_ptrs += BLOCK_K
            d_ptrs += BLOCK_K * stride_di
        if HAS_LOW_RANK:  # r more K steps: h_lr[p] @ B_d[e]^T
            acc = low_rank_segment(acc, lr_ptr, rows, mask_m, stride_lm, lb_ptr + expert.to(tl.int64) * stride_lbe,
                                   stride_lbr, stride_lbn, offs_n, mask_n, R, BLOCK_R, INPUT_PRECISION)
        # -- epilogue: bias and routing weight in fp32, one rounding, stored at the pair's row --
        if HAS_BIAS:
            acc += tl.load(db_ptr + expert.to(tl.int64) * stride_dbe + offs_n * stride_dbn, mask=mask_n,
                           other=0.0).to(tl.float32)[None, :]
        weight = tl.load(rw_ptr + (rows // TOP_K) * stride_rt + (rows % TOP_K) * stride_rj, mask=mask_m, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
        y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _experts_combine_kernel(
    y_ptr, idx_ptr, out_ptr, K_OUT, NUM_EXPERTS,
    stride_ym, stride_it, stride_ij, stride_om, stride_on,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    num_pid_n = tl.cdiv(K_OUT, BLOCK_N)
    token = (tl.program_id(0) // num_pid_n).to(tl.int64)
    offs_n = (tl.program_id(0) % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < K_OUT
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(TOP_K):  # slots in order: a fixed summation order
        expert = tl.load(idx_ptr + token * stride_it + j * stride_ij)
        width = tl.where(expert < NUM_EXPERTS, K_OUT, 0)  # a sentinel's row was never written: read none of it
        row = tl.load(y_ptr + (token * TOP_K + j) * stride_ym + offs_n, mask=offs_n < width, other=0.0)
        acc += row.to(tl.float32)
    tl.store(out_ptr + token * stride_om + offs_n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


COMBINE_BLOCK = 512


def _precision(dtype: torch.dtype) -> str:
    if dtype is not torch.float32:
        return "tf32"  # ignored by tl.dot for 16-bit operands
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


CAPABILITY = KernelCapability("experts_grouped", ops=("experts",), features=frozenset({"store_preact", "low_rank"}))


def can_run(*tensors) -> bool:
    """Every call the planner makes: any device Triton runs on, any strides, any sizes."""
    return True


def project_launchers(top_k: int, block_m: int, rank_block: int, by_token: bool, block_k: int = 64) -> dict:
    """`_experts_project_kernel` launchers per tl.dot precision ("tf32", "ieee")."""
    return {precision: FastLaunch(_experts_project_kernel, dict(
        TOP_K=top_k, BY_TOKEN=by_token, INPUT_PRECISION=precision, BLOCK_M=block_m, BLOCK_R=rank_block,
        BLOCK_K=block_k, num_warps=4)) for precision in ("tf32", "ieee")}


def project(launchers: dict, precision: str, src: torch.Tensor, sorted_pairs: torch.Tensor,
            block_expert: torch.Tensor, m: torch.Tensor, scale: float, out: torch.Tensor, num_pairs: int) -> None:
    """out[p] = scale * src[row(p)] @ m[e]^T for every routed pair p (`_experts_project_kernel`):
    src [T or S, n], m [E, r, n] any strides, out [S, r] with unit column stride."""
    launchers[precision](block_expert.shape[0], src.get_device(), src, sorted_pairs, block_expert, m, out,
                         num_pairs, src.shape[1], m.shape[1], m.shape[0], float(scale), *src.stride(), *m.stride(),
                         out.stride(0))


def make_launcher(config: ExpertsConfig, epilogue: dict, layout, has_bias: bool, top_k: int,
                  store_preact: bool = False, low_rank: tuple[int, int] = (0, 0)):
    """A launcher `(x [T, K], top_k_index [T, TOP_K], top_k_weights [T, TOP_K], gate_up, down,
    gate_up_bias or None, down_bias or None, out [T, K_out], preact [S, 2I] or None, lora=None) -> out` for one
    (config, epilogue constexprs plus APPROX_TANH, `ExpertsLayout`, bias, TOP_K, store_preact,
    low_rank): the routing prep (`experts_routing.expert_blocks`), both grouped GEMMs and the
    combine; with store_preact the gated GEMM also writes each pair's pre-activation (bias added, before the
    epilogue, rounded once to x's dtype) into preact's row p, in the model's gate/up column order
    (rows of sentinel pairs are not written). low_rank: the low-rank segment's BLOCK_R of the
    gate_up and the down GEMM (0: none); lora is then (gate_up_a [E, r, K], gate_up_b [E, 2I, r],
    gate_up_scale, down_a [E, r, I], down_b [E, K_out, r], down_scale, x_lr [S, r], h_lr [S, r'])
    (None for a projection without one), x_lr and h_lr written here (`experts_low_rank_jit`).
    Arguments are checked by the caller (`experts.experts_forward`,
    `experts_backward.experts_forward_with_preact`, `experts_low_rank.experts_low_rank_forward`)."""
    step = 1 if layout.concatenated else 2
    lr_gu, lr_d = low_rank
    tiles = dict(BLOCK_M=config.block_m, GROUP_M=config.group_m, num_warps=config.num_warps,
                 num_stages=config.num_stages)
    gated = {precision: FastLaunch(_experts_gated_gemm_kernel, dict(
        TOP_K=top_k, GATE_STEP=step, HAS_BIAS=has_bias, STORE_PREACT=store_preact, **epilogue, INPUT_PRECISION=precision,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, HAS_LOW_RANK=bool(lr_gu), BLOCK_R=lr_gu or 16, **tiles))
        for precision in ("tf32", "ieee")}
    down_kernel = {precision: FastLaunch(_experts_down_gemm_kernel, dict(
        TOP_K=top_k, HAS_BIAS=has_bias, INPUT_PRECISION=precision, BLOCK_N=config.down_block_n,
        BLOCK_K=config.down_block_k, HAS_LOW_RANK=bool(lr_d), BLOCK_R=lr_d or 16, **tiles))
        for precision in ("tf32", "ieee")}
    ws = config.warp_specialized_preact if store_preact else config.warp_specialized
    gated_ws = (experts_gated_ws.make_launcher(config, epilogue, top_k, store_preact)
                if ws and layout.concatenated and not (layout.transposed or has_bias or lr_gu) else None)
    down_ws = (experts_down_ws.make_launcher(config, top_k)
               if config.down_warp_specialized and not (has_bias or lr_d) else None)
    combine = FastLaunch(_experts_combine_kernel, dict(TOP_K=top_k, BLOCK_N=COMBINE_BLOCK, num_warps=4))
    project_x = project_launchers(top_k, config.block_m, lr_gu, True) if lr_gu else None
    project_h = project_launchers(top_k, config.block_m, lr_d, False) if lr_d else None

    def launch(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, out, preact=None, lora=None):
        t, k = x.shape
        num_pairs, num_experts = t * top_k, gate_up.shape[0]
        inter = gate_up.shape[1 + layout.transposed] >> 1
        k_out = out.shape[1]
        precision = _precision(x.dtype)
        sorted_pairs, block_expert = expert_blocks(top_k_index, num_experts, config.block_m)
        num_blocks = block_expert.shape[0]
        h = x.new_empty((num_pairs, inter))
        y = x.new_empty((num_pairs, k_out))
        bias = gate_up if gate_up_bias is None else gate_up_bias  # not read without HAS_BIAS
        dbias = down if down_bias is None else down_bias
        device = x.get_device()
        p = h if preact is None else preact  # not written without STORE_PREACT
        a_gu, b_gu, s_gu, a_d, b_d, s_d, x_lr, h_lr = lora if lora is not None else (None,) * 8
        if lr_gu:
            project(project_x, precision, x, sorted_pairs, block_expert, a_gu, s_gu, x_lr, num_pairs)
        lr_gu_args = (x_lr, b_gu, b_gu.shape[2]) if lr_gu else (x, x, 0)  # not read without HAS_LOW_RANK
        lr_gu_strides = (x_lr.stride(0), *b_gu.stride()) if lr_gu else (0, 0, 0, 0)
        if gated_ws is not None and experts_gated_ws.can_run(x, gate_up, layout, has_bias, bool(lr_gu), h, preact,
                                                             config):
            gated_ws(x, sorted_pairs, block_expert, gate_up, h, preact, num_experts)
        else:
            gated[precision](num_blocks * ceil_div(inter, config.block_n), device,
                             x, sorted_pairs, block_expert, gate_up, bias, h, p, *lr_gu_args[:2],
                             num_pairs, num_blocks, k, inter, inter if step == 1 else 1, num_experts, lr_gu_args[2],
                             *x.stride(), *layout.gate_up_strides(gate_up), bias.stride(0), bias.stride(1),
                             h.stride(0), p.stride(0), *lr_gu_strides)
        if lr_d:
            project(project_h, precision, h, sorted_pairs, block_expert, a_d, s_d, h_lr, num_pairs)
        lr_d_args = (h_lr, b_d, b_d.shape[2]) if lr_d else (h, h, 0)
        lr_d_strides = (h_lr.stride(0), *b_d.stride()) if lr_d else (0, 0, 0, 0)
        down_strides = layout.down_strides(down)
        if down_ws is not None and experts_down_ws.can_run(h, down, down_strides, y, has_bias, bool(lr_d), config):
            down_ws(h, sorted_pairs, block_expert, top_k_weights, down, down_strides, y, num_experts)
        else:
            down_kernel[precision](num_blocks * ceil_div(k_out, config.down_block_n), device,
                                   h, sorted_pairs, block_expert, top_k_weights, down, dbias, y, *lr_d_args[:2],
                                   num_pairs, num_blocks, k_out, inter, num_experts, lr_d_args[2], h.stride(0),
                                   *top_k_weights.stride(), *down_strides, dbias.stride(0), dbias.stride(1),
                                   y.stride(0), *lr_d_strides)
        combine(t * ceil_div(k_out, COMBINE_BLOCK), device, y, top_k_index, out, k_out, num_experts, y.stride(0),
                *top_k_index.stride(), *out.stride())
        return out

    return launch
