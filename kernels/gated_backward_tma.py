"""The persistent TMA backward GEMM of the gated MLP for large M on Hopper.

Computes what `gated_backward_pointer.py` computes (its docstring has the math, the layout of
P and dP, dtypes and rounding): dH = dY @ Wd in fp32 registers, then h and the interleaved
dP = (dH * dh/dgate, dH * dh/dup) from the matching tile of P, organised for large M:

- dY [M, K] and Wd [K, I] are read through TMA descriptors built on the device: per K step
  one [BLOCK_SIZE_M, BLOCK_SIZE_K] box of dY and one [BLOCK_SIZE_K, BLOCK_SIZE_N] box of Wd
  into one fp32 accumulator [BLOCK_SIZE_M, BLOCK_SIZE_N] of dH.
- the epilogue runs in SUBTILES (2 or 4: `config.epilogue_subtiles`) slices of
  S = BLOCK_SIZE_N / SUBTILES output columns, each reading one [BLOCK_SIZE_M, 2 * S] box of P:
  S is a multiple of 16, so a slice's gate and up columns are whole 16-column blocks of P,
  contiguous, at column 2 * (first output column). The box is viewed as [BM, S/16, 2, 16], the
  gate/up axis moved last and split; dP goes back the same way into one [BM, 2 * S] box,
  written over P when dP is P (the box is read before it is written, and no other program
  touches it). Slices divide the epilogue's staging shared memory and registers.
- persistent programs (`config.programs_per_sm` per SM) walk the tiles in grouped order.
- HAS_DH_IN: a further gradient of h, dh_in [M, I] (LoRA on the down projection sends one back
  through h), is added to each fp32 dH half before the derivative. It is read with plain
  loads (any strides), not TMA: the 4-stage pipeline leaves no shared memory for another box.

TMA zero-fills out-of-bounds reads and clips out-of-bounds writes, so any M and K work; it
needs 16-bit dtypes, I % 16 == 0 (whole blocks) and TMA-aligned dY, Wd, P, dP and h: unit
inner strides, 16-byte-aligned row strides and base pointers (`can_run`).
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
def _epilogue_slice(dh, p_desc, dp_desc, h_desc, dh_ptr, stride_dhm, stride_dhi, M, I, offs_m, offs_n,
                    HAS_DH_IN: tl.constexpr, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
                    GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
                    GATE_UP_BLOCK: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, S: tl.constexpr):
    """dH [BM, S] of output columns offs_n.. (plus dh_in there) -> h there and dP in P's
    columns 2*offs_n.. ."""
    if HAS_DH_IN:
        rows = offs_m + tl.arange(0, BLOCK_SIZE_M)
        cols = offs_n + tl.arange(0, S)
        dh_in = tl.load(dh_ptr + rows[:, None] * stride_dhm + cols[None, :] * stride_dhi,
                        mask=(rows[:, None] < M) & (cols[None, :] < I), other=0.0)
        dh += dh_in.to(tl.float32)
    p = p_desc.load([offs_m, 2 * offs_n]).to(tl.float32)  # [BLOCK_SIZE_M, 2 * S], interleaved by 16
    p = tl.permute(tl.reshape(p, (BLOCK_SIZE_M, S // GATE_UP_BLOCK, 2, GATE_UP_BLOCK)), (0, 1, 3, 2))
    gate, up = tl.split(tl.reshape(p, (BLOCK_SIZE_M, S, 2)))  # [BLOCK_SIZE_M, S] each
    h, dgate, dup = gated_epilogue_grad(gate, up, dh, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT)
    dp = tl.reshape(tl.join(dgate.to(dp_desc.dtype), dup.to(dp_desc.dtype)),
                    (BLOCK_SIZE_M, S // GATE_UP_BLOCK, GATE_UP_BLOCK, 2))
    dp = tl.reshape(tl.permute(dp, (0, 1, 3, 2)), (BLOCK_SIZE_M, 2 * S))  # interleaved by 16, as P
    dp_desc.store([offs_m, 2 * offs_n], dp)
    h_desc.store([offs_m, offs_n], h.to(h_desc.dtype))


@triton.jit
def _gated_backward_tma_kernel(
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
    WARP_SPECIALIZE: tl.constexpr,
    SUBTILES: tl.constexpr,
):
    S: tl.constexpr = BLOCK_SIZE_N // SUBTILES
    dy_desc = tl.make_tensor_descriptor(dy_ptr, [M, K], [stride_dym, 1], [BLOCK_SIZE_M, BLOCK_SIZE_K])
    wd_desc = tl.make_tensor_descriptor(wd_ptr, [K, I], [stride_wdk, 1], [BLOCK_SIZE_K, BLOCK_SIZE_N])
    p_desc = tl.make_tensor_descriptor(p_ptr, [M, 2 * I], [stride_pm, 1], [BLOCK_SIZE_M, 2 * S])
    dp_desc = tl.make_tensor_descriptor(dp_ptr, [M, 2 * I], [stride_dpm, 1], [BLOCK_SIZE_M, 2 * S])
    h_desc = tl.make_tensor_descriptor(h_ptr, [M, I], [stride_hm, 1], [BLOCK_SIZE_M, S])
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(I, BLOCK_SIZE_N)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_SIZE_K)

    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True,
                            warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = tile_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
        offs_m = pid_m * BLOCK_SIZE_M
        offs_n = pid_n * BLOCK_SIZE_N

        # -- main loop: dH = dY @ Wd, fp32 --
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for ki in range(0, k_tiles):
            dy = dy_desc.load([offs_m, ki * BLOCK_SIZE_K])  # [BLOCK_SIZE_M, BLOCK_SIZE_K]
            wd = wd_desc.load([ki * BLOCK_SIZE_K, offs_n])  # [BLOCK_SIZE_K, BLOCK_SIZE_N]
            acc = tl.dot(dy, wd, acc)

        # -- epilogue, in SUBTILES slices of S output columns --
        dh_lo, dh_hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_SIZE_M, 2, BLOCK_SIZE_N // 2)), (0, 2, 1)))
        if SUBTILES == 2:
            _epilogue_slice(dh_lo, p_desc, dp_desc, h_desc, dh_ptr, stride_dhm, stride_dhi, M, I, offs_m, offs_n,
                            HAS_DH_IN, ACTIVATION, APPROX_TANH, GATE_SCALE,
                            OUT_SCALE, CLAMP, LIMIT, GATE_UP_BLOCK, BLOCK_SIZE_M, S)
            _epilogue_slice(dh_hi, p_desc, dp_desc, h_desc, dh_ptr, stride_dhm, stride_dhi, M, I, offs_m,
                            offs_n + S, HAS_DH_IN, ACTIVATION, APPROX_TANH,
                            GATE_SCALE, OUT_SCALE, CLAMP, LIMIT, GATE_UP_BLOCK, BLOCK_SIZE_M, S)
        else:
            dh0, dh1 = tl.split(tl.permute(tl.reshape(dh_lo, (BLOCK_SIZE_M, 2, S)), (0, 2, 1)))
            dh2, dh3 = tl.split(tl.permute(tl.reshape(dh_hi, (BLOCK_SIZE_M, 2, S)), (0, 2, 1)))
            _epilogue_slice(dh0, p_desc, dp_desc, h_desc, dh_ptr, stride_dhm, stride_dhi, M, I, offs_m, offs_n,
                            HAS_DH_IN, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT, GATE_UP_BLOCK,
                            BLOCK_SIZE_M, S)
            _epilogue_slice(dh1, p_desc, dp_desc, h_desc, dh_ptr, stride_dhm, stride_dhi, M, I, offs_m, offs_n + S,
                            HAS_DH_IN, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT, GATE_UP_BLOCK,
                            BLOCK_SIZE_M, S)
            _epilogue_slice(dh2, p_desc, dp_desc, h_desc, dh_ptr, stride_dhm, stride_dhi, M, I, offs_m,
                            offs_n + 2 * S, HAS_DH_IN, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT,
                            GATE_UP_BLOCK, BLOCK_SIZE_M, S)
            _epilogue_slice(dh3, p_desc, dp_desc, h_desc, dh_ptr, stride_dhm, stride_dhi, M, I, offs_m,
                            offs_n + 3 * S, HAS_DH_IN, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT,
                            GATE_UP_BLOCK, BLOCK_SIZE_M, S)


CAPABILITY = KernelCapability("backward_tma", ops=("backward",), features=frozenset({"dh_in"}), dtypes=TMA_DTYPES,
                              tma=True)


def can_run(dy: torch.Tensor, down_weight: torch.Tensor, preact: torch.Tensor, dpreact: torch.Tensor,
            h: torch.Tensor, dh_in: torch.Tensor | None = None) -> bool:
    """`configs.TMA_NEEDS` (`device.tma_operands_ok`); dh_in, read with plain loads, may have any strides."""
    return tma_operands_ok(down_weight.shape[1], dy, down_weight, preact, dpreact, h)


def make_launcher(config: GatedGemmConfig, epilogue: dict, dtype: torch.dtype, has_dh_in: bool = False):
    """A launcher `(dy [M, K], down_weight [K, I], preact [M, 2*I], dpreact [M, 2*I], h [M, I], dh_in)`
    running `config.programs_per_sm` persistent programs per SM, writing dP (may be preact itself)
    and h; the tensors passed `can_run`; dh_in [M, I] must be given with has_dh_in, None without.
    config.block_n must be a multiple of config.epilogue_subtiles * GATE_UP_BLOCK (each epilogue
    slice holds whole gate/up blocks). The device-built descriptors need Triton's scratch
    allocator set (`dispatch` sets it)."""
    subtiles = config.epilogue_subtiles
    if subtiles not in (2, 4):
        raise ValueError(f"gated_backward_tma: epilogue_subtiles must be 2 or 4, got {subtiles}")
    if config.block_n % (subtiles * GATE_UP_BLOCK):
        raise ValueError(f"gated_backward_tma: block_n must be a multiple of {subtiles * GATE_UP_BLOCK} with "
                         f"{subtiles} epilogue slices, got {config.block_n}")
    fixed = dict(
        HAS_DH_IN=has_dh_in, **epilogue, GATE_UP_BLOCK=GATE_UP_BLOCK, **config.meta(),
        WARP_SPECIALIZE=config.warp_specialize, SUBTILES=subtiles, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if config.max_registers:  # two programs per SM need <= 65536 / (2 * 32 * num_warps)
        fixed["maxnreg"] = config.max_registers
    kernels: dict[int, FastLaunch] = {}  # programs -> launcher

    def launch(dy: torch.Tensor, down_weight: torch.Tensor, preact: torch.Tensor, dpreact: torch.Tensor,
               h: torch.Tensor, dh_in: torch.Tensor | None = None) -> None:
        if has_dh_in and dh_in is None:
            raise ValueError("gated_backward_tma: a HAS_DH_IN launcher needs dh_in")
        dh = dh_in if has_dh_in else h  # not read without HAS_DH_IN
        m, k = dy.shape
        i = down_weight.shape[1]
        index = dy.device.index or 0
        # a constant NUM_PROGRAMS per device compiles once whatever the tile count
        programs = config.programs_per_sm * (num_sms(index) if dy.is_cuda else 4)
        kernel = kernels.get(programs)
        if kernel is None:
            kernel = kernels[programs] = FastLaunch(_gated_backward_tma_kernel, dict(fixed, NUM_PROGRAMS=programs))
        kernel(programs, index, dy, down_weight, preact, dpreact, h, dh, m, i, k,
               dy.stride(0), down_weight.stride(0), preact.stride(0), dpreact.stride(0), h.stride(0), *dh.stride())

    return launch
