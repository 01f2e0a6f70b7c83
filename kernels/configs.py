"""Launch configurations of the fused gated GEMM: tiles per M bucket and per GPU and shape.

`GatedGemmConfig` is one launch config; `m_bucket` maps M to its bucket. `_DEFAULTS` (pointer
kernel) and `_TMA_DEFAULTS` (persistent TMA kernel) hold a tile per M bucket; `_SHAPE_RULES`
override them per GPU and shape (first match wins), and `_GRAPH_RULES` go before those for a
call being captured into a CUDA graph. Every number in the comments comes from a graph-timed
sweep of `benchmarks/tune_kernel.py` under `benchmarks/results/tune_graph/` (or the file
named). `gated_gemm.default_config` and `gated_gemm.gated_gemm` read these tables.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatedGemmConfig:
    """One launch configuration of `_gated_gemm_fwd_kernel`."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    warp_specialize: bool = False  # TMA kernel only: loads and MMAs in separate warp groups
    stream_k: bool = False  # TMA kernel only: split the last partial wave's tiles over all SMs by K
    split_tail: bool = False  # TMA kernel only: run a last wave that fits in half the SMs as narrower tiles
    programs_per_sm: int = 1  # TMA kernel only: persistent programs per SM (2: two share an SM, if they fit)
    grid_boxes: int = 0  # 1 or 2: the one-program-per-tile TMA kernel (`gated_gemm_tma_grid`) with this many weight boxes

    def meta(self) -> dict:
        """The kernel's tile meta-parameters."""
        return dict(
            BLOCK_SIZE_M=self.block_m, BLOCK_SIZE_N=self.block_n, BLOCK_SIZE_K=self.block_k,
            GROUP_SIZE_M=self.group_m,
        )


def m_bucket(m: int) -> int:
    """The power of two >= m, capped at 8192: configs are chosen per bucket, not per M."""
    return min(1 << max(m - 1, 0).bit_length(), 8192)


# Defaults per M bucket: the best geometric mean over the six benchmark shapes, bf16 on an
# H100, from `python -m benchmarks.tune_kernel` (benchmarks/results/tune_h100_bf16_graph.json:
# CUDA-graph timing after a read-only L2 flush). fp32 halves BLOCK_SIZE_K to fit shared memory.
_DEFAULTS: dict[int, GatedGemmConfig] = {
    16: GatedGemmConfig(16, 32, 256, num_warps=4, num_stages=4),
    32: GatedGemmConfig(32, 64, 128, num_warps=4, num_stages=4),
    64: GatedGemmConfig(64, 64, 128, num_warps=4, num_stages=4),
    8192: GatedGemmConfig(128, 128, 64, num_warps=8, num_stages=4),
}

# Candidates `benchmarks/tune_kernel.py` times to pick `_DEFAULTS` (offline: no autotuning at run time).
CANDIDATE_CONFIGS: list[GatedGemmConfig] = [
    # decode: few tokens, weight-bandwidth bound; many programs over I, deep pipelines
    GatedGemmConfig(16, 16, 256, num_warps=4, num_stages=4),
    GatedGemmConfig(16, 16, 256, num_warps=4, num_stages=6),
    GatedGemmConfig(16, 16, 512, num_warps=4, num_stages=3),
    GatedGemmConfig(16, 32, 128, num_warps=4, num_stages=4),
    GatedGemmConfig(16, 32, 128, num_warps=4, num_stages=6),
    GatedGemmConfig(16, 32, 256, num_warps=4, num_stages=4),
    GatedGemmConfig(16, 64, 128, num_warps=4, num_stages=4),
    GatedGemmConfig(16, 64, 256, num_warps=4, num_stages=3),
    GatedGemmConfig(16, 128, 128, num_warps=4, num_stages=4),
    # small and middle M
    GatedGemmConfig(32, 32, 256, num_warps=4, num_stages=4),
    GatedGemmConfig(32, 64, 128, num_warps=4, num_stages=4),
    GatedGemmConfig(64, 32, 128, num_warps=4, num_stages=4),
    GatedGemmConfig(64, 64, 64, num_warps=4, num_stages=4),
    GatedGemmConfig(64, 64, 128, num_warps=4, num_stages=4),
    GatedGemmConfig(64, 128, 64, num_warps=4, num_stages=4),
    # prefill without TMA (pre-Hopper, unaligned): two 128x128 fp32 accumulators
    GatedGemmConfig(128, 128, 64, num_warps=8, num_stages=4),
]


