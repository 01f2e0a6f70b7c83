"""The experts block's backward: four grouped GEMMs over the forward's blocks of pairs sorted by expert.

The forward (`experts_reference.py`, pairs p = t * TOP_K + j of S = T * TOP_K, expert e = top_k_index[t, j],
w_p = top_k_weights[t, j]):

    P[p] = x[t] @ Wgu[e]^T + bgu[e]   [S, 2I], gate/up columns in the model's order (`ExpertsLayout`)
    h[p] = epilogue(gate(P[p]), up(P[p]))   rounded to x's dtype
    out[t] = sum_j w_p * (h[p] @ Wd[e]^T + bd[e])

Given dOut [T, K_out] and P (stored by the forward, or recomputed here by the forward's gated
kernel, `experts_gemm._experts_gated_gemm_kernel` with STORE_PREACT), on the blocks of
`experts_routing.expert_blocks`:

- `_experts_dh_kernel`, per (block, I tile): G = dOut[t] @ Wd[e] (fp32, over K_out; dOut rows
  gathered by token); its epilogue reads the tile's gate and up columns of P and writes
  dP[p] = d(sum dh * h)/dP with dh = w_p * G (`experts_epilogue_grad`), in P's column order and
  dtype, over P when dP is P (each program reads its P tile before it writes the same elements);
  hw[p] = w_p * h[p] [S, I] (for dWd); and the routing weight's gradient per column tile,
  dw_part[p, tile] = <G, h> (+ <dOut[t], bd[e]> in tile 0), fp32: dw = dw_part summed over
  tiles afterwards, in a fixed order (deterministic). A config with dh_warp_specialized runs it
  as `experts_dh_ws.py` (Gluon, Hopper) where that kernel can take the call (its `can_run`).
- `_experts_wgrad_kernel`, per (expert, output tile): out[e] = sum over e's blocks A^T @ B, rows
  gathered by pair or by token, fp32, rounded once; bias = sum over rows of A (times w_p if
  asked). dWd[e] = dOut^T @ hw with dbd[e] = sum w_p dOut[t]; dWgu[e] = dP^T @ x with
  dbgu[e] = sum dP. Written through the weight's own strides (any layout); an expert with no
  pairs gets zeros. A config with wgrad_warp_specialized runs both as `experts_wgrad_ws.py`
  (Gluon, Hopper: persistent, the next tile's loads and MMAs beside a tile's store) where that
  kernel can take the call (its `can_run`: no bias).
- `_experts_dx_kernel`, per (block, K tile): dx_pair[p] = dP[p] @ Wgu[e] [S, K], then the
  forward's fixed-order combine (`experts_gemm._experts_combine_kernel`): dx[t] = sum_j
  dx_pair[t * TOP_K + j], skipping slots of expert-parallel sentinels (ids >= E), which get
  no row, no gradient and dw = 0. A config with dx_warp_specialized runs the GEMM as
  `experts_dx_ws.py` (Gluon, Hopper) where that kernel can take the call (its `can_run`).

With LoRA on the experts (`make_launcher`'s low_rank), dH's G gains dout_lr[p] @ A_d[e] and dX's
rows dP_lr[p] @ A[e] as r more K steps (`experts_low_rank_jit.low_rank_segment`), and the
adapters' gradients are `_experts_wgrad_kernel` sums (`experts_low_rank.py` has the formulas).

Rounding: each stored value once, to x's dtype (dP, hw, dx rows, dx, the weight gradients),
dw to top_k_weights' dtype; all accumulation in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import experts_dh_ws, experts_dx_ws, experts_wgrad_ws
from .configs import KernelCapability, ceil_div
from .experts_backward_config import ExpertsBackwardConfig
from .experts_gemm import (COMBINE_BLOCK, _experts_combine_kernel, _experts_gated_gemm_kernel, _precision, project,
                           project_launchers)
from .experts_jit import experts_epilogue_grad
from .experts_low_rank_jit import low_rank_segment
from .experts_routing import expert_blocks
from .jit_common import tile_pid
from .launcher import FastLaunch


@triton.jit
def _experts_dh_kernel(
    dy_ptr, pairs_ptr, blocks_ptr, rw_ptr, d_ptr, db_ptr, p_ptr, dp_ptr, hw_ptr, dw_ptr, lr_ptr, la_ptr,
    NUM_PAIRS, NUM_BLOCKS, K_OUT, I, UP_SHIFT, NUM_EXPERTS, R,
    stride_dym, stride_dyk,
    stride_rt, stride_rj,
    stride_de, stride_dn, stride_di,
    stride_dbe, stride_dbn,
    stride_pm, stride_dpm, stride_hm, stride_dwm,
    stride_lm, stride_lae, stride_lar, stride_lai,
    TOP_K: tl.constexpr, GATE_STEP: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
    GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
    ALPHA: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_LOW_RANK: tl.constexpr = False, BLOCK_R: tl.constexpr = 16,
):
    pid_m, pid_n = tile_pid(tl.program_id(0), GROUP_M * tl.cdiv(I, BLOCK_N), NUM_BLOCKS, GROUP_M)
    expert = tl.load(blocks_ptr + pid_m)
    if expert < NUM_EXPERTS:
        pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = pairs < NUM_PAIRS
        rows = pairs.to(tl.int64)
        tokens = rows // TOP_K
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)
        dy_ptrs = dy_ptr + tokens[:, None] * stride_dym + offs_k[None, :] * stride_dyk  # [BLOCK_M, BLOCK_K]
        d_ptrs = (d_ptr + expert.to(tl.int64) * stride_de + offs_k[:, None] * stride_dn
                  + offs_n[None, :].to(tl.int64) * stride_di)  # [BLOCK_K, BLOCK_N]
        # -- main loop: G = dOut[t] @ Wd[e] over K_out, fp32 --
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K_OUT, BLOCK_K)):
            k_left = K_OUT - k * BLOCK_K
            dy = tl.load(dy_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            wd = tl.load(d_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
            acc = tl.dot(dy, wd, acc, input_precision=INPUT_PRECISION)
            dy_ptrs += BLOCK_K * stride_dyk
            d_ptrs += BLOCK_K * stride_dn
        # -- <dOut[t], bd[e]> for dw, in column tile 0 only, by a loop of its own: summed inside the main loop, from
        # the tile the dot reads, Triton 3.6's 4-stage Hopper build computes G wrong (docs/history.md) --
        bias_dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if HAS_BIAS:
            if pid_n == 0:
                dy_ptrs = dy_ptr + tokens[:, None] * stride_dym + offs_k[None, :] * stride_dyk
                db_ptrs = db_ptr + expert.to(tl.int64) * stride_dbe + offs_k * stride_dbn
                for k in range(0, tl.cdiv(K_OUT, BLOCK_K)):
                    k_left = K_OUT - k * BLOCK_K
                    dy = tl.load(dy_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
                    bd = tl.load(db_ptrs, mask=offs_k < k_left, other=0.0).to(tl.float32)
                    bias_dot += tl.sum(dy.to(tl.float32) * bd[None, :], 1)
                    dy_ptrs += BLOCK_K * stride_dyk
                    db_ptrs += BLOCK_K * stride_dbn
        if HAS_LOW_RANK:  # r more K steps: G += dout_lr[p] @ A_d[e] (dout_lr = s dOut[t] @ B_d[e])
            acc = low_rank_segment(acc, lr_ptr, rows, mask_m, stride_lm, la_ptr + expert.to(tl.int64) * stride_lae,
                                   stride_lar, stride_lai, offs_n, mask_n, R, BLOCK_R, INPUT_PRECISION)
        # -- epilogue: P's gate and up columns, h and the derivatives in fp32, one rounding per store --
        weight = tl.load(rw_ptr + tokens * stride_rt + (rows % TOP_K) * stride_rj, mask=mask_m, other=0.0)
        weight = weight.to(tl.float32)
        mask = mask_m[:, None] & mask_n[None, :]
        gate_cols = (offs_n * GATE_STEP).to(tl.int64)
        p_rows = p_ptr + rows[:, None] * stride_pm
        gate = tl.load(p_rows + gate_cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(p_rows + (gate_cols + UP_SHIFT)[None, :], mask=mask, other=0.0).to(tl.float32)
        h, dgate, dup = experts_epilogue_grad(gate, up, acc * weight[:, None], ACTIVATION, APPROX_TANH, GATE_SCALE,
                                              OUT_SCALE, CLAMP, LIMIT, ALPHA)
        dp_rows = dp_ptr + rows[:, None] * stride_dpm
        tl.store(dp_rows + gate_cols[None, :], dgate.to(dp_ptr.dtype.element_ty), mask=mask)
        tl.store(dp_rows + (gate_cols + UP_SHIFT)[None, :], dup.to(dp_ptr.dtype.element_ty), mask=mask)
        h = h.to(hw_ptr.dtype.element_ty).to(tl.float32)  # h as the forward rounded it
        hw_ptrs = hw_ptr + rows[:, None] * stride_hm + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
        tl.store(hw_ptrs, (h * weight[:, None]).to(hw_ptr.dtype.element_ty), mask=mask)
        # -- dw: this tile's part of <G, h>, tile 0 adding <dOut[t], bd[e]> --
        part = tl.sum(tl.where(mask, acc * h, 0.0), 1)
        if HAS_BIAS:
            part += tl.where(pid_n == 0, bias_dot, 0.0)
        tl.store(dw_ptr + rows * stride_dwm + pid_n, part, mask=mask_m)


@triton.jit
def _experts_wgrad_kernel(
    a_ptr, b_ptr, pairs_ptr, starts_ptr, ends_ptr, rw_ptr, out_ptr, bias_ptr,
    NUM_PAIRS, A_COLS, B_COLS,
    stride_am, stride_ak, stride_bm, stride_bk,
    stride_rt, stride_rj,
    stride_oe, stride_oa, stride_ob,
    stride_be, stride_bn,
    TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_WEIGHTED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, ROWS: tl.constexpr,
):
    tiles_a = tl.cdiv(A_COLS, BLOCK_A)
    tiles_b = tl.cdiv(B_COLS, BLOCK_B)
    pid = tl.program_id(0)
    expert = pid // (tiles_a * tiles_b)
    pid_a = (pid // tiles_b) % tiles_a
    pid_b = pid % tiles_b
    offs_a = pid_a * BLOCK_A + tl.arange(0, BLOCK_A)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_a = offs_a < A_COLS
    mask_b = offs_b < B_COLS
    first = tl.load(starts_ptr + expert)
    last = tl.load(ends_ptr + expert)
    # -- main loop over the expert's blocks: out += A[rows]^T @ B[rows], fp32 --
    acc = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
    bias = tl.zeros((BLOCK_A,), dtype=tl.float32)
    for step in range(first * (BLOCK_M // ROWS), last * (BLOCK_M // ROWS)):  # ROWS of a block per step
        pairs = tl.load(pairs_ptr + step * ROWS + tl.arange(0, ROWS))
        mask_m = pairs < NUM_PAIRS
        rows = pairs.to(tl.int64)
        a_rows = rows // TOP_K if A_BY_TOKEN else rows
        b_rows = rows // TOP_K if B_BY_TOKEN else rows
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_a[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_a[None, :], other=0.0)  # [ROWS, BLOCK_A]
        b = tl.load(b_ptr + b_rows[:, None] * stride_bm + offs_b[None, :] * stride_bk,
                    mask=mask_m[:, None] & mask_b[None, :], other=0.0)  # [ROWS, BLOCK_B]
        acc = tl.dot(tl.trans(a), b, acc, input_precision=INPUT_PRECISION)
        if HAS_BIAS:
            if BIAS_WEIGHTED:
                w = tl.load(rw_ptr + (rows // TOP_K) * stride_rt + (rows % TOP_K) * stride_rj, mask=mask_m, other=0.0)
                bias += tl.sum(a.to(tl.float32) * w.to(tl.float32)[:, None], 0)
            else:
                bias += tl.sum(a.to(tl.float32), 0)
    # -- one rounding, through the weight's own strides --
    out_ptrs = (out_ptr + expert.to(tl.int64) * stride_oe + offs_a[:, None].to(tl.int64) * stride_oa
                + offs_b[None, :].to(tl.int64) * stride_ob)  # [BLOCK_A, BLOCK_B]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_a[:, None] & mask_b[None, :])
    if HAS_BIAS:
        if pid_b == 0:
            tl.store(bias_ptr + expert.to(tl.int64) * stride_be + offs_a * stride_bn,
                     bias.to(bias_ptr.dtype.element_ty), mask=mask_a)


@triton.jit
def _experts_dx_kernel(
    dp_ptr, pairs_ptr, blocks_ptr, w_ptr, dx_ptr, lr_ptr, la_ptr,
    NUM_PAIRS, NUM_BLOCKS, K, N2, NUM_EXPERTS, R,
    stride_dpm, stride_we, stride_wn, stride_wk, stride_dxm,
    stride_lm, stride_lae, stride_lar, stride_lak,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_LOW_RANK: tl.constexpr = False, BLOCK_R: tl.constexpr = 16,
):
    pid_m, pid_n = tile_pid(tl.program_id(0), GROUP_M * tl.cdiv(K, BLOCK_N), NUM_BLOCKS, GROUP_M)
    expert = tl.load(blocks_ptr + pid_m)
    if expert < NUM_EXPERTS:
        pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = pairs < NUM_PAIRS
        rows = pairs.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < K
        offs_k = tl.arange(0, BLOCK_K)
        dp_ptrs = dp_ptr + rows[:, None] * stride_dpm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None].to(tl.int64) * stride_wn
                  + offs_n[None, :].to(tl.int64) * stride_wk)  # [BLOCK_K, BLOCK_N]
        # -- main loop over 2I: dx_pair = dP @ Wgu[e], fp32 --
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(N2, BLOCK_K)):
            k_left = N2 - k * BLOCK_K
            dp = tl.load(dp_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
            acc = tl.dot(dp, w, acc, input_precision=INPUT_PRECISION)
            dp_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wn
        if HAS_LOW_RANK:  # r more K steps: dx_pair += dP_lr[p] @ A[e] (dP_lr = s dP[p] @ B[e])
            acc = low_rank_segment(acc, lr_ptr, rows, mask_m, stride_lm, la_ptr + expert.to(tl.int64) * stride_lae,
                                   stride_lar, stride_lak, offs_n, mask_n, R, BLOCK_R, INPUT_PRECISION)
        dx_ptrs = dx_ptr + rows[:, None] * stride_dxm + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
        tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


CAPABILITY = KernelCapability("experts_backward_grouped", ops=("experts_backward",))


def can_run(*tensors) -> bool:
    """Every call the planner makes: any device Triton runs on, any strides, any sizes."""
    return True


def fit_wgrad_tile(rows: int, block_a: int, block_b: int, size: int, stages: int, budget: int) -> tuple[int, int]:
    """The weight-gradient kernels' output tile (a, b) for operands of `size` bytes: block_a x block_b
    halved along its longer side until min(2, stages) stages of its operand tiles (rows x (a + b)
    elements each) fit `budget` bytes of shared memory, or a side reaches 16."""
    a, b = block_a, block_b
    while rows * (a + b) * size * min(2, stages) > budget and max(a, b) > 16:
        a, b = (a // 2, b) if a >= b else (a, b // 2)
    return a, b


def tiles_of(wgrad_launcher: FastLaunch, a_cols: int, b_cols: int) -> int:
    """Output tiles per expert of a `_experts_wgrad_kernel` launcher over an a_cols x b_cols gradient."""
    tile = wgrad_launcher.constexprs
    return ceil_div(a_cols, tile["BLOCK_A"]) * ceil_div(b_cols, tile["BLOCK_B"])


def expert_ranges(block_expert: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first block, end block) [E] each of every expert in `block_expert` (nondecreasing, E for
    unused blocks): torch ops, no host synchronisation; an expert with no pairs gets first == end."""
    experts = torch.arange(num_experts, device=block_expert.device, dtype=block_expert.dtype)
    return torch.searchsorted(block_expert, experts), torch.searchsorted(block_expert, experts, right=True)


