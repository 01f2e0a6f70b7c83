"""The experts backward's dH kernel, warp-specialized for Hopper, in Gluon.

Computes what `experts_backward_gemm._experts_dh_kernel` computes (its module docstring has the
math, layouts and rounding), per (block of pairs, I tile): G = dOut[t] @ Wd[e] in fp32 over
K_out, with dOut's rows gathered by token; then from the tile's gate and up columns of P,
dP = d(sum dh * h)/dP with dh = w_p * G (over P when dP is P), hw = w_p * h, and the routing
weight's part <G, h> per column tile. The epilogue of one tile runs while the tensor cores work
on the next, as in the dense `gated_backward_ws.py`. Each persistent program (one per SM) holds
three groups of warps that hand work on through shared memory and mbarriers:

- the loader (LOADER_WARPS warps): per K step, the block's [BLOCK_M, BLOCK_K] rows of dOut by
  cp.async (gathered by token: Hopper's TMA has no row gather) and one [BLOCK_K, BLOCK_N] box of
  Wd[e] by TMA, into a ring of NUM_STAGES buffers. A step's rows are waited for LAG steps later
  (cp.async groups), then fenced for the tensor cores and signalled;
- the MMA group (the default partition, `num_warps` warps: one warpgroup for tiles of up to 128
  columns, two side by side for 256): wgmma over the ring into one fp32 accumulator
  [BLOCK_M, BLOCK_N], written when the tile is done into one shared handoff buffer (fp32 where it
  fits beside the ring, else in dOut's dtype: G rounded once, as HF eager's backward rounds it);
- the epilogue group (EPILOGUE_WARPS warps): reads the handoff in [EPILOGUE_M, EPILOGUE_N]
  slices, gathers P's rows by pair, and writes dP, hw and dw_part.

The loader and the MMA group are `experts_ws_jit`'s (dX's kernel, `experts_dx_ws.py`, runs them
too). Blocks of the routing with no expert (ids >= NUM_EXPERTS: padding) are skipped by all
three groups alike. What it takes (`can_run`): 16-bit operands, no biases and no low-rank segment,
Wd in the [E, K_out, I] layout with its experts one after the other, K_out a multiple of
block_k, I and the strides multiples of 16, 16-byte-aligned base pointers (every real model's
contiguous experts); the rest runs the one-program-per-tile kernel. Gluon kernels run on the GPU
only (no interpreter), and wgmma on Hopper only. Written against Triton 3.6's Gluon; the names that changed by 3.9 are aliased.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .device import capability, interpreting, num_sms
from .experts_backward_config import ExpertsBackwardConfig
from .experts_jit import experts_epilogue_grad
from .jit_common import tile_pid
from .launcher import FastLaunch
from .experts_ws_jit import block_tiles_mma, gathered_rows_loader
from .ws_jit import SHARED_MEMORY_BYTES, partition_barrier, ring_barriers

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
LOADER_WARPS = 4
EPILOGUE_WARPS = 4
EPILOGUE_N = 16  # columns per epilogue slice: 16-byte loads and stores of P, dP and hw


@gluon.jit
def _epilogue(handoff, handoff_ready, handoff_free, pairs_ptr, blocks_ptr, rw_ptr, p_ptr, dp_ptr, hw_ptr, dw_ptr,
              NUM_PAIRS, NUM_BLOCKS, I, UP_SHIFT, NUM_EXPERTS, stride_rt, stride_rj, stride_pm, stride_dpm,
              stride_hm, stride_dwm,
              TOP_K: gl.constexpr, GATE_STEP: gl.constexpr, ACTIVATION: gl.constexpr, APPROX_TANH: gl.constexpr,
              GATE_SCALE: gl.constexpr, OUT_SCALE: gl.constexpr, CLAMP: gl.constexpr, LIMIT: gl.constexpr,
              ALPHA: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
              NUM_PROGRAMS: gl.constexpr, EPILOGUE_M: gl.constexpr, EPILOGUE_N: gl.constexpr,
              EPILOGUE_WARPS: gl.constexpr):
    """Per tile, per [EPILOGUE_M, EPILOGUE_N] slice of the handoff: dP, hw and the tile's dw part."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // EPILOGUE_N, EPILOGUE_N // 8], [EPILOGUE_WARPS, 1],
                                            [1, 0])
    tiles_n = gl.cdiv(I, BLOCK_N)
    tiles_done = 0
    for tile_id in range(gl.program_id(0), NUM_BLOCKS * tiles_n, NUM_PROGRAMS):
        pid_m, pid_n = tile_pid(tile_id, GROUP_M * tiles_n, NUM_BLOCKS, GROUP_M)
        expert = gl.load(blocks_ptr + pid_m)
        if expert < NUM_EXPERTS:
            mbarrier.wait(handoff_ready, tiles_done & 1)
            for r in gl.static_range(BLOCK_M // EPILOGUE_M):
                pairs = gl.load(pairs_ptr + pid_m * BLOCK_M + r * EPILOGUE_M
                                + gl.arange(0, EPILOGUE_M, layout=gl.SliceLayout(1, layout)))
                mask_m = pairs < NUM_PAIRS
                rows = pairs.to(gl.int64)
                tokens = rows // TOP_K
                weight = gl.load(rw_ptr + tokens * stride_rt + (rows % TOP_K) * stride_rj, mask=mask_m,
                                 other=0.0).to(gl.float32)
                part = gl.zeros([EPILOGUE_M], gl.float32, gl.SliceLayout(1, layout))
                for j in gl.static_range(BLOCK_N // EPILOGUE_N):
                    cols = pid_n * BLOCK_N + j * EPILOGUE_N + gl.arange(0, EPILOGUE_N, layout=gl.SliceLayout(0, layout))
                    mask = mask_m[:, None] & (cols[None, :] < I)
                    g = handoff.slice(r * EPILOGUE_M, EPILOGUE_M, dim=0).slice(j * EPILOGUE_N, EPILOGUE_N, dim=1).load(
                        layout).to(gl.float32)
                    gate_cols = (cols * GATE_STEP).to(gl.int64)
                    p_rows = p_ptr + rows[:, None] * stride_pm
                    gate = gl.load(p_rows + gate_cols[None, :], mask=mask, other=0.0).to(gl.float32)
                    up = gl.load(p_rows + (gate_cols + UP_SHIFT)[None, :], mask=mask, other=0.0).to(gl.float32)
                    h, dgate, dup = experts_epilogue_grad(gate, up, g * weight[:, None], ACTIVATION, APPROX_TANH,
                                                          GATE_SCALE, OUT_SCALE, CLAMP, LIMIT, ALPHA)
                    dp_rows = dp_ptr + rows[:, None] * stride_dpm
                    gl.store(dp_rows + gate_cols[None, :], dgate.to(dp_ptr.dtype.element_ty), mask=mask)
                    gl.store(dp_rows + (gate_cols + UP_SHIFT)[None, :], dup.to(dp_ptr.dtype.element_ty), mask=mask)
                    h = h.to(hw_ptr.dtype.element_ty).to(gl.float32)  # h as the forward rounded it
                    gl.store(hw_ptr + rows[:, None] * stride_hm + cols[None, :],
                             (h * weight[:, None]).to(hw_ptr.dtype.element_ty), mask=mask)
                    part += gl.sum(gl.where(mask, g * h, 0.0), 1)
                gl.store(dw_ptr + rows * stride_dwm + pid_n, part, mask=mask_m)
            partition_barrier()
            mbarrier.arrive(handoff_free, count=1)
            tiles_done += 1


@gluon.jit
def _experts_dh_ws_kernel(
    dy_ptr, pairs_ptr, blocks_ptr, rw_ptr, p_ptr, dp_ptr, hw_ptr, dw_ptr, wd_desc,
    NUM_PAIRS, NUM_BLOCKS, K_OUT, I, UP_SHIFT, NUM_EXPERTS,
    stride_dym, stride_rt, stride_rj, stride_pm, stride_dpm, stride_hm, stride_dwm,
    TOP_K: gl.constexpr, GATE_STEP: gl.constexpr, ACTIVATION: gl.constexpr, APPROX_TANH: gl.constexpr,
    GATE_SCALE: gl.constexpr, OUT_SCALE: gl.constexpr, CLAMP: gl.constexpr, LIMIT: gl.constexpr, ALPHA: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr, LAG: gl.constexpr, LOADER_WARPS: gl.constexpr,
    LOADER_REGISTERS: gl.constexpr, EPILOGUE_M: gl.constexpr, EPILOGUE_N: gl.constexpr,
    EPILOGUE_WARPS: gl.constexpr, EPILOGUE_REGISTERS: gl.constexpr, HANDOFF_FP32: gl.constexpr,
    WARPS_N: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = dy_ptr.dtype.element_ty
    a_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype))
    b_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, BLOCK_N], wd_desc.layout)
    handoff_dtype: gl.constexpr = gl.float32 if HANDOFF_FP32 else dtype
    handoff = gl.allocate_shared_memory(handoff_dtype, [BLOCK_M, BLOCK_N],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], handoff_dtype))
    ready, empty, handoff_ready, handoff_free = ring_barriers(NUM_STAGES, 2)  # ready: Wd's expect, the rows' arrive

    gl.warp_specialize([
        (block_tiles_mma, (a_ring, b_ring, ready, empty, handoff, handoff_ready, handoff_free, blocks_ptr, NUM_BLOCKS,
                           K_OUT, I, NUM_EXPERTS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, NUM_STAGES,
                           num_warps, WARPS_N)),
        (gathered_rows_loader, (dy_ptr, wd_desc, pairs_ptr, blocks_ptr, a_ring, b_ring, ready, empty,
                                NUM_PAIRS, NUM_BLOCKS, K_OUT, I, NUM_EXPERTS, stride_dym, TOP_K, True,
                                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, NUM_STAGES, LAG, LOADER_WARPS)),
        (_epilogue, (handoff, handoff_ready, handoff_free, pairs_ptr, blocks_ptr, rw_ptr, p_ptr, dp_ptr, hw_ptr, dw_ptr,
                     NUM_PAIRS, NUM_BLOCKS, I, UP_SHIFT, NUM_EXPERTS, stride_rt, stride_rj, stride_pm, stride_dpm,
                     stride_hm, stride_dwm, TOP_K, GATE_STEP, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP,
                     LIMIT, ALPHA, BLOCK_M, BLOCK_N, GROUP_M, NUM_PROGRAMS, EPILOGUE_M, EPILOGUE_N, EPILOGUE_WARPS)),
    ], [LOADER_WARPS, EPILOGUE_WARPS], [LOADER_REGISTERS, EPILOGUE_REGISTERS])


