"""The experts backward's dX GEMM, warp-specialized for Hopper, in Gluon.

Computes what `experts_backward_gemm._experts_dx_kernel` computes without a low-rank segment (its
module docstring has the math): per (block of BLOCK_M pairs of one expert e, K tile),
dx_pair[p] = dP[p] @ Wgu[e] [S, K] in fp32 over 2I (P's column order, which is the weight's row
order in every layout), rounded once to dx_pair's dtype; the forward's fixed-order combine then
sums a token's pairs. Each persistent program (one per SM) holds three groups of warps, as
`experts_dh_ws.py` does:

- the loader (`experts_ws_jit.gathered_rows_loader`, LOADER_WARPS warps): dP's rows by pair by
  cp.async and Wgu[e]'s [BLOCK_K, BLOCK_N] box by TMA, from Wgu seen as [E * 2I, K];
- the MMA group (`experts_ws_jit.block_tiles_mma`, `num_warps` warps: one warpgroup for tiles
  of up to 128 columns, two side by side for 256): wgmma into an fp32 accumulator, then into
  the shared handoff (fp32 where it fits beside the ring, else in dx_pair's dtype: either way
  rounded once, to dx_pair's dtype);
- the epilogue group (`experts_ws_jit.handoff_rows_epilogue`, EPILOGUE_WARPS warps): writes the
  handoff's rows to dx_pair by pair in [EPILOGUE_M, BLOCK_N] slices while the next tile's MMAs run.

What it takes (`can_run`): 16-bit operands without a low-rank segment, Wgu in the [E, 2I, K]
layout with its experts one after the other (gpt-oss's [E, K, 2I] is not), 2I a multiple of
block_k, K and the strides multiples of 16, 16-byte-aligned base pointers; the rest runs
`_experts_dx_kernel`. Gluon kernels run on the GPU only (no interpreter), and wgmma on Hopper only.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .device import capability, interpreting, num_sms
from .experts_backward_config import ExpertsBackwardConfig
from .experts_ws_jit import block_tiles_mma, gathered_rows_loader, handoff_rows_epilogue
from .launcher import FastLaunch
from .ws_jit import SHARED_MEMORY_BYTES, ring_barriers

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
LOADER_WARPS = 4
EPILOGUE_WARPS = 4


@gluon.jit
def _experts_dx_ws_kernel(
    dp_ptr, pairs_ptr, blocks_ptr, dx_ptr, w_desc,
    NUM_PAIRS, NUM_BLOCKS, K, N2, NUM_EXPERTS, stride_dpm, stride_dxm,
    TOP_K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr, LAG: gl.constexpr, LOADER_WARPS: gl.constexpr,
    LOADER_REGISTERS: gl.constexpr, EPILOGUE_M: gl.constexpr, EPILOGUE_WARPS: gl.constexpr,
    EPILOGUE_REGISTERS: gl.constexpr, HANDOFF_FP32: gl.constexpr, WARPS_N: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = dp_ptr.dtype.element_ty
    a_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype))
    b_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, BLOCK_N], w_desc.layout)
    handoff_dtype: gl.constexpr = gl.float32 if HANDOFF_FP32 else dtype
    handoff = gl.allocate_shared_memory(handoff_dtype, [BLOCK_M, BLOCK_N],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], handoff_dtype))
    # a stage's ready barrier: the weight box's expect, and the rows' arrive
    ready, empty, handoff_ready, handoff_free = ring_barriers(NUM_STAGES, 2)

    gl.warp_specialize([
        (block_tiles_mma, (a_ring, b_ring, ready, empty, handoff, handoff_ready, handoff_free, blocks_ptr, NUM_BLOCKS,
                           N2, K, NUM_EXPERTS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, NUM_STAGES,
                           num_warps, WARPS_N)),
        (gathered_rows_loader, (dp_ptr, w_desc, pairs_ptr, blocks_ptr, a_ring, b_ring, ready, empty,
                                NUM_PAIRS, NUM_BLOCKS, N2, K, NUM_EXPERTS, stride_dpm, TOP_K, False,
                                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, NUM_STAGES, LAG, LOADER_WARPS)),
        (handoff_rows_epilogue, (handoff, handoff_ready, handoff_free, pairs_ptr, blocks_ptr, dx_ptr, NUM_PAIRS, NUM_BLOCKS, K,
                     NUM_EXPERTS, stride_dxm, BLOCK_M, BLOCK_N, GROUP_M, NUM_PROGRAMS, EPILOGUE_M, EPILOGUE_WARPS)),
    ], [LOADER_WARPS, EPILOGUE_WARPS], [LOADER_REGISTERS, EPILOGUE_REGISTERS])


def can_run(dpreact: torch.Tensor, gate_up: torch.Tensor, gate_up_strides: tuple[int, int, int], dx_pairs: torch.Tensor,
            low_rank: bool, config: ExpertsBackwardConfig) -> bool:
    """A 16-bit call on a Hopper GPU, outside the interpreter, without a low-rank segment; dP's
    rows (2I contiguous) and Wgu seen as [E * 2I, K] (K contiguous, experts one after the other)
    with 2I a multiple of dx_block_k (a TMA box never reaches into the next expert), K, the row
    strides and base pointers multiples of 16 (elements; bytes for pointers)."""
    stride_we, stride_wn, stride_wk = gate_up_strides
    n2, k = dpreact.shape[1], dx_pairs.shape[1]
    return (dpreact.is_cuda and not interpreting() and dpreact.dtype in (torch.bfloat16, torch.float16)
            and gate_up.dtype == dpreact.dtype and dx_pairs.dtype == dpreact.dtype and not low_rank
            and capability(dpreact.device.index or 0)[0] == 9
            and stride_wk == 1 and dpreact.stride(1) == 1 and dx_pairs.stride(1) == 1 and stride_we == n2 * stride_wn
            and n2 % config.dx_block_k == 0
            and all(n % 16 == 0 for n in (k, stride_wn, dpreact.stride(0), dx_pairs.stride(0)))
            and all(t.data_ptr() % 16 == 0 for t in (gate_up, dpreact, dx_pairs)))


def make_launcher(config: ExpertsBackwardConfig, top_k: int):
    """A launcher `(dpreact [S, 2I], sorted_pairs, block_expert, gate_up, gate_up_strides, dx_pairs [S, K],
    num_experts)` running one persistent program per SM, for calls that passed `can_run`; writes
    dx_pairs' rows as `_experts_dx_kernel` does.

    config: the pairs' block_m (128) x dx_ws_block_n tiles (a multiple of 16 from 32 to 128: one
    warpgroup of 4 MMA warps; or 256: two side by side), dx_block_k steps over 2I, dx_ws_stages
    ring buffers, group_m; the loader and the epilogue take 4 warps each at
    config.dx_ws_registers = (loader, epilogue) registers a thread."""
    stages = config.dx_ws_stages
    if stages < 3:  # the loader signals a stage LAG >= 1 steps late and the MMA holds one wgmma in flight
        raise ValueError(f"experts_dx_ws: a ring of at least 3 stages, got {stages} (with 2 the loader and the MMA group "
                         f"wait on each other)")
    bm, bn, bk = config.block_m, config.dx_ws_block_n, config.dx_block_k
    if bm != 128 or not (bn % 16 == 0 and 32 <= bn <= 128 or bn == 256) or bk > 256:
        raise ValueError(f"experts_dx_ws: 128-row blocks and dx_ws_block_n a multiple of 16 from 32 to 128 or 256, got "
                         f"{bm}x{bn}x{bk}")
    ring = stages * (bm + bn) * bk * 2
    if ring + bm * bn * 2 > SHARED_MEMORY_BYTES:
        raise ValueError(f"experts_dx_ws: {stages} stages and the handoff take {ring + bm * bn * 2} bytes of shared "
                         f"memory, over Hopper's {SHARED_MEMORY_BYTES}: fewer stages")
    loader_registers, epilogue_registers = config.dx_ws_registers
    fixed = dict(TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m, NUM_STAGES=stages,
                 LAG=max(1, stages - 2), LOADER_WARPS=LOADER_WARPS, LOADER_REGISTERS=loader_registers,
                 EPILOGUE_M=4096 // bn, EPILOGUE_WARPS=EPILOGUE_WARPS, EPILOGUE_REGISTERS=epilogue_registers,
                 HANDOFF_FP32=ring + bm * bn * 4 <= SHARED_MEMORY_BYTES, WARPS_N=1 if bn <= 128 else 2,
                 num_warps=4 if bn <= 128 else 8)
    w_block = [bk, bn]
    kernels: dict[int, FastLaunch] = {}  # programs -> launcher

    def launch(dpreact, sorted_pairs, block_expert, gate_up, gate_up_strides, dx_pairs, num_experts: int) -> None:
        index = dpreact.device.index or 0
        programs = num_sms(index)
        kernel = kernels.get(programs)
        if kernel is None:  # a constant NUM_PROGRAMS per device compiles once whatever the tile count
            kernel = kernels[programs] = FastLaunch(_experts_dx_ws_kernel, dict(fixed, NUM_PROGRAMS=programs))
        n2, k = dpreact.shape[1], dx_pairs.shape[1]
        w_desc = TensorDescriptor(gate_up, [num_experts * n2, k], [gate_up_strides[1], 1], w_block,
                                  gl.NVMMASharedLayout.get_default_for(w_block, _GL_DTYPES[dpreact.dtype]))
        kernel(programs, index, dpreact, sorted_pairs, block_expert, dx_pairs, w_desc, dpreact.shape[0],
               block_expert.shape[0], k, n2, num_experts, dpreact.stride(0), dx_pairs.stride(0))

    launch.constexprs = fixed  # what the kernel compiles with, less NUM_PROGRAMS (tests compile it without a GPU)
    return launch
