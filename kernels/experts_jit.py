"""Triton helpers the experts kernels share: the experts' gated epilogue.

`experts_epilogue` computes `experts_reference.ExpertsEpilogue.apply` in fp32: with ALPHA == 0
the dense kernels' `jit_common.gated_epilogue`; with ALPHA > 0 gpt-oss's clamped SwiGLU,
g = min(gate, LIMIT), u = clip(up, -LIMIT, LIMIT), h = g * sigmoid(ALPHA * g) * (u + 1).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import gated_epilogue


@triton.jit
def experts_epilogue(gate, up, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr, GATE_SCALE: tl.constexpr,
                     OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """h in fp32 from fp32 gate and up (see the module docstring)."""
    if ALPHA != 0.0:
        g = tl.minimum(gate, LIMIT)
        u = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        h = g / (1.0 + tl.exp(-ALPHA * g)) * (u + 1.0)
    else:
        h = gated_epilogue(gate, up, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT)
    return h
