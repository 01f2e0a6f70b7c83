"""Fused gated GEMM on Hopper for few tokens: TMA loads, one program per output tile.

Computes what `gated_gemm_pointer.py` computes (its docstring has the layout, dtypes and
rounding). The persistent kernel of `gated_gemm_tma.py` walks tiles in a loop; at 2 <= M <= 64
the weight read bounds the call, and there a grid with one program per tile lets the hardware
scheduler keep several programs per SM in flight and balance the SMs to the end, as Liger's
inference kernel does.

Per K step a program loads one [BLOCK_SIZE_M, BLOCK_SIZE_K] box of x and the tile's weight,
either
- `weight_boxes` = 1 (TWO_DOTS = False): one [2*BLOCK_SIZE_N, BLOCK_SIZE_K] box of packed rows (BLOCK_SIZE_N // 16
  whole gate/up blocks) into one [BM, 2*BN] accumulator, split in registers by the epilogue
  (as `gated_gemm_tma.py` does), or
- `weight_boxes` = 2 (TWO_DOTS = True): the gate rows and the up rows as two [BLOCK_SIZE_N // 16, 16, BLOCK_SIZE_K]
  boxes of the packed weight viewed as [I // 16, 32, K] (block b's gate rows at [b, 0:16], its
  up rows at [b, 16:32]) into two [BM, BN] accumulators: no split in the epilogue.

The descriptors are built on the host (device-built ones measured 3-10% slower at M <= 128 on
the H100), which costs host time per call: the rules run this kernel only for calls captured
into a CUDA graph, which pay it once. TMA zero-fills out-of-bounds reads and clips
out-of-bounds writes, so any M and K work; 16-bit dtypes, I % 16 == 0 and TMA-aligned tensors
are required (`can_run`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .configs import TMA_DTYPES, GatedGemmConfig, KernelCapability, ceil_div
from .device import tma_operands_ok
from .jit_common import gated_epilogue, tile_pid
from .layout import GATE_UP_BLOCK


@triton.jit
def _gated_gemm_tma_grid_kernel(
    x_desc, w_desc, w3_desc, out_desc, b_ptr, M, I, K,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr, GATE_SCALE: tl.constexpr,
    OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr, TWO_DOTS: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    """Program p computes output tile p (grouped order): out[offs_m:+BM, pid_n*BN:+BN]. Host-built
    descriptors; w_desc and w3_desc are the same one, whichever TWO_DOTS reads."""
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(I, BLOCK_SIZE_N)
    pid_m, pid_n = tile_pid(tl.program_id(0), GROUP_SIZE_M * num_pid_n, num_pid_m, GROUP_SIZE_M)
    offs_m = pid_m * BLOCK_SIZE_M
    offs_w = pid_n * 2 * BLOCK_SIZE_N  # first packed row of this tile's blocks
    k_tiles = tl.cdiv(K, BLOCK_SIZE_K)
    if TWO_DOTS:
        blk = pid_n * (BLOCK_SIZE_N // GATE_UP_BLOCK)
        gate = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for ki in range(k_tiles):
            x = x_desc.load([offs_m, ki * BLOCK_SIZE_K])  # [BM, BK]
            wg = tl.reshape(w3_desc.load([blk, 0, ki * BLOCK_SIZE_K]), (BLOCK_SIZE_N, BLOCK_SIZE_K))
            gate = tl.dot(x, wg.T, gate)
            wu = tl.reshape(w3_desc.load([blk, GATE_UP_BLOCK, ki * BLOCK_SIZE_K]), (BLOCK_SIZE_N, BLOCK_SIZE_K))
            up = tl.dot(x, wu.T, up)
        if HAS_BIAS:
            cols = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)  # output columns; whole blocks (I % 16 == 0)
            g_rows = 2 * GATE_UP_BLOCK * (cols // GATE_UP_BLOCK) + cols % GATE_UP_BLOCK
            gate += tl.load(b_ptr + g_rows, mask=cols < I, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_ptr + g_rows + GATE_UP_BLOCK, mask=cols < I, other=0.0).to(tl.float32)[None, :]
    else:
        acc = tl.zeros((BLOCK_SIZE_M, 2 * BLOCK_SIZE_N), dtype=tl.float32)
        for ki in range(k_tiles):
            x = x_desc.load([offs_m, ki * BLOCK_SIZE_K])  # [BM, BK]
            w = w_desc.load([offs_w, ki * BLOCK_SIZE_K])  # [2*BN, BK]
            acc = tl.dot(x, w.T, acc)
        if HAS_BIAS:
            offs_b = offs_w + tl.arange(0, 2 * BLOCK_SIZE_N)
            acc += tl.load(b_ptr + offs_b, mask=offs_b < 2 * I, other=0.0).to(tl.float32)[None, :]
        acc = tl.reshape(acc, (BLOCK_SIZE_M, BLOCK_SIZE_N // GATE_UP_BLOCK, 2, GATE_UP_BLOCK))
        gate, up = tl.split(tl.reshape(tl.permute(acc, (0, 1, 3, 2)), (BLOCK_SIZE_M, BLOCK_SIZE_N, 2)))
    h = gated_epilogue(gate, up, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT)
    out_desc.store([offs_m, pid_n * BLOCK_SIZE_N], h.to(out_desc.dtype))


CAPABILITY = KernelCapability("grid", ops=("forward",), dtypes=TMA_DTYPES, tma=True)


def can_run(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> bool:
    """`configs.TMA_NEEDS` (`device.tma_operands_ok`)."""
    return tma_operands_ok(weight.shape[0] >> 1, x, weight, out)


def make_launcher(config: GatedGemmConfig, epilogue: dict, has_bias: bool, dtype: torch.dtype):
    """A launcher `(x [M, K], weight [2*I, K], bias [2*I] or None, out [M, I]) -> out`: one program per
    [block_m, block_n] output tile; the tensors passed `can_run`. Builds only the weight
    descriptor the kernel reads (each costs host time); Triton's own launch path (descriptors)."""
    if config.weight_boxes not in (1, 2):
        raise ValueError(f"gated_gemm_tma_grid: weight_boxes must be 1 or 2, got {config.weight_boxes}")
    meta = dict(
        HAS_BIAS=has_bias, **epilogue, TWO_DOTS=config.weight_boxes == 2, GATE_UP_BLOCK=GATE_UP_BLOCK,
        **config.meta(), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    bm, bn, bk = config.block_m, config.block_n, config.block_k

    def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        i = weight.shape[0] // 2
        grid = (ceil_div(m, bm) * ceil_div(i, bn),)
        if config.weight_boxes == 2:  # the packed weight as [I/16, 32, K]: gate rows at [b, :16], up at [b, 16:]
            row = weight.stride(0)
            w3 = weight.as_strided((i // GATE_UP_BLOCK, 2 * GATE_UP_BLOCK, k), (2 * GATE_UP_BLOCK * row, row, 1))
            w_desc = TensorDescriptor.from_tensor(w3, [bn // GATE_UP_BLOCK, GATE_UP_BLOCK, bk])
        else:
            w_desc = TensorDescriptor.from_tensor(weight, [2 * bn, bk])
        _gated_gemm_tma_grid_kernel[grid](
            TensorDescriptor.from_tensor(x, [bm, bk]), w_desc, w_desc, TensorDescriptor.from_tensor(out, [bm, bn]),
            bias if bias is not None else weight, m, i, k, **meta)
        return out

    return launch
