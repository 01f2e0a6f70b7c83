"""Time every candidate config of the fused gated GEMM per (shape, M) and pick defaults per M bucket.

Each config is first checked against float64 on sampled rows (a config that is wrong is
reported and never timed), then all configs of one (shape, M) are timed together with cuBLAS
on the stacked weight (`gemm_only`) by `timing.GraphTimer` (CUDA-graph replays after a
read-only L2 flush, interleaved in rounds). Prints, per M bucket, the config with the best
geometric-mean ratio to `gemm_only` across shapes: the tables in `kernels/configs.py` are
copied from that output.

    python -m benchmarks.tune_kernel --out $OUT/tune [--shapes llama-3-8b ...] [--tokens 1 16 ...]
    python -m benchmarks.tune_kernel --variants tail --tokens 384 512 1024 ...   # last-wave handling
    python -m benchmarks.tune_kernel --variants mid --tokens 32 48 64            # TMA at 17 <= M <= 64
    python -m benchmarks.tune_kernel --variants decode --tokens 1 4 16           # TMA at M <= 16
    python -m benchmarks.tune_kernel --variants midocc --tokens 24 32 48 64 --with-liger  # occupancy at mid M
    python -m benchmarks.tune_kernel --variants paired --tokens 64 128 512 2048 8192   # 2 programs per SM
    python -m benchmarks.tune_kernel --variants grid --tokens 4 16 32 64 --with-liger   # one program per tile
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections import defaultdict
from pathlib import Path

import torch
import triton

from benchmarks.timing import GraphTimer
from benchmarks.ways import Operands, build, fast_liger_autotune
from benchmarks.shapes import SHAPES, TP_SHARD_SHAPES, select_shapes
from swiglu_patch import pack_gate_up
from swiglu_patch.kernels.activations import ACTIVATIONS
from swiglu_patch.kernels.activations import ACTIVATION_CODES
from swiglu_patch.kernels.gated_gemm import (
    _DEFAULTS, CANDIDATE_CONFIGS, TMA_MIN_M, GatedGemmConfig, _for_bucket, _tma_default, default_approx_tanh,
    default_config, gated_gemm, m_bucket,
)
from swiglu_patch.kernels.gated_gemm_tma_grid import gated_gemm_tma_grid

TOKENS = (1, 4, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 4096, 16384)

# TMA kernel tiles (block_n = output columns; the weight box is 2 * block_n rows). 128-row
# tiles are tried with and without warp specialization, and for 64 < M <= 4096 every tile
# also with stream-K (the last partial wave split over all SMs by K).
TMA_CONFIGS = [
    GatedGemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3),
    GatedGemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4),
    GatedGemmConfig(128, 64, 64, group_m=8, num_warps=4, num_stages=4),
    GatedGemmConfig(128, 64, 64, group_m=8, num_warps=8, num_stages=5),
    GatedGemmConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=4),
    GatedGemmConfig(64, 64, 128, group_m=8, num_warps=4, num_stages=4),
    GatedGemmConfig(64, 64, 64, group_m=8, num_warps=4, num_stages=6),
]
# decode (M <= 64): 64-row MMA (x zero-filled by TMA), narrow weight boxes, deep pipelines
TMA_DECODE_CONFIGS = [
    GatedGemmConfig(64, 32, 128, group_m=1, num_warps=4, num_stages=6),
    GatedGemmConfig(64, 16, 128, group_m=1, num_warps=4, num_stages=8),
    GatedGemmConfig(64, 32, 64, group_m=1, num_warps=4, num_stages=10),
]


def variants(m: int) -> list[tuple[str, dict]]:
    """(label, gated_gemm kwargs) worth timing at m tokens: tiny tiles never at prefill,
    large tiles never at decode."""
    ptr = [
        c for c in CANDIDATE_CONFIGS
        if (m <= 16 and c.block_m <= 16) or (16 < m <= 64 and 16 < c.block_m <= 64)
        or (64 < m <= 256 and c.block_m == 64)
    ]
    out = [(f"ptr {c}", dict(kernel="pointer", config=c)) for c in ptr]
    tma = [c for c in TMA_CONFIGS if m >= 48 and (m < 512 or c.block_m == 128)]
    tma += TMA_DECODE_CONFIGS if 16 < m <= 96 else []
    for c in tma:
        for ws in ((False, True) if c.block_m == 128 else (False,)):
            for sk in ((False, True) if 64 < m <= 4096 and c in TMA_CONFIGS else (False,)):
                cfg = dataclasses.replace(c, warp_specialize=ws, stream_k=sk)
                out.append((f"tma {cfg}", dict(kernel="tma", config=cfg)))
    return out


# 17 <= M <= 64 (the pointer kernel's range), wide weight boxes as Liger's inference kernel uses
# (BLOCK_M 32/64, 128 gate and 128 up rows per box)
TMA_MID_CONFIGS = [
    GatedGemmConfig(32, 128, 128, group_m=1, num_warps=4, num_stages=3),
    GatedGemmConfig(32, 128, 64, group_m=1, num_warps=4, num_stages=4),
    GatedGemmConfig(64, 128, 128, group_m=1, num_warps=4, num_stages=3),
    GatedGemmConfig(64, 128, 64, group_m=1, num_warps=8, num_stages=4),
    GatedGemmConfig(64, 64, 128, group_m=1, num_warps=4, num_stages=4),
]


def mid_variants(m: int) -> list[tuple[str, dict]]:
    """The shipped pointer config for m's bucket against TMA tiles with and without a split tail."""
    return [(f"ptr {_shipped_ptr(m)}", dict(kernel="pointer", config=_shipped_ptr(m)))] + \
        _tma_split_off_and_on(TMA_MID_CONFIGS + TMA_DECODE_CONFIGS)


