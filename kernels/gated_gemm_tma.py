"""Fused gated GEMM for prefill on Hopper: TMA tensor descriptors, one 2*BLOCK_SIZE_N-wide MMA.

Computes the same function as `gated_gemm.py` (read its docstring for the layout, dtypes and
rounding), organised for large M:

- x [M, K] and the packed weight [2*I, K] are read through TMA descriptors: per K step one
  [BLOCK_SIZE_M, BLOCK_SIZE_K] box of x and one [2*BLOCK_SIZE_N, BLOCK_SIZE_K] box of packed
  rows. Since BLOCK_SIZE_N is a multiple of GATE_UP_BLOCK, that box holds BLOCK_SIZE_N // 16
  whole blocks: the gate rows of output columns pid_n*BLOCK_SIZE_N .. +BLOCK_SIZE_N and
  their up rows, interleaved by 16.
- one fp32 accumulator [BLOCK_SIZE_M, 2*BLOCK_SIZE_N] (a 128x256 tile: one wgmma N=256);
  the epilogue views it as [BM, BN/16, 2, 16], moves the gate/up axis last and splits it.
  Gate column j and up column j sit 16 columns apart, inside one thread's accumulator
  registers, so the split moves no data.
- persistent programs (`config.programs_per_sm` per SM, one by default) walk the tiles in
  grouped order for L2 reuse. With two per SM (a tile small enough for two programs' shared
  memory), one program's epilogue can run while the other's MMAs do.
- stream-K (`config.stream_k`; no shipped config sets it: the split tail below measured faster
  wherever both apply): where the last wave of whole tiles would leave most SMs idle, its
  tiles' K iterations are split evenly over all programs instead. A tile split between
  programs has each piece's fp32 accumulator stored to a workspace; the piece that completes
  the tile's arrival count sums all pieces in program order (the same sum whichever arrives
  last, so results are deterministic) and runs the epilogue. Nothing waits on another
  program, so it also runs in Triton's CPU interpreter. The counts live in an int32 buffer
  per (device, stream), zero between calls: concurrent calls on one stream are ordered, but
  two streams never share one.
- split tail (`config.split_tail`): where the last wave's T whole tiles would leave at least
  half the programs idle, each of them runs as S = 2 or 4 tiles of BLOCK_SIZE_N / S output
  columns instead (the largest S with S * T <= programs): one wave of narrower tiles, about
  1/S of a whole tile's time each, no workspace, no cross-program sums. Their weight box is
  [2 * BLOCK_SIZE_N / S, BLOCK_SIZE_K]: still whole 16-row gate/up blocks.

TMA zero-fills out-of-bounds reads and clips out-of-bounds writes, so any M and K work; it
needs I % 16 == 0 (whole blocks; every real model), unit inner strides and 16-byte-aligned
row strides and base pointers. `tma_supported` says whether a call qualifies; otherwise
`gated_gemm` uses the pointer kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation
from triton.tools.tensor_descriptor import TensorDescriptor

from .gated_gemm import GatedGemmConfig, _apply_activation, _tile_pid
from .gated_gemm import num_sms as _num_sms
from .layout import GATE_UP_BLOCK
from .stream_k import sk_first_iter, sk_owner, sk_piece_slot, stream_k_counts


@triton.jit
def _k_range_acc(x_desc, w_desc, offs_m, offs_w, k_begin, k_end,
                 BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr):
    """sum over K tiles k_begin..k_end-1 of x[offs_m:, k] @ w[offs_w:, k]^T, fp32 [BM, 2*BN]:
    gate and up columns interleaved by GATE_UP_BLOCK, as the packed rows are."""
    acc = tl.zeros((BLOCK_SIZE_M, 2 * BLOCK_SIZE_N), dtype=tl.float32)
    for ki in range(k_begin, k_end):
        x = x_desc.load([offs_m, ki * BLOCK_SIZE_K])  # [BLOCK_SIZE_M, BLOCK_SIZE_K]
        w = w_desc.load([offs_w, ki * BLOCK_SIZE_K])  # [2 * BLOCK_SIZE_N, BLOCK_SIZE_K]
        acc = tl.dot(x, w.T, acc)
    return acc


@triton.jit
def _gated_epilogue(acc, out_desc, b_ptr, offs_m, offs_w, pid_n, I,
                    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
                    GATE_UP_BLOCK: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr):
    """Bias, split gate/up in registers, act(gate) * up in fp32, one rounding, one TMA store."""
    if HAS_BIAS:
        offs_b = offs_w + tl.arange(0, 2 * BLOCK_SIZE_N)
        acc += tl.load(b_ptr + offs_b, mask=offs_b < 2 * I, other=0.0).to(tl.float32)[None, :]
    acc = tl.reshape(acc, (BLOCK_SIZE_M, 2 * BLOCK_SIZE_N // (2 * GATE_UP_BLOCK), 2, GATE_UP_BLOCK))
    acc = tl.permute(acc, (0, 1, 3, 2))
    gate, up = tl.split(tl.reshape(acc, (BLOCK_SIZE_M, BLOCK_SIZE_N, 2)))  # [BLOCK_SIZE_M, BLOCK_SIZE_N] each
    h = _apply_activation(gate, ACTIVATION, APPROX_TANH) * up
    out_desc.store([offs_m, pid_n * BLOCK_SIZE_N], h.to(out_desc.dtype))


@triton.jit
def _gated_gemm_tma_tiles(
    x_desc, w_desc, out_desc, w_tail_desc, out_tail_desc, b_ptr, ws_ptr, cnt_ptr, M, I, K, dp_tiles,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    APPROX_TANH: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    FLATTEN: tl.constexpr,
    STREAM_K: tl.constexpr,
    TAIL_SPLIT: tl.constexpr,
):
    """The persistent tile loop, shared by the host- and device-descriptor kernels.

    Tiles 0..dp_tiles-1 run data-parallel (whole tiles, strided over the programs). With
    STREAM_K, the K iterations of the tiles after them are split evenly over all programs
    (program p gets one contiguous run of them): a tile split between programs has each
    piece's fp32 accumulator written to the workspace ws [2 * NUM_PROGRAMS, BM, 2*BN] (slot
    2p for the piece at the start of p's run, 2p+1 for the one at its end); the piece whose
    arrival completes the tile's count (cnt, one int32 per stream-K tile, zero on entry and
    reset on exit) sums the pieces in program order, so the sum is the same whichever
    finished last, and runs the epilogue. With TAIL_SPLIT = S > 1 instead, each tile after
    them runs as S tiles of BLOCK_SIZE_N / S output columns, read and written through
    w_tail_desc ([2 * BLOCK_SIZE_N / S, BLOCK_SIZE_K] boxes) and out_tail_desc.
    """
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(I, BLOCK_SIZE_N)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_SIZE_K)

    # -- data-parallel tiles: one [BM, 2*BN] accumulator each, gate/up interleaved by 16 --
    for tile_id in tl.range(start_pid, dp_tiles, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
        offs_m = pid_m * BLOCK_SIZE_M
        offs_w = pid_n * 2 * BLOCK_SIZE_N  # first packed row of this tile's blocks
        acc = _k_range_acc(x_desc, w_desc, offs_m, offs_w, 0, k_tiles, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K)
        _gated_epilogue(acc, out_desc, b_ptr, offs_m, offs_w, pid_n, I,
                        HAS_BIAS, ACTIVATION, APPROX_TANH, GATE_UP_BLOCK, BLOCK_SIZE_M, BLOCK_SIZE_N)

    # -- stream-K tiles: this program's contiguous run of K iterations --
    # (a while over the run's pieces with a K loop inside: Triton pipelines the inner loop. One
    # flat loop over the run with the piece logic under an `if` measured up to 1.9x slower.)
    if STREAM_K:
        sk_iters = (num_tiles - dp_tiles) * k_tiles
        q = sk_iters // NUM_PROGRAMS
        r = sk_iters % NUM_PROGRAMS
        run_begin = sk_first_iter(start_pid, q, r)
        run_end = sk_first_iter(start_pid + 1, q, r)
        offs_acc = tl.arange(0, BLOCK_SIZE_M)[:, None] * (2 * BLOCK_SIZE_N) + tl.arange(0, 2 * BLOCK_SIZE_N)[None, :]
        it = run_begin
        while it < run_end:
            sk_tile = it // k_tiles
            k_begin = it % k_tiles
            k_end = tl.minimum(k_tiles, k_begin + run_end - it)
            pid_m, pid_n = _tile_pid(dp_tiles + sk_tile, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
            offs_m = pid_m * BLOCK_SIZE_M
            offs_w = pid_n * 2 * BLOCK_SIZE_N
            acc = _k_range_acc(x_desc, w_desc, offs_m, offs_w, k_begin, k_end, BLOCK_SIZE_M, BLOCK_SIZE_N,
                               BLOCK_SIZE_K)
            if k_end - k_begin == k_tiles:  # the whole tile in this run
                _gated_epilogue(acc, out_desc, b_ptr, offs_m, offs_w, pid_n, I,
                                HAS_BIAS, ACTIVATION, APPROX_TANH, GATE_UP_BLOCK, BLOCK_SIZE_M, BLOCK_SIZE_N)
            else:
                slot = 2 * start_pid + (it != run_begin).to(tl.int32)
                tl.store(ws_ptr + slot.to(tl.int64) * (BLOCK_SIZE_M * 2 * BLOCK_SIZE_N) + offs_acc, acc)
                tl.debug_barrier()  # every thread's piece is stored before the count says so
                done = tl.atomic_add(cnt_ptr + sk_tile, k_end - k_begin, sem="acq_rel", scope="gpu")
                if done + k_end - k_begin == k_tiles:  # the last piece in: sum all, in program order
                    tile_begin = sk_tile * k_tiles
                    acc = tl.zeros((BLOCK_SIZE_M, 2 * BLOCK_SIZE_N), dtype=tl.float32)
                    for p in range(sk_owner(tile_begin, q, r), sk_owner(tile_begin + k_tiles - 1, q, r) + 1):
                        p_slot = sk_piece_slot(p, tile_begin, q, r)
                        acc += tl.load(ws_ptr + p_slot.to(tl.int64) * (BLOCK_SIZE_M * 2 * BLOCK_SIZE_N) + offs_acc,
                                       cache_modifier=".cg")
                    _gated_epilogue(acc, out_desc, b_ptr, offs_m, offs_w, pid_n, I,
                                    HAS_BIAS, ACTIVATION, APPROX_TANH, GATE_UP_BLOCK, BLOCK_SIZE_M, BLOCK_SIZE_N)
                    tl.atomic_xchg(cnt_ptr + sk_tile, 0)  # ready for the next call on this stream
            it += k_end - k_begin

    # -- split tail: the tiles after the data-parallel ones, each as TAIL_SPLIT narrower tiles --
    if TAIL_SPLIT > 1:
        for sub_id in tl.range(start_pid, (num_tiles - dp_tiles) * TAIL_SPLIT, NUM_PROGRAMS):
            pid_m, pid_n = _tile_pid(dp_tiles + sub_id // TAIL_SPLIT, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
            sub_n = pid_n * TAIL_SPLIT + sub_id % TAIL_SPLIT  # in units of BLOCK_SIZE_N // TAIL_SPLIT columns
            offs_m = pid_m * BLOCK_SIZE_M
            offs_w = sub_n * 2 * (BLOCK_SIZE_N // TAIL_SPLIT)
            acc = _k_range_acc(x_desc, w_tail_desc, offs_m, offs_w, 0, k_tiles, BLOCK_SIZE_M,
                               BLOCK_SIZE_N // TAIL_SPLIT, BLOCK_SIZE_K)
            _gated_epilogue(acc, out_tail_desc, b_ptr, offs_m, offs_w, sub_n, I,
                            HAS_BIAS, ACTIVATION, APPROX_TANH, GATE_UP_BLOCK, BLOCK_SIZE_M, BLOCK_SIZE_N // TAIL_SPLIT)


@triton.jit
def _gated_gemm_tma_kernel(
    x_desc, w_desc, out_desc, w_tail_desc, out_tail_desc, b_ptr, ws_ptr, cnt_ptr, M, I, K, dp_tiles,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, FLATTEN: tl.constexpr,
    STREAM_K: tl.constexpr, TAIL_SPLIT: tl.constexpr,
):
    """Host-built TMA descriptors."""
    _gated_gemm_tma_tiles(
        x_desc, w_desc, out_desc, w_tail_desc, out_tail_desc, b_ptr, ws_ptr, cnt_ptr, M, I, K, dp_tiles,
        HAS_BIAS, ACTIVATION, APPROX_TANH, GATE_UP_BLOCK, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M,
        NUM_PROGRAMS, WARP_SPECIALIZE, FLATTEN, STREAM_K, TAIL_SPLIT,
    )


@triton.jit
def _gated_gemm_tma_devdesc_kernel(
    x_ptr, w_ptr, out_ptr, b_ptr, ws_ptr, cnt_ptr, M, I, K, dp_tiles, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, FLATTEN: tl.constexpr,
    STREAM_K: tl.constexpr, TAIL_SPLIT: tl.constexpr,
):
    """TMA descriptors built on the device: the host passes plain pointers (less launch overhead)."""
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_SIZE_M, BLOCK_SIZE_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, [2 * I, K], [stride_wn, 1], [2 * BLOCK_SIZE_N, BLOCK_SIZE_K])
    out_desc = tl.make_tensor_descriptor(out_ptr, [M, I], [stride_om, 1], [BLOCK_SIZE_M, BLOCK_SIZE_N])
    if TAIL_SPLIT > 1:
        w_tail_desc = tl.make_tensor_descriptor(w_ptr, [2 * I, K], [stride_wn, 1],
                                                [2 * BLOCK_SIZE_N // TAIL_SPLIT, BLOCK_SIZE_K])
        out_tail_desc = tl.make_tensor_descriptor(out_ptr, [M, I], [stride_om, 1],
                                                  [BLOCK_SIZE_M, BLOCK_SIZE_N // TAIL_SPLIT])
    else:
        w_tail_desc = w_desc
        out_tail_desc = out_desc
    _gated_gemm_tma_tiles(
        x_desc, w_desc, out_desc, w_tail_desc, out_tail_desc, b_ptr, ws_ptr, cnt_ptr, M, I, K, dp_tiles,
        HAS_BIAS, ACTIVATION, APPROX_TANH, GATE_UP_BLOCK, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M,
        NUM_PROGRAMS, WARP_SPECIALIZE, FLATTEN, STREAM_K, TAIL_SPLIT,
    )


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for device-built TMA descriptors (128 bytes each)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Give Triton a scratch allocator unless the caller set one (it is per thread: a ContextVar)."""
    current = getattr(_allocation, "_allocator", None)
    if current is None or current.get() is getattr(_allocation, "_NULL_ALLOCATOR", None):
        triton.set_allocator(_scratch)


