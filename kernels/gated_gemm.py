"""Fused gated GEMM in Triton: out[M, I] = act(x @ Wg^T + bg) * (x @ Wu^T + bu).

Layout (see `layout.py`): the weight is the packed ``gate_up_interleaved`` [N = 2*I, K],
gate and up rows interleaved in blocks of GATE_UP_BLOCK = 16 (gate row i at packed row
2*16*(i // 16) + i % 16, up row i right after its block's gate rows; a partial last block
holds r gate rows then r up rows). The optional bias is [2*I] in the same layout.

Each program computes one [BLOCK_SIZE_M, BLOCK_SIZE_N] tile of the output: it loads the
BLOCK_SIZE_N gate rows and the BLOCK_SIZE_N matching up rows of the packed weight (row
indices computed from the layout, so any I works, block-aligned or not), runs two fp32
accumulators over K, adds the bias in fp32, applies the activation to the gate accumulator
in fp32, multiplies by the up accumulator and rounds once to x's dtype on the single store
of [M, I]. The [M, 2*I] pre-activation never reaches memory. For bf16/fp16 on the GPU, silu
and gelu_tanh use the MUFU's `tanh.approx.f32` (`_apply_activation`).

dtypes: x and the weight share one of bf16, fp16, fp32; out has x's dtype. fp32 dots use
tf32 only where ``torch.backends.cuda.matmul.allow_tf32`` says so.

`gated_gemm` is the entry point: it runs this pointer kernel (decode, fp32, partial blocks,
unaligned strides), the persistent Hopper TMA kernel of `gated_gemm_tma.py` (M >= TMA_MIN_M)
or, where a shape rule says so, the one-token GEMV of `gated_gemv.py` or the one-program-per-tile
TMA kernel of `gated_gemm_tma_grid.py` (H100, M <= 128), each with a fixed config per M bucket
(at M <= 128 also per GPU and shape, `_SHAPE_RULES`) measured by `benchmarks/tune_kernel.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .activations import ACTIVATION_CODES, check_activation
from .layout import GATE_UP_BLOCK


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh_approx(x):
    """tanh(x) in one MUFU op: PTX `tanh.approx.f32` (sm_75+, max relative error 2^-11)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _apply_activation(gate, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr):
    """act(gate) in fp32; codes follow `activations.ACTIVATION_CODES`.

    With APPROX_TANH (16-bit inputs on the GPU, see `gated_gemm`) silu and gelu_tanh take
    one `tanh.approx.f32` per output, g/2 + g/2 * tanh(.), instead of exp and a reciprocal:
    one MUFU op instead of two (the MUFU pipe bounds the prefill epilogue,
    benchmarks/results/epilogue/). Its error, at most 2^-11 of tanh, is below the rounding
    of a 16-bit output.
    """
    if ACTIVATION == 0:  # silu: g * sigmoid(g) = g/2 + g/2 * tanh(g/2)
        if APPROX_TANH:
            half = 0.5 * gate
            out = half + half * _tanh_approx(half)
        else:
            out = gate * _sigmoid(gate)
    elif ACTIVATION == 1:  # gelu_tanh: g/2 * (1 + tanh(inner)); tanh(z) = 2 * sigmoid(2z) - 1
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        if APPROX_TANH:
            half = 0.5 * gate
            out = half + half * _tanh_approx(inner)
        else:
            out = gate * _sigmoid(2.0 * inner)
    else:  # gelu (erf)
        out = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    return out