def _tma_split_off_and_on(configs: list[GatedGemmConfig]) -> list[tuple[str, dict]]:
    """Each TMA config as a variant with the split tail off, then on."""
    both = [dataclasses.replace(c, split_tail=split) for c in configs for split in (False, True)]
    return [(f"tma {cfg}", dict(kernel="tma", config=cfg)) for cfg in both]


def _shipped_ptr(m: int) -> GatedGemmConfig:
    return _for_bucket(_DEFAULTS, m)


# M <= 16 through the persistent TMA kernel: x zero-filled to BLOCK_M rows, the weight streamed
# in [2*BLOCK_SIZE_N, BLOCK_SIZE_K] boxes, the next tile's loads issued while a tile finishes
TMA_DECODE_SMALL_M_CONFIGS = [
    GatedGemmConfig(16, 32, 256, group_m=1, num_warps=4, num_stages=4),
    GatedGemmConfig(16, 64, 256, group_m=1, num_warps=4, num_stages=3),
    GatedGemmConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=5),
    GatedGemmConfig(16, 128, 128, group_m=1, num_warps=4, num_stages=3),
    GatedGemmConfig(16, 32, 128, group_m=1, num_warps=4, num_stages=8),
    GatedGemmConfig(64, 32, 128, group_m=1, num_warps=4, num_stages=6),
    GatedGemmConfig(64, 64, 128, group_m=1, num_warps=4, num_stages=4),
]


# Pointer-kernel decode tiles with a long K block: each weight row segment a program reads per
# step is BLOCK_SIZE_K * 2 bytes, 0.5 KB at the shipped 256; these read 1-2 KB per row segment.
DECODE_LONG_K_CONFIGS = [
    GatedGemmConfig(16, 16, 512, num_warps=4, num_stages=3),
    GatedGemmConfig(16, 32, 512, num_warps=4, num_stages=2),
    GatedGemmConfig(16, 32, 512, num_warps=8, num_stages=2),
    GatedGemmConfig(16, 16, 1024, num_warps=4, num_stages=2),
]


