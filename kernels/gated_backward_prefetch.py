"""The persistent backward GEMM of the gated MLP whose P read overlaps its matrix work (Hopper).

Computes what `gated_backward_pointer.py` computes (its docstring has the math, the layout of
P and dP, dtypes and rounding): dH = dY @ Wd in fp32 registers, then h and the interleaved
dP = (dH * dh/dgate, dH * dh/dup) from the matching tile of P. Its epilogue is organised so
that its memory traffic does not stall the MMAs:

- dY [M, K] and Wd [K, I] are read through TMA descriptors built on the device: per K step one
  [BLOCK_SIZE_M, BLOCK_SIZE_K] box of dY and one [BLOCK_SIZE_K, BLOCK_SIZE_N] box of Wd into
  one fp32 accumulator [BLOCK_SIZE_M, BLOCK_SIZE_N] of dH.
- the tile's gate and up columns of P are loaded, in four [BLOCK_SIZE_M, BLOCK_SIZE_N / 4]
  slices each (16-bit), with plain loads issued *before* the tile's main loop: the loads are
  asynchronous, so they land in registers while the MMAs run, and the epilogue finds them there
  (the TMA kernel reads its P box after the main loop and waits for it). Rows and columns past
  the edge are clamped to the tile's last ones (in bounds, never stored), so no mask is live
  across the main loop.
- the epilogue runs slice by slice. The derivatives are linear in dH: they are taken per unit
  dH from P alone (in the loads' register layout), then multiplied by dH, which leaves 4 layout
  conversions (through shared memory) per slice between the accumulator's layout and the
  loads', against 5 for the derivative taken with dH inside. A non-finite dH gives NaN where a
  clamp clips (0 * inf) instead of 0.
- h and dP are written with plain stores, which need no shared-memory staging and no wait: the
  next tile's main loop starts while they drain. With no epilogue staging, the pipeline may
  take more stages than the TMA kernel's.
- persistent programs (`config.programs_per_sm` per SM) walk the tiles in grouped order.
- dP may be P itself: each tile's P is read before its dP is written, and no other program
  touches that tile.
- HAS_DH_IN: a further gradient of h, dh_in [M, I] (any strides), is added to the fp32 dH tile
  before the derivative.

Gate column i of P sits at i + 16 * (i // 16), its up column 16 later (I % 16 == 0: whole
blocks). Needs 16-bit dtypes and TMA-aligned dY and Wd (`can_run`); P, dP and h need unit
inner strides (plain loads and stores with any row stride).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import TMA_DTYPES, GatedGemmConfig, KernelCapability
from .device import num_sms, tma_operands_ok
from .jit_common import gated_epilogue_grad, tile_pid
from .launcher import FastLaunch
from .layout import GATE_UP_BLOCK


@triton.jit
def _p_part(p_ptr, stride_pm, rows, cols, M, I, GATE_UP_BLOCK: tl.constexpr):
    """P's gate and up columns for output columns `cols` of rows `rows`, unmasked: rows and
    columns past the edge read the tile's own last row or column (in bounds, never stored), so
    no mask stays live in registers across the main loop."""
    rows_in = tl.minimum(rows, M - 1).to(tl.int64)
    cols_in = tl.minimum(cols, I - 1)
    p_ptrs = p_ptr + rows_in[:, None] * stride_pm + (cols_in + (cols_in // GATE_UP_BLOCK) * GATE_UP_BLOCK)[None, :]
    return tl.load(p_ptrs), tl.load(p_ptrs + GATE_UP_BLOCK)


@triton.jit
def _epilogue_part(dh, gate, up, dp_ptr, h_ptr, dh_ptr, stride_dpm, stride_hm, stride_dhm, stride_dhi, M, I, rows, cols,
                   HAS_DH_IN: tl.constexpr, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
                   GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
                   GATE_UP_BLOCK: tl.constexpr):
    """dH [BM, Q] of output columns `cols` (plus dh_in there), with P's gate and up there ->
    h and dP, by plain masked stores."""
    rows = rows.to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < I)
    if HAS_DH_IN:
        dh += tl.load(dh_ptr + rows[:, None] * stride_dhm + cols[None, :] * stride_dhi, mask=mask,
                      other=0.0).to(tl.float32)
    # the derivatives are linear in dH: take them per unit dH from P alone, then scale by dH
    ones = tl.full(gate.shape, 1.0, tl.float32)
    h, dgate, dup = gated_epilogue_grad(gate.to(tl.float32), up.to(tl.float32), ones, ACTIVATION, APPROX_TANH,
                                        GATE_SCALE, OUT_SCALE, CLAMP, LIMIT)
    dgate = dgate * dh
    dup = dup * dh
    dp_ptrs = dp_ptr + rows[:, None] * stride_dpm + (cols + (cols // GATE_UP_BLOCK) * GATE_UP_BLOCK)[None, :]
    tl.store(dp_ptrs, dgate.to(dp_ptr.dtype.element_ty), mask=mask)
    tl.store(dp_ptrs + GATE_UP_BLOCK, dup.to(dp_ptr.dtype.element_ty), mask=mask)
    tl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_backward_prefetch_kernel(
    dy_ptr, wd_ptr, p_ptr, dp_ptr, h_ptr, dh_ptr, M, I, K,
    stride_dym, stride_wdk, stride_pm, stride_dpm, stride_hm, stride_dhm, stride_dhi,
    HAS_DH_IN: tl.constexpr, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
    GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    Q: tl.constexpr = BLOCK_SIZE_N // 4
    dy_desc = tl.make_tensor_descriptor(dy_ptr, [M, K], [stride_dym, 1], [BLOCK_SIZE_M, BLOCK_SIZE_K])
    wd_desc = tl.make_tensor_descriptor(wd_ptr, [K, I], [stride_wdk, 1], [BLOCK_SIZE_K, BLOCK_SIZE_N])
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(I, BLOCK_SIZE_N)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_SIZE_K)

    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = tile_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
        offs_m = pid_m * BLOCK_SIZE_M
        offs_n = pid_n * BLOCK_SIZE_N
        rows = offs_m + tl.arange(0, BLOCK_SIZE_M)
        cols0 = offs_n + tl.arange(0, Q)

        # -- P's gate and up columns of the tile, in four quarters of Q output columns
        # ([BLOCK_SIZE_M, Q] each), issued before the main loop: the loads are asynchronous and
        # land while the MMAs run --
        gate0, up0 = _p_part(p_ptr, stride_pm, rows, cols0, M, I, GATE_UP_BLOCK)
        gate1, up1 = _p_part(p_ptr, stride_pm, rows, cols0 + Q, M, I, GATE_UP_BLOCK)
        gate2, up2 = _p_part(p_ptr, stride_pm, rows, cols0 + 2 * Q, M, I, GATE_UP_BLOCK)
        gate3, up3 = _p_part(p_ptr, stride_pm, rows, cols0 + 3 * Q, M, I, GATE_UP_BLOCK)

        # -- main loop: dH = dY @ Wd, fp32 --
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for ki in range(0, k_tiles):
            dy = dy_desc.load([offs_m, ki * BLOCK_SIZE_K])  # [BLOCK_SIZE_M, BLOCK_SIZE_K]
            wd = wd_desc.load([ki * BLOCK_SIZE_K, offs_n])  # [BLOCK_SIZE_K, BLOCK_SIZE_N]
            acc = tl.dot(dy, wd, acc)

        # -- epilogue, in quarters of output columns: plain stores (no staging, no wait) --
        dh_lo, dh_hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_SIZE_M, 2, 2 * Q)), (0, 2, 1)))
        dh0, dh1 = tl.split(tl.permute(tl.reshape(dh_lo, (BLOCK_SIZE_M, 2, Q)), (0, 2, 1)))
        dh2, dh3 = tl.split(tl.permute(tl.reshape(dh_hi, (BLOCK_SIZE_M, 2, Q)), (0, 2, 1)))
        _epilogue_part(dh0, gate0, up0, dp_ptr, h_ptr, dh_ptr, stride_dpm, stride_hm, stride_dhm, stride_dhi,
                       M, I, rows, cols0, HAS_DH_IN, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT,
                       GATE_UP_BLOCK)
        _epilogue_part(dh1, gate1, up1, dp_ptr, h_ptr, dh_ptr, stride_dpm, stride_hm, stride_dhm, stride_dhi,
                       M, I, rows, cols0 + Q, HAS_DH_IN, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP,
                       LIMIT, GATE_UP_BLOCK)
        _epilogue_part(dh2, gate2, up2, dp_ptr, h_ptr, dh_ptr, stride_dpm, stride_hm, stride_dhm, stride_dhi,
                       M, I, rows, cols0 + 2 * Q, HAS_DH_IN, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP,
                       LIMIT, GATE_UP_BLOCK)
        _epilogue_part(dh3, gate3, up3, dp_ptr, h_ptr, dh_ptr, stride_dpm, stride_hm, stride_dhm, stride_dhi,
                       M, I, rows, cols0 + 3 * Q, HAS_DH_IN, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP,
                       LIMIT, GATE_UP_BLOCK)

CAPABILITY = KernelCapability("backward_prefetch", ops=("backward",), features=frozenset({"dh_in"}),
                              dtypes=TMA_DTYPES, tma=True)


def can_run(dy: torch.Tensor, down_weight: torch.Tensor, preact: torch.Tensor, dpreact: torch.Tensor,
            h: torch.Tensor, dh_in: torch.Tensor | None = None) -> bool:
    """`configs.TMA_NEEDS` (`device.tma_operands_ok`) for dY, Wd, P, dP and h; dh_in may have any strides."""
    return tma_operands_ok(down_weight.shape[1], dy, down_weight, preact, dpreact, h)


def make_launcher(config: GatedGemmConfig, epilogue: dict, dtype: torch.dtype, has_dh_in: bool = False):
    """A launcher `(dy [M, K], down_weight [K, I], preact [M, 2*I], dpreact [M, 2*I], h [M, I], dh_in)`
    running `config.programs_per_sm` persistent programs per SM, writing dP (may be preact itself)
    and h; the tensors passed `can_run`; dh_in [M, I] must be given with has_dh_in, None without.
    config.max_registers, when set, caps the registers per thread (two programs per SM need
    <= 65536 / (2 * 32 * num_warps)). The device-built descriptors need Triton's scratch
    allocator set (`dispatch` sets it)."""
    fixed = dict(
        HAS_DH_IN=has_dh_in, **epilogue, GATE_UP_BLOCK=GATE_UP_BLOCK, **config.meta(),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if config.max_registers:
        fixed["maxnreg"] = config.max_registers
    kernels: dict[int, FastLaunch] = {}  # programs -> launcher

    def launch(dy: torch.Tensor, down_weight: torch.Tensor, preact: torch.Tensor, dpreact: torch.Tensor,
               h: torch.Tensor, dh_in: torch.Tensor | None = None) -> None:
        if has_dh_in and dh_in is None:
            raise ValueError("gated_backward_prefetch: a HAS_DH_IN launcher needs dh_in")
        dh = dh_in if has_dh_in else h  # not read without HAS_DH_IN
        m, k = dy.shape
        i = down_weight.shape[1]
        index = dy.device.index or 0
        # a constant NUM_PROGRAMS per device compiles once whatever the tile count
        programs = config.programs_per_sm * (num_sms(index) if dy.is_cuda else 4)
        kernel = kernels.get(programs)
        if kernel is None:
            kernel = kernels[programs] = FastLaunch(_gated_backward_prefetch_kernel,
                                                    dict(fixed, NUM_PROGRAMS=programs))
        kernel(programs, index, dy, down_weight, preact, dpreact, h, dh, m, i, k,
               dy.stride(0), down_weight.stride(0), preact.stride(0), dpreact.stride(0), h.stride(0), *dh.stride())

    return launch