def can_run(dout: torch.Tensor, down: torch.Tensor, down_strides: tuple[int, int, int], inter: int,
            has_bias: bool, low_rank: bool, config: ExpertsBackwardConfig) -> bool:
    """A 16-bit call on a Hopper GPU, outside the interpreter, without biases or a low-rank
    segment; dOut's rows (K_out contiguous) and Wd seen as [E * K_out, I] (I contiguous, experts
    one after the other) with K_out a multiple of block_k (a TMA box of Wd never reaches into the
    next expert), I, the row strides and base pointers multiples of 16 (elements; bytes for
    pointers): what TMA needs, and what Triton's specialization needs to prove every 8-element
    cp.async copy of a row whole and 16-byte aligned."""
    stride_de, stride_dn, stride_di = down_strides
    k_out = dout.shape[1]
    return (dout.is_cuda and not interpreting() and dout.dtype in (torch.bfloat16, torch.float16)
            and down.dtype == dout.dtype and not has_bias and not low_rank
            and capability(dout.device.index or 0)[0] == 9
            and stride_di == 1 and dout.stride(1) == 1 and stride_de == k_out * stride_dn
            and k_out % config.block_k == 0
            and all(n % 16 == 0 for n in (k_out, inter, stride_dn, dout.stride(0)))
            and down.data_ptr() % 16 == 0 and dout.data_ptr() % 16 == 0)


