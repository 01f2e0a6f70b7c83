"""Triton helpers the experts kernels share: the experts' gated epilogue and its gradient, and the
GEMV paths' combine of a token's slots (`combine_slots`).

`experts_epilogue` computes `experts_reference.ExpertsEpilogue.apply` in fp32: with ALPHA == 0
the dense kernels' `jit_common.gated_epilogue`; with ALPHA > 0 gpt-oss's clamped SwiGLU,
g = min(gate, LIMIT), u = clip(up, -LIMIT, LIMIT), h = g * sigmoid(ALPHA * g) * (u + 1).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import clip_passes, gated_epilogue, gated_epilogue_grad, min_passes


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
    dgate = dh * (u + 1) * s * (1 + ALPHA g (1 - s)) where gate is below LIMIT, dup = dh * g * s
    where up is inside (-LIMIT, LIMIT): a clamp passes no gradient where it clips, as torch.clamp's
    backward, and on the bound as the installed torch does (`jit_common.clip_passes`, `min_passes`)."""
    if ALPHA != 0.0:
        gate_passes = min_passes(gate, LIMIT)
        up_passes = clip_passes(up, LIMIT)
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


@triton.jit
def combine_slots(part, token, slot, expert, real, offs_n, mask_n, rw_ptr, db_ptr, out_ptr,
                  stride_rt, stride_rj, stride_dbe, stride_dbn, stride_om, stride_on,
                  TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[token, offs_n] from part [SLOTS, BLOCK_N], each slot's fp32 h @ Wd^T over all of I:
    per slot y_j = w[token, j] * (part_j + bd[e_j]) rounded to out's dtype (as the grouped down
    GEMM rounds it), then the slots summed in order in fp32 and rounded once. Sentinel slots
    (real False) add nothing."""
    if HAS_BIAS:
        part += tl.load(db_ptr + expert[:, None] * stride_dbe + offs_n[None, :] * stride_dbn,
                        mask=real[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    weight = tl.load(rw_ptr + token * stride_rt + slot * stride_rj, mask=real, other=0.0).to(tl.float32)
    y = (part * weight[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded per pair, as the grouped y
    y = tl.where(real[:, None], y, 0.0)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # slots in order: the combine's fixed summation order
        total += tl.sum(tl.where(slot[:, None] == j, y, 0.0), axis=0)
    tl.store(out_ptr + token * stride_om + offs_n * stride_on, total.to(out_ptr.dtype.element_ty), mask=mask_n)
