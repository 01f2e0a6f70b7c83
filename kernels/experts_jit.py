"""Triton helpers the experts kernels share: the experts' gated epilogue and its gradient.

`experts_epilogue` computes `experts_reference.ExpertsEpilogue.apply` in fp32: with ALPHA == 0
the dense kernels' `jit_common.gated_epilogue`; with ALPHA > 0 gpt-oss's clamped SwiGLU,
g = min(gate, LIMIT), u = clip(up, -LIMIT, LIMIT), h = g * sigmoid(ALPHA * g) * (u + 1).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import gated_epilogue, gated_epilogue_grad


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


@triton.jit
def experts_epilogue_grad(gate, up, dh, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
                          GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr,
                          LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """(h, dgate, dup) in fp32 for `experts_epilogue`: with ALPHA == 0 the dense
    `gated_epilogue_grad`; with ALPHA > 0 gpt-oss's h = g * sigmoid(ALPHA g) * (u + 1),
    g = min(gate, LIMIT), u = clip(up, -LIMIT, LIMIT): with s = sigmoid(ALPHA g),
    dgate = dh * (u + 1) * s * (1 + ALPHA g (1 - s)) where gate <= LIMIT, dup = dh * g * s where
    -LIMIT <= up <= LIMIT (a clamp passes no gradient where it clips, as torch.clamp's backward)."""
    if ALPHA != 0.0:
        gate_passes = gate <= LIMIT
        up_passes = (up >= -LIMIT) & (up <= LIMIT)
        g = tl.minimum(gate, LIMIT)
        u1 = tl.minimum(tl.maximum(up, -LIMIT), LIMIT) + 1.0
        s = 1.0 / (1.0 + tl.exp(-ALPHA * g))
        gs = g * s
        h = gs * u1
        dgate = tl.where(gate_passes, dh * u1 * (s + ALPHA * gs * (1.0 - s)), 0.0)
        dup = tl.where(up_passes, dh * gs, 0.0)
    else:
        h, dgate, dup = gated_epilogue_grad(gate, up, dh, ACTIVATION, APPROX_TANH, GATE_SCALE, OUT_SCALE, CLAMP,
                                            LIMIT)
    return h, dgate, dup
