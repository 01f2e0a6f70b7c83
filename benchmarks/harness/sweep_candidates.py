"""The candidates of each `tune` sweep: per (shape, M), a list of (kernel name, `GatedGemmConfig`)
that `benchmarks/tune.py` checks against float64 and times against cuBLAS and the shipped rule.

A sweep is a function `(m, k, i, shipped) -> [(kernel, config), ...]` of the token count M, the
hidden size K and the intermediate size I; `shipped(kernel, at_m)` is the config of the first
rule for `kernel` that matches the shape at M = at_m (eager), or None, so a sweep can put the
rules' own tile beside its candidates (a None config is dropped by the caller). `SWEEPS` maps
each `--sweep` name to its function, `OP` names the op a sweep times (`sweep_ops.OPS`;
"forward" where absent), and `label` is a candidate's name in tune.json's rows.
"""

from __future__ import annotations

import dataclasses

from swiglu_patch.kernels.configs import GatedGemmConfig as C


# Pointer tiles per M range (the bucket sweep): decode tiles read 2 x 16-64 weight rows, deep pipelines.
POINTER_TILES = [
    C(16, 16, 256, num_warps=4, num_stages=4), C(16, 16, 512, num_warps=4, num_stages=3),
    C(16, 32, 128, num_warps=4, num_stages=4), C(16, 32, 256, num_warps=4, num_stages=4),
    C(16, 64, 128, num_warps=4, num_stages=4), C(16, 64, 256, num_warps=4, num_stages=3),
    C(32, 32, 256, num_warps=4, num_stages=4), C(32, 64, 128, num_warps=4, num_stages=4),
    C(64, 32, 128, num_warps=4, num_stages=4), C(64, 64, 64, num_warps=4, num_stages=4),
    C(64, 64, 128, num_warps=4, num_stages=4), C(64, 128, 64, num_warps=4, num_stages=4),
    C(128, 128, 64, num_warps=8, num_stages=4),
]
# Persistent TMA tiles, M >= 48: one [BM, 2*BN] accumulator; 128-row tiles also warp-specialized.
TMA_TILES = [
    C(128, 128, 64, group_m=8, num_warps=8, num_stages=3), C(128, 128, 64, group_m=8, num_warps=8, num_stages=4),
    C(128, 64, 64, group_m=8, num_warps=4, num_stages=4), C(64, 128, 64, group_m=8, num_warps=4, num_stages=4),
    C(64, 64, 128, group_m=8, num_warps=4, num_stages=4), C(64, 64, 64, group_m=8, num_warps=4, num_stages=6),
]
# Decode (M <= 16) pointer tiles: long K blocks (1-2 KB per weight-row segment) and 1-2 stage
# tiles that hide latency by occupancy; the persistent TMA kernel's small-M tiles beside them.
DECODE_TILES = [
    C(16, 32, 128, num_warps=4, num_stages=4), C(16, 32, 256, num_warps=4, num_stages=4),
    C(16, 64, 256, num_warps=4, num_stages=3), C(16, 64, 128, num_warps=4, num_stages=4),
    C(16, 16, 512, num_warps=4, num_stages=3), C(16, 32, 512, num_warps=4, num_stages=2),
    C(16, 32, 128, num_warps=4, num_stages=2), C(16, 64, 128, num_warps=4, num_stages=2),
    C(16, 32, 256, num_warps=4, num_stages=1),
]
DECODE_TMA_TILES = [C(16, 32, 256, group_m=1, num_warps=4, num_stages=4), C(16, 64, 128, group_m=1, num_warps=4,
                                                                            num_stages=5)]
