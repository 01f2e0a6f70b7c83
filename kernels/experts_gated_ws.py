"""The experts' gated GEMM (the forward's first GEMM), warp-specialized for Hopper, in Gluon.

Computes what `experts_gemm._experts_gated_gemm_kernel` computes for chunked weights without a
bias or a low-rank segment (its module docstring has the math): per (block of BLOCK_M pairs of
one expert e, I tile), gate and up = x[t] @ W[e]'s gate and up rows^T in fp32 over K, x's rows
gathered by token (t = p // TOP_K); h = epilogue(gate, up) in fp32, rounded once, at the pair's
row of h [S, I]; with STORE_PREACT also gate and up, each rounded once, at the pair's row of
P [S, 2I] (columns n and I + n: the model's column order), and h then from those rounded values. Each persistent program (one per SM)
holds three groups of warps that hand work on through shared memory and mbarriers:

- the loader (`experts_ws_jit.gathered_rows_loader` with W_GATED, LOADER_WARPS warps): x's rows
  by cp.async and the tile's gate and up [BLOCK_N, BLOCK_K] boxes by TMA from W seen as
  [E * 2I, K], into a ring of NUM_STAGES stages;
- the MMA group (the default partition, 8 warps: two warpgroups of 64 rows each): two fp32
  accumulators by wgmma (gate and up of one element in one thread); then the epilogue's math on
  them in registers, and h in x's dtype into the shared handoff; with STORE_PREACT instead gate and
  up, each rounded once to x's dtype, into the handoff's two halves;
- the epilogue group (EPILOGUE_WARPS warps): writes the handoff's rows to h by pair in
  [EPILOGUE_M, BLOCK_N] slices while the next tile's MMAs run (`experts_ws_jit.handoff_rows_epilogue`);
  with STORE_PREACT (`_preact_epilogue`) it writes gate and up to P's rows and h = epilogue(gate,
  up) from those rounded values, as HF eager computes it.

Blocks of the routing with no expert (ids >= NUM_EXPERTS: padding) are skipped by all three
groups alike; padding pairs load zeros and store nothing. What it takes (`can_run`): 16-bit
operands on a Hopper GPU outside the interpreter, W in the chunked [E, 2I, K] layout with its
experts one after the other (K contiguous), no bias, no low-rank segment, K a multiple of the
step, x's row stride, K and W's row stride multiples of 16, 16-byte-aligned base pointers; the rest
runs `_experts_gated_gemm_kernel`. Gluon kernels run on the GPU only (no interpreter), and wgmma on
Hopper only.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .configs import ExpertsConfig
from .device import capability, interpreting, num_sms
from .experts_jit import experts_epilogue
from .experts_ws_jit import gathered_rows_loader, handoff_rows_epilogue
from .jit_common import tile_pid
from .launcher import FastLaunch
from .ws_jit import SHARED_MEMORY_BYTES, partition_barrier, ring_barriers

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
LOADER_WARPS = 4
EPILOGUE_WARPS = 4
MMA_WARPS = 8  # two warpgroups, 64 rows each


@gluon.jit
def _gated_mma(a_ring, b_ring, ready, empty, handoff, handoff_ready, handoff_free, pairs_ptr, blocks_ptr, p_ptr,
               NUM_PAIRS, NUM_BLOCKS, K, I, NUM_EXPERTS, stride_pm, ACTIVATION: gl.constexpr, APPROX_TANH: gl.constexpr, GATE_SCALE: gl.constexpr,
               OUT_SCALE: gl.constexpr, CLAMP: gl.constexpr, LIMIT: gl.constexpr, ALPHA: gl.constexpr,
               STORE_PREACT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
               GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr,
               MMA_WARPS: gl.constexpr):
    """Per tile: gate and up by wgmma over the ring, each stage released once its MMAs retire; then
    h = epilogue(gate, up) in fp32 into the handoff in its dtype, or with STORE_PREACT gate and up
    into the handoff's two halves in theirs."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[MMA_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    tiles_n = gl.cdiv(I, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    step = 0
    tiles_done = 0
    for tile_id in range(gl.program_id(0), NUM_BLOCKS * tiles_n, NUM_PROGRAMS):
        pid_m, pid_n = tile_pid(tile_id, GROUP_M * tiles_n, NUM_BLOCKS, GROUP_M)
        if gl.load(blocks_ptr + pid_m) < NUM_EXPERTS:
            gate = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            for ki in range(k_tiles):
                s = step % NUM_STAGES
                mbarrier.wait(ready.index(s), (step // NUM_STAGES) & 1)
                a_stage = a_ring.index(s)
                gate = warpgroup_mma(a_stage, b_ring.index(2 * s).permute((1, 0)), gate, is_async=True)
                up = warpgroup_mma(a_stage, b_ring.index(2 * s + 1).permute((1, 0)), up, is_async=True)
                gate, up = warpgroup_mma_wait(num_outstanding=2, deps=(gate, up))
                # the MMAs of the step before have retired: its stage is free
                mbarrier.arrive(empty.index((step + NUM_STAGES - 1) % NUM_STAGES), count=1, pred=ki > 0)
                step += 1
            gate, up = warpgroup_mma_wait(num_outstanding=0, deps=(gate, up))
            mbarrier.arrive(empty.index((step + NUM_STAGES - 1) % NUM_STAGES), count=1, pred=k_tiles > 0)
            if STORE_PREACT:  # gate and up, each rounded once, for the epilogue group to store and take h from
                mbarrier.wait(handoff_free, (tiles_done & 1) ^ 1)
                handoff.index(0).store(gate.to(handoff.dtype))
                handoff.index(1).store(up.to(handoff.dtype))
            else:
                h = experts_epilogue(gate, up, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT, ALPHA)
                mbarrier.wait(handoff_free, (tiles_done & 1) ^ 1)
                handoff.store(h.to(handoff.dtype))
            partition_barrier()
            mbarrier.arrive(handoff_ready, count=1)
            tiles_done += 1


@gluon.jit
def _preact_epilogue(handoff, handoff_ready, handoff_free, pairs_ptr, blocks_ptr, h_ptr, p_ptr, NUM_PAIRS, NUM_BLOCKS,
                     I, NUM_EXPERTS, stride_hm, stride_pm, ACTIVATION: gl.constexpr, APPROX_TANH: gl.constexpr,
                     GATE_SCALE: gl.constexpr, OUT_SCALE: gl.constexpr, CLAMP: gl.constexpr, LIMIT: gl.constexpr,
                     ALPHA: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                     NUM_PROGRAMS: gl.constexpr, EPILOGUE_M: gl.constexpr, EPILOGUE_WARPS: gl.constexpr):
    """Per tile, in [EPILOGUE_M, BLOCK_N] slices of the handoff's gate and up halves: both into P's rows by pair
    (columns n and I + n), and h = epilogue(gate, up) in fp32 from the rounded values (as HF eager computes it)
    into h's rows; the handoff freed for the next tile after each."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [EPILOGUE_WARPS, 1], [1, 0])
    tiles_n = gl.cdiv(I, BLOCK_N)
    tiles_done = 0
    for tile_id in range(gl.program_id(0), NUM_BLOCKS * tiles_n, NUM_PROGRAMS):
        pid_m, pid_n = tile_pid(tile_id, GROUP_M * tiles_n, NUM_BLOCKS, GROUP_M)
        if gl.load(blocks_ptr + pid_m) < NUM_EXPERTS:
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            mbarrier.wait(handoff_ready, tiles_done & 1)
            for r in gl.static_range(BLOCK_M // EPILOGUE_M):
                pairs = gl.load(pairs_ptr + pid_m * BLOCK_M + r * EPILOGUE_M
                                + gl.arange(0, EPILOGUE_M, layout=gl.SliceLayout(1, layout)))
                mask = (pairs < NUM_PAIRS)[:, None] & (cols < I)[None, :]
                rows = pairs.to(gl.int64)[:, None]
                gate = handoff.index(0).slice(r * EPILOGUE_M, EPILOGUE_M, dim=0).load(layout)
                up = handoff.index(1).slice(r * EPILOGUE_M, EPILOGUE_M, dim=0).load(layout)
                p_rows = p_ptr + rows * stride_pm
                gl.store(p_rows + cols[None, :], gate, mask=mask)
                gl.store(p_rows + (I + cols)[None, :], up, mask=mask)
                h = experts_epilogue(gate.to(gl.float32), up.to(gl.float32), ACTIVATION, APPROX_TANH, GATE_SCALE,
                                     OUT_SCALE, CLAMP, LIMIT, ALPHA)
                gl.store(h_ptr + rows * stride_hm + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
            partition_barrier()
            mbarrier.arrive(handoff_free, count=1)
            tiles_done += 1


@gluon.jit
def _epilogue(handoff, handoff_ready, handoff_free, pairs_ptr, blocks_ptr, h_ptr, p_ptr, NUM_PAIRS, NUM_BLOCKS, I,
              NUM_EXPERTS, stride_hm, stride_pm, ACTIVATION: gl.constexpr, APPROX_TANH: gl.constexpr,
              GATE_SCALE: gl.constexpr, OUT_SCALE: gl.constexpr, CLAMP: gl.constexpr, LIMIT: gl.constexpr,
              ALPHA: gl.constexpr, STORE_PREACT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, EPILOGUE_M: gl.constexpr,
              EPILOGUE_WARPS: gl.constexpr):
    """The epilogue partition: `_preact_epilogue` with STORE_PREACT, else `experts_ws_jit.handoff_rows_epilogue`."""
    if STORE_PREACT:
        _preact_epilogue(handoff, handoff_ready, handoff_free, pairs_ptr, blocks_ptr, h_ptr, p_ptr, NUM_PAIRS,
                         NUM_BLOCKS, I, NUM_EXPERTS, stride_hm, stride_pm, ACTIVATION, APPROX_TANH, GATE_SCALE,
                         OUT_SCALE, CLAMP, LIMIT, ALPHA, BLOCK_M, BLOCK_N, GROUP_M, NUM_PROGRAMS, EPILOGUE_M,
                         EPILOGUE_WARPS)
    else:
        handoff_rows_epilogue(handoff, handoff_ready, handoff_free, pairs_ptr, blocks_ptr, h_ptr, NUM_PAIRS,
                              NUM_BLOCKS, I, NUM_EXPERTS, stride_hm, BLOCK_M, BLOCK_N, GROUP_M, NUM_PROGRAMS,
                              EPILOGUE_M, EPILOGUE_WARPS)


@gluon.jit
def _experts_gated_ws_kernel(
    x_ptr, pairs_ptr, blocks_ptr, h_ptr, p_ptr, w_desc,
    NUM_PAIRS, NUM_BLOCKS, K, I, NUM_EXPERTS, stride_xm, stride_hm, stride_pm,
    TOP_K: gl.constexpr, ACTIVATION: gl.constexpr, APPROX_TANH: gl.constexpr, GATE_SCALE: gl.constexpr,
    OUT_SCALE: gl.constexpr, CLAMP: gl.constexpr, LIMIT: gl.constexpr, ALPHA: gl.constexpr,
    STORE_PREACT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr, LAG: gl.constexpr,
    LOADER_WARPS: gl.constexpr, LOADER_REGISTERS: gl.constexpr, EPILOGUE_M: gl.constexpr,
    EPILOGUE_WARPS: gl.constexpr, EPILOGUE_REGISTERS: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    a_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype))
    b_ring = gl.allocate_shared_memory(dtype, [2 * NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    handoff_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    if STORE_PREACT:  # gate's and up's halves
        handoff = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], handoff_layout)
    else:
        handoff = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], handoff_layout)
    # a stage's ready barrier: the two weight boxes' expect, and the rows' arrive
    ready, empty, handoff_ready, handoff_free = ring_barriers(NUM_STAGES, 2)

    gl.warp_specialize([
        (_gated_mma, (a_ring, b_ring, ready, empty, handoff, handoff_ready, handoff_free, pairs_ptr, blocks_ptr, p_ptr,
                      NUM_PAIRS, NUM_BLOCKS, K, I, NUM_EXPERTS, stride_pm, ACTIVATION, APPROX_TANH, GATE_SCALE,
                      OUT_SCALE, CLAMP, LIMIT, ALPHA, STORE_PREACT,
                      BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, NUM_STAGES, num_warps)),
        (gathered_rows_loader, (x_ptr, w_desc, pairs_ptr, blocks_ptr, a_ring, b_ring, ready, empty,
                                NUM_PAIRS, NUM_BLOCKS, K, I, NUM_EXPERTS, stride_xm, TOP_K, True,
                                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, NUM_STAGES, LAG, LOADER_WARPS,
                                True)),
        (_epilogue, (handoff, handoff_ready, handoff_free, pairs_ptr, blocks_ptr, h_ptr, p_ptr, NUM_PAIRS, NUM_BLOCKS,
                     I, NUM_EXPERTS, stride_hm, stride_pm, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP,
                     LIMIT, ALPHA, STORE_PREACT, BLOCK_M, BLOCK_N, GROUP_M, NUM_PROGRAMS, EPILOGUE_M,
                     EPILOGUE_WARPS)),
    ], [LOADER_WARPS, EPILOGUE_WARPS], [LOADER_REGISTERS, EPILOGUE_REGISTERS])


def _steps(config: ExpertsConfig, store_preact: bool) -> tuple[int, int]:
    """(block_k, stages) of the call: the config's, or its ws_preact_* where P is stored."""
    if store_preact:
        return config.ws_preact_block_k, config.ws_preact_stages
    return config.block_k, config.ws_stages


def can_run(x: torch.Tensor, gate_up: torch.Tensor, layout, has_bias: bool, low_rank: bool, h: torch.Tensor,
            preact: torch.Tensor | None, config: ExpertsConfig) -> bool:
    """A 16-bit call on a Hopper GPU, outside the interpreter, without a bias or a low-rank segment;
    gate_up chunked [E, 2I, K] (K contiguous, experts one after the other: W seen as [E * 2I, K]),
    K a multiple of the call's step along K, x's and W's row strides and K multiples of 16
    (elements), h's and P's columns contiguous, 16-byte-aligned base pointers."""
    if not (x.is_cuda and not interpreting() and x.dtype in _GL_DTYPES and gate_up.dtype == x.dtype
            and not layout.transposed and layout.concatenated and not has_bias and not low_rank
            and capability(x.device.index or 0)[0] == 9):
        return False
    stride_we, stride_wn, stride_wk = gate_up.stride()
    k = x.shape[1]
    tensors = (x, gate_up, h) if preact is None else (x, gate_up, h, preact)
    return (stride_wk == 1 and stride_we == gate_up.shape[1] * stride_wn and x.stride(1) == 1
            and k % _steps(config, preact is not None)[0] == 0
            and all(n % 16 == 0 for n in (k, stride_wn, x.stride(0)))
            and all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 for t in tensors))


def make_launcher(config: ExpertsConfig, epilogue: dict, top_k: int, store_preact: bool):
    """A launcher `(x [T, K], sorted_pairs, block_expert, gate_up [E, 2I, K], h [S, I], preact [S, 2I] or None,
    num_experts)` running one persistent program per SM, for calls that passed `can_run`; writes h's
    rows (and P's) as `_experts_gated_gemm_kernel` does.

    config: 128-row blocks (block_m) x block_n columns of h (a multiple of 16 up to 128: the two
    accumulators of 2 x block_n columns), block_k steps at ws_stages ring stages (ws_preact_block_k
    and ws_preact_stages with store_preact); the loader and the epilogue take 4 warps each at
    config.ws_registers = (loader, epilogue) registers a thread."""
    block_k, stages = _steps(config, store_preact)
    if stages < 3:  # the loader signals a stage LAG >= 1 steps late and the MMA holds one step's wgmmas in flight
        raise ValueError(f"experts_gated_ws: a ring of at least 3 stages, got {stages} (with 2 the loader and the MMA "
                         f"group wait on each other)")
    bm, bn = config.block_m, config.block_n
    if bm != 128 or not (bn % 16 == 0 and 16 <= bn <= 128) or block_k % 16 or not 16 <= block_k <= 128:
        raise ValueError(f"experts_gated_ws: 128-row blocks, block_n a multiple of 16 up to 128 and a step along K a "
                         f"multiple of 16 up to 128, got {bm}x{bn}x{block_k}")
    smem = stages * (bm + 2 * bn) * block_k * 2 + (2 if store_preact else 1) * bm * bn * 2  # ring, handoff
    if smem > SHARED_MEMORY_BYTES:
        raise ValueError(f"experts_gated_ws: {stages} stages and the handoff take {smem} bytes of shared memory, over "
                         f"Hopper's {SHARED_MEMORY_BYTES}: fewer stages or a shorter step along K")
    loader_registers, epilogue_registers = config.ws_registers
    fixed = dict(TOP_K=top_k, **epilogue, STORE_PREACT=store_preact, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k,
                 GROUP_M=config.group_m, NUM_STAGES=stages, LAG=max(1, stages - 2), LOADER_WARPS=LOADER_WARPS,
                 LOADER_REGISTERS=loader_registers, EPILOGUE_M=(2048 if store_preact else 4096) // bn,
                 EPILOGUE_WARPS=EPILOGUE_WARPS,
                 EPILOGUE_REGISTERS=epilogue_registers, num_warps=MMA_WARPS)
    w_block = [bn, block_k]
    kernels: dict[int, FastLaunch] = {}  # programs -> launcher

    def launch(x, sorted_pairs, block_expert, gate_up, h, preact, num_experts: int) -> None:
        index = x.device.index or 0
        programs = num_sms(index)
        kernel = kernels.get(programs)
        if kernel is None:  # a constant NUM_PROGRAMS per device compiles once whatever the tile count
            kernel = kernels[programs] = FastLaunch(_experts_gated_ws_kernel, dict(fixed, NUM_PROGRAMS=programs))
        n2, k = gate_up.shape[1], x.shape[1]
        w_desc = TensorDescriptor(gate_up, [num_experts * n2, k], [gate_up.stride(1), 1], w_block,
                                  gl.NVMMASharedLayout.get_default_for(w_block, _GL_DTYPES[x.dtype]))
        p = h if preact is None else preact  # not written without STORE_PREACT
        kernel(programs, index, x, sorted_pairs, block_expert, h, p, w_desc, h.shape[0], block_expert.shape[0], k,
               n2 // 2, num_experts, x.stride(0), h.stride(0), p.stride(0))

    launch.constexprs = fixed  # what the kernel compiles with, less NUM_PROGRAMS (tests compile it without a GPU)
    return launch
