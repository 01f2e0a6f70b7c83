"""`experts_forward`: the entry point to the experts kernels, chosen by the planner (`dispatch`).

    out[T, K] = sum_j w[t, j] * down_e(epilogue(gate_e(x[t]), up_e(x[t])))   (`experts_reference.py`)

Op "experts" of `dispatch.OPS`; its rules are `rules.EXPERTS_RULES` (M is the block's tokens T,
each rule a tile config), run by the kernel files "experts_grouped" (`experts_gemm.py`: the pairs
sorted into per-expert blocks by `experts_routing`, two grouped GEMMs and a fixed-order
combine) and, for calls of one token (and of two on small experts), "experts_gemv"
(`experts_gemv.py`: two GEMV launches, the combine in the second); eager one-token calls on
transposed weights (gpt-oss), "experts_gemv_transposed" (`experts_gemv_transposed.py`: three
launches). Every launch is asynchronous
and needs no host synchronisation, so a call can be captured into a CUDA graph.
`dispatch.explain(..., op="experts")` says which rule a call takes.
"""

from __future__ import annotations

import torch

from .configs import ALL_DTYPES, ExpertsConfig
from .device import interpreting
from .dispatch import _call_key, _launch
from .experts_reference import ExpertsEpilogue, ExpertsLayout
from .operands import BF16_INTERPRETER, resolve_approx_tanh

EXPERTS_KERNELS = ("experts_gemv", "experts_gemv_transposed", "experts_grouped")


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
    if x.dtype not in ALL_DTYPES:
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
        raise TypeError(f"{fn}: {BF16_INTERPRETER}")


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
        kernel: "auto" (the planner's rule for T), or one of `EXPERTS_KERNELS` to force it.
        config: the kernel's tiles (None: the rule's, or the named kernel's rule for T).
        approx_tanh: silu and gelu_tanh through `tanh.approx.f32` (None: on the GPU for 16-bit x).
        out: optional [T, K_out] output (x's dtype and device, any strides), every element written.

    Returns:
        out, [T, K_out] in x's dtype.

    Raises:
        ValueError, TypeError: operands the kernels cannot take (the message names the fix).
    """
    fn = "experts_forward"
    check_experts_operands(fn, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, layout)
    tokens = x.shape[0]
    k_out = down.shape[2] if layout.transposed else down.shape[1]
    if out is None:
        out = x.new_empty((tokens, k_out))
    elif tuple(out.shape) != (tokens, k_out) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"{fn}: out must be [{tokens}, {k_out}] ({x.dtype} on {x.device}), got "
                         f"{list(out.shape)} ({out.dtype} on {out.device})")
    if tokens == 0:
        return out
    inter = (gate_up.shape[2] if layout.transposed else gate_up.shape[1]) // 2
    key = _call_key(x, inter, x.is_cuda and torch.cuda.is_current_stream_capturing(),
                    (gate_up.shape[0], top_k_index.shape[1]))
    extras = (layout, gate_up_bias is not None, top_k_index.shape[1])
    return _launch(fn, "experts", key, epilogue, resolve_approx_tanh(x, approx_tanh, fn), extras,
                   (x, gate_up, down, layout),
                   (x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, out), kernel, config)