def _bucket_key(table: dict[int, GatedGemmConfig], m: int) -> int:
    """The smallest key of `table` that holds m (the largest key for any bigger m)."""
    return min((b for b in table if b >= m_bucket(m)), default=max(table))


def _for_bucket(table: dict[int, GatedGemmConfig], m: int) -> GatedGemmConfig:
    """The entry of the smallest bucket key that holds m (the largest key for any bigger m)."""
    return table[_bucket_key(table, m)]


@dataclass(frozen=True)
class ShapeRule:
    """The config for the M bucket `bucket` (a `_DEFAULTS` key: 16 is M <= 16, 32 is
    17 <= M <= 32), m_min <= M <= m_max, on a GPU whose name holds one of `gpus`, for
    k_min <= K <= k_max and i_min <= I <= i_max (None: any). A config with block_m == 1 runs
    the one-token GEMV (`gated_gemv.py`), one with grid_boxes > 0 the one-program-per-tile TMA
    kernel (`gated_gemm_tma_grid.py`, where `tma_supported`), one with programs_per_sm > 1 the
    persistent TMA kernel (`gated_gemm_tma.py`), any other the pointer kernel; a call the named
    kernel cannot run takes the bucket's `_DEFAULTS` entry."""

    gpus: tuple[str, ...]
    k_max: int | None
    i_max: int | None
    config: GatedGemmConfig
    i_min: int | None = None
    bucket: int = 16
    m_max: int | None = None
    k_min: int | None = None
    m_min: int | None = None


# Shape rules, first match wins; a call no rule covers takes its bucket's `_DEFAULTS` entry.
# Decode (bucket 16), from the graph-timed decode sweeps (H100:
# benchmarks/results/tune_graph/tune_decode_streamk_h100_bf16.json, data-parallel rows; H200:
# tune_h200_bf16.json), M = 1, 4, 16:
_SHAPE_RULES: tuple[ShapeRule, ...] = (
    # K <= 2048 (Llama-3.2-1B): a 256-wide K block leaves 8 iterations, half of them pipeline fill;
    # 16x(2*32)x128 measured 27.9 µs against 29.1 for 16x(2*32)x256 on the H100, 21.3 against 21.9
    # for the next rule's tile on the H200.
    ShapeRule(("H100", "H200"), 2048, None, GatedGemmConfig(16, 32, 128, num_warps=4, num_stages=4)),
    # M = 1, 2048 < K <= 4096 and 14336 <= I <= 16384 (Llama-3-8B, Gemma-2-9B; the bounds are the
    # shapes measured): the GEMV, 64 output columns per program, 128-wide K steps, 8 warps. H100:
    # 83.5 µs against 84.0 for the next rule's tile on Llama-3-8B, 73.6 against 75.1 on Gemma-2-9B
    # (tune_gemv_h100_bf16.json); H200: 58.8 against 60.9, 51.7 against 54.1
    # (tune_gemv_h200_bf16.json). Its programs use no shared memory, so several share an SM and
    # the call drains evenly. On the wider shapes its best tile tied the table's on the H100.
    ShapeRule(("H100", "H200"), 4096, 16384, GatedGemmConfig(1, 64, 128, num_warps=8, num_stages=1), i_min=14336,
              m_max=1),
    # 4096 <= I <= 16384 (Llama-3-8B, Gemma-2-9B): 16x(2*64)x256 with 3 stages, 0.8-2.4% faster
    # than 16x(2*32)x256 on the H100 and 2-6% on the H200; 1-5% slower for wider I (Qwen2.5-7B,
    # Gemma-2-27B, Llama-3-70B), which keep `_DEFAULTS[16]`. Tensor-parallel shards
    # (tune_decode_tp_h100_bf16.json): best or within 0.3% at I = 4608-7168, 4% slower at I = 3584
    # (56 tiles for 132 SMs), hence the lower bound.
    ShapeRule(("H100", "H200"), None, 16384, GatedGemmConfig(16, 64, 256, num_warps=4, num_stages=3), i_min=4096),
    # 17 <= M <= 32 with I > 16384 and K <= 4096 (Qwen2.5-7B): the bucket's 4-stage tile takes 120 KB
    # of shared memory, one program per SM, and Qwen's 296 tiles run as 2.24 waves; with 2 stages
    # (40 KB) every tile is resident at once: 0.948x of cuBLAS at M = 32 against 0.999x, 0.960x
    # against 1.015x at M = 24, where Liger ran at 0.958x / 0.962x. On the other five shapes
    # 2 stages lost 1-19% (H100, tune_midocc_h100_bf16.json).
    ShapeRule(("H100",), 4096, None, GatedGemmConfig(32, 64, 128, num_warps=4, num_stages=2), i_min=16385, bucket=32),
    # The same shapes on the H200 (tune_midocc_h200_bf16.json): 32x(2*64)x64 with 4 stages (60 KB,
    # three programs per SM) 0.995x / 1.004x of cuBLAS at M = 24 / 32, the H100's 2-stage tile
    # 1.012x, the table's 1.083x / 1.072x; Liger 0.972x / 0.975x.
    ShapeRule(("H200",), 4096, None, GatedGemmConfig(32, 64, 64, num_warps=4, num_stages=4), i_min=16385, bucket=32),
    # 33 <= M <= 64 with K >= 8192 and I > 16384 (Llama-3-70B), H100: the TMA kernel's 64x(2*64)x128
    # tile with 2 stages (106 KB) and two persistent programs per SM, so one program's loads and
    # epilogue overlap the other's MMAs: 0.951x and 0.957x of cuBLAS at M = 64 in two sweeps
    # against 0.977x / 0.979x for the bucket's pointer tile, Liger 0.954x / 0.962x
    # (tune_paired_h100_bf16.json, tune_tmaocc_h100_bf16.json). On Qwen2.5-7B and Llama-3-8B the
    # same tile lost (1.01-1.13x), and no 32-row TMA tile with 1-4 programs per SM came near Liger
    # on Qwen2.5-7B at M = 64 (1.09x at best, against 0.951x).
    ShapeRule(("H100",), None, None, GatedGemmConfig(64, 64, 128, group_m=4, num_warps=4, num_stages=2,
                                                     programs_per_sm=2), i_min=16385, bucket=64, k_min=8192),
)


