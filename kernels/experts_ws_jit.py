"""The loader, MMA and row-storing epilogue partitions of the experts' per-block warp-specialized Hopper kernels, in Gluon.

Shared by `experts_dh_ws.py` (G = dOut[t] @ Wd[e]) and `experts_dx_ws.py` (dx_pair = dP[p] @
Wgu[e]), the loader and the epilogue also by `experts_gated_ws.py` (the forward: x[t] @ W[e]'s gate
and up rows^T) and `experts_down_ws.py` (the forward's y[p] = w_p h[p] @ Wd[e]^T):
per (block of BLOCK_M pairs of one expert e, N tile), the sum over the reduction axis (K_RED)
of A[row(p)] @ W[e], with A's rows gathered by pair or by token (A_BY_TOKEN: p // TOP_K) and
W[e] read as [K_RED, N] boxes of W seen as [E * K_RED, N] (the experts one after the other, N
contiguous, K_RED a multiple of BLOCK_K: a box never reaches into the next expert). Tiles are
walked in grouped order (`jit_common.tile_pid`), NUM_PROGRAMS apart; blocks of no expert (ids >=
NUM_EXPERTS: padding) are skipped by every partition alike.

- `gathered_rows_loader`: per K step, A's [BLOCK_M, BLOCK_K] rows by cp.async (Hopper's TMA has
  no row gather) and W's [BLOCK_K, BLOCK_N] box by TMA into a ring of NUM_STAGES buffers; a
  stage's ready barrier counts 2: the TMA's expect, and one arrive LAG steps after its rows were
  issued, once they have landed and are fenced for the tensor cores. With W_GATED (the forward's
  gated GEMM, `experts_gated_ws.py`) W is seen as [E * 2N, K_RED] instead (K_RED contiguous,
  gate rows [0, N) and up rows [N, 2N) of each expert) and a stage holds two [BLOCK_N, BLOCK_K]
  boxes, the tile's gate rows at b_ring[2 s] and its up rows at b_ring[2 s + 1]; with W_TRANSPOSED
  (the forward's down GEMM, `experts_down_ws.py`) W is seen as [E * N, K_RED] (K_RED contiguous) and
  a stage holds one [BLOCK_N, BLOCK_K] box;
- `block_tiles_mma`: each tile by wgmma over the ring (`ws_jit.mma_tile`; with ROW_WEIGHTS each row
  times its pair's routing weight) into the shared handoff buffer, which the kernel's own epilogue
  partition reads;
- `handoff_rows_epilogue`: the epilogue partition that stores the handoff's rows by pair (dX's and
  the forward's).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, mbarrier

from .jit_common import tile_pid
from .ws_jit import (accumulator_to_handoff, cp_async, last_rows_landed, mma_tile, partition_barrier, rows_landed,
                     tma_load)


@gluon.jit
def gathered_rows_loader(a_ptr, w_desc, pairs_ptr, blocks_ptr, a_ring, b_ring, ready, empty,
                         NUM_PAIRS, NUM_BLOCKS, K_RED, N, NUM_EXPERTS, stride_am,
                         TOP_K: gl.constexpr, A_BY_TOKEN: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                         NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr, LAG: gl.constexpr,
                         LOADER_WARPS: gl.constexpr, W_GATED: gl.constexpr = False, W_TRANSPOSED: gl.constexpr = False):
    """Per K step, A's gathered rows by cp.async and W[e]'s box (W_GATED: gate and up boxes; W_TRANSPOSED: a
    [BLOCK_N, BLOCK_K] box) by TMA into the ring."""
    a_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [LOADER_WARPS, 1], [1, 0])
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K_RED, BLOCK_K)
    offs_am = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, a_layout))
    offs_ak = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, a_layout))
    step = 0
    for tile_id in range(gl.program_id(0), NUM_BLOCKS * tiles_n, NUM_PROGRAMS):
        pid_m, pid_n = tile_pid(tile_id, GROUP_M * tiles_n, NUM_BLOCKS, GROUP_M)
        expert = gl.load(blocks_ptr + pid_m)
        if expert < NUM_EXPERTS:
            pairs = gl.load(pairs_ptr + pid_m * BLOCK_M + offs_am)
            mask_m = pairs < NUM_PAIRS
            rows = pairs.to(gl.int64)
            if A_BY_TOKEN:
                rows = rows // TOP_K
            a_ptrs = a_ptr + rows[:, None] * stride_am + offs_ak[None, :]  # [BLOCK_M, BLOCK_K]
            if W_GATED:
                first_row = expert.to(gl.int32) * 2 * N + pid_n * BLOCK_N  # the tile's gate rows in W as [E * 2N, K_RED]
            elif W_TRANSPOSED:
                first_row = expert.to(gl.int32) * N + pid_n * BLOCK_N  # the tile's rows in W as [E * N, K_RED]
            else:
                first_row = expert.to(gl.int32) * K_RED  # of W[e] in W seen as [E * K_RED, N]
            for ki in range(k_tiles):
                s = step % NUM_STAGES
                mbarrier.wait(empty.index(s), ((step // NUM_STAGES) & 1) ^ 1)
                # K_RED % BLOCK_K == 0 (the kernels' `can_run`): a box stays inside its expert, no K mask
                if W_GATED:  # columns past N of a last tile read other rows (or TMA's zeros): never stored
                    mbarrier.expect(ready.index(s), 2 * w_desc.block_type.nbytes)
                    tma_load(w_desc, [first_row, ki * BLOCK_K], ready.index(s), b_ring.index(2 * s))
                    tma_load(w_desc, [first_row + N, ki * BLOCK_K], ready.index(s), b_ring.index(2 * s + 1))
                elif W_TRANSPOSED:  # as W_GATED's: rows past N of a last tile are never stored
                    mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
                    tma_load(w_desc, [first_row, ki * BLOCK_K], ready.index(s), b_ring.index(s))
                else:
                    mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
                    tma_load(w_desc, [first_row + ki * BLOCK_K, pid_n * BLOCK_N], ready.index(s), b_ring.index(s))
                cp_async(a_ring.index(s), a_ptrs + ki * BLOCK_K, mask=mask_m[:, None])
                async_copy.commit_group()
                rows_landed(ready, step, LAG, NUM_STAGES)  # a stage's second arrive, LAG steps late
                step += 1
    last_rows_landed(ready, step, LAG, NUM_STAGES)


@gluon.jit
def block_tiles_mma(a_ring, b_ring, ready, empty, handoff, handoff_ready, handoff_free, blocks_ptr, NUM_BLOCKS, K_RED,
                    N, NUM_EXPERTS, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr,
                    MMA_WARPS: gl.constexpr, WARPS_N: gl.constexpr = 1, B_TRANSPOSED: gl.constexpr = False,
                    ROW_WEIGHTS: gl.constexpr = False, pairs_ptr=None, rw_ptr=None, NUM_PAIRS=0, stride_rt=0,
                    stride_rj=0, TOP_K: gl.constexpr = 1):
    """Each [BLOCK_M, BLOCK_N] tile of a block with an expert by wgmma over the ring (`ws_jit.mma_tile`; W's
    stages [BLOCK_N, BLOCK_K] read transposed where B_TRANSPOSED), into the handoff when done. ROW_WEIGHTS: each
    row first times its pair's routing weight rw[p // TOP_K, p % TOP_K] in fp32 (the forward's down GEMM)."""
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K_RED, BLOCK_K)
    step = 0
    tiles_done = 0
    for tile_id in range(gl.program_id(0), NUM_BLOCKS * tiles_n, NUM_PROGRAMS):
        pid_m, pid_n = tile_pid(tile_id, GROUP_M * tiles_n, NUM_BLOCKS, GROUP_M)
        if gl.load(blocks_ptr + pid_m) < NUM_EXPERTS:
            acc, step = mma_tile(a_ring, b_ring, ready, empty, k_tiles, step, BLOCK_M, BLOCK_N, NUM_STAGES, MMA_WARPS,
                                 False, WARPS_N, B_TRANSPOSED)
            if ROW_WEIGHTS:
                pairs = gl.load(pairs_ptr + pid_m * BLOCK_M
                                + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc.type.layout)))
                rows = pairs.to(gl.int64)
                weight = gl.load(rw_ptr + (rows // TOP_K) * stride_rt + (rows % TOP_K) * stride_rj,
                                 mask=pairs < NUM_PAIRS, other=0.0)
                acc = acc * weight.to(gl.float32)[:, None]
            tiles_done = accumulator_to_handoff(acc, handoff, handoff_ready, handoff_free, tiles_done)


@gluon.jit
def handoff_rows_epilogue(handoff, handoff_ready, handoff_free, pairs_ptr, blocks_ptr, out_ptr, NUM_PAIRS, NUM_BLOCKS,
                          N, NUM_EXPERTS, stride_om, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, EPILOGUE_M: gl.constexpr,
                          EPILOGUE_WARPS: gl.constexpr):
    """Per tile, the handoff in [EPILOGUE_M, BLOCK_N] slices, rounded once to out's dtype, into out's rows [S, N]
    by pair (dX's dx_pair, the forward's h); the handoff freed for the next tile after each."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [EPILOGUE_WARPS, 1], [1, 0])
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_done = 0
    for tile_id in range(gl.program_id(0), NUM_BLOCKS * tiles_n, NUM_PROGRAMS):
        pid_m, pid_n = tile_pid(tile_id, GROUP_M * tiles_n, NUM_BLOCKS, GROUP_M)
        if gl.load(blocks_ptr + pid_m) < NUM_EXPERTS:
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            mbarrier.wait(handoff_ready, tiles_done & 1)
            for r in gl.static_range(BLOCK_M // EPILOGUE_M):
                pairs = gl.load(pairs_ptr + pid_m * BLOCK_M + r * EPILOGUE_M
                                + gl.arange(0, EPILOGUE_M, layout=gl.SliceLayout(1, layout)))
                value = handoff.slice(r * EPILOGUE_M, EPILOGUE_M, dim=0).load(layout).to(gl.float32)
                gl.store(out_ptr + pairs[:, None].to(gl.int64) * stride_om + cols[None, :],
                         value.to(out_ptr.dtype.element_ty), mask=(pairs < NUM_PAIRS)[:, None] & (cols < N)[None, :])
            partition_barrier()
            mbarrier.arrive(handoff_free, count=1)
            tiles_done += 1