def tile_n(config: ExpertsBackwardConfig) -> int:
    """The kernel's tile along I: config.dh_ws_block_n, else config.block_n (the one-program-per-tile
    kernel's); dw_part has one column per tile."""
    return config.dh_ws_block_n or config.block_n


def make_launcher(config: ExpertsBackwardConfig, epilogue: dict, top_k: int, gate_step: int):
    """A launcher `(dout [T, K_out], sorted_pairs, block_expert, top_k_weights [T, TOP_K], down,
    down_strides, preact [S, 2I], dpreact, hw [S, I], dw_part [S, cdiv(I, tile_n(config))] fp32,
    num_experts, up_shift)` running one persistent program per SM, for calls that passed `can_run`;
    writes dpreact (may be preact), hw and dw_part as `_experts_dh_kernel` does.

    config: the pairs' block_m (128) x `tile_n(config)` tiles (a multiple of 16 up to 128: one
    warpgroup of 4 MMA warps; or 256: two side by side), block_k steps, dh_ws_stages (or
    dh_num_stages, or num_stages) ring buffers, group_m; the loader and the epilogue take 4 warps
    each at config.dh_ws_registers = (loader, epilogue) registers a thread."""
    stages = config.dh_ws_stages or config.dh_num_stages or config.num_stages
    if stages < 3:  # the loader signals a stage LAG >= 1 steps late and the MMA holds one wgmma in flight
        raise ValueError(f"experts_dh_ws: a ring of at least 3 stages, got {stages} (with 2 the loader and the MMA group "
                         f"wait on each other)")
    bm, bn, bk = config.block_m, tile_n(config), config.block_k
    if bm != 128 or not (bn % EPILOGUE_N == 0 and bn <= 128 or bn == 256) or bk > 256:
        raise ValueError(f"experts_dh_ws: 128-row blocks and a tile along I that is a multiple of {EPILOGUE_N} up to "
                         f"128, or 256, got {bm}x{bn}x{bk}")
    ring_bytes = stages * (bm + bn) * bk * 2
    if ring_bytes + bm * bn * 2 > SHARED_MEMORY_BYTES:
        raise ValueError(f"experts_dh_ws: {stages} stages and the handoff take {ring_bytes + bm * bn * 2} bytes of "
                         f"shared memory, over Hopper's {SHARED_MEMORY_BYTES}: fewer stages")
    loader_registers, epilogue_registers = config.dh_ws_registers
    fixed = dict(
        TOP_K=top_k, GATE_STEP=gate_step, **epilogue, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, GROUP_M=config.group_m, NUM_STAGES=stages, LAG=max(1, stages - 2),
        LOADER_WARPS=LOADER_WARPS, LOADER_REGISTERS=loader_registers,
        EPILOGUE_M=(32 * 8 // EPILOGUE_N) * EPILOGUE_WARPS * (2 if bn <= 128 else 1), EPILOGUE_N=EPILOGUE_N,
        EPILOGUE_WARPS=EPILOGUE_WARPS, EPILOGUE_REGISTERS=epilogue_registers,
        HANDOFF_FP32=ring_bytes + bm * bn * 4 <= SHARED_MEMORY_BYTES, WARPS_N=1 if bn <= 128 else 2,
        num_warps=4 if bn <= 128 else 8,
    )
    wd_block = [bk, bn]
    kernels: dict[int, FastLaunch] = {}  # programs -> launcher

    def launch(dout, sorted_pairs, block_expert, top_k_weights, down, down_strides, preact, dpreact, hw, dw_part,
               num_experts: int, up_shift: int) -> None:
        index = dout.device.index or 0
        programs = num_sms(index)
        kernel = kernels.get(programs)
        if kernel is None:  # a constant NUM_PROGRAMS per device compiles once whatever the tile count
            kernel = kernels[programs] = FastLaunch(_experts_dh_ws_kernel, dict(fixed, NUM_PROGRAMS=programs))
        k_out, inter = dout.shape[1], hw.shape[1]
        wd_desc = TensorDescriptor(down, [num_experts * k_out, inter], [down_strides[1], 1], wd_block,
                                   gl.NVMMASharedLayout.get_default_for(wd_block, _GL_DTYPES[dout.dtype]))
        kernel(programs, index, dout, sorted_pairs, block_expert, top_k_weights, preact, dpreact, hw, dw_part,
               wd_desc, preact.shape[0], block_expert.shape[0], k_out, inter, up_shift, num_experts,
               dout.stride(0), *top_k_weights.stride(), preact.stride(0), dpreact.stride(0), hw.stride(0),
               dw_part.stride(0))

    launch.constexprs = fixed  # what the kernel compiles with, less NUM_PROGRAMS (tests compile it without a GPU)
    return launch