# The one-token GEMV: block_n output columns (block_n / 16 gate/up blocks) per program, block_k
# inputs per step, num_warps; all at <= 128 registers per thread on sm_90.
GEMV_TILES = [
    C(1, 16, 128, num_warps=4, num_stages=1), C(1, 16, 256, num_warps=4, num_stages=1),
    C(1, 16, 512, num_warps=8, num_stages=1), C(1, 32, 128, num_warps=4, num_stages=1),
    C(1, 32, 256, num_warps=8, num_stages=1), C(1, 64, 64, num_warps=4, num_stages=1),
    C(1, 64, 128, num_warps=8, num_stages=1),
]
# 17 <= M <= 64, pointer tiles of small shared-memory footprint (several programs per SM).
MID_OCCUPANCY_TILES = [
    C(32, 64, 128, num_warps=4, num_stages=2), C(32, 64, 128, num_warps=4, num_stages=3),
    C(32, 64, 64, num_warps=4, num_stages=3), C(32, 64, 64, num_warps=4, num_stages=4),
    C(32, 32, 128, num_warps=4, num_stages=3), C(64, 64, 128, num_warps=4, num_stages=2),
    C(64, 64, 64, num_warps=4, num_stages=3), C(64, 128, 64, num_warps=4, num_stages=2),
]
# Persistent TMA tiles small enough for 2-4 programs per SM (<= 112 KB of shared memory each).
PAIRED_TILES = [
    C(64, 64, 128, group_m=4, num_warps=4, num_stages=2), C(32, 128, 128, group_m=4, num_warps=4, num_stages=2),
    C(32, 64, 128, group_m=4, num_warps=4, num_stages=2), C(128, 64, 64, group_m=8, num_warps=4, num_stages=3),
    C(128, 64, 32, group_m=8, num_warps=4, num_stages=4),
]


# Training (M >= 1024): the rules' Hopper tile, varied one field at a time.
_T = dict(group_m=8, num_warps=8, num_stages=4)
BACKWARD_TILES = [
    ("backward_tma", C(128, 128, 64, **_T)), ("backward_tma", C(128, 128, 64, **_T | {"num_stages": 3})),
    ("backward_tma", C(128, 128, 64, **_T | {"group_m": 4})), ("backward_tma", C(128, 128, 64, **_T | {"group_m": 16})),
    ("backward_tma", C(128, 128, 64, **_T, warp_specialize=True)),
    ("backward_tma", C(128, 128, 64, **_T | {"num_stages": 3}, warp_specialize=True)),
    ("backward_tma", C(128, 128, 128, **_T | {"num_stages": 3})), ("backward_tma", C(128, 128, 32, **_T | {"num_stages": 6})),
    ("backward_tma", C(128, 64, 64, **_T | {"num_warps": 4})), ("backward_tma", C(128, 64, 64, **_T)),
    ("backward_tma", C(64, 128, 64, **_T | {"num_warps": 4, "num_stages": 2, "programs_per_sm": 2})),
    ("backward_tma", C(64, 64, 64, **_T | {"num_warps": 4, "programs_per_sm": 2})),
    ("backward_pointer", C(64, 64, 64, num_warps=8, num_stages=3)), ("backward_pointer", C(16, 32, 64, num_warps=4,
                                                                                          num_stages=3)),
]
# The backward's kernels side by side (`--sweep backward_variants`): the fused TMA kernel, its tile
# with the epilogue in 2 and 4 slices (4: less staging, so a fifth stage fits, or two programs per
# SM at <= 128 registers); the split (cuBLAS dH, then the elementwise pass) with four tiles.
_Q = dict(epilogue_subtiles=4)
BACKWARD_VARIANTS = [
    ("backward_tma", C(128, 128, 64, **_T)), ("backward_tma", C(128, 128, 64, **_T, **_Q)),
    ("backward_tma", C(128, 128, 64, **_T | {"num_stages": 5}, **_Q)),
    ("backward_tma", C(128, 128, 64, **_T | {"num_stages": 2, "programs_per_sm": 2}, max_registers=128, **_Q)),
    ("backward_split", C(32, 128, 16, num_warps=4)), ("backward_split", C(64, 128, 16, num_warps=8)),
    ("backward_split", C(16, 256, 16, num_warps=4)), ("backward_split", C(32, 64, 16, num_warps=4)),
    # the warp-specialized kernel (Hopper): 4, 5 and 6 ring stages (6: the handoff in 16 bits), groups 4 and 16
    ("backward_ws", C(128, 128, 64, num_warps=4, num_stages=4, epilogue_subtiles=8)),
    ("backward_ws", C(128, 128, 64, group_m=4, num_warps=4, num_stages=4, epilogue_subtiles=8)),
    ("backward_ws", C(128, 128, 64, group_m=4, num_warps=4, num_stages=5, epilogue_subtiles=8)),
    ("backward_ws", C(128, 128, 64, num_warps=4, num_stages=5, epilogue_subtiles=8)),
    ("backward_ws", C(128, 128, 64, num_warps=4, num_stages=6, epilogue_subtiles=8)),
    ("backward_ws", C(128, 128, 64, group_m=16, num_warps=4, num_stages=5, epilogue_subtiles=8)),
]
# The warp-specialized kernel's tiles (`--sweep backward_ws`): the rules' 128x128 tile (5 stages, fp32
# handoff, groups 8 and 4) against 256x128 tiles with 8 MMA warps (two warpgroups share each Wd box:
# a quarter fewer bytes from L2 per flop), whose handoff is 16-bit (an fp32 one does not fit beside
# the ring): 3 stages of 64-deep K steps or 6 of 32, groups 8 and 4.
_W = dict(num_warps=8, epilogue_subtiles=8, epilogue_registers=152)
BACKWARD_WS_TILES = [
    ("backward_ws", C(128, 128, 64, num_warps=4, num_stages=5, epilogue_subtiles=8)),
    ("backward_ws", C(128, 128, 64, group_m=4, num_warps=4, num_stages=5, epilogue_subtiles=8)),
    ("backward_ws", C(256, 128, 64, num_stages=3, **_W)),
    ("backward_ws", C(256, 128, 64, group_m=4, num_stages=3, **_W)),
    ("backward_ws", C(256, 128, 32, num_stages=6, **_W)),
    ("backward_ws", C(256, 128, 64, group_m=16, num_stages=3, **_W)),
]
PREACT_TILES = [
    ("tma", C(128, 128, 64, **_T, split_tail=True)), ("tma", C(128, 128, 64, **_T | {"num_stages": 3}, split_tail=True)),
    ("tma", C(128, 128, 64, **_T | {"num_stages": 3}, warp_specialize=True, split_tail=True)),
    ("tma", C(128, 128, 64, **_T)), ("tma", C(128, 64, 64, **_T | {"num_warps": 4}, split_tail=True)),
    ("pointer", C(128, 128, 64, num_warps=8, num_stages=4)), ("pointer", C(64, 64, 64, num_warps=4, num_stages=4)),
]


