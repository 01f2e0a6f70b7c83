"""The experts backward's weight-gradient kernel, persistent and warp-specialized for Hopper, in Gluon.

Computes what `experts_backward_gemm._experts_wgrad_kernel` computes without a bias (its module
docstring has the math): per (expert e, [BLOCK_A, BLOCK_B] output tile), out[e] = sum over e's
pairs p of A[row_a(p)]^T @ B[row_b(p)] in fp32, rounded once to out's dtype, where a row is the
pair p itself or its token p // TOP_K (A_BY_TOKEN, B_BY_TOKEN). dW_down[e] = dOut^T @ hw and
dW_gate_up[e] = dP^T @ x. An expert with no pairs gets zeros.

An expert holds about T * TOP_K / E pairs, so a tile's reduction is short (16 steps of 64 rows at
Qwen3-30B-A3B's T = 16384): one program per tile spends much of its time filling and draining its
pipeline. Here each persistent program (one per SM) walks its tiles with three groups of warps
that hand work on through shared memory and mbarriers, so the next tile's loads and MMAs run
while a tile is written:

- the loader (LOADER_WARPS warps): per step, ROWS of the expert's pairs: the rows of A
  [ROWS, BLOCK_A] and of B [ROWS, BLOCK_B], both gathered by cp.async (Hopper's TMA has no row
  gather; padding pairs load as zeros), into a ring of NUM_STAGES buffers. A step's rows are
  waited for LAG steps later (cp.async groups), then fenced for the tensor cores and signalled;
- the MMA group (the default partition, `num_warps` warps: one warpgroup for tiles of up to
  128 rows, two for 256): wgmma of the A stage read transposed ([BLOCK_A, ROWS] as a view of
  [ROWS, BLOCK_A]) by the B stage, into one fp32 accumulator, written when the tile is done into
  a shared handoff buffer (`ws_jit.mma_tile_to_handoff`; fp32 where it fits beside the ring,
  else in out's dtype: either way the sum is rounded once, to out's dtype);
- the epilogue group (EPILOGUE_WARPS warps): reads the handoff in [EPILOGUE_A, BLOCK_B] slices
  and writes them through out's strides.

What it takes (`can_run`): 16-bit operands without a bias, A's and B's rows and out's B axis
contiguous, column counts and row strides multiples of 16, 16-byte-aligned base pointers (every
real model's contiguous experts); the rest (biases: gpt-oss; the adapters' narrow gradients) runs
`_experts_wgrad_kernel`. Gluon kernels run on the GPU only (no interpreter), and wgmma on Hopper
only. Written against Triton 3.6's Gluon; the names that changed by 3.9 are aliased.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, mbarrier

from .device import capability, interpreting, num_sms
from .experts_backward_config import ExpertsBackwardConfig
from .launcher import FastLaunch
from .ws_jit import (SHARED_MEMORY_BYTES, cp_async, last_rows_landed, mma_tile_to_handoff, partition_barrier,
                     ring_barriers, rows_landed)

LOADER_WARPS = 4
EPILOGUE_WARPS = 4


@gluon.jit
def _tile_of(tile_id, tiles_a, tiles_b):
    """(expert, pid_a, pid_b) of a tile id, expert-major: programs running at once share an expert's rows in L2."""
    expert = tile_id // (tiles_a * tiles_b)
    rest = tile_id % (tiles_a * tiles_b)
    return expert, rest // tiles_b, rest % tiles_b


@gluon.jit
def _gather_rows(ring, base_ptr, pairs_ptr, step_row, offs_r, cols, NUM_PAIRS, COLS, stride_m,
                 TOP_K: gl.constexpr, BY_TOKEN: gl.constexpr):
    """cp.async of ROWS gathered rows [ROWS, BLOCK] (pairs from step_row on; by token or by pair) into `ring`."""
    pairs = gl.load(pairs_ptr + step_row + offs_r)
    rows = pairs.to(gl.int64)
    if BY_TOKEN:
        rows = rows // TOP_K
    mask = (pairs < NUM_PAIRS)[:, None] & (cols < COLS)[None, :]
    cp_async(ring, base_ptr + rows[:, None] * stride_m + cols[None, :], mask=mask)


