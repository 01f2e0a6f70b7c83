"""The experts forward's down GEMM, warp-specialized for Hopper, in Gluon.

Computes what `experts_gemm._experts_down_gemm_kernel` computes without a bias or a low-rank
segment: per (block of BLOCK_M pairs of one expert e, K_out tile), y[p] = w_p * (h[p] @ Wd[e]^T)
[S, K_out], the sum over I in fp32, times the pair's routing weight in fp32, rounded once to y's
dtype; the fixed-order combine then sums a token's pairs. Each persistent program (one per SM)
holds three groups of warps, as `experts_dx_ws.py` does:

- the loader (`experts_ws_jit.gathered_rows_loader` with W_TRANSPOSED, LOADER_WARPS warps): h's
  rows by pair by cp.async, and Wd[e]'s [BLOCK_N, BLOCK_K] box by TMA from Wd seen as
  [E * K_out, I];
- the MMA group (`experts_ws_jit.block_tiles_mma` with B_TRANSPOSED and ROW_WEIGHTS, `num_warps`
  warps: one warpgroup for tiles of up to 128 columns, two side by side for 256): wgmma into an fp32
  accumulator, each row times its pair's routing weight, then into the shared handoff (fp32 where it fits beside the ring, else in y's
  dtype: either way rounded once);
- the epilogue group (`experts_ws_jit.handoff_rows_epilogue`, EPILOGUE_WARPS warps): writes the
  handoff's rows to y by pair while the next tile's MMAs run.

What it takes (`can_run`): 16-bit operands without a bias or a low-rank segment, Wd in the
[E, K_out, I] layout with I contiguous and its experts one after the other, I a multiple of
down_ws_block_k, K_out and the strides multiples of 16, 16-byte-aligned base pointers (every
untransposed layout: Qwen3-MoE, OLMoE, Mixtral, GLM); the rest runs `_experts_down_gemm_kernel`.
Gluon kernels run on the GPU only (no interpreter), and wgmma on Hopper only.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .configs import ExpertsConfig
from .device import capability, interpreting, num_sms
from .experts_ws_jit import block_tiles_mma, gathered_rows_loader, handoff_rows_epilogue
from .launcher import FastLaunch
from .ws_jit import SHARED_MEMORY_BYTES, ring_barriers

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
LOADER_WARPS = 4
EPILOGUE_WARPS = 4


@gluon.jit
def _experts_down_ws_kernel(
    h_ptr, pairs_ptr, blocks_ptr, rw_ptr, y_ptr, wd_desc,
    NUM_PAIRS, NUM_BLOCKS, K_OUT, I, NUM_EXPERTS, stride_hm, stride_rt, stride_rj, stride_ym,
    TOP_K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr, LAG: gl.constexpr, LOADER_WARPS: gl.constexpr,
    LOADER_REGISTERS: gl.constexpr, EPILOGUE_M: gl.constexpr, EPILOGUE_WARPS: gl.constexpr,
    EPILOGUE_REGISTERS: gl.constexpr, HANDOFF_FP32: gl.constexpr, WARPS_N: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = h_ptr.dtype.element_ty
    a_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype))
    b_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], wd_desc.layout)
    handoff_dtype: gl.constexpr = gl.float32 if HANDOFF_FP32 else dtype
    handoff = gl.allocate_shared_memory(handoff_dtype, [BLOCK_M, BLOCK_N],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], handoff_dtype))
    # a stage's ready barrier: the weight box's expect, and the rows' arrive
    ready, empty, handoff_ready, handoff_free = ring_barriers(NUM_STAGES, 2)

    gl.warp_specialize([
        (block_tiles_mma, (a_ring, b_ring, ready, empty, handoff, handoff_ready, handoff_free, blocks_ptr,
                           NUM_BLOCKS, I, K_OUT, NUM_EXPERTS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS,
                           NUM_STAGES, num_warps, WARPS_N, True, True, pairs_ptr, rw_ptr, NUM_PAIRS, stride_rt,
                           stride_rj, TOP_K)),
        (gathered_rows_loader, (h_ptr, wd_desc, pairs_ptr, blocks_ptr, a_ring, b_ring, ready, empty,
                                NUM_PAIRS, NUM_BLOCKS, I, K_OUT, NUM_EXPERTS, stride_hm, TOP_K, False,
                                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, NUM_STAGES, LAG, LOADER_WARPS,
                                False, True)),
        (handoff_rows_epilogue, (handoff, handoff_ready, handoff_free, pairs_ptr, blocks_ptr, y_ptr, NUM_PAIRS,
                                 NUM_BLOCKS, K_OUT, NUM_EXPERTS, stride_ym, BLOCK_M, BLOCK_N, GROUP_M, NUM_PROGRAMS,
                                 EPILOGUE_M, EPILOGUE_WARPS)),
    ], [LOADER_WARPS, EPILOGUE_WARPS], [LOADER_REGISTERS, EPILOGUE_REGISTERS])


def can_run(h: torch.Tensor, down: torch.Tensor, down_strides: tuple[int, int, int], y: torch.Tensor,
            has_bias: bool, low_rank: bool, config: ExpertsConfig) -> bool:
    """A 16-bit call on a Hopper GPU, outside the interpreter, without a bias or a low-rank segment;
    h's and y's rows (unit inner stride) and Wd seen as [E * K_out, I] (I contiguous, experts one
    after the other) with I a multiple of down_ws_block_k (no step reaches past a row of h), K_out,
    the row strides and base pointers multiples of 16 (elements; bytes for pointers)."""
    stride_de, stride_dn, stride_di = down_strides
    inter, k_out = h.shape[1], y.shape[1]
    return (h.is_cuda and not interpreting() and h.dtype in (torch.bfloat16, torch.float16)
            and down.dtype == h.dtype and y.dtype == h.dtype and not has_bias and not low_rank
            and capability(h.device.index or 0)[0] == 9
            and stride_di == 1 and h.stride(1) == 1 and y.stride(1) == 1 and stride_de == k_out * stride_dn
            and inter % config.down_ws_block_k == 0
            and all(n % 16 == 0 for n in (k_out, stride_dn, h.stride(0), y.stride(0)))
            and all(t.data_ptr() % 16 == 0 for t in (h, down, y)))


def make_launcher(config: ExpertsConfig, top_k: int):
    """A launcher `(h [S, I], sorted_pairs, block_expert, top_k_weights [T, TOP_K], down, down_strides,
    y [S, K_out], num_experts)` running one persistent program per SM, for calls that passed
    `can_run`; writes y's rows as `_experts_down_gemm_kernel` does.

    config: the pairs' block_m (128) x down_ws_block_n tiles (a multiple of 16 from 32 to 128: one
    warpgroup of 4 MMA warps; or 256: two side by side), down_ws_block_k steps over I,
    down_ws_stages ring buffers, group_m; the loader and the epilogue take 4 warps each at
    config.down_ws_registers = (loader, epilogue) registers a thread."""
    stages = config.down_ws_stages
    if stages < 3:  # the loader signals a stage LAG >= 1 steps late and the MMA holds one wgmma in flight
        raise ValueError(f"experts_down_ws: a ring of at least 3 stages, got {stages} (with 2 the loader and the MMA "
                         f"group wait on each other)")
    bm, bn, bk = config.block_m, config.down_ws_block_n, config.down_ws_block_k
    if bm != 128 or not (bn % 16 == 0 and 32 <= bn <= 128 or bn == 256) or bk not in (32, 64, 128):
        raise ValueError(f"experts_down_ws: 128-row blocks, down_ws_block_n a multiple of 16 from 32 to 128 or 256, "
                         f"and down_ws_block_k 32, 64 or 128, got {bm}x{bn}x{bk}")
    ring = stages * (bm + bn) * bk * 2
    if ring + bm * bn * 2 > SHARED_MEMORY_BYTES:
        raise ValueError(f"experts_down_ws: {stages} stages and the handoff take {ring + bm * bn * 2} bytes of shared "
                         f"memory, over Hopper's {SHARED_MEMORY_BYTES}: fewer stages")
    loader_registers, epilogue_registers = config.down_ws_registers
    fixed = dict(TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m, NUM_STAGES=stages,
                 LAG=max(1, stages - 2), LOADER_WARPS=LOADER_WARPS, LOADER_REGISTERS=loader_registers,
                 EPILOGUE_M=4096 // bn, EPILOGUE_WARPS=EPILOGUE_WARPS, EPILOGUE_REGISTERS=epilogue_registers,
                 HANDOFF_FP32=ring + bm * bn * 4 <= SHARED_MEMORY_BYTES, WARPS_N=1 if bn <= 128 else 2,
                 num_warps=4 if bn <= 128 else 8)
    wd_block = [bn, bk]
    kernels: dict[int, FastLaunch] = {}  # programs -> launcher

    def launch(h, sorted_pairs, block_expert, top_k_weights, down, down_strides, y, num_experts: int) -> None:
        index = h.device.index or 0
        programs = num_sms(index)
        kernel = kernels.get(programs)
        if kernel is None:  # a constant NUM_PROGRAMS per device compiles once whatever the tile count
            kernel = kernels[programs] = FastLaunch(_experts_down_ws_kernel, dict(fixed, NUM_PROGRAMS=programs))
        inter, k_out = h.shape[1], y.shape[1]
        wd_desc = TensorDescriptor(down, [num_experts * k_out, inter], [down_strides[1], 1], wd_block,
                                   gl.NVMMASharedLayout.get_default_for(wd_block, _GL_DTYPES[h.dtype]))
        kernel(programs, index, h, sorted_pairs, block_expert, top_k_weights, y, wd_desc, h.shape[0],
               block_expert.shape[0], k_out, inter, num_experts, h.stride(0), *top_k_weights.stride(), y.stride(0))

    launch.constexprs = fixed  # what the kernel compiles with, less NUM_PROGRAMS (tests compile it without a GPU)
    return launch