def grid_tiles(m: int) -> list[C]:
    """The grid kernel's tiles for m: 16/32-row (M <= 16) or 32/64-row, 2x64 or 2x128 weight rows,
    BLOCK_K 64/128, 2-3 stages; four prefill-like tiles beyond M = 64."""
    if m > 64:
        return [C(64, 128, 64, group_m=8, num_warps=4, num_stages=4), C(64, 64, 128, group_m=8, num_warps=4, num_stages=4),
                C(128, 64, 64, group_m=8, num_warps=4, num_stages=4), C(128, 128, 64, group_m=8, num_warps=8, num_stages=3)]
    return [C(bm, bn, bk, group_m=4, num_warps=4, num_stages=s)
            for bm in ((16, 32) if m <= 16 else (32, 64)) for bn in (64, 128) for bk in (64, 128) for s in (2, 3)]


def _ptr(cfgs) -> list[tuple[str, C]]:
    return [("pointer", c) for c in cfgs]


def sweep_buckets(m, k, i, shipped):
    """Pointer tiles of m's size class; persistent TMA tiles from M = 48 (128-row ones with and
    without warp specialization and the split tail)."""
    ptr = [c for c in POINTER_TILES if (m <= 16 and c.block_m <= 16) or (16 < m <= 64 and 16 < c.block_m <= 64)
           or (64 < m <= 256 and c.block_m == 64) or (m > 256 and c.block_m == 128)]
    tma = [dataclasses.replace(c, warp_specialize=ws, split_tail=st) for c in TMA_TILES
           if m >= 48 and (m < 512 or c.block_m == 128)
           for ws in ((False, True) if c.block_m == 128 else (False,)) for st in ((False, True) if m > 64 else (False,))]
    return _ptr(ptr) + [("tma", c) for c in tma]


def sweep_decode(m, k, i, shipped):
    """M <= 16: the pointer tile the rules give, the decode tiles, the persistent TMA small-M tiles."""
    return _ptr(dict.fromkeys([shipped("pointer", 16)] + DECODE_TILES)) + [("tma", c) for c in DECODE_TMA_TILES]


