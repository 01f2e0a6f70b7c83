"""Gluon helpers the warp-specialized Hopper kernels share (`gated_backward_ws.py`, `experts_dh_ws.py`,
`experts_wgrad_ws.py`).

- `partition_barrier`, `tma_load`, `cp_async`: names that changed between Triton 3.6 and 3.9, aliased;
- `SHARED_MEMORY_BYTES`: Hopper's shared memory per block less the mbarriers';
- `ring_barriers`: the ring's and the handoff's mbarriers, allocated and initialised;
- `rows_landed`, `last_rows_landed`: a loader's cp.async protocol: a stage's rows are waited
  for LAG steps after they were issued, fenced for the tensor cores, and signalled;
- `mma_tile`, `accumulator_to_handoff`, and `mma_tile_to_handoff` (the two in turn): the MMA
  partition's work for one tile: wgmma over the operand ring into an fp32 accumulator, each stage
  released as soon as its MMA retires, then the accumulator written into the shared handoff
  buffer once the epilogue partition has freed it.
Nothing here launches anything.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

# A barrier across one partition's warps: `thread_barrier` in Triton 3.6, `barrier` in 3.9.
partition_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
# A TMA box into shared memory: `async_copy_global_to_shared` in Triton 3.6, `async_load` in 3.9.
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
# cp.async into shared memory: `async_copy_global_to_shared` in Triton 3.6, `async_load` in 3.9.
cp_async = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared
# Hopper's shared memory per block (227 KiB) less 1 KiB for the mbarriers.
SHARED_MEMORY_BYTES = 227 * 1024 - 1024


@gluon.jit
def ring_barriers(NUM_STAGES: gl.constexpr, READY_COUNT: gl.constexpr):
    """(ready [NUM_STAGES], empty [NUM_STAGES], handoff_ready, handoff_free): mbarriers in shared memory,
    initialised; a stage's ready barrier counts READY_COUNT arrivals, every other one 1."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    handoff_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    handoff_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=READY_COUNT)
        mbarrier.init(empty.index(s), count=1)
    mbarrier.init(handoff_ready, count=1)
    mbarrier.init(handoff_free, count=1)
    return ready, empty, handoff_ready, handoff_free


@gluon.jit
def rows_landed(ready, step, LAG: gl.constexpr, NUM_STAGES: gl.constexpr):
    """After a loader commits step `step`'s cp.async group: once the rows issued LAG steps ago have landed,
    fence them for the tensor cores and arrive on their stage's ready barrier."""
    async_copy.wait_group(LAG)
    if step >= LAG:
        fence_async_shared()
        partition_barrier()
        mbarrier.arrive(ready.index((step - LAG) % NUM_STAGES), count=1)


@gluon.jit
def last_rows_landed(ready, step, LAG: gl.constexpr, NUM_STAGES: gl.constexpr):
    """After a loader's last step (`step` steps issued): every group landed, fenced, and the stages not yet
    signalled arrived on."""
    async_copy.wait_group(0)
    fence_async_shared()
    partition_barrier()
    for done in range(max(step - LAG, 0), step):
        mbarrier.arrive(ready.index(done % NUM_STAGES), count=1)


@gluon.jit
def mma_tile(a_ring, b_ring, ready, empty, k_tiles, step, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             NUM_STAGES: gl.constexpr, MMA_WARPS: gl.constexpr, A_TRANSPOSED: gl.constexpr = False,
             WARPS_N: gl.constexpr = 1, B_TRANSPOSED: gl.constexpr = False):
    """One [BLOCK_M, BLOCK_N] tile in fp32: the sum over k_tiles ring stages (from the running `step`;
    none gives zeros) of a_ring[s] @ b_ring[s] by wgmma (a_ring[s]^T where A_TRANSPOSED: stages
    [BLOCK_K, BLOCK_M]; b_ring[s]^T where B_TRANSPOSED: stages [BLOCK_N, BLOCK_K]), each stage
    released as soon as its MMA retires. WARPS_N: warpgroups side by side along N (2: each of two
    warpgroups takes BLOCK_N / 2 columns, a wgmma of half the width). Returns (acc, step)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                         warps_per_cta=[MMA_WARPS // WARPS_N, WARPS_N],
                                                         instr_shape=[16, BLOCK_N // WARPS_N, 16])
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    for ki in range(k_tiles):
        s = step % NUM_STAGES
        mbarrier.wait(ready.index(s), (step // NUM_STAGES) & 1)
        a_stage = a_ring.index(s)
        if A_TRANSPOSED:
            a_stage = a_stage.permute((1, 0))
        b_stage = b_ring.index(s)
        if B_TRANSPOSED:
            b_stage = b_stage.permute((1, 0))
        acc = warpgroup_mma(a_stage, b_stage, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        # the MMA of the step before has retired: its stage is free
        mbarrier.arrive(empty.index((step + NUM_STAGES - 1) % NUM_STAGES), count=1, pred=ki > 0)
        step += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((step + NUM_STAGES - 1) % NUM_STAGES), count=1, pred=k_tiles > 0)
    return acc, step


@gluon.jit
def accumulator_to_handoff(acc, handoff, handoff_ready, handoff_free, tiles_done):
    """acc into `handoff` (in its dtype) once the epilogue has freed it (`handoff_free`, phase by
    `tiles_done`), signalled by `handoff_ready`. Returns tiles_done + 1."""
    mbarrier.wait(handoff_free, (tiles_done & 1) ^ 1)
    handoff.store(acc.to(handoff.dtype))
    partition_barrier()
    mbarrier.arrive(handoff_ready, count=1)
    return tiles_done + 1


@gluon.jit
def mma_tile_to_handoff(a_ring, b_ring, ready, empty, handoff, handoff_ready, handoff_free, k_tiles, step, tiles_done,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                        MMA_WARPS: gl.constexpr, A_TRANSPOSED: gl.constexpr = False, WARPS_N: gl.constexpr = 1):
    """The MMA partition's work for one tile: `mma_tile`, then `accumulator_to_handoff`. Returns
    (step, tiles_done) after the tile."""
    acc, step = mma_tile(a_ring, b_ring, ready, empty, k_tiles, step, BLOCK_M, BLOCK_N, NUM_STAGES, MMA_WARPS,
                         A_TRANSPOSED, WARPS_N)
    tiles_done = accumulator_to_handoff(acc, handoff, handoff_ready, handoff_free, tiles_done)
    return step, tiles_done
