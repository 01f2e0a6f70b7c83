"""Which kernel runs a gated GEMM call, as data: an ordered table of rules, first match wins.

One table per op (`TABLES`): `RULES` for the gated GEMM (the forward: inference, training's
forward storing P, LoRA's low-rank forward), `BACKWARD_RULES` for training's backward GEMM. A rule
names a kernel ("gemv", "pointer", "grid", "tma", ...: one file each in this package) and the
config it runs with, and says which calls it is for: GPU name, compute capability, the ranges of M
(tokens), K (hidden size), I (intermediate size) and, in the experts tables, the mean rows per
expert, and whether the call is being captured into a CUDA graph. `dispatch.py` takes the first
rule that matches the call and whose kernel has the call's features and can run its tensors
(dtype, alignment, whole gate/up blocks: the kernel file's CAPABILITY and `can_run`); the last
rules of each table match every call, so there is always one. fp32 calls halve the chosen block_k
(shared memory).

`sweep` names the measurements that chose the rule, relative to benchmarks/results/; the
per-rule numbers are in docs/performance.md. `swiglu-patch explain --m 16 --k 4096 --i 14336`
says which rule a call takes and why the earlier ones did not (`--op backward` for the
backward table).

Why the groups exist:
- captured calls (CUDA graphs) may take the grid kernel, whose host-built TMA descriptors
  cost ~50 us of host time per call that a graph pays once and an eager decode step would
  pay on every layer;
- decode (M <= 16) is weight-bandwidth bound: tiles per shape, the one-token GEMV at M = 1;
- from M = 65 on Hopper the persistent TMA kernel; elsewhere the pointer kernel per M bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .configs import ExpertsConfig as EC
from .experts_backward_config import ExpertsBackwardConfig as EBC
from .configs import GatedGemmConfig as C

KERNELS = ("gemv", "pointer", "grid", "tma")
HOPPER = (9, 0)


@dataclass(frozen=True)
class Rule:
    """Run `kernel` with `config` for calls inside every bound given (None: no bound).

    Attributes:
        kernel: one of `KERNELS`.
        config: its launch config.
        gpus: substrings of the CUDA device name (any one must match); () any device.
        min_capability: the least compute capability, or None.
        m, k, i: inclusive (low, high) bounds on tokens, hidden size and intermediate size.
        rows: experts tables: inclusive bounds on the mean rows per expert,
            rows_bucket(M) * top_k // num_experts (`dispatch.expert_rows`); a call without it skips the rule.
        captured: True only while a CUDA graph is being captured; None either way.
        sweep: result files (under benchmarks/results/) that chose this rule.
        why: one line on what it wins.
    """

    kernel: str
    config: C
    gpus: tuple[str, ...] = ()
    min_capability: tuple[int, int] | None = None
    m: tuple[int | None, int | None] = (None, None)
    k: tuple[int | None, int | None] = (None, None)
    i: tuple[int | None, int | None] = (None, None)
    rows: tuple[int | None, int | None] = (None, None)
    captured: bool | None = None
    sweep: tuple[str, ...] = ()
    why: str = ""


H100 = ("H100",)
H200 = ("H200",)
HOPPERS = ("H100", "H200")
GRID_H100 = ("h100/tune/tune_grid_h100_bf16.json", "h100/tune/tune_gridpick_h100_bf16.json")
GRID_H200 = ("h200/tune/tune_grid_h200_bf16.json",)

RULES: tuple[Rule, ...] = (
    # -- calls captured into a CUDA graph: the one-program-per-tile TMA kernel --
    Rule("grid", C(16, 128, 128, group_m=4, num_warps=4, num_stages=3, weight_boxes=1), H200,
         m=(2, 16), k=(2049, 4096), i=(14336, 16384), captured=True, sweep=GRID_H200,
         why="Llama-3-8B, Gemma-2-9B decode on H200: 1.002/0.994 of cuBLAS vs 1.055/1.042 pointer"),
    Rule("grid", C(16, 64, 128, group_m=4, num_warps=4, num_stages=2, weight_boxes=2), H200,
         m=(1, 16), k=(4097, 8191), i=(16385, None), captured=True, sweep=GRID_H200,
         why="Gemma-2-27B decode on H200: 0.988 vs 1.005"),
    Rule("grid", C(32, 64, 128, group_m=4, num_warps=4, num_stages=2, weight_boxes=1), H200,
         m=(17, 32), k=(4097, 8191), i=(16385, None), captured=True, sweep=GRID_H200,
         why="Gemma-2-27B on H200: 1.000 vs 1.027"),
    Rule("grid", C(32, 128, 128, group_m=4, num_warps=4, num_stages=3, weight_boxes=2), H200,
         m=(17, 32), k=(2049, 4096), i=(14336, 16384), captured=True, sweep=GRID_H200,
         why="Llama-3-8B, Gemma-2-9B on H200: 0.996/0.999 vs 1.051/1.055"),
    Rule("grid", C(32, 128, 128, group_m=4, num_warps=4, num_stages=3, weight_boxes=2), H200,
         m=(17, 32), k=(8192, None), i=(16385, None), captured=True, sweep=GRID_H200,
         why="Llama-3-70B on H200: 0.990 vs 1.037"),
    Rule("grid", C(64, 64, 64, group_m=4, num_warps=4, num_stages=3, weight_boxes=1), H200,
         m=(33, 64), k=(None, 8191), i=(16385, None), captured=True, sweep=GRID_H200,
         why="Qwen2.5-7B, Gemma-2-27B on H200: 0.939/0.992 vs 1.080/1.029"),
    Rule("grid", C(16, 64, 128, group_m=4, num_warps=4, num_stages=2, weight_boxes=2), HOPPERS,
         m=(1, 16), k=(None, 4096), i=(16385, None), captured=True, sweep=GRID_H100 + GRID_H200,
         why="Qwen2.5-7B decode: 0.936-0.953 vs 0.940-0.965 pointer (H100), 0.914 vs 0.978 (H200)"),
    Rule("grid", C(32, 64, 128, group_m=4, num_warps=4, num_stages=2, weight_boxes=2), HOPPERS,
         m=(17, 32), k=(None, 4096), i=(16385, None), captured=True, sweep=GRID_H100 + GRID_H200,
         why="Qwen2.5-7B: 0.948/0.962 vs 0.965/0.978 (H100), 0.913 vs 1.020 (H200)"),
    Rule("grid", C(32, 64, 128, group_m=4, num_warps=4, num_stages=2, weight_boxes=1), H100,
         m=(33, 64), k=(None, 4096), i=(16385, None), captured=True, sweep=GRID_H100,
         why="Qwen2.5-7B on H100: 0.956/0.954 vs 1.012/1.011"),
    Rule("grid", C(64, 64, 128, group_m=4, num_warps=4, num_stages=2, weight_boxes=1), HOPPERS,
         m=(33, 64), k=(2049, 4096), i=(8192, 16384), captured=True, sweep=GRID_H100 + GRID_H200,
         why="Llama-3-8B, Gemma-2-9B: 0.960-0.971 vs 0.973-0.989"),
    Rule("grid", C(64, 64, 128, group_m=4, num_warps=4, num_stages=2, weight_boxes=1), HOPPERS,
         m=(33, 64), k=(8192, None), i=(16385, None), captured=True, sweep=GRID_H100 + GRID_H200,
         why="Llama-3-70B: 0.942/0.954 vs 0.954/0.960 (persistent TMA rule)"),
    Rule("grid", C(64, 64, 128, group_m=4, num_warps=4, num_stages=3, weight_boxes=1), HOPPERS,
         m=(33, 64), k=(2048, None), i=(8192, None), captured=True, sweep=GRID_H100 + GRID_H200,
         why="Llama-3.2-1B, Gemma-2-27B: 0.987-0.991 vs 0.980-1.004; 2 stages lost 3-9%"),
    Rule("grid", C(128, 64, 64, group_m=8, num_warps=4, num_stages=4, weight_boxes=1), HOPPERS,
         m=(65, 128), k=(2048, None), i=(8192, 16384), captured=True, sweep=GRID_H100 + GRID_H200,
         why="1B/8B/9B at M = 128: 1.013-1.046 vs 1.057-1.069 persistent TMA (64-112 tiles idle SMs)"),
    # -- decode and middle M, eager or captured: tiles per GPU and shape --
    Rule("pointer", C(16, 32, 128, num_warps=4, num_stages=4), HOPPERS, m=(1, 16), k=(None, 2048),
         sweep=("h100/tune/tune_decode_streamk_h100_bf16.json", "h200/tune/tune_h200_bf16.json"),
         why="K <= 2048 (Llama-3.2-1B): a 256-wide K block leaves half the 8 steps to pipeline fill"),
    Rule("gemv", C(1, 64, 128, num_warps=8, num_stages=1), HOPPERS, m=(1, 1), k=(None, 4096), i=(14336, 16384),
         sweep=("h100/tune/tune_gemv_h100_bf16.json", "h200/tune/tune_gemv_h200_bf16.json"),
         why="one token, Llama-3-8B / Gemma-2-9B: 83.5 vs 84.0 us (H100), 58.8 vs 60.9 (H200)"),
    Rule("pointer", C(16, 64, 256, num_warps=4, num_stages=3), HOPPERS, m=(1, 16), i=(4096, 16384),
         sweep=("h100/tune/tune_decode_streamk_h100_bf16.json", "h100/tune/tune_decode_tp_h100_bf16.json",
                "h200/tune/tune_h200_bf16.json"),
         why="4096 <= I <= 16384 (8B, 9B, tensor-parallel shards): 0.8-2.4% faster (H100), 2-6% (H200)"),
    Rule("pointer", C(32, 64, 128, num_warps=4, num_stages=2), H100, m=(17, 32), k=(None, 4096),
         i=(16385, None), sweep=("h100/tune/tune_midocc_h100_bf16.json",),
         why="Qwen2.5-7B: 2 stages keep all 296 tiles resident, 0.948 vs 0.999 of cuBLAS at M = 32"),
    Rule("pointer", C(32, 64, 64, num_warps=4, num_stages=4), H200, m=(17, 32), k=(None, 4096),
         i=(16385, None), sweep=("h200/tune/tune_midocc_h200_bf16.json",),
         why="Qwen2.5-7B on H200: 0.995/1.004 vs 1.083/1.072 of cuBLAS"),
    Rule("tma", C(64, 64, 128, group_m=4, num_warps=4, num_stages=2, programs_per_sm=2), H100,
         m=(33, 64), k=(8192, None), i=(16385, None),
         sweep=("h100/tune/tune_paired_h100_bf16.json", "h100/tune/tune_tmaocc_h100_bf16.json"),
         why="Llama-3-70B: two programs per SM overlap epilogue and MMAs, 0.951 vs 0.977 of cuBLAS"),
    # -- prefill on Hopper: the persistent TMA kernel per M bucket --
    Rule("tma", C(64, 64, 128, group_m=8, num_warps=4, num_stages=4), min_capability=HOPPER, m=(65, 128),
         sweep=("h100/tune/tune_h100_bf16_graph.json",), why="65 <= M <= 128: weight-bandwidth bound, small tiles"),
    Rule("tma", C(128, 128, 64, group_m=8, num_warps=8, num_stages=4, warp_specialize=True, split_tail=True),
         min_capability=HOPPER, m=(129, 1024),
         sweep=("h100/tune/tune_h100_bf16_graph.json", "h100/tune/tune_tail_h100_bf16.json"),
         why="one 128x256 wgmma tile; a last wave under half the SMs runs split"),
    Rule("tma", C(128, 128, 64, group_m=8, num_warps=8, num_stages=4, split_tail=True), min_capability=HOPPER,
         m=(1025, 4096), sweep=("h100/tune/tune_h100_bf16_graph.json", "h100/tune/tune_tail_h100_bf16.json"),
         why="as above, 4 stages"),
    Rule("tma", C(128, 128, 64, group_m=8, num_warps=8, num_stages=3, warp_specialize=True, split_tail=True),
         min_capability=HOPPER, m=(4097, None),
         sweep=("h100/tune/tune_h100_bf16_graph.json", "h100/tune/tune_tail_h100_bf16.json"),
         why="as above, 3 stages"),
    # -- every other call: the pointer kernel per M bucket (any GPU, dtype, strides, I) --
    Rule("pointer", C(16, 32, 256, num_warps=4, num_stages=4), m=(None, 16),
         sweep=("h100/tune/tune_h100_bf16_graph.json",), why="best geometric mean over six shapes (H100)"),
    Rule("pointer", C(32, 64, 128, num_warps=4, num_stages=4), m=(17, 32),
         sweep=("h100/tune/tune_h100_bf16_graph.json",), why="best geometric mean over six shapes (H100)"),
    Rule("pointer", C(64, 64, 128, num_warps=4, num_stages=4), m=(33, 64),
         sweep=("h100/tune/tune_h100_bf16_graph.json",), why="best geometric mean over six shapes (H100)"),
    Rule("pointer", C(128, 128, 64, num_warps=8, num_stages=4), m=(65, None),
         sweep=("h100/tune/tune_h100_bf16_graph.json",), why="pre-Hopper or unaligned prefill: two 128x128 accumulators"),
)

# -- the backward GEMM dH = dY @ Wd with the gated derivative in its epilogue (training) ---------
# Kernels: `gated_backward_pointer.py`, `gated_backward_tma.py` (fused: dH stays in registers),
# `gated_backward_ws.py` (Gluon, Hopper: the epilogue beside the next tile's MMAs),
# `gated_backward_split.py` (cuBLAS writes dH, then an elementwise pass). The forward of training
# (storing the pre-activation P) and LoRA's low-rank forward take `RULES`, skipping kernels without
# that feature (each kernel file's CAPABILITY says which it has).

BACKWARD_KERNELS = ("backward_pointer", "backward_tma", "backward_ws", "backward_split")

BACKWARD_VARIANTS_H100 = ("h100/train/tune_backward_variants_bf16.json", "h100/train/tune_backward_variants_fp16.json",
                          "h100/train/tune_backward_variants_small_m_bf16.json")
BACKWARD_WS_H100 = ("h100/train/ws/tune_backward_variants_bf16.json", "h100/train/ws/tune_backward_variants_fp16.json",
                    "h100/train/ws/tune_backward_variants_small_m_bf16.json")
BACKWARD_WS_CAP_H100 = ("h100/train/ws_cap/tune_flushed_bf16.json", "h100/train/ws_cap/tune_sustained_bf16.json")
BACKWARD_WS_256_H100 = ("h100/train/ws256/tune_flushed_bf16.json", "h100/train/ws256/tune_sustained_bf16.json",
                        "h100/train/ws256/tune_small_m_sustained_bf16.json",
                        "h100/train/ws256/tune_m1536_sustained_bf16.json")
WS_CONFIG = C(128, 128, 64, num_warps=4, num_stages=5, epilogue_subtiles=8)
# 256x128 tiles: two MMA warpgroups share each Wd box; the 16-bit handoff leaves room for 3 stages
WS_256_CONFIG = C(256, 128, 64, num_warps=8, num_stages=3, epilogue_subtiles=8, epilogue_registers=152)

BACKWARD_RULES: tuple[Rule, ...] = (
    Rule("backward_ws", WS_CONFIG, HOPPERS, min_capability=HOPPER, m=(513, 2048), sweep=BACKWARD_WS_H100,
         why="Hopper's wgmma in Gluon, the epilogue of one 128x128 tile beside the next tile's MMAs (a TMA loader warp, "
             "5 ring stages, an fp32 handoff buffer, 4 epilogue warps): the fastest backward kernel from M = 512 on "
             "(H100 sweep: Llama-3-8B 0.760 vs the split's 0.876 ms at M = 4096, 1.509 vs 1.796 at 8192, Gemma-2-9B "
             "0.703 vs 0.782 and 1.427 vs 1.605, fp16 0.781 vs 0.907, M = 1024 0.195 vs 0.223, 512 0.114 vs 0.118; "
             "cuBLAS's dH alone 0.697 at M = 4096); the split wins at M = 256 (0.060 vs 0.069); Hopper only (wgmma)"),
    Rule("backward_ws", WS_256_CONFIG, HOPPERS, min_capability=HOPPER, m=(2049, 4096), sweep=BACKWARD_WS_256_H100,
         why="the planner's M bucket 4096: the same kernel on 256x128 tiles (8 MMA warps, 3 stages, dH handed to the "
             "epilogue in 16 bits, as eager rounds it), a quarter fewer bytes from L2 per flop. H100, calls back to "
             "back at the power cap (`tune --sweep backward_ws --sustained`), of cuBLAS's dH alone: Llama-3-8B "
             "M = 4096 1.183x vs the 128x128 tile's 1.212x, Gemma-2-9B 1.245x vs 1.385x (group 4: 1.311x); M = 3072 "
             "1.197x and 1.246x vs group 4's 1.150x and 1.279x. In the bucket below it wins at M = 2048 (1.175x and "
             "1.288x vs 1.189x and 1.303x) but loses at 1536 (1.283x and 1.346x vs 1.231x and 1.330x) and 1024. With "
             "L2 flushed before each call (an idle GPU, below its cap) the 128x128 tile leads by 5-7% at M = 4096; "
             "training runs at the cap. The whole MLP's forward + backward at the cap, in three A/B runs of one H100 "
             "session: Llama-3-8B M = 4096 0.906-0.931x eager against the 128x128 tile's 0.964-1.004x"),
    Rule("backward_ws", replace(WS_CONFIG, group_m=4), HOPPERS, min_capability=HOPPER, m=(4097, None),
         sweep=BACKWARD_WS_CAP_H100 + BACKWARD_WS_256_H100,
         why="M > 4096: the 128x128 tile with 4 row tiles per group, ahead of 8 with L2 flushed before each call and with "
             "calls back to back at the power cap (`tune --sustained`), in one H100 run: of cuBLAS's dH alone, "
             "Llama-3-8B M = 8192 1.087x vs 1.110x and 1.227x vs 1.242x, Gemma-2-9B M = 8192 1.143x vs 1.194x and "
             "1.292x vs 1.331x. The 256x128 tile here: Llama-3-8B's whole MLP 1.1-1.5% slower in three A/B runs at the "
             "cap (its kernel alone 1.192x vs 1.186x), Gemma-2-9B's kernel alone 4% faster (1.256x vs 1.307x)"),
    Rule("backward_split", C(32, 128, 16, num_warps=4), min_capability=HOPPER, m=(129, None),
         sweep=BACKWARD_VARIANTS_H100,
         why="cuBLAS dH, then one elementwise pass (dH, P read; dP, h written) beats the fused TMA kernel, whose "
             "epilogue does not overlap its MMAs (its 128x128x64 s4 tile, DEFAULT_CONFIGS): Llama-3-8B 0.839 vs "
             "0.867 ms at M = 4096, 1.676 vs 1.769 at 8192, Gemma-2-9B 0.764 vs 0.842 and 1.527 vs 1.659, fp16 "
             "0.866 vs 0.918 (H100; cuBLAS alone 0.604 at M = 4096); a later run: 0.119 vs 0.136 ms at M = 512, 0.428 "
             "vs 0.462 at 2048 (the fused kernel with its epilogue in 4 slices: slower still, 1.06-1.19x)"),
    Rule("backward_tma", C(64, 128, 64, group_m=8, num_warps=4, num_stages=4), min_capability=HOPPER,
         m=(65, 128), why="64-row tiles where M is too small for 128-row tiles to fill the SMs; not yet timed"),
    Rule("backward_pointer", C(16, 32, 64, num_warps=4, num_stages=3), m=(None, 16),
         why="few tokens: the Wd read bounds the call; not yet timed"),
    Rule("backward_pointer", C(64, 64, 64, num_warps=8, num_stages=3), m=(17, None),
         why="pre-Hopper, fp32 or unaligned: the largest tile ptxas fits without spills for every epilogue "
             "and dtype (Triton 3.6, sm_90a: 128x64x64 w8 and 64x64x64 w4 spill 150-660 bytes); not yet timed"),
)

# -- MoE experts blocks: M is the block's tokens T (`experts.experts_forward`); the configs are
# `configs.ExpertsConfig` (the gated tile, then the down tile). Chosen on the H100 by
# `bench_moe --sweep` over the Qwen3-30B-A3B, OLMoE, gpt-oss-20b, Mixtral-8x7B and GLM-4.5-Air shapes
# (geometric mean of time over the best config, per T range; uniform routing).
MOE = ("h100/moe/sweep.json",)
MOE_GATED_WS_PREACT = ("h100/moe/gated_ws_preact_handoff/results.json",)
MOE_GEMV = ("h100/moe/gemv_tiles/results.json", "h100/moe/gemv_t2/results.json")
MOE_DOWN_WS = ("h100/moe/down_ws/results.json", "h100/moe/down_ws_8192/results.json")
MOE_GATED_WS = ("h100/moe/gated_ws/results.json", "h100/moe/gated_ws_rerun/results.json",
                "h100/moe/gated_ws_preact/results.json", "h100/moe/gated_ws_preact_registers/results.json")
MOE_BACKWARD = ("h100/moe_train/backward_tiles/results.json", "h100/moe_train/backward_tiles/candidates/results.json",
                "h100/moe_train/backward_tiles/rows/results.json")
MOE_BACKWARD_DH_WS = ("h100/moe_train/dh_ws/results.json", "h100/moe_train/dh_ws_variants/results.json",
                      "h100/moe_train/dh_ws_final/results.json")
MOE_BACKWARD_WGRAD_WS = ("h100/moe_train/wgrad_ws/results.json", "h100/moe_train/wgrad_ws_256/results.json",
                         "h100/moe_train/wgrad_ws_rule/results.json")
MOE_BACKWARD_DX_WS = ("h100/moe_train/dx_ws/results.json", "h100/moe_train/dx_ws256/results.json")
MOE_BACKWARD_DH_WS_256 = ("h100/moe_train/dh_ws256/results.json", "h100/moe_train/dh_ws256_small_t/results.json")
EXPERTS_GEMV_CONFIG = EC(1, 8, 128, 1, 128, num_warps=8, num_stages=1, down_num_warps=4)
EXPERTS_GEMV_T2_CONFIG = EC(1, 16, 128, 1, 128, num_warps=2, num_stages=1, down_num_warps=4)
EXPERTS_GEMV_TRANSPOSED_CONFIG = EC(1, 32, 64, 256, 8, num_warps=8, num_stages=1, down_num_warps=4, down_split_i=96)
MOE_GEMV_TRANSPOSED = ("h100/moe/gemv_transposed/results.json",)
MOE_H200_ROWS = ("h200/moe/prefill_tiles/results.json", "h200/moe/rows_per_expert/results.json",
                 "h200/moe/ws_from_1024/results.json", "h200/moe/rows_48/results.json")
EXPERTS_RULES: tuple[Rule, ...] = (
    Rule("experts_gemv", EXPERTS_GEMV_CONFIG, m=(None, 1), sweep=MOE_GEMV,
         why="one token: two launches and one allocation, no routing prep (the grouped path: four launches, six "
             "allocations), and less GPU time too, so captured calls take it as well: under CUDA graphs on the H100 "
             "0.86-0.96x the grouped kernels' time on five shapes (Qwen3-30B-A3B 35.9 against 40.5 us, Qwen3.5-35B-A3B "
             "28.1 against 32.7, Mixtral-8x7B 239.7 against 249.8). Tiles: each kernel timed alone over 150 variants "
             "(docs/history.md); the first tiles (16x256, down 4x256, 4 warps) took 0.98-1.03x the grouped kernels' "
             "time. Weights with unit-stride rows only (its can_run): a transposed layout (gpt-oss) takes the "
             "transposed GEMV's rule (eager calls) or the grouped rules below"),
    Rule("experts_gemv", EXPERTS_GEMV_T2_CONFIG, m=(2, 2), i=(None, 1024), sweep=MOE_GEMV,
         why="two tokens on experts of I <= 1024, on their own gated tiles (16x128 at 2 warps; the one-token "
             "tiles took 1.05-1.06x their time on two shapes of three, 0.93x on Qwen3.5-35B-A3B): under CUDA "
             "graphs on the H100 0.96-0.98x the grouped kernels' time (Qwen3-30B-A3B 56.8 against 59.3 us, "
             "Qwen3.5-35B-A3B 50.3 against 51.2, OLMoE 74.0 against 75.7), eager calls back to back 0.39-0.43x "
             "theirs. Larger experts keep the grouped kernels: GLM-4.5-Air (I = 1408) 1.12x, Mixtral 1.30x their "
             "GPU time, and the GPU bounds those loops"),
    Rule("experts_gemv_transposed", EXPERTS_GEMV_TRANSPOSED_CONFIG, m=(None, 1), captured=False,
         sweep=MOE_GEMV_TRANSPOSED,
         why="one token on transposed weights (gpt-oss), eager calls: three launches and two allocations against the "
             "grouped path's four and six, so an eager decode loop waits less on the host: on the H100, gpt-oss-20b "
             "calls back to back, each kernel named, took 128 us against the grouped kernels' 210, host time from "
             "idle 145 against 240; HF generate at batch 1 (8 layers) 0.875x the time. Captured calls keep the "
             "grouped kernels, which take less GPU time (83.2 against 85.8 us under CUDA graphs); two tokens too, "
             "where the GPU bounds the loop (grouped: 157 us a call back to back, 150 in a graph) and the GEMV takes "
             "1.08x their GPU time. Tiles: gated 32x64 at 8 warps, "
             "down 256 columns of K_out x 8 rows of I over 96 rows of I per program (the split gives the read its "
             "programs), 4 warps: the best of 75 gated and 150 down variants each timed alone (docs/history.md)"),
    Rule("experts_grouped", EC(16, 64, 128, 64, 128, group_m=8, num_warps=4, num_stages=4), m=(None, 64), sweep=MOE,
         why="few rows per expert (weight-bandwidth bound): 16-row blocks; 1.015x the best of 17 configs at T = 1, "
             "1.014x at T = 4-8, 1.017x at T = 64"),
    Rule("experts_grouped", EC(64, 64, 128, 64, 128, group_m=8, num_warps=4, num_stages=3), m=(65, 512),
         sweep=MOE, why="tens of rows per expert: 64-row blocks; 1.019x the best at T = 256"),
    Rule("experts_grouped", EC(64, 128, 64, 128, 64, group_m=8, num_warps=4, num_stages=4), H200, m=(513, None),
         rows=(None, 48), sweep=MOE_H200_ROWS,
         why="many experts per routed token (at most 48 rows per expert on average), past the 64-row rule's T: "
             "64-row blocks, as 128-row ones are mostly padding there; on the H200, 0.88x the 128-row tiles' time on "
             "Qwen3.5-35B-A3B (256 experts, top 8) at T = 768 and 1024, 0.92x at 1152 and 1536 (48 rows); 0.90x on "
             "Qwen3-30B-A3B and GLM-4.5-Air (128 experts, top 8) at T = 640 and 768 (40-48 rows); the 128-row tiles "
             "lead from 64 rows per expert (1.00x at 64 rows, 1.13-1.16x at 72)"),
    Rule("experts_grouped", EC(128, 128, 64, 128, 64, group_m=8, num_warps=8, num_stages=3, warp_specialized=True,
                               down_warp_specialized=True),
         H200, m=(1025, 2048), sweep=MOE_H200_ROWS,
         why="prefill on the H200 at T = 1025-2048: the Hopper rule below, its gated GEMM warp-specialized for "
             "calls storing no P; 0.935-0.975x the one-program-per-tile kernels' time at T = 2048 on Qwen3-30B-A3B, "
             "Qwen3.5-35B-A3B, OLMoE, Mixtral-8x7B and GLM-4.5-Air (1.00x on gpt-oss-20b, which it cannot take), "
             "0.96-1.005x at T = 1024 (not taken)"),
    Rule("experts_grouped", EC(128, 128, 64, 128, 64, group_m=8, num_warps=8, num_stages=3, warp_specialized=True,
                               warp_specialized_preact=True, down_warp_specialized=True),
         HOPPERS, m=(4096, None), sweep=MOE_GATED_WS + MOE_DOWN_WS + MOE_GATED_WS_PREACT,
         why="prefill on Hopper from T = 4096: the tiles below, the gated GEMM warp-specialized where it can take the "
             "call; the block 0.94-0.98x the one-program-per-tile kernel's time on five shapes at T = 4096 and 16384 "
             "(at 1024 0.98-1.10x); in a second run 0.96-0.97x on Qwen3-30B-A3B and OLMoE, 1.00-1.03x on "
             "Mixtral-8x7B. Calls storing P too, gate and up handed to the epilogue warps, which store P and take h "
             "from it: store mode's forward 0.95-1.00x on four shapes at T = 4096 and 16384 (P from the MMA warps' "
             "registers lost 1.03-1.05x, P and h both through the handoff 1.004-1.014x). "
             "The down GEMM warp-specialized too (128x256 tiles at 3 stages) where it can take the call, in both "
             "modes' forward: the block 0.94-0.96x the time with the one-program-per-tile down GEMM on Qwen3-30B-A3B, "
             "OLMoE, Mixtral-8x7B and GLM-4.5-Air at T = 16384, 0.93-0.98x at 8192, 0.90-1.04x at 4096 in two runs; "
             "128x128 tiles at 4 stages 1.07-1.16x"),
    Rule("experts_grouped", EC(128, 128, 64, 128, 64, group_m=8, num_warps=8, num_stages=3), m=(513, None),
         sweep=MOE, why="prefill: 128x128 tiles of both GEMMs; 1.004x the best at T = 1024-4096"),
)

# -- the MoE experts block's backward (`experts_backward.experts_backward`, kernel file
# `experts_backward_gemm.py`): M is the block's tokens T; the configs are
# `experts_backward_config.ExpertsBackwardConfig` (the pairs' block, then the dH, dX and weight-gradient tiles).
EXPERTS_BACKWARD_RULES: tuple[Rule, ...] = (
    Rule("experts_backward_grouped", EBC(16, 64, 64, 64, 64, 64, 64, group_m=8, num_warps=4, num_stages=3),
         m=(None, 64), why="few rows per expert: 16-row blocks, as the forward's rule; not yet timed"),
    Rule("experts_backward_grouped", EBC(64, 64, 64, 128, 64, 64, 64, group_m=8, num_warps=4, num_stages=3),
         m=(65, 512), why="tens of rows per expert: 64-row blocks, as the forward's rule; not yet timed"),
    Rule("experts_backward_grouped", EBC(128, 128, 64, 128, 64, 128, 128, group_m=8, num_warps=8, num_stages=3,
                                         dh_num_stages=4, wgrad_num_stages=3, wgrad_rows=64, smem_budget_kib=224,
                                         dh_warp_specialized=True, dh_ws_block_n=256, dh_ws_stages=3,
                                         dh_ws_registers=(64, 96), wgrad_warp_specialized=True,
                                         wgrad_ws_tile=(256, 128), dx_warp_specialized=True, dx_ws_block_n=256,
                                         dx_ws_stages=3),
         HOPPERS, m=(513, None), sweep=MOE_BACKWARD + MOE_BACKWARD_DH_WS + MOE_BACKWARD_WGRAD_WS + MOE_BACKWARD_DX_WS
         + MOE_BACKWARD_DH_WS_256,
         why="training batches on Hopper (227 KiB of shared memory a block): a 128x128 dH tile at 4 stages (the "
             "one-program-per-tile kernel's), 128x128 "
             "weight-gradient tiles reducing 64 rows a step at 3 stages; per kernel 0.69x (dH), 0.77x (dWd) and 0.80x "
             "(dWgu) the time of the tiles below at Qwen3-30B-A3B T = 16384; the weight-gradient kernels 0.86-0.92x "
             "those of 128x256 tiles over whole blocks on OLMoE; dH warp-specialized where it can take the call "
             "(0.85-0.95x the one-program-per-tile kernel's time on both shapes at T = 4096 and 16384), on 128x256 tiles at "
             "3 stages (two MMA warpgroups, G handed over in 16 bits: 0.85x and 0.85x its 128x128 tiles' dH time at "
             "T = 16384, 0.93x and 0.88x at 4096, Qwen3-30B-A3B and OLMoE, 0.91-1.09x at 1024 and 2048; the backward "
             "0.97-0.99x); the weight "
             "gradients by the persistent warp-specialized kernel with 256x128 tiles where it can take the call (0.84-"
             "0.96x the 128x128 one-program-per-tile kernel's time, 1.015x on OLMoE's dW_gate_up at T = 16384; its "
             "128x128 tiles 1.16-1.18x, its 256x128 tiles at 32 rows a step 1.02-1.22x); dX by the warp-specialized "
             "kernel on 128x256 tiles where it can take the call (0.84-0.87x the one-program-per-tile kernel's dX "
             "time at T = 16384, 0.93x and 1.00x at 4096; its 128x128 tiles 1.07-1.19x)"),
    Rule("experts_backward_grouped", EBC(128, 64, 64, 128, 64, 128, 128, group_m=8, num_warps=8, num_stages=3),
         m=(513, None), why="training batches on other GPUs: 128-row blocks, a 128x64 dH tile, 128x128 dX and "
                            "weight-gradient tiles, within 160 KiB of shared memory; not timed on them (on the H100: "
                            "1.15-1.19x the Hopper rule's backward)"),
)

# A call that names a kernel without a config gets this one (the pointer and TMA kernels: their
# GPU-independent rule for the call's M).
DEFAULT_CONFIGS: dict[str, C] = {
    "gemv": C(1, 16, 256, num_warps=4, num_stages=1),
    "grid": C(64, 64, 128, group_m=4, num_warps=4, num_stages=3, weight_boxes=1),
    "backward_pointer": BACKWARD_RULES[-1].config,
    # the fused TMA kernel's fastest of 12 tiles at Llama-3-8B M = 4096 in an earlier H100 sweep (0.867 ms;
    # warp-specialized 0.881, group 16 0.906, 3 stages 1.078; docs/backward_gemm.md): kernel="backward_tma" at M >= 129
    "backward_tma": C(128, 128, 64, group_m=8, num_warps=8, num_stages=4),
    "backward_split": next(r.config for r in BACKWARD_RULES if r.kernel == "backward_split"),
    "backward_ws": WS_CONFIG,
    "experts_gemv": EXPERTS_GEMV_CONFIG,  # at any T, not only the eager decode its rule covers
    "experts_gemv_transposed": EXPERTS_GEMV_TRANSPOSED_CONFIG,
}

# The planner's tables, by the op they choose for (a `KernelCapability.ops` entry). A new op family
# adds its table here and kernel files whose CAPABILITY names it.
TABLES: dict[str, tuple[Rule, ...]] = {"forward": RULES, "backward": BACKWARD_RULES, "experts": EXPERTS_RULES,
                                       "experts_backward": EXPERTS_BACKWARD_RULES}