@triton.jit
def _tile_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M: tl.constexpr):
    """(pid_m, pid_n) of tile `tile_id` in grouped order: GROUP_SIZE_M row-tiles walk the
    column tiles together, so the weight tiles they share stay in L2."""
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _gated_gemm_fwd_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, I, K,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_om, stride_oi,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    APPROX_TANH: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    # -- tile ordering: groups of GROUP_SIZE_M row-tiles share weight tiles in L2 --
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    pid_m, pid_n = _tile_pid(tl.program_id(0), GROUP_SIZE_M * tl.cdiv(I, BLOCK_SIZE_N), num_pid_m, GROUP_SIZE_M)

    # -- which packed rows hold this tile's gate and up rows --
    offs_m = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    offs_i = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    block_start = (offs_i // GATE_UP_BLOCK) * GATE_UP_BLOCK
    width = tl.minimum(I - block_start, GATE_UP_BLOCK)
    gate_rows = (offs_i + block_start).to(tl.int64)  # 2 * block_start + (offs_i - block_start)
    up_rows = gate_rows + width
    mask_m = offs_m < M
    mask_i = offs_i < I
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_SIZE_M, BLOCK_SIZE_K]
    wg_ptrs = w_ptr + gate_rows[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_SIZE_K, BLOCK_SIZE_N]
    wu_ptrs = w_ptr + up_rows[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_SIZE_K, BLOCK_SIZE_N]

    # -- main loop: two fp32 accumulators over K --
    acc_gate = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_left = K - k * BLOCK_SIZE_K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        wg = tl.load(wg_ptrs, mask=mask_i[None, :] & (offs_k[:, None] < k_left), other=0.0)
        wu = tl.load(wu_ptrs, mask=mask_i[None, :] & (offs_k[:, None] < k_left), other=0.0)
        acc_gate = tl.dot(x, wg, acc_gate, input_precision=INPUT_PRECISION)
        acc_up = tl.dot(x, wu, acc_up, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_SIZE_K * stride_xk
        wg_ptrs += BLOCK_SIZE_K * stride_wk
        wu_ptrs += BLOCK_SIZE_K * stride_wk

    # -- epilogue: bias, act(gate) * up in fp32, one rounding, one store --
    if HAS_BIAS:
        acc_gate += tl.load(b_ptr + gate_rows, mask=mask_i, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_ptr + up_rows, mask=mask_i, other=0.0).to(tl.float32)[None, :]
    h = _apply_activation(acc_gate, ACTIVATION, APPROX_TANH) * acc_up  # [BLOCK_SIZE_M, BLOCK_SIZE_N]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_i[None, :] * stride_oi
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_i[None, :])


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
    17 <= M <= 32), M <= m_max, on a GPU whose name holds one of `gpus`, for
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
    # H100, M <= 128: the TMA kernel with one program per tile (`gated_gemm_tma_grid`, grid_boxes =
    # weight boxes per K step), from two interleaved sweeps of it against the shipped tile and Liger
    # (benchmarks/results/tune_graph/tune_grid_h100_bf16.json, tune_gridpick_h100_bf16.json; ratios
    # to cuBLAS, first sweep / second). Its programs hold 1-2 stages of shared memory, so 2-3 of them
    # share an SM and the hardware scheduler balances the weight read across the SMs to the end; the
    # persistent and pointer tiles it replaces run one program per SM. Bounds: the shapes measured
    # (K 2048-8192, I 8192-36864).
    # M <= 16, I > 16384, K <= 4096 (Qwen2.5-7B): 16x(2*64)x128, 2 stages, gate and up as two boxes:
    # 0.953 / 0.936 / 0.936-0.933 at M = 2 / 8 / 16, the pointer tile 0.965 / 0.955 / 0.945-0.940.
    # On the other shapes the pointer tiles stayed ahead (by 0.3-2.5%).
    ShapeRule(("H100",), 4096, None, GatedGemmConfig(16, 64, 128, group_m=4, num_warps=4, num_stages=2, grid_boxes=2),
              i_min=16385),
    # 17 <= M <= 32, I > 16384, K <= 4096 (Qwen2.5-7B): 32x(2*64)x128, 2 stages, two boxes: 0.948 /
    # 0.962 against 0.965 / 0.978 for the 2-stage pointer rule. On the other shapes the sweeps' gains
    # (0-1.5%) did not hold in a bench run (benchmarks/results/mlp_raw/run0960882_*.json).
    ShapeRule(("H100",), 4096, None, GatedGemmConfig(32, 64, 128, group_m=4, num_warps=4, num_stages=2, grid_boxes=2),
              i_min=16385, bucket=32),
    # 33 <= M <= 64, one box: Qwen2.5-7B 32x(2*64)x128 with 2 stages (two row tiles per weight tile):
    # 0.956 / 0.954 against 1.012 / 1.011 for the pointer tile, Liger 0.964 / 0.960. 64x(2*64)x128
    # with 2 stages on Llama-3-8B, Gemma-2-9B and Llama-3-70B (0.965 / 0.960, 0.969 / 0.971, 0.942 /
    # 0.954 against 0.981 / 0.973, 0.988 / 0.989 and the persistent TMA rule's 0.954 / 0.960), with
    # 3 stages on Llama-3.2-1B and Gemma-2-27B (0.991 / 0.987 against 1.004 / 1.003, 0.968 / 0.969
    # against 0.980 / 0.981), where 2 stages lost 3-9%.
    ShapeRule(("H100",), 4096, None, GatedGemmConfig(32, 64, 128, group_m=4, num_warps=4, num_stages=2, grid_boxes=1),
              i_min=16385, bucket=64),
    ShapeRule(("H100",), 4096, 16384, GatedGemmConfig(64, 64, 128, group_m=4, num_warps=4, num_stages=2, grid_boxes=1),
              i_min=8192, bucket=64, k_min=2049),
    ShapeRule(("H100",), None, None, GatedGemmConfig(64, 64, 128, group_m=4, num_warps=4, num_stages=2, grid_boxes=1),
              i_min=16385, bucket=64, k_min=8192),
    ShapeRule(("H100",), None, None, GatedGemmConfig(64, 64, 128, group_m=4, num_warps=4, num_stages=3, grid_boxes=1),
              i_min=8192, bucket=64, k_min=2048),
    # 65 <= M <= 128 with I <= 16384 (Llama-3.2-1B, Llama-3-8B, Gemma-2-9B): 128x(2*64)x64, 4 stages,
    # one box: 1.026 / 1.019, 1.014 / 1.013, 1.043 / 1.046 at M = 128 against 1.067 / 1.065, 1.057 /
    # 1.058, 1.064 / 1.069 for the persistent 128x(2*128) tile, whose 64-112 tiles leave SMs idle
    # there. It lost on the wider shapes (1.02-1.06 against 0.97-1.01).
    ShapeRule(("H100",), None, 16384, GatedGemmConfig(128, 64, 64, group_m=8, num_warps=4, num_stages=4, grid_boxes=1),
              i_min=8192, bucket=8192, m_max=128, k_min=2048),
)