def make_launcher(config: ExpertsBackwardConfig, epilogue: dict, layout, has_bias: bool, top_k: int,
                  low_rank: tuple[int, int] = (0, 0)):
    """A launcher `(dout [T, K_out], x [T, K], top_k_index, top_k_weights [T, TOP_K], gate_up, down,
    gate_up_bias or None, down_bias or None, preact [S, 2I] or None, needs, lora=None, lora_needs=None)
    -> (dx, dgate_up, ddown, dgate_up_bias, ddown_bias, dweights)` for one (config, epilogue
    constexprs plus APPROX_TANH, `ExpertsLayout`, bias, TOP_K, low_rank). preact None recomputes P
    (the forward's gated kernel); a given preact is overwritten with dP. needs: six bools, which of
    the six gradients to compute (the others are None). The weight gradients are new contiguous
    tensors of the weights' shapes; dx is [T, K] and dweights [T, TOP_K] in top_k_weights' dtype.

    low_rank: BLOCK_R of the gate_up and the down adapters (0: none), as the forward's
    (`experts_gemm.make_launcher`); lora is then its (gate_up_a, gate_up_b, gate_up_scale, down_a,
    down_b, down_scale, x_lr, h_lr) with the x_lr and h_lr the forward wrote, lora_needs four bools
    (gate_up_a, gate_up_b, down_a, down_b), and the result gains their four gradients (None where
    not needed), [E, r, in] and [E, out, r] contiguous. Arguments are checked by the caller
    (`experts_backward.experts_backward`, `experts_low_rank.experts_low_rank_backward`)."""
    step = 1 if layout.concatenated else 2
    bm = config.block_m
    lr_gu, lr_d = low_rank

    budget = config.smem_budget_kib * 1024

    def variants(kernel, stage_elems: int, stages: int | None = None, **constexprs):
        """Launchers per (tl.dot precision, element size): `stages` (None: the config's num_stages)
        cut to fit the config's shared-memory budget where a stage of `stage_elems` elements would
        not (fp32 tiles)."""
        stages = config.num_stages if stages is None else stages
        return {(p, size): FastLaunch(kernel, dict(
            constexprs, INPUT_PRECISION=p, BLOCK_M=bm, num_warps=config.num_warps,
            num_stages=max(1, min(stages, budget // (stage_elems * size)))))
            for p in ("tf32", "ieee") for size in (2, 4)}

    def wgrad_variants(block_a: int, block_b: int, **constexprs):
        """`variants` of `_experts_wgrad_kernel` with output tile block_a x block_b, per element size
        as `fit_wgrad_tile` cuts it."""
        out = {}
        stages = config.num_stages if config.wgrad_num_stages is None else config.wgrad_num_stages
        rows = config.wgrad_rows or bm
        for size in (2, 4):
            a, b = fit_wgrad_tile(rows, block_a, block_b, size, stages, budget)
            for key, launcher in variants(_experts_wgrad_kernel, rows * (a + b), stages, BLOCK_A=a, BLOCK_B=b,
                                          ROWS=rows, **constexprs).items():
                if key[1] == size:
                    out[key] = launcher
        return out

    bk, bn = config.block_k, config.block_n
    recompute = variants(_experts_gated_gemm_kernel, bm * bk + 2 * bk * bn, TOP_K=top_k, GATE_STEP=step,
                         HAS_BIAS=has_bias, STORE_PREACT=True, **epilogue, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
                         HAS_LOW_RANK=bool(lr_gu), BLOCK_R=lr_gu or 16)
    dh = variants(_experts_dh_kernel, bm * bk + bk * bn, config.dh_num_stages, TOP_K=top_k, GATE_STEP=step,
                  HAS_BIAS=has_bias, **epilogue, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
                  HAS_LOW_RANK=bool(lr_d), BLOCK_R=lr_d or 16)
    dh_ws = experts_dh_ws.make_launcher(config, epilogue, top_k, step) if config.dh_warp_specialized else None
    ba, bb = config.wgrad_block_a, config.wgrad_block_b
    dwd = wgrad_variants(ba, bb, TOP_K=top_k, HAS_BIAS=has_bias, A_BY_TOKEN=True, B_BY_TOKEN=False, BIAS_WEIGHTED=True)
    dwgu = wgrad_variants(ba, bb, TOP_K=top_k, HAS_BIAS=has_bias, A_BY_TOKEN=False, B_BY_TOKEN=True,
                          BIAS_WEIGHTED=False)
    dwd_ws, dwgu_ws = ((experts_wgrad_ws.make_launcher(config, top_k, True, False),
                        experts_wgrad_ws.make_launcher(config, top_k, False, True))
                       if config.wgrad_warp_specialized else (None, None))
    dxn, dxk = config.dx_block_n, config.dx_block_k
    dx_kernel = variants(_experts_dx_kernel, bm * dxk + dxk * dxn, BLOCK_N=dxn, BLOCK_K=dxk, GROUP_M=config.group_m,
                         HAS_LOW_RANK=bool(lr_gu), BLOCK_R=lr_gu or 16)
    dx_ws = experts_dx_ws.make_launcher(config, top_k) if config.dx_warp_specialized else None
    combine = FastLaunch(_experts_combine_kernel, dict(TOP_K=top_k, BLOCK_N=COMBINE_BLOCK, num_warps=4))

    def lr_wgrad(block_a: int, block_b: int, a_by_token: bool, b_by_token: bool):
        return wgrad_variants(block_a, block_b, TOP_K=top_k, HAS_BIAS=False, A_BY_TOKEN=a_by_token,
                              B_BY_TOKEN=b_by_token, BIAS_WEIGHTED=False)

    if lr_gu:  # dA = dP_lr^T x, dB = dP^T x_lr; dP_lr = s dP @ B
        d_a_gu, d_b_gu = lr_wgrad(lr_gu, bb, False, True), lr_wgrad(ba, lr_gu, False, False)
        project_dp = project_launchers(top_k, bm, lr_gu, False)
    if lr_d:  # dA_d = dout_lr^T (w h), dB_d = dOut^T (w h_lr); dout_lr = s dOut @ B_d
        d_a_d, d_b_d = lr_wgrad(lr_d, bb, False, False), lr_wgrad(ba, lr_d, True, False)
        project_dy = project_launchers(top_k, bm, lr_d, True)

    def launch(dout, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, preact, needs, lora=None,
               lora_needs=None):
        need_x, need_gu, need_d, need_gub, need_db, need_w = needs
        a_gu, b_gu, s_gu, a_d, b_d, s_d, x_lr, h_lr = lora if lora is not None else (None,) * 8
        need_agu, need_bgu, need_ad, need_bd = lora_needs if lora_needs is not None else (False,) * 4
        t, k = x.shape
        num_pairs, num_experts = t * top_k, gate_up.shape[0]
        inter = gate_up.shape[1 + layout.transposed] >> 1
        k_out = dout.shape[1]
        precision = (_precision(x.dtype), x.element_size())
        device = x.get_device()
        up_shift = inter if step == 1 else 1
        sorted_pairs, block_expert = expert_blocks(top_k_index, num_experts, bm)
        num_blocks = block_expert.shape[0]
        gu_bias = gate_up if gate_up_bias is None else gate_up_bias  # not read without HAS_BIAS
        d_bias = down if down_bias is None else down_bias
        hw = x.new_empty((num_pairs, inter))
        if preact is None:  # recompute P (the forward's gated kernel; its h lands in hw, overwritten below)
            preact = x.new_empty((num_pairs, 2 * inter))
            lr_args = (x_lr, b_gu, b_gu.shape[2]) if lr_gu else (x, x, 0)
            lr_strides = (x_lr.stride(0), *b_gu.stride()) if lr_gu else (0, 0, 0, 0)
            recompute[precision](num_blocks * ceil_div(inter, config.block_n), device,
                                 x, sorted_pairs, block_expert, gate_up, gu_bias, hw, preact, *lr_args[:2],
                                 num_pairs, num_blocks, k, inter, up_shift, num_experts, lr_args[2], *x.stride(),
                                 *layout.gate_up_strides(gate_up), gu_bias.stride(0), gu_bias.stride(1),
                                 hw.stride(0), preact.stride(0), *lr_strides)
        dpre = preact  # dP is written over P
        dout_lr = None
        if lr_d:  # dout_lr[p] = s dOut[t] @ B_d[e], the low-rank part of G
            dout_lr = x.new_zeros((num_pairs, b_d.shape[2]))
            project(project_dy, precision[0], dout, sorted_pairs, block_expert, b_d.transpose(1, 2), s_d, dout_lr,
                    num_pairs)
        lr_args = (dout_lr, a_d, a_d.shape[1]) if lr_d else (dout, dout, 0)
        lr_strides = (dout_lr.stride(0), *a_d.stride()) if lr_d else (0, 0, 0, 0)
        down_strides = layout.down_strides(down)
        use_ws = dh_ws is not None and experts_dh_ws.can_run(dout, down, down_strides, inter, has_bias, bool(lr_d),
                                                              config)
        tiles_i = ceil_div(inter, experts_dh_ws.tile_n(config) if use_ws else config.block_n)
        dw_part = torch.zeros((num_pairs, tiles_i), dtype=torch.float32, device=x.device)
        if use_ws:
            dh_ws(dout, sorted_pairs, block_expert, top_k_weights, down, down_strides, preact, dpre, hw, dw_part,
                  num_experts, up_shift)
        else:
            dh[precision](num_blocks * tiles_i, device,
                          dout, sorted_pairs, block_expert, top_k_weights, down, d_bias, preact, dpre, hw, dw_part,
                          *lr_args[:2], num_pairs, num_blocks, k_out, inter, up_shift, num_experts, lr_args[2],
                          *dout.stride(), *top_k_weights.stride(), *down_strides, d_bias.stride(0),
                          d_bias.stride(1), preact.stride(0), dpre.stride(0), hw.stride(0), dw_part.stride(0),
                          *lr_strides)
        dweights = dw_part.sum(1).view(t, top_k).to(top_k_weights.dtype) if need_w else None
        del dw_part
        dx = dgate_up = ddown = dgate_up_bias = ddown_bias = None
        grads_lr = [None] * 4
        starts, ends = expert_ranges(block_expert, num_experts)

        def lr_grad(kernels, a, b, out):  # out[e] = sum over e's pairs a[row]^T b[row]
            kernels[precision](num_experts * tiles_of(kernels[precision], a.shape[1], b.shape[1]), device,
                               a, b, sorted_pairs, starts, ends, top_k_weights, out, out, num_pairs, a.shape[1],
                               b.shape[1], *a.stride(), *b.stride(), *top_k_weights.stride(), *out.stride(), 0, 0)
            return out

        if need_d or need_db:
            ddown = torch.empty_like(down, memory_format=torch.contiguous_format)
            ddown_bias = x.new_empty((num_experts, k_out)) if has_bias else None
            db = ddown if ddown_bias is None else ddown_bias
            out_strides = layout.down_strides(ddown)
            if dwd_ws is not None and experts_wgrad_ws.can_run(dout, hw, ddown, out_strides, has_bias):
                dwd_ws(dout, hw, sorted_pairs, starts, ends, ddown, out_strides, num_pairs, num_experts)
            else:
                dwd[precision](num_experts * tiles_of(dwd[precision], k_out, inter), device,
                               dout, hw, sorted_pairs, starts, ends, top_k_weights, ddown, db,
                               num_pairs, k_out, inter, *dout.stride(), *hw.stride(), *top_k_weights.stride(),
                               *out_strides, db.stride(0), db.stride(1))
        if lr_d and need_ad:
            grads_lr[2] = lr_grad(d_a_d, dout_lr, hw, x.new_empty(a_d.shape))
        if lr_d and need_bd:
            h_lr_w = (h_lr.float() * top_k_weights.reshape(-1, 1).float()).to(x.dtype)
            grads_lr[3] = lr_grad(d_b_d, dout, h_lr_w, x.new_empty(b_d.shape))
        del hw, dout_lr
        if need_gu or need_gub:
            dgate_up = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
            dgate_up_bias = x.new_empty((num_experts, 2 * inter)) if has_bias else None
            db = dgate_up if dgate_up_bias is None else dgate_up_bias
            out_strides = layout.gate_up_strides(dgate_up)
            if dwgu_ws is not None and experts_wgrad_ws.can_run(dpre, x, dgate_up, out_strides, has_bias):
                dwgu_ws(dpre, x, sorted_pairs, starts, ends, dgate_up, out_strides, num_pairs, num_experts)
            else:
                dwgu[precision](num_experts * tiles_of(dwgu[precision], 2 * inter, k), device,
                                dpre, x, sorted_pairs, starts, ends, top_k_weights, dgate_up, db,
                                num_pairs, 2 * inter, k, *dpre.stride(), *x.stride(), *top_k_weights.stride(),
                                *out_strides, db.stride(0), db.stride(1))
        dp_lr = None
        if lr_gu and (need_x or need_agu):  # dP_lr[p] = s dP[p] @ B[e]
            dp_lr = x.new_zeros((num_pairs, b_gu.shape[2]))
            project(project_dp, precision[0], dpre, sorted_pairs, block_expert, b_gu.transpose(1, 2), s_gu, dp_lr,
                    num_pairs)
        if lr_gu and need_agu:
            grads_lr[0] = lr_grad(d_a_gu, dp_lr, x, x.new_empty(a_gu.shape))
        if lr_gu and need_bgu:
            grads_lr[1] = lr_grad(d_b_gu, dpre, x_lr, x.new_empty(b_gu.shape))
        if need_x:
            dx_pairs = x.new_empty((num_pairs, k))
            gs = layout.gate_up_strides(gate_up)  # (expert, 2I-axis, K-axis)
            if dx_ws is not None and experts_dx_ws.can_run(dpre, gate_up, gs, dx_pairs, bool(lr_gu), config):
                dx_ws(dpre, sorted_pairs, block_expert, gate_up, gs, dx_pairs, num_experts)
            else:
                lr_args = (dp_lr, a_gu, a_gu.shape[1]) if lr_gu else (dpre, dpre, 0)
                lr_strides = (dp_lr.stride(0), *a_gu.stride()) if lr_gu else (0, 0, 0, 0)
                dx_kernel[precision](num_blocks * ceil_div(k, config.dx_block_n), device,
                                     dpre, sorted_pairs, block_expert, gate_up, dx_pairs, *lr_args[:2],
                                     num_pairs, num_blocks, k, 2 * inter, num_experts, lr_args[2],
                                     dpre.stride(0), gs[0], gs[1], gs[2], dx_pairs.stride(0), *lr_strides)
            dx = x.new_empty((t, k))
            combine(t * ceil_div(k, COMBINE_BLOCK), device, dx_pairs, top_k_index, dx, k, num_experts,
                    dx_pairs.stride(0), *top_k_index.stride(), *dx.stride())
        grads = (dx, dgate_up if need_gu else None, ddown if need_d else None,
                 dgate_up_bias if need_gub else None, ddown_bias if need_db else None, dweights)
        return grads if lora is None else grads + tuple(grads_lr)

    return launch
