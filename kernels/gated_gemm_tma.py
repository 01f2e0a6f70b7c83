"""The persistent TMA fused gated GEMM for prefill on Hopper: one 2*BLOCK_SIZE_N-wide MMA per step.

Computes what `gated_gemm_pointer.py` computes (its docstring has the layout, dtypes and
rounding), organised for large M:

- x [M, K] and the packed weight [2*I, K] are read through TMA descriptors built on the
  device: per K step one [BLOCK_SIZE_M, BLOCK_SIZE_K] box of x and one
  [2*BLOCK_SIZE_N, BLOCK_SIZE_K] box of packed rows. BLOCK_SIZE_N is a multiple of
  GATE_UP_BLOCK, so that box holds BLOCK_SIZE_N // 16 whole blocks: the gate rows of output
  columns pid_n*BLOCK_SIZE_N .. +BLOCK_SIZE_N and their up rows, interleaved by 16.
- one fp32 accumulator [BLOCK_SIZE_M, 2*BLOCK_SIZE_N] (a 128x256 tile: one wgmma N=256);
  the epilogue views it as [BM, BN/16, 2, 16], moves the gate/up axis last and splits it.
  Gate column j and up column j sit 16 columns apart, inside one thread's accumulator
  registers, so the split moves no data.
- persistent programs (`config.programs_per_sm` per SM) walk the tiles in grouped order for
  L2 reuse. With two per SM, one program's epilogue can run while the other's MMAs do.
- split tail (`config.split_tail`): where the last wave's T whole tiles would leave at least
  half the programs idle, each of them runs as S = 2 or 4 tiles of BLOCK_SIZE_N / S output
  columns instead (the largest S with S * T <= programs and BLOCK_SIZE_N / S >= 32): one wave
  of narrower tiles, each about 1/S of a whole tile's time. Their weight box is
  [2 * BLOCK_SIZE_N / S, BLOCK_SIZE_K]: still whole 16-row gate/up blocks.

With STORE_PREACT (training's store mode) the epilogue also stores the tile's pre-activation,
bias added, rounded once to x's dtype, into P [M, 2*I]: the accumulator's columns are
interleaved as the packed rows are, so P comes out in the layout the backward reads. It goes
out as two [BLOCK_SIZE_M, BLOCK_SIZE_N] TMA boxes, which reuse the output's staging shared
memory (one [BM, 2*BN] box would not fit beside a 4-stage 128x(2*128)x64 pipeline). Off, the
branch and the P descriptor are compiled out.

Low-rank segment (HAS_LOW_RANK, LoRA's gate/up adapters: `swiglu_patch.low_rank`): P also gets
x_lr @ b_lr^T, x_lr [M, R] and b_lr [2*I, R] in the packed row layout, by a second loop over R
in BLOCK_SIZE_R steps after the K loop, into the same accumulator, before the bias: one
[BLOCK_SIZE_M, BLOCK_SIZE_R] box of x_lr and one [2*BLOCK_SIZE_N, BLOCK_SIZE_R] box of packed
b_lr rows per step (zero-filled past R). x_lr and b_lr must be TMA-aligned too (R % 8 == 0 for
16-bit dtypes).

TMA zero-fills out-of-bounds reads and clips out-of-bounds writes, so any M and K work; it
needs 16-bit dtypes, I % 16 == 0 (whole blocks; every real model), unit inner strides and
16-byte-aligned row strides and base pointers (`can_run`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from .configs import LOW_RANK_BLOCK, TMA_DTYPES, GatedGemmConfig, KernelCapability, ceil_div
from .device import num_sms, tma_operands_ok
from .jit_common import gated_epilogue, tile_pid
from .launcher import FastLaunch
from .layout import GATE_UP_BLOCK

# A split tail's tiles keep at least this many output columns (a 2 * 32-row weight box).
SPLIT_TAIL_MIN_N = 32


@triton.jit
def _k_loop(x_desc, w_desc, offs_m, offs_w, k_tiles,
            BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr):
    """sum over K tiles of x[offs_m:, k] @ w[offs_w:, k]^T, fp32 [BM, 2*BN]: gate and up
    columns interleaved by GATE_UP_BLOCK, as the packed rows are."""
    acc = tl.zeros((BLOCK_SIZE_M, 2 * BLOCK_SIZE_N), dtype=tl.float32)
    for ki in range(0, k_tiles):
        x = x_desc.load([offs_m, ki * BLOCK_SIZE_K])  # [BLOCK_SIZE_M, BLOCK_SIZE_K]
        w = w_desc.load([offs_w, ki * BLOCK_SIZE_K])  # [2 * BLOCK_SIZE_N, BLOCK_SIZE_K]
        acc = tl.dot(x, w.T, acc)
    return acc


@triton.jit
def _low_rank_loop(acc, xl_desc, bl_desc, offs_m, offs_w, r_tiles, BLOCK_SIZE_R: tl.constexpr):
    """acc + sum over R tiles of x_lr[offs_m:, r] @ b_lr[offs_w:, r]^T (LoRA's update of the tile)."""
    for ri in range(0, r_tiles):
        xl = xl_desc.load([offs_m, ri * BLOCK_SIZE_R])  # [BLOCK_SIZE_M, BLOCK_SIZE_R]
        bl = bl_desc.load([offs_w, ri * BLOCK_SIZE_R])  # [2 * BLOCK_SIZE_N, BLOCK_SIZE_R]
        acc = tl.dot(xl, bl.T, acc)
    return acc


@triton.jit
def _store_tile(acc, out_desc, p_desc, b_ptr, offs_m, offs_w, pid_n, I,
                HAS_BIAS: tl.constexpr, STORE_PREACT: tl.constexpr,
                ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
                GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
                GATE_UP_BLOCK: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr):
    """Bias, split gate/up in registers, the gated epilogue in fp32, one rounding, one TMA store
    (with STORE_PREACT first the pre-activation, as two [BM, BN] boxes: columns as the packed rows)."""
    if HAS_BIAS:
        offs_b = offs_w + tl.arange(0, 2 * BLOCK_SIZE_N)
        acc += tl.load(b_ptr + offs_b, mask=offs_b < 2 * I, other=0.0).to(tl.float32)[None, :]
    if STORE_PREACT:
        p_lo, p_hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_SIZE_M, 2, BLOCK_SIZE_N)), (0, 2, 1)))
        p_desc.store([offs_m, offs_w], p_lo.to(p_desc.dtype))  # [BLOCK_SIZE_M, BLOCK_SIZE_N]
        p_desc.store([offs_m, offs_w + BLOCK_SIZE_N], p_hi.to(p_desc.dtype))
    acc = tl.reshape(acc, (BLOCK_SIZE_M, 2 * BLOCK_SIZE_N // (2 * GATE_UP_BLOCK), 2, GATE_UP_BLOCK))
    acc = tl.permute(acc, (0, 1, 3, 2))
    gate, up = tl.split(tl.reshape(acc, (BLOCK_SIZE_M, BLOCK_SIZE_N, 2)))  # [BLOCK_SIZE_M, BLOCK_SIZE_N] each
    h = gated_epilogue(gate, up, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT)
    out_desc.store([offs_m, pid_n * BLOCK_SIZE_N], h.to(out_desc.dtype))


@triton.jit
def _gated_gemm_tma_kernel(
    x_ptr, w_ptr, out_ptr, b_ptr, p_ptr, xl_ptr, bl_ptr, M, I, K, R, dp_tiles,
    stride_xm, stride_wn, stride_om, stride_pm, stride_xlm, stride_bln,
    HAS_BIAS: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    HAS_LOW_RANK: tl.constexpr,
    BLOCK_SIZE_R: tl.constexpr,
    ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
    GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    TAIL_SPLIT: tl.constexpr,
):
    """Tiles 0..dp_tiles-1 whole (strided over the persistent programs); with TAIL_SPLIT = S > 1
    each tile after them as S tiles of BLOCK_SIZE_N / S output columns."""
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_SIZE_M, BLOCK_SIZE_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, [2 * I, K], [stride_wn, 1], [2 * BLOCK_SIZE_N, BLOCK_SIZE_K])
    out_desc = tl.make_tensor_descriptor(out_ptr, [M, I], [stride_om, 1], [BLOCK_SIZE_M, BLOCK_SIZE_N])
    if STORE_PREACT:
        p_desc = tl.make_tensor_descriptor(p_ptr, [M, 2 * I], [stride_pm, 1], [BLOCK_SIZE_M, BLOCK_SIZE_N])
    else:
        p_desc = out_desc  # never stored through
    if HAS_LOW_RANK:
        xl_desc = tl.make_tensor_descriptor(xl_ptr, [M, R], [stride_xlm, 1], [BLOCK_SIZE_M, BLOCK_SIZE_R])
        bl_desc = tl.make_tensor_descriptor(bl_ptr, [2 * I, R], [stride_bln, 1], [2 * BLOCK_SIZE_N, BLOCK_SIZE_R])
    r_tiles = tl.cdiv(R, BLOCK_SIZE_R)
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(I, BLOCK_SIZE_N)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_SIZE_K)

    # -- whole tiles: one [BM, 2*BN] accumulator each, gate/up interleaved by 16 --
    for tile_id in tl.range(start_pid, dp_tiles, NUM_PROGRAMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = tile_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
        offs_m = pid_m * BLOCK_SIZE_M
        offs_w = pid_n * 2 * BLOCK_SIZE_N  # first packed row of this tile's blocks
        acc = _k_loop(x_desc, w_desc, offs_m, offs_w, k_tiles, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K)
        if HAS_LOW_RANK:
            acc = _low_rank_loop(acc, xl_desc, bl_desc, offs_m, offs_w, r_tiles, BLOCK_SIZE_R)
        _store_tile(acc, out_desc, p_desc, b_ptr, offs_m, offs_w, pid_n, I, HAS_BIAS, STORE_PREACT,
                    ACTIVATION, APPROX_TANH,
                    GATE_SCALE, OUT_SCALE, CLAMP, LIMIT, GATE_UP_BLOCK, BLOCK_SIZE_M, BLOCK_SIZE_N)

    # -- split tail: the tiles after the whole ones, each as TAIL_SPLIT narrower tiles --
    if TAIL_SPLIT > 1:
        SUB_N: tl.constexpr = BLOCK_SIZE_N // TAIL_SPLIT
        w_tail_desc = tl.make_tensor_descriptor(w_ptr, [2 * I, K], [stride_wn, 1], [2 * SUB_N, BLOCK_SIZE_K])
        out_tail_desc = tl.make_tensor_descriptor(out_ptr, [M, I], [stride_om, 1], [BLOCK_SIZE_M, SUB_N])
        if STORE_PREACT:
            p_tail_desc = tl.make_tensor_descriptor(p_ptr, [M, 2 * I], [stride_pm, 1], [BLOCK_SIZE_M, SUB_N])
        else:
            p_tail_desc = out_tail_desc
        if HAS_LOW_RANK:
            bl_tail_desc = tl.make_tensor_descriptor(bl_ptr, [2 * I, R], [stride_bln, 1], [2 * SUB_N, BLOCK_SIZE_R])
        for sub_id in tl.range(start_pid, (num_tiles - dp_tiles) * TAIL_SPLIT, NUM_PROGRAMS):
            pid_m, pid_n = tile_pid(dp_tiles + sub_id // TAIL_SPLIT, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
            sub_n = pid_n * TAIL_SPLIT + sub_id % TAIL_SPLIT  # in units of SUB_N output columns
            offs_m = pid_m * BLOCK_SIZE_M
            offs_w = sub_n * 2 * SUB_N
            acc = _k_loop(x_desc, w_tail_desc, offs_m, offs_w, k_tiles, BLOCK_SIZE_M, SUB_N, BLOCK_SIZE_K)
            if HAS_LOW_RANK:
                acc = _low_rank_loop(acc, xl_desc, bl_tail_desc, offs_m, offs_w, r_tiles, BLOCK_SIZE_R)
            _store_tile(acc, out_tail_desc, p_tail_desc, b_ptr, offs_m, offs_w, sub_n, I, HAS_BIAS, STORE_PREACT,
                        ACTIVATION, APPROX_TANH,
                        GATE_SCALE, OUT_SCALE, CLAMP, LIMIT, GATE_UP_BLOCK, BLOCK_SIZE_M, SUB_N)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for device-built TMA descriptors (128 bytes each)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Give Triton a scratch allocator unless the caller set one (it is per thread: a ContextVar)."""
    current = getattr(_allocation, "_allocator", None)
    if current is None or current.get() is getattr(_allocation, "_NULL_ALLOCATOR", None):
        triton.set_allocator(_scratch)


CAPABILITY = KernelCapability("tma", ops=("forward",), features=frozenset({"store_preact", "low_rank"}),
                              dtypes=TMA_DTYPES, tma=True)


def can_run(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, preact: torch.Tensor | None = None,
            x_lr: torch.Tensor | None = None, b_lr: torch.Tensor | None = None) -> bool:
    """`configs.TMA_NEEDS` (`device.tma_operands_ok`), for preact and the low-rank operands too where given."""
    return tma_operands_ok(weight.shape[0] >> 1, x, weight, out, preact, x_lr, b_lr)


def tail_split(m: int, i: int, config: GatedGemmConfig, programs: int) -> tuple[int, int]:
    """(whole tiles, S): the T tiles of a last partial wave run as S narrower tiles each, for the
    largest S in (4, 2) with S * T <= programs and block_n / S >= SPLIT_TAIL_MIN_N, where
    `config.split_tail` asks for it; S = 1 runs every tile whole."""
    tiles = ceil_div(m, config.block_m) * ceil_div(i, config.block_n)
    tail = tiles % programs
    if config.split_tail and tail:
        for s in (4, 2):
            if s * tail <= programs and config.block_n // s >= SPLIT_TAIL_MIN_N:
                return tiles - tail, s
    return tiles, 1


def make_launcher(config: GatedGemmConfig, epilogue: dict, has_bias: bool, dtype: torch.dtype,
                  store_preact: bool = False, low_rank: bool = False):
    """A launcher `(x [M, K], weight [2*I, K], bias [2*I] or None, out [M, I], preact, x_lr, b_lr)
    -> out` running `config.programs_per_sm` persistent programs per SM; the tensors passed
    `can_run`. With store_preact it also writes preact [M, 2*I] (must be given); without, preact
    is None. With low_rank, x_lr [M, R] and b_lr [2*I, R] must be given; without, they are None."""
    fixed = dict(
        HAS_BIAS=has_bias, STORE_PREACT=store_preact, HAS_LOW_RANK=low_rank, BLOCK_SIZE_R=LOW_RANK_BLOCK,
        **epilogue, GATE_UP_BLOCK=GATE_UP_BLOCK, **config.meta(),
        WARP_SPECIALIZE=config.warp_specialize, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    kernels: dict[tuple[int, int], FastLaunch] = {}  # (programs, tail split) -> launcher

    def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
               preact: torch.Tensor | None = None, x_lr: torch.Tensor | None = None,
               b_lr: torch.Tensor | None = None) -> torch.Tensor:
        if store_preact and preact is None:
            raise ValueError("gated_gemm_tma: a STORE_PREACT launcher needs preact")
        if low_rank and (x_lr is None or b_lr is None):
            raise ValueError("gated_gemm_tma: a low-rank launcher needs x_lr and b_lr")
        p = out if preact is None else preact  # not read unless STORE_PREACT
        xl, bl = (x_lr, b_lr) if low_rank else (x, weight)  # not read unless HAS_LOW_RANK
        m, k = x.shape
        i = weight.shape[0] >> 1
        index = x.device.index or 0
        # a constant NUM_PROGRAMS per device compiles once whatever the tile count
        programs = config.programs_per_sm * (num_sms(index) if x.is_cuda else 4)
        dp_tiles, split = tail_split(m, i, config, programs)
        kernel = kernels.get((programs, split))
        if kernel is None:
            kernel = kernels[programs, split] = FastLaunch(
                _gated_gemm_tma_kernel, dict(fixed, NUM_PROGRAMS=programs, TAIL_SPLIT=split))
        ensure_allocator()
        kernel(programs, index, x, weight, out, weight if bias is None else bias, p, xl, bl, m, i, k,
               xl.shape[1] if low_rank else 0, dp_tiles,
               x.stride(0), weight.stride(0), out.stride(0), p.stride(0), xl.stride(0), bl.stride(0))
        return out

    return launch
