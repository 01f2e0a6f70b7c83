"""The warp-specialized backward GEMM of the gated MLP for large M on Hopper, in Gluon.

Computes what `gated_backward_pointer.py` computes (its docstring has the math, the layout of
P and dP, dtypes and rounding): dH = dY @ Wd in fp32, then h and the interleaved
dP = (dH * dh/dgate, dH * dh/dup) from the matching tile of P, with the epilogue of one tile
running while the tensor cores work on the next. Each persistent program (one per SM) holds
three groups of warps that hand work on through shared memory and mbarriers:

- the loader (1 warp): per K step, one [BLOCK_SIZE_M, BLOCK_SIZE_K] TMA box of dY [M, K] and
  one [BLOCK_SIZE_K, BLOCK_SIZE_N] box of Wd [K, I] into a ring of NUM_STAGES buffers;
- the MMA group (the default partition, `num_warps` warps): wgmma over the ring into one fp32
  accumulator [BLOCK_SIZE_M, BLOCK_SIZE_N] of dH, written when the tile is done into one
  shared buffer of the same shape (the handoff: fp32 where it fits beside the ring, else in
  dY's dtype, `SHARED_MEMORY_BYTES`);
- the epilogue group (EPILOGUE_WARPS warps): reads the handoff in [EPILOGUE_M, EPILOGUE_N]
  slices (EPILOGUE_N 8 or 16: a slice lies in one 16-column gate/up block of P, so its gate
  columns are contiguous from c + 16 * (c // 16) for a slice starting at output column c, and
  its up columns 16 later: 16-byte loads and stores; EPILOGUE_M rows: two repetitions of the
  epilogue's layout, 16 elements of each operand a thread, so a 256-row tile needs no more
  registers than a 128-row one), adds dh_in there (HAS_DH_IN), and writes h and dP (over P
  when dP is P: each element is read before it is written, by the same thread).

Tiles: 128x128 with 4 MMA warps (one warpgroup, fp32 handoff beside 5 stages), or 256x128 with
8 (two warpgroups share each Wd box: a quarter fewer bytes from L2 per flop; the kernel launches
16 warps at 128 registers, and the handoff is 16-bit beside 3 stages).

The MMA group starts the next tile while the epilogue group works through the handoff; it
waits only if the epilogue is a whole tile behind. With the fp32 handoff dH stays in fp32 to the
derivative, as in the other fused kernels; with the 16-bit one it is rounded once to dY's dtype,
as HF eager's backward rounds it.

TMA needs dY and Wd 16-bit, unit inner strides, 16-byte-aligned rows and base pointers, and
I % 16 == 0; out-of-bounds TMA reads are zeros, so any M and K work. The kernel reads P, dP, h
and dh_in by pointer (any strides); `can_run` asks the TMA kernels' alignment of all of them, as
the planner's test is one for every operand. Gluon kernels run on the GPU only (no
interpreter), and wgmma on Hopper only: the planner picks this kernel there
(`rules.BACKWARD_RULES`). Written against Triton 3.6's Gluon; the two names that changed by
3.9 are aliased below. H100 measurements: docs/backward_gemm.md.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .configs import TMA_DTYPES, GatedGemmConfig, KernelCapability
from .device import capability, interpreting, num_sms, tma_operands_ok
from .jit_common import gated_epilogue_grad, tile_pid
from .launcher import FastLaunch
from .layout import GATE_UP_BLOCK
from .ws_jit import SHARED_MEMORY_BYTES, mma_tile_to_handoff, partition_barrier, ring_barriers, tma_load

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _loader(dy_desc, wd_desc, a_ring, b_ring, ready, empty, M, I, K,
            BLOCK_SIZE_M: gl.constexpr, BLOCK_SIZE_N: gl.constexpr, BLOCK_SIZE_K: gl.constexpr,
            GROUP_SIZE_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr):
    """TMA boxes of dY and Wd into the ring, NUM_STAGES steps ahead of the MMAs."""
    num_pid_m = gl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = gl.cdiv(I, BLOCK_SIZE_N)
    k_tiles = gl.cdiv(K, BLOCK_SIZE_K)
    step = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
        pid_m, pid_n = tile_pid(tile_id, GROUP_SIZE_M * num_pid_n, num_pid_m, GROUP_SIZE_M)
        for ki in range(k_tiles):
            s = step % NUM_STAGES
            mbarrier.wait(empty.index(s), ((step // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), dy_desc.block_type.nbytes + wd_desc.block_type.nbytes)
            tma_load(dy_desc, [pid_m * BLOCK_SIZE_M, ki * BLOCK_SIZE_K], ready.index(s), a_ring.index(s))
            tma_load(wd_desc, [ki * BLOCK_SIZE_K, pid_n * BLOCK_SIZE_N], ready.index(s), b_ring.index(s))
            step += 1


@gluon.jit
def _mma(a_ring, b_ring, ready, empty, handoff, handoff_ready, handoff_free, M, I, K,
         BLOCK_SIZE_M: gl.constexpr, BLOCK_SIZE_N: gl.constexpr, BLOCK_SIZE_K: gl.constexpr,
         NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr, MMA_WARPS: gl.constexpr):
    """dH tiles by wgmma over the ring, each written to the handoff buffer when done."""
    num_tiles = gl.cdiv(M, BLOCK_SIZE_M) * gl.cdiv(I, BLOCK_SIZE_N)
    k_tiles = gl.cdiv(K, BLOCK_SIZE_K)
    step = 0
    tiles_done = 0
    for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        step, tiles_done = mma_tile_to_handoff(a_ring, b_ring, ready, empty, handoff, handoff_ready, handoff_free,
                                               k_tiles, step, tiles_done, BLOCK_SIZE_M, BLOCK_SIZE_N, NUM_STAGES,
                                               MMA_WARPS)


@gluon.jit
def _epilogue(handoff, handoff_ready, handoff_free, p_ptr, dp_ptr, h_ptr, dh_ptr, M, I,
              stride_pm, stride_pn, stride_dpm, stride_dpn, stride_hm, stride_hi, stride_dhm, stride_dhi,
              HAS_DH_IN: gl.constexpr, ACTIVATION: gl.constexpr, APPROX_TANH: gl.constexpr,
              GATE_SCALE: gl.constexpr, OUT_SCALE: gl.constexpr, CLAMP: gl.constexpr, LIMIT: gl.constexpr,
              GATE_UP_BLOCK: gl.constexpr, BLOCK_SIZE_M: gl.constexpr, BLOCK_SIZE_N: gl.constexpr,
              GROUP_SIZE_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, EPILOGUE_M: gl.constexpr,
              EPILOGUE_N: gl.constexpr, EPILOGUE_WARPS: gl.constexpr):
    """Per tile, per [EPILOGUE_M, EPILOGUE_N] slice of the handoff: h and dP from dH and P."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // EPILOGUE_N, EPILOGUE_N // 8], [EPILOGUE_WARPS, 1],
                                            [1, 0])
    num_pid_m = gl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = gl.cdiv(I, BLOCK_SIZE_N)
    tiles_done = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
        pid_m, pid_n = tile_pid(tile_id, GROUP_SIZE_M * num_pid_n, num_pid_m, GROUP_SIZE_M)
        mbarrier.wait(handoff_ready, tiles_done & 1)
        for r in gl.static_range(BLOCK_SIZE_M // EPILOGUE_M):
            rows = (pid_m * BLOCK_SIZE_M + r * EPILOGUE_M
                    + gl.arange(0, EPILOGUE_M, layout=gl.SliceLayout(1, layout))).to(gl.int64)
            for j in gl.static_range(BLOCK_SIZE_N // EPILOGUE_N):
                start = pid_n * BLOCK_SIZE_N + j * EPILOGUE_N
                slice_cols = gl.arange(0, EPILOGUE_N, layout=gl.SliceLayout(0, layout))
                cols = start + slice_cols
                # the slice lies in one gate/up block of P: its gate columns are contiguous from
                # start + (start // 16) * 16, its up columns 16 later
                gate_cols = start + (start // GATE_UP_BLOCK) * GATE_UP_BLOCK + slice_cols
                mask = (rows[:, None] < M) & (cols[None, :] < I)
                dh = handoff.slice(r * EPILOGUE_M, EPILOGUE_M, dim=0).slice(j * EPILOGUE_N, EPILOGUE_N, dim=1).load(
                    layout).to(gl.float32)
                if HAS_DH_IN:
                    dh_in = gl.load(dh_ptr + rows[:, None] * stride_dhm + cols[None, :] * stride_dhi, mask=mask, other=0.0)
                    dh += dh_in.to(gl.float32)
                p_rows = p_ptr + rows[:, None] * stride_pm
                gate = gl.load(p_rows + gate_cols[None, :] * stride_pn, mask=mask, other=0.0).to(gl.float32)
                up = gl.load(p_rows + (gate_cols + GATE_UP_BLOCK)[None, :] * stride_pn, mask=mask,
                             other=0.0).to(gl.float32)
                h, dgate, dup = gated_epilogue_grad(gate, up, dh, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE,
                                                    CLAMP, LIMIT)
                dp_rows = dp_ptr + rows[:, None] * stride_dpm
                gl.store(dp_rows + gate_cols[None, :] * stride_dpn, dgate.to(dp_ptr.dtype.element_ty), mask=mask)
                gl.store(dp_rows + (gate_cols + GATE_UP_BLOCK)[None, :] * stride_dpn, dup.to(dp_ptr.dtype.element_ty),
                         mask=mask)
                gl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :] * stride_hi, h.to(h_ptr.dtype.element_ty),
                         mask=mask)
        partition_barrier()
        mbarrier.arrive(handoff_free, count=1)
        tiles_done += 1


@gluon.jit
def _gated_backward_ws_kernel(
    dy_desc, wd_desc, p_ptr, dp_ptr, h_ptr, dh_ptr, M, I, K,
    stride_pm, stride_pn, stride_dpm, stride_dpn, stride_hm, stride_hi, stride_dhm, stride_dhi,
    HAS_DH_IN: gl.constexpr, ACTIVATION: gl.constexpr, APPROX_TANH: gl.constexpr,
    GATE_SCALE: gl.constexpr, OUT_SCALE: gl.constexpr, CLAMP: gl.constexpr, LIMIT: gl.constexpr,
    GATE_UP_BLOCK: gl.constexpr,
    BLOCK_SIZE_M: gl.constexpr,
    BLOCK_SIZE_N: gl.constexpr,
    BLOCK_SIZE_K: gl.constexpr,
    GROUP_SIZE_M: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    EPILOGUE_M: gl.constexpr,
    EPILOGUE_N: gl.constexpr,
    EPILOGUE_WARPS: gl.constexpr,
    EPILOGUE_REGISTERS: gl.constexpr,
    HANDOFF_FP32: gl.constexpr,
    num_warps: gl.constexpr,
):
    handoff_dtype: gl.constexpr = gl.float32 if HANDOFF_FP32 else dy_desc.dtype
    a_ring = gl.allocate_shared_memory(dy_desc.dtype, [NUM_STAGES] + dy_desc.block_type.shape, dy_desc.layout)
    b_ring = gl.allocate_shared_memory(wd_desc.dtype, [NUM_STAGES] + wd_desc.block_type.shape, wd_desc.layout)
    handoff = gl.allocate_shared_memory(handoff_dtype, [BLOCK_SIZE_M, BLOCK_SIZE_N],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_SIZE_M, BLOCK_SIZE_N], handoff_dtype))
    ready, empty, handoff_ready, handoff_free = ring_barriers(NUM_STAGES, 1)  # ready: the TMA loads' expect

    gl.warp_specialize([
        (_mma, (a_ring, b_ring, ready, empty, handoff, handoff_ready, handoff_free, M, I, K,
                BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, NUM_PROGRAMS, NUM_STAGES, num_warps)),
        (_loader, (dy_desc, wd_desc, a_ring, b_ring, ready, empty, M, I, K,
                   BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, NUM_PROGRAMS, NUM_STAGES)),
        (_epilogue, (handoff, handoff_ready, handoff_free, p_ptr, dp_ptr, h_ptr, dh_ptr, M, I,
                     stride_pm, stride_pn, stride_dpm, stride_dpn, stride_hm, stride_hi, stride_dhm, stride_dhi,
                     HAS_DH_IN, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT, GATE_UP_BLOCK,
                     BLOCK_SIZE_M, BLOCK_SIZE_N, GROUP_SIZE_M, NUM_PROGRAMS, EPILOGUE_M, EPILOGUE_N, EPILOGUE_WARPS)),
    ], [1, EPILOGUE_WARPS], [24, EPILOGUE_REGISTERS])

