"""`experts_forward`: the one entry point to the experts kernels, choosing by `EXPERTS_RULES`.

    out[T, K] = sum_j w[t, j] * down_e(epilogue(gate_e(x[t]), up_e(x[t])))   (`experts_reference.py`)

Two kernel families: "experts_gemv" (`experts_gemv.py`: per pair and per token, no routing
prep; few tokens) and "experts_grouped" (`experts_gemm.py`: pairs sorted into per-expert
blocks by `experts_routing`, two grouped GEMMs and a fixed-order combine). The first rule whose
token range holds T runs, with its config. Every launch is asynchronous and needs no host
synchronisation, so a call can be captured into a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import experts_gemm, experts_gemv
from .device import interpreting
from .experts_reference import ExpertsEpilogue, ExpertsLayout
from .experts_routing import expert_blocks

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class ExpertsConfig:
    """Tiles of the experts kernels.

    Attributes:
        block_m: pairs per block (grouped kernels; a multiple of 16 for tl.dot).
        block_n, block_k: the gated kernel's tile along I and its step along K.
        down_block_n, down_block_k: the down kernel's tile along K_out and its step along I.
        group_m: blocks that walk the column tiles together (L2 reuse).
        num_warps, num_stages: Triton's launch parameters.
    """

    block_m: int
    block_n: int
    block_k: int
    down_block_n: int
    down_block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def short(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}, down {self.down_block_n}x{self.down_block_k}, "
                f"g{self.group_m} w{self.num_warps} s{self.num_stages}")


@dataclass(frozen=True)
class ExpertsRule:
    """Run `kernel` with `config` for calls of T tokens within `tokens` (inclusive; None: no bound)."""

    kernel: str
    config: ExpertsConfig
    tokens: tuple[int | None, int | None] = (None, None)
    why: str = ""


EXPERTS_KERNELS = ("experts_gemv", "experts_grouped")
EXPERTS_RULES: tuple[ExpertsRule, ...] = (
    ExpertsRule("experts_gemv", ExpertsConfig(1, 32, 128, 32, 128, num_warps=4, num_stages=1), tokens=(None, 4),
                why="few pairs: each expert hit about once; no routing prep, weights streamed once"),
    ExpertsRule("experts_grouped", ExpertsConfig(16, 64, 128, 64, 128, group_m=8, num_warps=4, num_stages=4),
                tokens=(5, 256), why="few rows per expert: 16-row blocks"),
    ExpertsRule("experts_grouped", ExpertsConfig(64, 128, 64, 128, 64, group_m=8, num_warps=8, num_stages=3),
                tokens=(257, None), why="prefill: 64-row blocks, 64x128 tiles"),
)


def choose_experts(tokens: int) -> ExpertsRule:
    """The rule a call of `tokens` tokens takes."""
    for rule in EXPERTS_RULES:
        low, high = rule.tokens
        if (low is None or tokens >= low) and (high is None or tokens <= high):
            return rule
    raise AssertionError("EXPERTS_RULES ends with a rule for every token count")  # unreachable


def check_experts_operands(fn: str, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                           layout: ExpertsLayout) -> None:
    """Raise an error naming the problem and the fix for operands the experts kernels cannot take."""
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        raise ValueError(f"{fn}: gate_up and down must be 3-D [E, ...] with the same E, got {tuple(gate_up.shape)} "
                         f"and {tuple(down.shape)}")
    e, n, k = (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1]) if layout.transposed else gate_up.shape
    i = n // 2
    down_i, k_out = (down.shape[1], down.shape[2]) if layout.transposed else (down.shape[2], down.shape[1])
    if n % 2 or n == 0 or down_i != i:
        raise ValueError(f"{fn}: gate_up must hold 2*I columns and down I of them ({layout.describe()}), got "
                         f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{fn}: x must be [T, {k}] (the experts' K), got shape {tuple(x.shape)}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0] or top_k_index.dtype.is_floating_point:
        raise ValueError(f"{fn}: top_k_index must be an integer [T={x.shape[0]}, top_k] tensor, got "
                         f"{tuple(top_k_index.shape)} {top_k_index.dtype}")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape) or not top_k_weights.dtype.is_floating_point:
        raise ValueError(f"{fn}: top_k_weights must be floating-point {tuple(top_k_index.shape)} like top_k_index, "
                         f"got {tuple(top_k_weights.shape)} {top_k_weights.dtype}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{fn}: the Triton kernels take bfloat16, float16 or float32, got {x.dtype}; cast the "
                        "model, or use backend='torch'")
    for name, t in (("gate_up", gate_up), ("down", down), ("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise TypeError(f"{fn}: {name} must match x's dtype and device ({x.dtype} on {x.device}), got {t.dtype} "
                            f"on {t.device}; cast one with .to()")
    for name, t, shape in (("gate_up_bias", gate_up_bias, (e, n)), ("down_bias", down_bias, (e, k_out))):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{fn}: {name} must be {list(shape)}, got {list(t.shape)}")
    if top_k_index.device != x.device or top_k_weights.device != x.device:
        raise TypeError(f"{fn}: the routing tensors must be on x's device ({x.device})")
    if x.dtype == torch.bfloat16 and not x.is_cuda and interpreting():
        raise TypeError(f"{fn}: Triton's CPU interpreter computes bfloat16 matrix products wrongly; run bf16 on "
                        "the GPU, use float16/float32 with TRITON_INTERPRET=1, or use backend='torch'")


def experts_forward(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    epilogue: ExpertsEpilogue,
    layout: ExpertsLayout = ExpertsLayout(),
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    kernel: str = "auto",
    config: ExpertsConfig | None = None,
    approx_tanh: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts block on the Triton kernels.

    Args:
        x: [T, K] tokens, bf16/fp16/fp32 (bf16 only on the GPU), any strides.
        top_k_index: [T, TOP_K] integer expert ids; ids >= E (expert-parallel sentinels) add nothing.
        top_k_weights: [T, TOP_K] routing weights, any float dtype.
        gate_up, down, gate_up_bias, down_bias: the experts' weights in `layout`, x's dtype, any strides.
        epilogue: the gated math.
        kernel: "auto" (the rule for T), or one of `EXPERTS_KERNELS`.
        config: the kernel's tiles (None: the rule's, or the named kernel's first rule's).
        approx_tanh: silu and gelu_tanh through `tanh.approx.f32` (None: on the GPU for 16-bit x).
        out: optional [T, K_out] output (x's dtype and device, any strides), every element written.

    Returns:
        out, [T, K_out] in x's dtype.

    Raises:
        ValueError, TypeError: operands the kernels cannot take (the message names the fix).
    """
    check_experts_operands("experts_forward", x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                           layout)
    tokens = x.shape[0]
    if kernel == "auto":
        rule = choose_experts(tokens)
    elif kernel in EXPERTS_KERNELS:
        rule = next(r for r in EXPERTS_RULES if r.kernel == kernel)
    else:
        raise ValueError(f"experts_forward: kernel must be 'auto' or one of {EXPERTS_KERNELS}, got {kernel!r}")
    config = config or rule.config
    if approx_tanh is None:
        approx_tanh = x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda and not interpreting()
    epi = dict(epilogue.constexprs(), APPROX_TANH=approx_tanh)
    k_out = down.shape[2] if layout.transposed else down.shape[1]
    if out is None:
        out = x.new_empty((tokens, k_out))
    elif tuple(out.shape) != (tokens, k_out) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"experts_forward: out must be [{tokens}, {k_out}] ({x.dtype} on {x.device}), got "
                         f"{list(out.shape)} ({out.dtype} on {out.device})")
    if tokens == 0:
        return out
    if rule.kernel == "experts_gemv":
        return experts_gemv.experts_gemv(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                                         epilogue=epi, layout=layout, config=config, out=out)
    sorted_pairs, block_expert = expert_blocks(top_k_index, gate_up.shape[0], config.block_m)
    return experts_gemm.experts_grouped(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                                        epilogue=epi, layout=layout, config=config, sorted_pairs=sorted_pairs,
                                        block_expert=block_expert, out=out)
