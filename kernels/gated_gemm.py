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
or, where a shape rule says so, the one-token GEMV of `gated_gemv.py` or (calls captured into
a CUDA graph on an H100 or H200, M <= 128) the one-program-per-tile TMA kernel of `gated_gemm_tma_grid.py`,
each with a fixed config per M bucket and, at small M, per GPU and shape (`configs.py`:
`_SHAPE_RULES`, `_GRAPH_RULES`) measured by `benchmarks/tune_kernel.py`.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .activations import ACTIVATION_CODES, check_activation
from .configs import (  # noqa: F401  (re-exported: the configs are read from this module too)
    _DEFAULTS, _GRAPH_RULES, _SHAPE_RULES, _TMA_DEFAULTS, CANDIDATE_CONFIGS, GEMV_DEFAULT, GRID_DEFAULT, TMA_MIN_M,
    GatedGemmConfig, ShapeRule, _bucket_key, _for_bucket, _shape_rule, m_bucket,
)
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


@lru_cache(maxsize=8)
def _gpu_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


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