# Shape rules for calls captured into a CUDA graph, consulted before `_SHAPE_RULES` there. Their
# kernel takes host-built TMA descriptors: 86.7 µs of host time per call from idle against 35.8
# for the pointer kernel (H100 host, `python -m benchmarks.launch_overhead --decode-only`,
# benchmarks/results/overhead/launch_overhead_decode_h100_0960882.json), which a host-bound eager
# decode step would pay on every layer; a graph pays it once, at capture.
_GRAPH_RULES: tuple[ShapeRule, ...] = (
    # H200 (one sweep, benchmarks/results/tune_graph/tune_grid_h200_bf16.json: 32 grid tiles x 2 box
    # layouts against the shipped tile and Liger, M = 2..128; geometric means of the ratio to cuBLAS
    # over M = 2, 8, 16 for bucket 16). Where a rule below names both GPUs, the H200's best tile was
    # the H100's (Gemma-2-9B at M = 64: within 0.1%); these are the H200's own:
    # M = 2..16 (the GEMV keeps M = 1), 2048 < K <= 4096, 14336 <= I <= 16384 (Llama-3-8B,
    # Gemma-2-9B): 16x(2*128)x128, 3 stages, one box: 1.002 / 0.994 against 1.055 / 1.042 for the
    # pointer tile, Liger 1.008 on Llama-3-8B.
    ShapeRule(("H200",), 4096, 16384, GatedGemmConfig(16, 128, 128, group_m=4, num_warps=4, num_stages=3, grid_boxes=1),
              i_min=14336, k_min=2049, m_min=2),
    # M <= 16, 4096 < K < 8192, I > 16384 (Gemma-2-27B): 16x(2*64)x128, 2 stages, two boxes: 0.988
    # against 1.005. (Llama-3-70B: the best grid tile 0.961 against 0.965: no rule.)
    ShapeRule(("H200",), 8191, None, GatedGemmConfig(16, 64, 128, group_m=4, num_warps=4, num_stages=2, grid_boxes=2),
              i_min=16385, k_min=4097),
    # 17 <= M <= 32, 4096 < K < 8192, I > 16384 (Gemma-2-27B): 32x(2*64)x128, 2 stages, one box:
    # 1.000 against 1.027.
    ShapeRule(("H200",), 8191, None, GatedGemmConfig(32, 64, 128, group_m=4, num_warps=4, num_stages=2, grid_boxes=1),
              i_min=16385, k_min=4097, bucket=32),
    # 17 <= M <= 32, 2048 < K <= 4096 and 14336 <= I <= 16384 (Llama-3-8B, Gemma-2-9B), or K >= 8192
    # and I > 16384 (Llama-3-70B): 32x(2*128)x128, 3 stages, two boxes: 0.996 / 0.999 / 0.990 against
    # 1.051 / 1.055 / 1.037 (Liger 0.983 / - / 0.982).
    ShapeRule(("H200",), 4096, 16384, GatedGemmConfig(32, 128, 128, group_m=4, num_warps=4, num_stages=3,
                                                      grid_boxes=2), i_min=14336, k_min=2049, bucket=32),
    ShapeRule(("H200",), None, None, GatedGemmConfig(32, 128, 128, group_m=4, num_warps=4, num_stages=3, grid_boxes=2),
              i_min=16385, k_min=8192, bucket=32),
    # 33 <= M <= 64, K < 8192, I > 16384 (Qwen2.5-7B, Gemma-2-27B): 64x(2*64)x64, 3 stages, one box:
    # 0.939 / 0.992 against 1.080 / 1.029 (Liger 1.005 on Qwen2.5-7B); the H100's 32-row Qwen tile
    # 0.983 here.
    ShapeRule(("H200",), 8191, None, GatedGemmConfig(64, 64, 64, group_m=4, num_warps=4, num_stages=3, grid_boxes=1),
              i_min=16385, bucket=64),
    # H100 (and the H200 where a rule names it), M <= 128: the TMA kernel with one program per tile
    # (`gated_gemm_tma_grid`, grid_boxes = weight boxes per K step), from two interleaved sweeps of
    # it against the shipped tile and Liger (benchmarks/results/tune_graph/tune_grid_h100_bf16.json,
    # tune_gridpick_h100_bf16.json; ratios to cuBLAS, first sweep / second). Its programs hold 1-2 stages of shared memory, so 2-3 of them
    # share an SM and the hardware scheduler balances the weight read across the SMs to the end; the
    # persistent and pointer tiles it replaces run one program per SM. Bounds: the shapes measured
    # (K 2048-8192, I 8192-36864).
    # M <= 16, I > 16384, K <= 4096 (Qwen2.5-7B): 16x(2*64)x128, 2 stages, gate and up as two boxes:
    # 0.953 / 0.936 / 0.936-0.933 at M = 2 / 8 / 16, the pointer tile 0.965 / 0.955 / 0.945-0.940.
    # On the other shapes the pointer tiles stayed ahead (by 0.3-2.5%).
    # H200: 0.914 against 0.978 for the pointer tile (M = 2-16), Liger 0.982.
    ShapeRule(("H100", "H200"), 4096, None, GatedGemmConfig(16, 64, 128, group_m=4, num_warps=4, num_stages=2,
                                                            grid_boxes=2), i_min=16385),
    # 17 <= M <= 32, I > 16384, K <= 4096 (Qwen2.5-7B): 32x(2*64)x128, 2 stages, two boxes: 0.948 /
    # 0.962 against 0.965 / 0.978 for the 2-stage pointer rule. On the other shapes the sweeps' gains
    # (0-1.5%) did not hold in a bench run (benchmarks/results/mlp_raw/run0960882_*.json).
    # H200: 0.913 against 1.020 for the pointer rule's tile, Liger 0.960.
    ShapeRule(("H100", "H200"), 4096, None, GatedGemmConfig(32, 64, 128, group_m=4, num_warps=4, num_stages=2,
                                                            grid_boxes=2), i_min=16385, bucket=32),
    # 33 <= M <= 64, one box: Qwen2.5-7B 32x(2*64)x128 with 2 stages (two row tiles per weight tile):
    # 0.956 / 0.954 against 1.012 / 1.011 for the pointer tile, Liger 0.964 / 0.960. 64x(2*64)x128
    # with 2 stages on Llama-3-8B, Gemma-2-9B and Llama-3-70B (0.965 / 0.960, 0.969 / 0.971, 0.942 /
    # 0.954 against 0.981 / 0.973, 0.988 / 0.989 and the persistent TMA rule's 0.954 / 0.960), with
    # 3 stages on Llama-3.2-1B and Gemma-2-27B (0.991 / 0.987 against 1.004 / 1.003, 0.968 / 0.969
    # against 0.980 / 0.981), where 2 stages lost 3-9%.
    ShapeRule(("H100",), 4096, None, GatedGemmConfig(32, 64, 128, group_m=4, num_warps=4, num_stages=2, grid_boxes=1),
              i_min=16385, bucket=64),
    # H200, these three: Llama-3-8B 0.982, Gemma-2-9B 0.973, Llama-3-70B 0.995, Llama-3.2-1B 1.011
    # against 1.024, 1.008, 1.030 and 1.035 for the pointer tile.
    ShapeRule(("H100", "H200"), 4096, 16384, GatedGemmConfig(64, 64, 128, group_m=4, num_warps=4, num_stages=2,
                                                             grid_boxes=1), i_min=8192, bucket=64, k_min=2049),
    ShapeRule(("H100", "H200"), None, None, GatedGemmConfig(64, 64, 128, group_m=4, num_warps=4, num_stages=2,
                                                            grid_boxes=1), i_min=16385, bucket=64, k_min=8192),
    # (H200: Qwen2.5-7B and Gemma-2-27B take the H200 rule above; this one is Llama-3.2-1B's there.)
    ShapeRule(("H100", "H200"), None, None, GatedGemmConfig(64, 64, 128, group_m=4, num_warps=4, num_stages=3,
                                                            grid_boxes=1), i_min=8192, bucket=64, k_min=2048),
    # 65 <= M <= 128 with I <= 16384 (Llama-3.2-1B, Llama-3-8B, Gemma-2-9B): 128x(2*64)x64, 4 stages,
    # one box: 1.026 / 1.019, 1.014 / 1.013, 1.043 / 1.046 at M = 128 against 1.067 / 1.065, 1.057 /
    # 1.058, 1.064 / 1.069 for the persistent 128x(2*128) tile, whose 64-112 tiles leave SMs idle
    # there. It lost on the wider shapes (1.02-1.06 against 0.97-1.01).
    # H200: 1.009 / 1.063 / 1.068 (Llama-3.2-1B, Llama-3-8B, Gemma-2-9B) against 1.111 / 1.125 / 1.125
    # for the persistent 64x(2*64) tile; on the wider shapes it lost there too (1.07-1.21 against 1.00-1.12).
    ShapeRule(("H100", "H200"), None, 16384, GatedGemmConfig(128, 64, 64, group_m=8, num_warps=4, num_stages=4,
                                                             grid_boxes=1), i_min=8192, bucket=8192, m_max=128,
              k_min=2048),
)