@lru_cache(maxsize=8)
def _gpu_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def _shape_rule(name: str, bucket: int, m: int, k: int | None, i: int | None,
                rules: tuple[ShapeRule, ...] = _SHAPE_RULES) -> GatedGemmConfig | None:
    for rule in rules:
        if (rule.bucket == bucket and (rule.m_max is None or m <= rule.m_max) and any(g in name for g in rule.gpus)
                and (rule.k_max is None or (k is not None and k <= rule.k_max))
                and (rule.k_min is None or (k is not None and k >= rule.k_min))
                and (rule.i_max is None or (i is not None and i <= rule.i_max))
                and (rule.i_min is None or (i is not None and i >= rule.i_min))):
            return rule.config
    return None


@lru_cache(maxsize=256)
def default_config(
    m: int, dtype: torch.dtype, i: int | None = None, device_index: int | None = None, k: int | None = None,
    captured: bool = False,
) -> GatedGemmConfig:
    """The shipped config for M tokens (the hot path passes `m_bucket(M)`: one cache entry per
    bucket), I output columns and K input features on CUDA device `device_index` (None: the
    bucket table `_DEFAULTS`, whatever the device): the pointer kernel's, the one-token
    GEMV's where a shape rule gives a config with block_m == 1, or the TMA kernel's where it
    gives one with programs_per_sm > 1, or the grid TMA kernel's where one with grid_boxes > 0
    (`ShapeRule`). captured: the call is being captured into a CUDA graph (`_GRAPH_RULES` first)."""
    bucket = _bucket_key(_DEFAULTS, m)
    cfg = _DEFAULTS[bucket]
    if device_index is not None:
        name = _gpu_name(device_index)
        cfg = ((_shape_rule(name, bucket, m, k, i, _GRAPH_RULES) if captured else None)
               or _shape_rule(name, bucket, m, k, i) or cfg)
    if dtype == torch.float32:
        cfg = dataclasses.replace(cfg, block_k=max(16, cfg.block_k // 2))
    return cfg


@lru_cache(maxsize=64)
def _tma_default(m: int) -> GatedGemmConfig:
    return _for_bucket(_TMA_DEFAULTS, m)


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


@lru_cache(maxsize=8)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device: the persistent kernels' program count."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@lru_cache(maxsize=8)
def _is_hopper_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@lru_cache(maxsize=1)
def _tma():
    """The TMA kernel's module, imported once (it imports this one)."""
    from . import gated_gemm_tma

    return gated_gemm_tma


@lru_cache(maxsize=1)
def _grid():
    """The one-program-per-tile TMA kernel's module, imported once (it imports this one)."""
    from . import gated_gemm_tma_grid

    return gated_gemm_tma_grid


@lru_cache(maxsize=1)
def _gemv():
    """The one-token GEMV kernel's module, imported once (it imports this one)."""
    from . import gated_gemv

    return gated_gemv


# The GEMV's config when a call names kernel="gemv" without one (block_m, num_stages unused).
GEMV_DEFAULT = GatedGemmConfig(1, 16, 256, num_warps=4, num_stages=1)
# The grid kernel's config when a call names kernel="grid" without one with grid_boxes set.
GRID_DEFAULT = GatedGemmConfig(64, 64, 128, group_m=4, num_warps=4, num_stages=3, grid_boxes=1)


def _use_tma(x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor, min_m: int = TMA_MIN_M) -> bool:
    if x.shape[0] < min_m or not x.is_cuda or not _is_hopper_or_newer(x.device.index or 0):
        return False
    return _tma().tma_supported(x, packed, out)


def interpreting() -> bool:
    """True when this module's kernels run through Triton's CPU interpreter.

    Triton decides when a kernel is decorated, so TRITON_INTERPRET=1 must be set before
    this module is first imported.
    """
    return type(_gated_gemm_fwd_kernel).__name__ == "InterpretedFunction"


def default_approx_tanh(x: torch.Tensor) -> bool:
    """Whether `gated_gemm` evaluates the activation with `tanh.approx.f32` by default: for
    bf16/fp16 x on the GPU. Its error (at most 2^-11 of tanh) is below a 16-bit output's
    rounding; fp32 keeps exp and a reciprocal, and the CPU interpreter runs no inline PTX."""
    return x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda and not interpreting()


def _input_precision(dtype: torch.dtype) -> str:
    if dtype is not torch.float32:
        return "tf32"  # ignored by tl.dot for 16-bit operands
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


@lru_cache(maxsize=256)
def _launch_meta(cfg: GatedGemmConfig, code: int, approx_tanh: bool, has_bias: bool, precision: str) -> dict:
    """The pointer kernel's constexpr and launch keywords (built once per combination)."""
    return dict(
        HAS_BIAS=has_bias, ACTIVATION=code, APPROX_TANH=approx_tanh, INPUT_PRECISION=precision,
        GATE_UP_BLOCK=GATE_UP_BLOCK, **cfg.meta(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def gated_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    activation: str = "silu",
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: GatedGemmConfig | None = None,
    kernel: str = "auto",
    approx_tanh: bool | None = None,
) -> torch.Tensor:
    """Launch the fused gated GEMM on 2-D x.

    Args:
        x: [M, K], any strides, bf16/fp16/fp32.
        packed: [2*I, K] interleaved gate/up weight, x's dtype and device, any strides.
        activation: "silu", "gelu_tanh" or "gelu".
        bias: optional [2*I] interleaved bias, x's dtype.
        out: optional [M, I] output to write (any strides); allocated if None.
        config: launch config; if None, `default_config` for M's bucket, I, K and x's GPU.
        kernel: "pointer" (this module's kernel), "tma" (`gated_gemm_tma`, Hopper, prefill),
            "grid" (`gated_gemm_tma_grid`, Hopper, one program per tile), "gemv" (`gated_gemv`,
            M = 1 and I % 16 == 0) or "auto": the kernel the shape rules name (`ShapeRule`: the
            GEMV at M = 1 on some shapes; while a CUDA graph is captured, the grid kernel at
            some shapes and M <= 128, `_GRAPH_RULES`) where it can run, else TMA for
            M >= TMA_MIN_M where `tma_supported`, else pointer.
        approx_tanh: evaluate silu and gelu_tanh with PTX `tanh.approx.f32` (see
            `_apply_activation`); None (default): `default_approx_tanh(x)`, i.e. for bf16/fp16
            x on the GPU, not for fp32 and not in Triton's CPU interpreter.

    Returns:
        out, [M, I] in x's dtype.
    """
    check_activation("gated_gemm", activation)
    m, k = x.shape
    i = packed.shape[0] // 2
    if out is None:
        out = torch.empty((m, i), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    code = ACTIVATION_CODES[activation]
    if approx_tanh is None:
        approx_tanh = default_approx_tanh(x)
    elif approx_tanh and interpreting():
        raise ValueError("gated_gemm: approx_tanh=True needs the GPU (inline PTX `tanh.approx.f32`), which "
                         "Triton's CPU interpreter cannot run; pass approx_tanh=None or False")
    if kernel == "gemv":
        if not _gemv().gemv_supported(x, packed):
            raise ValueError(f"gated_gemm: kernel='gemv' needs M == 1 and I % {GATE_UP_BLOCK} == 0, "
                             f"got M={m}, I={i}; use kernel='auto'")
        return _gemv().gated_gemv(x, packed, code, approx_tanh, bias, out, config or GEMV_DEFAULT)
    if kernel == "grid":
        if not _use_tma(x, packed, out, min_m=1):
            raise ValueError("gated_gemm: kernel='grid' needs a Hopper GPU, bf16/fp16 tensors with unit inner "
                             f"strides and 16-byte-aligned rows, and I % {GATE_UP_BLOCK} == 0; use kernel='auto'")
        cfg = config or GRID_DEFAULT
        return _grid().gated_gemm_tma_grid(x, packed, code, approx_tanh, bias, out, cfg, two_dots=cfg.grid_boxes == 2)
    if kernel == "tma":
        return _tma().gated_gemm_tma(x, packed, code, approx_tanh, bias, out, config or _tma_default(m_bucket(m)))
    captured = x.is_cuda and torch.cuda.is_current_stream_capturing()
    cfg = config or default_config(m_bucket(m), x.dtype, i, (x.device.index or 0) if x.is_cuda else None, k, captured)
    rule_tma = config is None and cfg.programs_per_sm > 1  # a shape rule's persistent TMA tile (M <= 64)
    if cfg.block_m == 1 and kernel == "pointer" and config is not None:
        raise ValueError("gated_gemm: a config with block_m=1 is the one-token GEMV's; "
                         "pass kernel='gemv' or kernel='auto', or a pointer config with block_m >= 16")
    if kernel == "auto":
        if cfg.block_m == 1 and _gemv().gemv_supported(x, packed):  # a rule's (M = 1) or given
            return _gemv().gated_gemv(x, packed, code, approx_tanh, bias, out, cfg)
        if cfg.grid_boxes and _use_tma(x, packed, out, min_m=1):  # a rule's or given grid tile
            return _grid().gated_gemm_tma_grid(x, packed, code, approx_tanh, bias, out, cfg,
                                               two_dots=cfg.grid_boxes == 2)
        if config is None and _use_tma(x, packed, out):  # prefill: the persistent TMA kernel's bucket tile
            return _tma().gated_gemm_tma(x, packed, code, approx_tanh, bias, out, _tma_default(m_bucket(m)))
        if rule_tma and _use_tma(x, packed, out, min_m=1):
            return _tma().gated_gemm_tma(x, packed, code, approx_tanh, bias, out, cfg)
    if cfg.block_m == 1 or rule_tma or (config is None and cfg.grid_boxes):
        cfg = default_config(m_bucket(m), x.dtype)  # the rule's kernel cannot run this call: the bucket's tile
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(i, cfg.block_n),)
    _gated_gemm_fwd_kernel[grid](
        x, packed, bias if bias is not None else packed, out,
        m, i, k,
        x.stride(0), x.stride(1),
        packed.stride(0), packed.stride(1),
        out.stride(0), out.stride(1),
        **_launch_meta(cfg, code, approx_tanh, bias is not None, _input_precision(x.dtype)),
    )
    return out