# Decode tiles that hide latency by occupancy instead of a deep software pipeline: 1-2 stages,
# small shared-memory footprints, so several programs share an SM (a pure read of the weight,
# `read_floor.py`, reaches 0.97-0.99 of the floor on the 7-9B shapes that way).
DECODE_OCCUPANCY_CONFIGS = [
    GatedGemmConfig(16, 32, 128, num_warps=4, num_stages=1),
    GatedGemmConfig(16, 32, 256, num_warps=4, num_stages=1),
    GatedGemmConfig(16, 64, 128, num_warps=4, num_stages=1),
    GatedGemmConfig(16, 32, 64, num_warps=4, num_stages=2),
    GatedGemmConfig(16, 32, 128, num_warps=4, num_stages=2),
    GatedGemmConfig(16, 64, 128, num_warps=4, num_stages=2),
    GatedGemmConfig(16, 32, 256, num_warps=4, num_stages=2),
]


# 17 <= M <= 64 through the pointer kernel with small shared-memory footprints (1-3 buffers of
# at most 40 KB), so that two or more programs share an SM: the shipped tiles (4 stages) run one
# program per SM, and a weight-bound call whose tile count is not a multiple of the SMs then
# ends in a partial wave (Qwen2.5-7B at M = 32: 296 tiles, 2.24 waves).
MID_OCCUPANCY_CONFIGS = [
    GatedGemmConfig(32, 64, 128, num_warps=4, num_stages=2),
    GatedGemmConfig(32, 64, 128, num_warps=4, num_stages=3),
    GatedGemmConfig(32, 64, 64, num_warps=4, num_stages=3),
    GatedGemmConfig(32, 64, 64, num_warps=4, num_stages=4),
    GatedGemmConfig(32, 32, 128, num_warps=4, num_stages=3),
    GatedGemmConfig(32, 128, 64, num_warps=4, num_stages=3),
    GatedGemmConfig(64, 64, 128, num_warps=4, num_stages=2),
    GatedGemmConfig(64, 64, 64, num_warps=4, num_stages=3),
    GatedGemmConfig(64, 32, 128, num_warps=4, num_stages=3),
    GatedGemmConfig(64, 128, 64, num_warps=8, num_stages=3),
    # 2 x 128 weight rows per tile as Liger's inference kernel, small enough for two programs per SM
    GatedGemmConfig(64, 128, 64, num_warps=4, num_stages=2),
    GatedGemmConfig(64, 128, 64, num_warps=8, num_stages=2),
    GatedGemmConfig(64, 128, 32, num_warps=4, num_stages=3),
    GatedGemmConfig(64, 128, 32, num_warps=8, num_stages=4),
]


def mid_occupancy_variants(m: int) -> list[tuple[str, dict]]:
    """The shipped pointer config for m's bucket and every low-footprint pointer tile (32-row tiles
    at M > 32 too: two row tiles per weight tile, as Liger's kernel picks on Qwen2.5-7B at M = 64)."""
    cfgs = dict.fromkeys([_shipped_ptr(m)] + MID_OCCUPANCY_CONFIGS)
    return [(f"ptr {c}", dict(kernel="pointer", config=c)) for c in cfgs]


# Two persistent programs per SM (`programs_per_sm=2`): tiles whose shared memory fits twice
# in an SM (<= 112 KB each, Triton 3.6 on sm_90), so that one program's epilogue (the
# activation, which stops the MMAs of a one-program SM: `epilogue_cost.py`) can run while the
# other's MMAs do. Each tile also runs with one program per SM, to tell the tile from the pairing.
TMA_PAIRED_CONFIGS = [
    GatedGemmConfig(128, 64, 64, group_m=8, num_warps=4, num_stages=3, programs_per_sm=2),
    GatedGemmConfig(128, 64, 64, group_m=8, num_warps=8, num_stages=3, programs_per_sm=2),
    GatedGemmConfig(128, 64, 64, group_m=8, num_warps=4, num_stages=2, programs_per_sm=2),
    GatedGemmConfig(128, 64, 32, group_m=8, num_warps=4, num_stages=4, programs_per_sm=2),
]
TMA_PAIRED_SMALL_M_CONFIGS = [
    GatedGemmConfig(64, 64, 128, group_m=8, num_warps=4, num_stages=2, programs_per_sm=2),
    GatedGemmConfig(64, 64, 64, group_m=8, num_warps=4, num_stages=3, programs_per_sm=2),
    GatedGemmConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=2, programs_per_sm=2),
]