def _shape_rule(name: str, bucket: int, m: int, k: int | None, i: int | None,
                rules: tuple[ShapeRule, ...] = _SHAPE_RULES) -> GatedGemmConfig | None:
    for rule in rules:
        if (rule.bucket == bucket and (rule.m_max is None or m <= rule.m_max)
                and (rule.m_min is None or m >= rule.m_min) and any(g in name for g in rule.gpus)
                and (rule.k_max is None or (k is not None and k <= rule.k_max))
                and (rule.k_min is None or (k is not None and k >= rule.k_min))
                and (rule.i_max is None or (i is not None and i <= rule.i_max))
                and (rule.i_min is None or (i is not None and i >= rule.i_min))):
            return rule.config
    return None


# The TMA kernel's tiles per M bucket (block_n = output columns: the weight box is 2 * block_n
# rows) and the M from which it runs; H100 bf16 sweeps of `benchmarks.tune_kernel`
# (benchmarks/results/tune_h100_bf16_graph.json, tune_streamk_h100_bf16.json): up to M = 64 the
# pointer kernel beats every TMA tile, from 65 to 128 a 64x(2*64) tile, beyond that 128x(2*128).
# Last wave (benchmarks/results/tune_graph/tune_tail_h100_bf16.json): a split tail beat stream-K
# and whole tiles on the 128x(2*128) buckets (geometric mean over the six shapes at M = 512:
# 1.041x of cuBLAS split, 1.088x stream-K, 1.094x whole) and lost on 64x(2*64) tiles (M <= 128,
# weight-bandwidth bound: 1.039x split, 1.030x whole), so only the former split. `warp_specialize`
# follows the sweeps that picked it, but with Triton 3.6 on sm_90 it compiles to the same SASS
# as without (`python -m benchmarks.epilogue_sass --warp-specialize`): the flag only matters
# where Triton partitions the loop (newer GPUs), where these tiles were never measured.
_TMA_DEFAULTS: dict[int, GatedGemmConfig] = {
    128: GatedGemmConfig(64, 64, 128, group_m=8, num_warps=4, num_stages=4),
    1024: GatedGemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4, warp_specialize=True, split_tail=True),
    4096: GatedGemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4, split_tail=True),
    8192: GatedGemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3, warp_specialize=True, split_tail=True),
}
TMA_MIN_M = 65


# The GEMV's config when a call names kernel="gemv" without one (block_m, num_stages unused).
GEMV_DEFAULT = GatedGemmConfig(1, 16, 256, num_warps=4, num_stages=1)
# The grid kernel's config when a call names kernel="grid" without a config.
GRID_DEFAULT = GatedGemmConfig(64, 64, 128, group_m=4, num_warps=4, num_stages=3, grid_boxes=1)