def _tma_ok(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def tma_supported(x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether `gated_gemm_tma` can run these tensors (16-bit, whole blocks, TMA-aligned)."""
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and (packed.shape[0] // 2) % GATE_UP_BLOCK == 0
        and _tma_ok(x) and _tma_ok(packed) and (out is None or _tma_ok(out))
        and ((packed.shape[0] // 2) * x.element_size()) % 16 == 0
    )


# Stream-K runs only where the last data-parallel wave would leave more than this share of
# the programs idle: there it measured 2-9% faster (H100, benchmarks/results/tune_streamk_h100_bf16.json),
# with 30-60% idle it measured slower (writing and summing the fp32 pieces costs more than the
# balance wins).
STREAM_K_MIN_IDLE = 0.8
# A split tail's tiles keep at least this many output columns (a 2 * 32-row weight box).
SPLIT_TAIL_MIN_N = 32


@dataclass(frozen=True)
class TailPlan:
    """How one call runs its tiles: `dp_tiles` whole tiles data-parallel, then the rest (if
    any) stream-K (`stream_k`) or each as `split` narrower tiles (`split` > 1)."""

    dp_tiles: int
    stream_k: bool = False
    split: int = 1


def plan_tail(m: int, i: int, config: GatedGemmConfig, programs: int,
              min_idle: float = STREAM_K_MIN_IDLE) -> TailPlan:
    """What to do with the last partial wave of whole tiles.

    Whole waves of `programs` tiles always run data-parallel. The T tiles of a last partial
    wave run
    - stream-K, with `config.stream_k`, if they would leave more than `min_idle` of the
      programs idle;
    - else, with `config.split_tail`, as S narrower tiles each for the largest S in (4, 2)
      with S * T <= programs and block_n / S >= SPLIT_TAIL_MIN_N;
    - else whole, data-parallel like the rest.
    """
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(i, config.block_n)
    tail = tiles % programs
    if tail == 0:
        return TailPlan(tiles)
    if config.stream_k and (programs - tail) / programs > min_idle:
        return TailPlan(tiles - tail, stream_k=True)
    if config.split_tail:
        for s in (4, 2):
            if s * tail <= programs and config.block_n // s >= SPLIT_TAIL_MIN_N:
                return TailPlan(tiles - tail, split=s)
    return TailPlan(tiles)


def gated_gemm_tma(
    x: torch.Tensor,
    packed: torch.Tensor,
    activation_code: int,
    approx_tanh: bool,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: GatedGemmConfig,
    flatten: bool = True,
    device_descriptors: bool = True,
    stream_k_min_idle: float = STREAM_K_MIN_IDLE,
) -> torch.Tensor:
    """Launch the TMA kernel; arguments as `gated_gemm`'s, already checked by `tma_supported`.

    stream_k_min_idle: with `config.stream_k`, the idle share of the last wave above which
    its tiles run stream-K (tests lower it to exercise stream-K on any shape).

    device_descriptors: build the TMA descriptors in the kernel (default; the host passes
    pointers: about 23 µs less host time per call on the H100 machine's host, for about 2 µs
    more GPU time, benchmarks/results/overhead/) instead of on the host.
    """
    m, k = x.shape
    i = packed.shape[0] // 2
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    # programs_per_sm programs per SM, whatever the tile count: a constant NUM_PROGRAMS compiles once
    programs = config.programs_per_sm * (_num_sms(x.device.index or 0) if x.is_cuda else 4)
    plan = plan_tail(m, i, config, programs, stream_k_min_idle)
    if plan.stream_k:  # fp32 pieces of split tiles: two slots per program; counts per stream-K tile
        ws = torch.empty((2 * programs, bm, 2 * bn), dtype=torch.float32, device=x.device)
        cnt = stream_k_counts(x.device, programs)
    else:
        ws = cnt = packed  # unused
    meta = dict(
        HAS_BIAS=bias is not None, ACTIVATION=activation_code, APPROX_TANH=approx_tanh, GATE_UP_BLOCK=GATE_UP_BLOCK,
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=config.group_m,
        NUM_PROGRAMS=programs, WARP_SPECIALIZE=config.warp_specialize, FLATTEN=flatten, STREAM_K=plan.stream_k,
        TAIL_SPLIT=plan.split,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    b = bias if bias is not None else packed
    if device_descriptors:
        _ensure_allocator()
        _gated_gemm_tma_devdesc_kernel[(programs,)](
            x, packed, out, b, ws, cnt, m, i, k, plan.dp_tiles, x.stride(0), packed.stride(0), out.stride(0), **meta
        )
    else:
        x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        w_desc = TensorDescriptor.from_tensor(packed, [2 * bn, bk])
        out_desc = TensorDescriptor.from_tensor(out, [bm, bn])
        if plan.split > 1:
            w_tail_desc = TensorDescriptor.from_tensor(packed, [2 * bn // plan.split, bk])
            out_tail_desc = TensorDescriptor.from_tensor(out, [bm, bn // plan.split])
        else:
            w_tail_desc, out_tail_desc = w_desc, out_desc
        _gated_gemm_tma_kernel[(programs,)](
            x_desc, w_desc, out_desc, w_tail_desc, out_tail_desc, b, ws, cnt, m, i, k, plan.dp_tiles, **meta
        )
    return out