def sweep_gemv(m, k, i, shipped):
    """M = 1: the pointer tile the M <= 16 rules give against the GEMV's tiles."""
    return _ptr([shipped("pointer", 16)]) + ([("gemv", c) for c in GEMV_TILES] if m == 1 else [])


def sweep_grid(m, k, i, shipped):
    """The one-program-per-tile TMA kernel, each tile with one and with two weight boxes."""
    return [("grid", dataclasses.replace(c, weight_boxes=b)) for c in grid_tiles(m) for b in (1, 2)]


def sweep_tail(m, k, i, shipped):
    """The TMA tile the rules give for m and a 128x(2x64) one, each with the split tail off and on."""
    tiles = dict.fromkeys([shipped("tma", max(m, 65)), C(128, 64, 64, group_m=8, num_warps=8, num_stages=5)])
    return [("tma", dataclasses.replace(c, split_tail=s)) for c in tiles for s in (False, True)]


def sweep_midocc(m, k, i, shipped):
    """17 <= M <= 64: the pointer tile of m's bucket rule against low-footprint pointer tiles."""
    return _ptr(dict.fromkeys([shipped("pointer", m)] + MID_OCCUPANCY_TILES))


def sweep_paired(m, k, i, shipped):
    """Persistent TMA tiles with 1, 2 and (32-row tiles) 4 programs per SM."""
    return [("tma", dataclasses.replace(c, programs_per_sm=p)) for c in PAIRED_TILES
            for p in ((1, 2, 4) if c.block_m == 32 else (1, 2))]


def sweep_backward(m, k, i, shipped):
    """Training's backward GEMM (op `backward`): TMA and pointer tiles."""
    return list(BACKWARD_TILES)


def sweep_backward_variants(m, k, i, shipped):
    """Training's backward GEMM (op `backward`): the fused TMA kernel's epilogue slices and depths, the split's tiles."""
    return list(BACKWARD_VARIANTS)


def sweep_backward_ws(m, k, i, shipped):
    """Training's backward GEMM (op `backward`): the warp-specialized kernel's 128x128 and 256x128 tiles."""
    return list(BACKWARD_WS_TILES)


def sweep_preact(m, k, i, shipped):
    """Training's forward storing P (op `preact`): TMA tiles with and without the split tail, two pointer tiles."""
    return list(PREACT_TILES)


SWEEPS = {"buckets": sweep_buckets, "decode": sweep_decode, "gemv": sweep_gemv, "grid": sweep_grid,
          "tail": sweep_tail, "midocc": sweep_midocc, "paired": sweep_paired, "backward": sweep_backward,
          "backward_variants": sweep_backward_variants, "backward_ws": sweep_backward_ws, "preact": sweep_preact}
OP = {"backward": "backward", "backward_variants": "backward", "backward_ws": "backward", "preact": "preact"}  # the op each sweep times; "forward" otherwise
SWEEP_HELP = {"buckets": "pointer and persistent TMA tiles per M bucket (default)",
              "decode": "pointer tiles at M <= 16, and TMA small-M tiles", "gemv": "GEMV tiles at M = 1",
              "grid": "one-program-per-tile TMA tiles, 1 and 2 weight boxes", "tail": "TMA split tail off and on",
              "midocc": "low-footprint pointer tiles at 17 <= M <= 64",
              "paired": "persistent TMA tiles with 1-4 programs per SM",
              "backward": "training's backward GEMM tiles (default M 4096 8192)",
              "backward_variants": "training's backward GEMM: fused TMA, warp-specialized and split kernels (default M 4096 8192)",
              "backward_ws": "training's backward GEMM: the warp-specialized kernel's tiles (default M 4096 8192)",
              "preact": "training's forward tiles, P stored (default M 4096 8192)"}
TMA_KERNELS = ("tma", "grid", "backward_tma", "backward_ws")  # these need a Hopper GPU


def label(kernel: str, config: C) -> str:
    """A candidate's name in tune.json's rows and tune.md: the kernel, then `config.short()`."""
    return f"{kernel} {config.short()}"