def paired_variants(m: int) -> list[tuple[str, dict]]:
    """The shipped config for m (TMA beyond TMA_MIN_M, else pointer) against paired TMA tiles,
    each also with one program per SM; 128-row tiles with a split tail, as shipped beyond M = 128."""
    out = [(f"tma {_tma_default(m_bucket(m))}", dict(kernel="tma", config=_tma_default(m_bucket(m))))] if m > 64 \
        else [(f"ptr {_shipped_ptr(m)}", dict(kernel="pointer", config=_shipped_ptr(m)))]
    cfgs = TMA_PAIRED_SMALL_M_CONFIGS if m <= 256 else []
    cfgs = cfgs + ([dataclasses.replace(c, split_tail=True) for c in TMA_PAIRED_CONFIGS] if m >= 256 else [])
    for c in cfgs:
        for pps in (2, 1):
            cfg = dataclasses.replace(c, programs_per_sm=pps)
            out.append((f"tma {cfg}", dict(kernel="tma", config=cfg)))
    return out


# 32-row TMA tiles with several persistent programs per SM: Liger's inference kernel picks
# 32 x (2 x 128) x 128 boxes with 2 stages on Qwen2.5-7B at M = 64 and runs several CTAs per SM
# (72 KB each); one persistent program per SM of the same box leaves a single load in flight
# per SM and measured 1.9-2.0x of cuBLAS (`tune_mid_h100_bf16.json`). Each tile runs with 1-4
# programs per SM (those that do not fit run as extra waves of the persistent loop).
TMA_OCC_CONFIGS = [  # shared memory per program by Triton 3.6's sm_90 compile: programs that fit per SM
    GatedGemmConfig(32, 128, 128, group_m=4, num_warps=4, num_stages=2),  # 86 KB: 2 (Liger's box)
    GatedGemmConfig(32, 128, 64, group_m=4, num_warps=4, num_stages=2),  # 49 KB: 4
    GatedGemmConfig(32, 128, 64, group_m=4, num_warps=4, num_stages=3),  # 86 KB: 2
    GatedGemmConfig(32, 64, 128, group_m=4, num_warps=4, num_stages=2),  # 49 KB: 4
    GatedGemmConfig(32, 64, 64, group_m=4, num_warps=4, num_stages=3),  # 49 KB: 4
    GatedGemmConfig(64, 64, 128, group_m=4, num_warps=4, num_stages=2),  # 106 KB: 2
]


def occupancy_tma_variants(m: int, k: int, i: int, dtype: torch.dtype) -> list[tuple[str, dict]]:
    """What gated_gemm ships for this GPU, shape and m (kernel='auto', no config: label
    `shipped`) against TMA_OCC_CONFIGS with 1, 2, 3 and 4 programs per SM."""
    out = [(f"shipped {_shipped(m, k, i, dtype)}", dict(kernel="auto"))]
    for c in TMA_OCC_CONFIGS:
        for pps in (1, 2, 3, 4):
            cfg = dataclasses.replace(c, programs_per_sm=pps)
            out.append((f"tma {cfg}", dict(kernel="tma", config=cfg)))
    return out