@gluon.jit
def _loader(a_ptr, b_ptr, pairs_ptr, starts_ptr, ends_ptr, a_ring, b_ring, ready, empty,
            NUM_PAIRS, A_COLS, B_COLS, NUM_EXPERTS, stride_am, stride_bm,
            TOP_K: gl.constexpr, A_BY_TOKEN: gl.constexpr, B_BY_TOKEN: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_A: gl.constexpr, BLOCK_B: gl.constexpr, ROWS: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
            NUM_STAGES: gl.constexpr, LAG: gl.constexpr, LOADER_WARPS: gl.constexpr):
    """Per step, ROWS gathered rows of A and of B into the ring (one cp.async group); a stage is
    ready (its barrier counts 1) LAG steps after it was issued, once its rows have landed."""
    a_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_A, BLOCK_A // 8], [LOADER_WARPS, 1], [1, 0])
    b_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_B, BLOCK_B // 8], [LOADER_WARPS, 1], [1, 0])
    tiles_a = gl.cdiv(A_COLS, BLOCK_A)
    tiles_b = gl.cdiv(B_COLS, BLOCK_B)
    offs_ra = gl.arange(0, ROWS, layout=gl.SliceLayout(1, a_layout))
    offs_rb = gl.arange(0, ROWS, layout=gl.SliceLayout(1, b_layout))
    step = 0
    for tile_id in range(gl.program_id(0), NUM_EXPERTS * tiles_a * tiles_b, NUM_PROGRAMS):
        expert, pid_a, pid_b = _tile_of(tile_id, tiles_a, tiles_b)
        cols_a = pid_a * BLOCK_A + gl.arange(0, BLOCK_A, layout=gl.SliceLayout(0, a_layout))
        cols_b = pid_b * BLOCK_B + gl.arange(0, BLOCK_B, layout=gl.SliceLayout(0, b_layout))
        first = gl.load(starts_ptr + expert) * (BLOCK_M // ROWS)
        last = gl.load(ends_ptr + expert) * (BLOCK_M // ROWS)
        for row_step in range(first, last):
            s = step % NUM_STAGES
            mbarrier.wait(empty.index(s), ((step // NUM_STAGES) & 1) ^ 1)
            _gather_rows(a_ring.index(s), a_ptr, pairs_ptr, row_step * ROWS, offs_ra, cols_a, NUM_PAIRS, A_COLS,
                         stride_am, TOP_K, A_BY_TOKEN)
            _gather_rows(b_ring.index(s), b_ptr, pairs_ptr, row_step * ROWS, offs_rb, cols_b, NUM_PAIRS, B_COLS,
                         stride_bm, TOP_K, B_BY_TOKEN)
            async_copy.commit_group()
            rows_landed(ready, step, LAG, NUM_STAGES)  # the stage issued LAG steps ago is ready
            step += 1
    last_rows_landed(ready, step, LAG, NUM_STAGES)


@gluon.jit
def _mma(a_ring, b_ring, ready, empty, handoff, handoff_ready, handoff_free, starts_ptr, ends_ptr, A_COLS, B_COLS,
         NUM_EXPERTS, BLOCK_M: gl.constexpr, BLOCK_A: gl.constexpr, BLOCK_B: gl.constexpr, ROWS: gl.constexpr,
         NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr, MMA_WARPS: gl.constexpr):
    """Each tile's sum A^T B by wgmma over its expert's steps (none for an expert without pairs: zeros)."""
    tiles_a = gl.cdiv(A_COLS, BLOCK_A)
    tiles_b = gl.cdiv(B_COLS, BLOCK_B)
    step = 0
    tiles_done = 0
    for tile_id in range(gl.program_id(0), NUM_EXPERTS * tiles_a * tiles_b, NUM_PROGRAMS):
        expert, pid_a, pid_b = _tile_of(tile_id, tiles_a, tiles_b)
        steps = (gl.load(ends_ptr + expert) - gl.load(starts_ptr + expert)) * (BLOCK_M // ROWS)
        step, tiles_done = mma_tile_to_handoff(a_ring, b_ring, ready, empty, handoff, handoff_ready, handoff_free,
                                               steps, step, tiles_done, BLOCK_A, BLOCK_B, NUM_STAGES, MMA_WARPS,
                                               A_TRANSPOSED=True)


@gluon.jit
def _epilogue(handoff, handoff_ready, handoff_free, out_ptr, A_COLS, B_COLS, NUM_EXPERTS,
              stride_oe, stride_oa, BLOCK_A: gl.constexpr, BLOCK_B: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
              EPILOGUE_A: gl.constexpr, EPILOGUE_WARPS: gl.constexpr):
    """Per tile, the handoff in [EPILOGUE_A, BLOCK_B] slices, rounded once, into out[e] (B axis contiguous)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_B, BLOCK_B // 8], [EPILOGUE_WARPS, 1], [1, 0])
    tiles_a = gl.cdiv(A_COLS, BLOCK_A)
    tiles_b = gl.cdiv(B_COLS, BLOCK_B)
    tiles_done = 0
    for tile_id in range(gl.program_id(0), NUM_EXPERTS * tiles_a * tiles_b, NUM_PROGRAMS):
        expert, pid_a, pid_b = _tile_of(tile_id, tiles_a, tiles_b)
        cols = pid_b * BLOCK_B + gl.arange(0, BLOCK_B, layout=gl.SliceLayout(0, layout))
        out_tile = out_ptr + expert.to(gl.int64) * stride_oe
        mbarrier.wait(handoff_ready, tiles_done & 1)
        for r in gl.static_range(BLOCK_A // EPILOGUE_A):
            rows = pid_a * BLOCK_A + r * EPILOGUE_A + gl.arange(0, EPILOGUE_A, layout=gl.SliceLayout(1, layout))
            value = handoff.slice(r * EPILOGUE_A, EPILOGUE_A, dim=0).load(layout).to(gl.float32)
            gl.store(out_tile + rows[:, None].to(gl.int64) * stride_oa + cols[None, :],
                     value.to(out_ptr.dtype.element_ty), mask=(rows < A_COLS)[:, None] & (cols < B_COLS)[None, :])
        partition_barrier()
        mbarrier.arrive(handoff_free, count=1)
        tiles_done += 1


@gluon.jit
def _experts_wgrad_ws_kernel(
    a_ptr, b_ptr, pairs_ptr, starts_ptr, ends_ptr, out_ptr,
    NUM_PAIRS, A_COLS, B_COLS, NUM_EXPERTS, stride_am, stride_bm, stride_oe, stride_oa,
    TOP_K: gl.constexpr, A_BY_TOKEN: gl.constexpr, B_BY_TOKEN: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_A: gl.constexpr, BLOCK_B: gl.constexpr, ROWS: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
    NUM_STAGES: gl.constexpr, LAG: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGISTERS: gl.constexpr,
    EPILOGUE_A: gl.constexpr, EPILOGUE_WARPS: gl.constexpr, EPILOGUE_REGISTERS: gl.constexpr,
    HANDOFF_FP32: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    a_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, ROWS, BLOCK_A],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_A], dtype))
    b_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, ROWS, BLOCK_B],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_B], dtype))
    handoff_dtype: gl.constexpr = gl.float32 if HANDOFF_FP32 else dtype
    handoff = gl.allocate_shared_memory(handoff_dtype, [BLOCK_A, BLOCK_B],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_A, BLOCK_B], handoff_dtype))
    ready, empty, handoff_ready, handoff_free = ring_barriers(NUM_STAGES, 1)  # ready: the rows' arrive

    gl.warp_specialize([
        (_mma, (a_ring, b_ring, ready, empty, handoff, handoff_ready, handoff_free, starts_ptr, ends_ptr, A_COLS,
                B_COLS, NUM_EXPERTS, BLOCK_M, BLOCK_A, BLOCK_B, ROWS, NUM_PROGRAMS, NUM_STAGES, num_warps)),
        (_loader, (a_ptr, b_ptr, pairs_ptr, starts_ptr, ends_ptr, a_ring, b_ring, ready, empty,
                   NUM_PAIRS, A_COLS, B_COLS, NUM_EXPERTS, stride_am, stride_bm, TOP_K, A_BY_TOKEN, B_BY_TOKEN,
                   BLOCK_M, BLOCK_A, BLOCK_B, ROWS, NUM_PROGRAMS, NUM_STAGES, LAG, LOADER_WARPS)),
        (_epilogue, (handoff, handoff_ready, handoff_free, out_ptr, A_COLS, B_COLS, NUM_EXPERTS, stride_oe, stride_oa,
                     BLOCK_A, BLOCK_B, NUM_PROGRAMS, EPILOGUE_A, EPILOGUE_WARPS)),
    ], [LOADER_WARPS, EPILOGUE_WARPS], [LOADER_REGISTERS, EPILOGUE_REGISTERS])


def can_run(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, out_strides: tuple[int, int, int],
            has_bias: bool) -> bool:
    """A 16-bit call on a Hopper GPU, outside the interpreter, without a bias; A's and B's rows
    (columns contiguous), out's B axis contiguous, the column counts and the row strides multiples
    of 16 elements and the base pointers of 16 bytes: what Triton's specialization needs to prove
    every 8-element cp.async copy of a row whole and 16-byte aligned."""
    return (a.is_cuda and not interpreting() and a.dtype in (torch.bfloat16, torch.float16)
            and b.dtype == a.dtype and out.dtype == a.dtype and not has_bias
            and capability(a.device.index or 0)[0] == 9
            and a.stride(1) == 1 and b.stride(1) == 1 and out_strides[2] == 1
            and all(n % 16 == 0 for n in (a.shape[1], b.shape[1], a.stride(0), b.stride(0), *out_strides[:2]))
            and all(t.data_ptr() % 16 == 0 for t in (a, b, out)))


def make_launcher(config: ExpertsBackwardConfig, top_k: int, a_by_token: bool, b_by_token: bool):
    """A launcher `(a [*, A_COLS], b [*, B_COLS], sorted_pairs, starts [E], ends [E], out, out_strides,
    num_pairs, num_experts)` running one persistent program per SM, for calls that passed `can_run`: out[e]
    (through out_strides = (expert, A axis, B axis)) = sum over e's blocks [starts[e], ends[e]) of
    a[rows]^T @ b[rows], rows by token (p // top_k) or by pair as a_by_token and b_by_token say.

    config: the routing's block_m; the wgrad_ws_tile = (block_a, block_b) tile: block_a 64, 128 or
    256, block_b a multiple of 16 from 32 to 128 (one warpgroup of 4 MMA warps up to 128x128
    elements, two above; a wgmma of 256 columns needs more than the 128 registers a thread that
    16 warps leave); wgrad_rows (or block_m) rows a step; wgrad_num_stages (or num_stages) ring
    buffers. The loader and the epilogue take 4 warps each at config.wgrad_ws_registers =
    (loader, epilogue) registers a thread."""
    (block_a, block_b), rows = config.wgrad_ws_tile, config.wgrad_rows or config.block_m
    stages = config.wgrad_num_stages or config.num_stages
    if stages < 3:  # the loader signals a stage LAG >= 1 steps late and the MMA holds one wgmma in flight
        raise ValueError(f"experts_wgrad_ws: a ring of at least 3 stages, got {stages} (with 2 the loader and the MMA group "
                         f"wait on each other)")
    if block_a not in (64, 128, 256) or block_b % 16 or not 32 <= block_b <= 128:
        raise ValueError(f"experts_wgrad_ws: a 64-, 128- or 256-row tile and 32 to 128 columns in steps of 16, got "
                         f"{block_a}x{block_b}")
    ring = stages * rows * (block_a + block_b) * 2
    if ring + block_a * block_b * 2 > SHARED_MEMORY_BYTES:
        raise ValueError(f"experts_wgrad_ws: {stages} stages of {rows} rows and the handoff take "
                         f"{ring + block_a * block_b * 2} bytes of shared memory, over Hopper's {SHARED_MEMORY_BYTES}: "
                         f"fewer stages or rows")
    loader_registers, epilogue_registers = config.wgrad_ws_registers
    fixed = dict(TOP_K=top_k, A_BY_TOKEN=a_by_token, B_BY_TOKEN=b_by_token, BLOCK_M=config.block_m, BLOCK_A=block_a,
                 BLOCK_B=block_b, ROWS=rows, NUM_STAGES=stages, LAG=max(1, stages - 2), LOADER_WARPS=LOADER_WARPS,
                 LOADER_REGISTERS=loader_registers, EPILOGUE_A=min(block_a, 4096 // block_b),
                 EPILOGUE_WARPS=EPILOGUE_WARPS, EPILOGUE_REGISTERS=epilogue_registers,
                 HANDOFF_FP32=ring + block_a * block_b * 4 <= SHARED_MEMORY_BYTES,
                 num_warps=4 if block_a * block_b <= 128 * 128 else 8)
    kernels: dict[int, FastLaunch] = {}  # programs -> launcher

    def launch(a, b, sorted_pairs, starts, ends, out, out_strides, num_pairs: int, num_experts: int) -> None:
        index = a.device.index or 0
        programs = num_sms(index)
        kernel = kernels.get(programs)
        if kernel is None:  # a constant NUM_PROGRAMS per device compiles once whatever the tile count
            kernel = kernels[programs] = FastLaunch(_experts_wgrad_ws_kernel, dict(fixed, NUM_PROGRAMS=programs))
        kernel(programs, index, a, b, sorted_pairs, starts, ends, out, num_pairs, a.shape[1], b.shape[1], num_experts,
               a.stride(0), b.stride(0), out_strides[0], out_strides[1])

    launch.constexprs = fixed  # what the kernel compiles with, less NUM_PROGRAMS (tests compile it without a GPU)
    return launch
