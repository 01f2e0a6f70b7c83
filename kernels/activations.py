"""The activations the fused kernel applies to the gate, by name, with their PyTorch spec.

- ``silu``: g * sigmoid(g) (Llama, Mistral, Qwen, Phi-3; HF ``silu``/``swish``).
- ``gelu_tanh``: 0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 * g^3))) (Gemma's
  ``gelu_pytorch_tanh``; HF ``gelu_new`` is the same formula).
- ``gelu``: 0.5 * g * (1 + erf(g / sqrt(2))), exact (HF ``gelu``).

The Triton kernel evaluates the same formulas in fp32 on its accumulators; for bf16/fp16
inputs on the GPU it takes silu and gelu_tanh's tanh from `tanh.approx.f32` (error at most
2^-11 of tanh, below a 16-bit output's rounding; `gated_gemm.default_approx_tanh`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
    "gelu": F.gelu,
}

# Integer codes passed to the kernel as a constexpr.
ACTIVATION_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}


def check_activation(fn: str, activation: str) -> None:
    """Raise NotImplementedError naming the supported activations if `activation` is not one."""
    if activation not in ACTIVATIONS:
        raise NotImplementedError(
            f"{fn}: activation {activation!r} is not supported by the fused kernel; supported: {', '.join(ACTIVATIONS)}"
        )