# One program per tile through `gated_gemm_tma_grid` (TMA loads, not persistent: the hardware
# scheduler keeps several programs per SM in flight), with one [2*BN, BK] weight box and one
# accumulator ("grid1") or the gate and up rows as two boxes and two accumulators ("grid2", as
# Liger's inference kernel reads its two weights). Liger's own search space at M <= 64: BLOCK_M
# 32/64, 128 output columns, BLOCK_K 64/128, 2-3 stages; BLOCK_M 16 and 64 columns added here.
def grid_configs(m: int) -> list[GatedGemmConfig]:
    if m > 64:
        return [GatedGemmConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=4),
                GatedGemmConfig(64, 64, 128, group_m=8, num_warps=4, num_stages=4),
                GatedGemmConfig(128, 64, 64, group_m=8, num_warps=4, num_stages=4),
                GatedGemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3)]
    return [GatedGemmConfig(bm, bn, bk, group_m=4, num_warps=4, num_stages=s)
            for bm in ((16, 32) if m <= 16 else (32, 64)) for bn in (64, 128) for bk in (64, 128) for s in (2, 3)]


def grid_variants(m: int, k: int, i: int, dtype: torch.dtype) -> list[tuple[str, dict]]:
    """What gated_gemm ships for this GPU, shape and m (kernel='auto': label `shipped`) against
    `gated_gemm_tma_grid` with one and with two weight boxes per K step."""
    out = [(f"shipped {_shipped(m, k, i, dtype)}", dict(kernel="auto"))]
    for c in grid_configs(m):
        for two in (False, True):
            out.append((f"grid{2 if two else 1} {c}", dict(grid=c, two_dots=two, device_descriptors=False)))
    return out


# The best `grid` tiles per M bucket of the H100 sweep (tune_grid_h100_bf16.json), each with its
# descriptors built on the host and by each program on the device ("grid1d"/"grid2d").
GRID_PICKS = {
    16: [(GatedGemmConfig(16, 64, 128, group_m=4, num_warps=4, num_stages=2), True),
         (GatedGemmConfig(16, 64, 128, group_m=4, num_warps=4, num_stages=3), False),
         (GatedGemmConfig(16, 128, 128, group_m=4, num_warps=4, num_stages=3), True)],
    32: [(GatedGemmConfig(32, 64, 128, group_m=4, num_warps=4, num_stages=2), True),
         (GatedGemmConfig(32, 64, 128, group_m=4, num_warps=4, num_stages=3), True),
         (GatedGemmConfig(64, 64, 128, group_m=4, num_warps=4, num_stages=2), False)],
    64: [(GatedGemmConfig(64, 64, 128, group_m=4, num_warps=4, num_stages=3), False),
         (GatedGemmConfig(64, 64, 128, group_m=4, num_warps=4, num_stages=2), False),
         (GatedGemmConfig(32, 64, 128, group_m=4, num_warps=4, num_stages=2), False)],
    128: [(GatedGemmConfig(128, 64, 64, group_m=8, num_warps=4, num_stages=4), False),
          (GatedGemmConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=4), False)],
}


def grid_pick_variants(m: int, k: int, i: int, dtype: torch.dtype) -> list[tuple[str, dict]]:
    """The shipped config against GRID_PICKS[m's bucket], host and device descriptors."""
    out = [(f"shipped {_shipped(m, k, i, dtype)}", dict(kernel="auto"))]
    for c, two in GRID_PICKS.get(min(m_bucket(m), 128), []):
        for dev in (False, True):
            out.append((f"grid{2 if two else 1}{'d' if dev else ''} {c}",
                        dict(grid=c, two_dots=two, device_descriptors=dev)))
    return out


def _shipped(m: int, k: int, i: int, dtype: torch.dtype) -> GatedGemmConfig:
    """The config kernel='auto' runs for this shape and m on this GPU when captured in a CUDA
    graph, as the timer runs it (M >= 65 without a rule: the persistent TMA kernel's bucket tile)."""
    cfg = default_config(m_bucket(m), dtype, i, torch.cuda.current_device(), k, True)
    return _tma_default(m_bucket(m)) if m >= TMA_MIN_M and not cfg.grid_boxes else cfg