CAPABILITY = KernelCapability("backward_ws", ops=("backward",), features=frozenset({"dh_in"}), dtypes=TMA_DTYPES,
                              tma=True, gpu_only=True)


def can_run(dy: torch.Tensor, down_weight: torch.Tensor, preact: torch.Tensor, dpreact: torch.Tensor,
            h: torch.Tensor, dh_in: torch.Tensor | None = None) -> bool:
    """CUDA tensors on a Hopper GPU (wgmma), outside the interpreter, meeting `configs.TMA_NEEDS`
    (`device.tma_operands_ok`) as the TMA kernel's (the kernel reads P, dP, h and dh_in with plain
    loads and stores, so it would take any strides there; the planner's alignment test is one
    for all operands)."""
    return (dy.is_cuda and not interpreting() and dy.shape[1] > 0 and down_weight.shape[1] > 0  # boxes need K, I > 0
            and capability(dy.device.index or 0)[0] == 9
            and tma_operands_ok(down_weight.shape[1], dy, down_weight, preact, dpreact, h))


def make_launcher(config: GatedGemmConfig, epilogue: dict, dtype: torch.dtype, has_dh_in: bool = False):
    """A launcher `(dy [M, K], down_weight [K, I], preact [M, 2*I], dpreact [M, 2*I], h [M, I], dh_in)`
    running one persistent program per SM (launched by `FastLaunch`: the descriptors go through
    Triton's compiled launcher without its per-call binding), writing dP (may be preact itself) and
    h; the tensors passed `can_run`; dh_in [M, I] must be given with has_dh_in, None without.

    config: block_m x block_n x block_k tiles, num_stages ring buffers, num_warps MMA warps (4 or
    8); the epilogue group takes config.epilogue_warps warps at config.epilogue_registers
    registers each, in block_n / config.epilogue_subtiles column slices."""
    epilogue_n = config.block_n // config.epilogue_subtiles
    # rows per slice: two repetitions of the epilogue's layout (16 elements of each operand a thread)
    epilogue_m = min(config.block_m, 2 * (32 * 8 // epilogue_n) * config.epilogue_warps)
    if config.block_n % config.epilogue_subtiles or epilogue_n not in (8, 16):
        raise ValueError(f"gated_backward_ws: block_n / epilogue_subtiles must be 8 or 16 columns (within one "
                         f"gate/up block), got {config.block_n} / {config.epilogue_subtiles}")
    gl_dtype = _GL_DTYPES[dtype]
    dy_layout = gl.NVMMASharedLayout.get_default_for([config.block_m, config.block_k], gl_dtype)
    wd_layout = gl.NVMMASharedLayout.get_default_for([config.block_k, config.block_n], gl_dtype)
    ring_bytes = config.num_stages * (config.block_m + config.block_n) * config.block_k * 2
    fixed = dict(
        HAS_DH_IN=has_dh_in, **epilogue, GATE_UP_BLOCK=GATE_UP_BLOCK, **config.meta(),
        NUM_STAGES=config.num_stages, EPILOGUE_M=epilogue_m, EPILOGUE_N=epilogue_n,
        EPILOGUE_WARPS=config.epilogue_warps, EPILOGUE_REGISTERS=config.epilogue_registers,
        HANDOFF_FP32=ring_bytes + config.block_m * config.block_n * 4 <= SHARED_MEMORY_BYTES,
        num_warps=config.num_warps,
    )

    kernels: dict[int, FastLaunch] = {}  # programs -> launcher

    def launch(dy: torch.Tensor, down_weight: torch.Tensor, preact: torch.Tensor, dpreact: torch.Tensor,
               h: torch.Tensor, dh_in: torch.Tensor | None = None) -> None:
        if has_dh_in and dh_in is None:
            raise ValueError("gated_backward_ws: a HAS_DH_IN launcher needs dh_in")
        dh = dh_in if has_dh_in else h  # not read without HAS_DH_IN
        m, k = dy.shape
        i = down_weight.shape[1]
        index = dy.device.index or 0
        programs = num_sms(index)
        kernel = kernels.get(programs)
        if kernel is None:  # a constant NUM_PROGRAMS per device compiles once whatever the tile count
            kernel = kernels[programs] = FastLaunch(_gated_backward_ws_kernel, dict(fixed, NUM_PROGRAMS=programs))
        dy_desc = TensorDescriptor(dy, [m, k], [dy.stride(0), 1], [config.block_m, config.block_k], dy_layout)
        wd_desc = TensorDescriptor(down_weight, [k, i], [down_weight.stride(0), 1], [config.block_k, config.block_n],
                                   wd_layout)
        kernel(programs, index, dy_desc, wd_desc, preact, dpreact, h, dh, m, i, k, *preact.stride(), *dpreact.stride(),
               *h.stride(), *dh.stride())

    launch.constexprs = fixed  # what the kernel compiles with, less NUM_PROGRAMS (tests compile it without a GPU)
    return launch