def _run(x, packed, activation, out, kw):
    """One call of the variant `kw`: gated_gemm's keyword arguments, or a `grid` config."""
    if "grid" in kw:
        return gated_gemm_tma_grid(x, packed, ACTIVATION_CODES[activation], default_approx_tanh(x), None, out,
                                   kw["grid"], kw["two_dots"], kw["device_descriptors"])
    return gated_gemm(x, packed, activation, out=out, **kw)


# One token through `gated_gemv` (no tensor cores: the weight streamed through registers, many
# programs per SM, as read_floor's pure read): block_n output columns (block_n // 16 gate/up
# blocks) and block_k inputs per step, num_warps.
GEMV_CONFIGS = [  # all at <= 128 registers per thread (sm_90, Triton 3.6): 2-6 programs per SM
    GatedGemmConfig(1, 16, 128, num_warps=4, num_stages=1),
    GatedGemmConfig(1, 16, 256, num_warps=4, num_stages=1),
    GatedGemmConfig(1, 16, 128, num_warps=2, num_stages=1),
    GatedGemmConfig(1, 16, 512, num_warps=8, num_stages=1),
    GatedGemmConfig(1, 32, 64, num_warps=4, num_stages=1),
    GatedGemmConfig(1, 32, 128, num_warps=4, num_stages=1),
    GatedGemmConfig(1, 32, 256, num_warps=8, num_stages=1),
    GatedGemmConfig(1, 64, 64, num_warps=4, num_stages=1),
    GatedGemmConfig(1, 64, 128, num_warps=8, num_stages=1),
]


def gemv_variants(m: int, k: int, i: int, dtype: torch.dtype) -> list[tuple[str, dict]]:
    """At M = 1: the pointer tile of this GPU and shape's M <= 16 rules against the GEMV's tiles
    (the shipped one first where a rule picks the GEMV)."""
    dev = torch.cuda.current_device()
    shipped = default_config(m_bucket(m), dtype, i, dev, k)
    table = default_config(16, dtype, i, dev, k)  # the pointer tile the M <= 16 rules give
    out = [(f"ptr {table}", dict(kernel="pointer", config=table))]
    if m == 1:
        out += [(f"gemv {c}", dict(kernel="gemv", config=c)) for c in dict.fromkeys([shipped, *GEMV_CONFIGS])
                if c.block_m == 1]
    return out


def decode_variants(m: int, k: int, i: int, dtype: torch.dtype) -> list[tuple[str, dict]]:
    """At M <= 16: the pointer config gated_gemm ships for this GPU and shape, the pointer
    kernel's decode candidates, long-K and low-stage tiles, and the persistent TMA kernel's
    small-M tiles. (Split-K tiles, swept at 9e1a3ea, were removed with the kernel's split-K.)"""
    dev = torch.cuda.current_device()
    shipped = default_config(m_bucket(m), dtype, i, dev, k)
    if shipped.block_m == 1:  # the GEMV's rule at M = 1: compare the pointer tiles with the one at M = 16
        shipped = default_config(16, dtype, i, dev, k)
    ptr = dict.fromkeys([shipped] + [c for c in CANDIDATE_CONFIGS if c.block_m == 16 and c.block_n >= 32]
                        + DECODE_LONG_K_CONFIGS + DECODE_OCCUPANCY_CONFIGS)
    return [(f"ptr {c}", dict(kernel="pointer", config=c)) for c in ptr] + \
        _tma_split_off_and_on(TMA_DECODE_SMALL_M_CONFIGS)


def tail_variants(m: int) -> list[tuple[str, dict]]:
    """The shipped TMA tile for m's bucket and a 128x(2*64) one, each with the last partial wave
    run whole, stream-K, split into narrower tiles, or either (stream-K where > 80% idle)."""
    shipped = dataclasses.replace(_tma_default(m_bucket(m)), stream_k=False, split_tail=False)
    tiles = [shipped, GatedGemmConfig(128, 64, 64, group_m=8, num_warps=8, num_stages=5)]
    out = []
    for c in dict.fromkeys(tiles):
        for sk, split in ((False, False), (True, False), (False, True), (True, True)):
            cfg = dataclasses.replace(c, stream_k=sk, split_tail=split)
            out.append((f"tma {cfg}", dict(kernel="tma", config=cfg)))
    return out


def rel_err_rows(out, x, gate, up, act, rows):
    xr = x[rows].double()
    ref = ACTIVATIONS[act](xr @ gate.double().T) * (xr @ up.double().T)
    return ((out[rows].double() - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--tp-shards", action="store_true",
                    help="sweep the tensor-parallel shard shapes (benchmarks.shapes.TP_SHARD_SHAPES) instead")
    ap.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kernels", nargs="*", default=["ptr", "tma", "gemv", "shipped", "grid"],
                    help="variant label prefixes to time")
    ap.add_argument("--variants", choices=["all", "tail", "mid", "midocc", "paired", "tmaocc", "decode", "gemv", "grid",
                                                "gridpick"],
                    default="all",
                    help="all: every candidate tile; tail: last-wave handling of the shipped tiles; "
                         "mid: TMA tiles against the pointer kernel at 17 <= M <= 64; "
                         "midocc: low-footprint pointer tiles at 17 <= M <= 64; "
                         "paired: TMA tiles with two persistent programs per SM; "
                         "tmaocc: 32-row TMA tiles with 1-4 persistent programs per SM; "
                         "grid: TMA tiles with one program per tile, one or two weight boxes; "
                         "gridpick: the best grid tiles per bucket, host and device descriptors; "
                         "gemv: the one-token GEMV against the shipped pointer tile at M = 1; "
                         "decode: persistent TMA tiles against the pointer kernel at M <= 16")
    ap.add_argument("--rep-ms", type=float, default=30)
    ap.add_argument("--with-liger", action="store_true",
                    help="time Liger's gemm_swiglu (SiLU shapes) in each row too, as config 'liger'")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/tune"))
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting shapes after this many seconds")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    timer = GraphTimer(warmup_ms=5, rep_ms=args.rep_ms, rounds=3)
    if args.with_liger:
        fast_liger_autotune(5, 20)
    t_start = time.perf_counter()
    rows_out = []
    for shape in select_shapes(args.shapes, TP_SHARD_SHAPES if args.tp_shards else SHAPES):
        if args.budget_s and time.perf_counter() - t_start > args.budget_s:
            print(f"out of --budget-s: {shape.name} not measured", flush=True)
            continue
        k, i = shape.hidden, shape.intermediate
        gate = (torch.randn(i, k, device="cuda") / k**0.5).to(dtype)
        up = (torch.randn(i, k, device="cuda") / k**0.5).to(dtype)
        stacked = torch.cat([gate, up])
        packed = pack_gate_up(gate, up)
        for m in args.tokens:
            x = torch.randn(m, k, device="cuda").to(dtype)
            rows = torch.randperm(m, device="cuda")[:64]
            fns, found = {"gemm_only": lambda: x @ stacked.T}, {}
            pick = dict(all=variants, tail=tail_variants, mid=mid_variants, midocc=mid_occupancy_variants,
                        paired=paired_variants, tmaocc=lambda m: occupancy_tma_variants(m, k, i, dtype),
                        decode=lambda m: decode_variants(m, k, i, dtype),
                        gemv=lambda m: gemv_variants(m, k, i, dtype),
                        grid=lambda m: grid_variants(m, k, i, dtype),
                        gridpick=lambda m: grid_pick_variants(m, k, i, dtype))[args.variants]
            for label, kw in pick(m):
                if not any(label.startswith(prefix) for prefix in args.kernels):
                    continue
                out = torch.full((m, i), float("nan"), dtype=dtype, device="cuda")
                t0 = time.perf_counter()
                try:
                    _run(x, packed, shape.activation, out, kw)
                    torch.cuda.synchronize()
                except Exception as e:  # out of shared memory or registers: record, go on
                    rows_out.append(dict(shape=shape.name, m=m, config=label, error=repr(e)[:300]))
                    continue
                first_call_s = time.perf_counter() - t0
                err = rel_err_rows(out, x, gate, up, shape.activation, rows)
                ok = math.isfinite(err) and err < 1e-2 and not out.isnan().any().item()
                if ok:  # the timer replays a CUDA graph, where kernel='auto' may choose otherwise: check that too
                    replayed = timer.replayed_output(lambda kw=kw, out=out: _run(x, packed, shape.activation, out, kw))
                    if replayed is not None:
                        err = max(err, rel_err_rows(replayed, x, gate, up, shape.activation, rows))
                        ok = math.isfinite(err) and err < 1e-2 and not replayed.isnan().any().item()
                found[label] = dict(shape=shape.name, m=m, bucket=m_bucket(m), config=label, rel_err=err, ok=ok,
                                    first_call_s=first_call_s)
                if ok:
                    fns[label] = (lambda kw=kw, out=out: _run(x, packed, shape.activation, out, kw))
            if args.with_liger and shape.activation == "silu":
                liger = build("liger", Operands(x, stacked, gate, up, packed, shape.activation, "auto"))
                err = rel_err_rows(liger(), x, gate, up, shape.activation, rows)
                from liger_kernel.ops import mlp as liger_mlp

                tuner = getattr(liger_mlp, "_swiglu_kernel_forward_inference", None)
                found["liger"] = dict(shape=shape.name, m=m, bucket=m_bucket(m), config="liger", rel_err=err,
                                      ok=math.isfinite(err) and err < 1e-2, first_call_s=float("nan"),
                                      liger_config=str(getattr(tuner, "best_config", None)))
                if found["liger"]["ok"]:
                    fns["liger"] = liger
            secs = timer.many(fns)
            t_gemm = secs["gemm_only"] * 1e3
            for label, r in found.items():
                t = secs.get(label, float("nan")) * 1e3
                rows_out.append(dict(r, ms=t, gemm_only_ms=t_gemm, ratio=t / t_gemm))
            best = min((r for r in rows_out if r.get("shape") == shape.name and r["m"] == m and r.get("ok")
                        and r["config"] != "liger"), key=lambda r: r["ms"], default=None)
            if best:
                liger_note = f"  liger {secs['liger'] * 1e3 / t_gemm:.3f}" if "liger" in secs else ""
                print(f"{shape.name:14s} M={m:6d} gemm_only {t_gemm*1e3:9.1f} us  best {best['ms']*1e3:9.1f} us "
                      f"ratio {best['ratio']:.3f}  {best['config']}{liger_note}", flush=True)
            del fns, found, x
        del gate, up, stacked, packed
        torch.cuda.empty_cache()
        (args.out / "tune.json").write_text(json.dumps(dict(
            gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            dtype=args.dtype, timer=timer.describe(), rows=rows_out), indent=1))

    # per M bucket: the config with the best geometric-mean ratio over the shapes measured
    by_bucket: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows_out:
        if r.get("ok") and r["config"] != "liger":
            by_bucket[r["bucket"]][r["config"]].append(math.log(r["ratio"]))
    errors = sorted({r["config"] + ": " + r["error"] for r in rows_out if "error" in r})
    print(f"\n{len(errors)} variants failed to run:" + "".join("\n  " + e for e in errors[:10]))
    print("\nbest config per M bucket (geometric-mean ratio to gemm_only over shapes):")
    for bucket in sorted(by_bucket):
        n_shapes = max(len(v) for v in by_bucket[bucket].values())
        scored = [(sum(v) / len(v), c) for c, v in by_bucket[bucket].items() if len(v) == n_shapes]
        score, cfg = min(scored)
        print(f"  bucket {bucket:5d}: {math.exp(score):.3f}x  {cfg}")


if __name__ == "__main__":
    main()
