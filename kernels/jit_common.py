"""Triton helpers every kernel shares: the tile order and the gated epilogue's math.

`gated_epilogue` computes what `epilogue.GatedEpilogue.apply` specifies, in fp32, on a
kernel's gate and up accumulators; its arguments after `up` are the constexprs of
`GatedEpilogue.constexprs()` plus APPROX_TANH. Nothing here launches anything.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .epilogue import CLIP_GRAD_AT_BOUND, MIN_GRAD_AT_BOUND

# The installed torch's clamp derivative where x equals the bound (`epilogue.CLIP_GRAD_AT_BOUND`):
# global constexprs, part of every kernel's compile key that reads them.
CLIP_PASSES_AT_BOUND = tl.constexpr(CLIP_GRAD_AT_BOUND)
MIN_PASSES_AT_BOUND = tl.constexpr(MIN_GRAD_AT_BOUND)


@triton.jit
def tile_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M: tl.constexpr):
    """(pid_m, pid_n) of tile `tile_id` in grouped order: GROUP_SIZE_M row-tiles walk the
    column tiles together, so the weight tiles they share stay in L2."""
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh_approx(x):
    """tanh(x) in one MUFU op: PTX `tanh.approx.f32` (sm_75+, max relative error 2^-11)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def apply_activation(gate, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr):
    """act(gate) in fp32; codes follow `epilogue.ACTIVATION_CODES` (0 silu, 1 gelu_tanh, 2 gelu).

    With APPROX_TANH (16-bit inputs on the GPU) silu and gelu_tanh take one
    `tanh.approx.f32` per output, g/2 + g/2 * tanh(.), instead of exp and a reciprocal: one
    MUFU op instead of two (the MUFU pipe bounds the prefill epilogue). Its error, at most
    2^-11 of tanh, is below the rounding of a 16-bit output.
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
def gated_epilogue(gate, up, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr, GATE_SCALE: tl.constexpr,
                   OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr):
    """h = OUT_SCALE * A(GATE_SCALE * gate) * C(up) in fp32 (`epilogue.py`): CLAMP 0 none,
    1 min(g, LIMIT) before the activation, 2 min(act(g), LIMIT) after it; up is clipped to
    [-LIMIT, LIMIT] whenever CLAMP != 0. Branches on constexprs: the plain case adds nothing."""
    if GATE_SCALE != 1.0:
        gate = gate * GATE_SCALE
    if CLAMP != 0:
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    if CLAMP == 1:
        gate = tl.minimum(gate, LIMIT)
    a = apply_activation(gate, ACTIVATION, APPROX_TANH)
    if CLAMP == 2:
        a = tl.minimum(a, LIMIT)
    h = a * up
    if OUT_SCALE != 1.0:
        h = h * OUT_SCALE
    return h


# -- derivatives, for the backward kernels ------------------------------------------------


@triton.jit
def activation_and_grad(gate, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr):
    """(act(gate), act'(gate)) in fp32; codes and APPROX_TANH as in `apply_activation`.

    silu: s = sigmoid(g), act' = s * (1 + g * (1 - s)).
    gelu_tanh: t = tanh(c * (g + 0.044715 g^3)), act' = (1 + t) / 2 + g/2 * (1 - t^2) * c * (1 + 3 * 0.044715 g^2)
    with c = sqrt(2/pi); the second term takes g clipped to [-10, 10], where t^2 rounds to 1 in
    fp32 (so the term is exactly 0 past it and g^3 cannot overflow into 0 * inf).
    gelu: act' = Phi(g) + g * phi(g), the normal CDF and density.
    """
    if ACTIVATION == 0:  # silu
        if APPROX_TANH:
            s = 0.5 + 0.5 * _tanh_approx(0.5 * gate)
        else:
            s = _sigmoid(gate)
        a = gate * s
        da = s * (1.0 + gate * (1.0 - s))
    elif ACTIVATION == 1:  # gelu_tanh
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        if APPROX_TANH:
            t = _tanh_approx(inner)
        else:
            t = 2.0 * _sigmoid(2.0 * inner) - 1.0
        half = 0.5 * gate
        a = half + half * t
        gc = tl.minimum(tl.maximum(gate, -10.0), 10.0)
        da = 0.5 + 0.5 * t + (0.5 * gc * (1.0 - t * t)) * (0.7978845608028654 * (1.0 + 0.134145 * gc * gc))
    else:  # gelu (erf)
        cdf = 0.5 * (1.0 + tl.erf(gate * 0.7071067811865476))
        a = gate * cdf
        da = cdf + gate * 0.3989422804014327 * tl.exp(-0.5 * gate * gate)
    return a, da


@triton.jit
def clip_passes(x, LIMIT: tl.constexpr):
    """Where clip(x, -LIMIT, LIMIT) passes x's gradient: inside the interval, and at its ends
    where torch.clamp's backward does (`CLIP_PASSES_AT_BOUND`)."""
    if CLIP_PASSES_AT_BOUND:
        passes = (x >= -LIMIT) & (x <= LIMIT)
    else:
        passes = (x > -LIMIT) & (x < LIMIT)
    return passes


@triton.jit
def min_passes(x, LIMIT: tl.constexpr):
    """Where min(x, LIMIT) passes x's gradient: below LIMIT, and at it where torch.clamp(max=)'s
    backward does (`MIN_PASSES_AT_BOUND`)."""
    if MIN_PASSES_AT_BOUND:
        passes = x <= LIMIT
    else:
        passes = x < LIMIT
    return passes


@triton.jit
def gated_epilogue_grad(gate, up, dh, ACTIVATION: tl.constexpr, APPROX_TANH: tl.constexpr,
                        GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLAMP: tl.constexpr,
                        LIMIT: tl.constexpr):
    """(h, dgate, dup) in fp32: h as `gated_epilogue` computes it from gate and up, and the
    gradients of sum(dh * h) with respect to gate and up (the scales included). A clamp passes
    no gradient where it clips, as torch.clamp's backward: up's where it is outside
    [-LIMIT, LIMIT]; CLAMP 1: gate's where GATE_SCALE * gate > LIMIT; CLAMP 2: where
    act(GATE_SCALE * gate) > LIMIT. At the bound itself, as the installed torch does
    (`clip_passes`, `min_passes`)."""
    if GATE_SCALE != 1.0:
        gate = gate * GATE_SCALE
    if CLAMP != 0:
        up_passes = clip_passes(up, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    if CLAMP == 1:
        gate_passes = min_passes(gate, LIMIT)
        gate = tl.minimum(gate, LIMIT)
    a, da = activation_and_grad(gate, ACTIVATION, APPROX_TANH)
    if CLAMP == 2:
        gate_passes = min_passes(a, LIMIT)
        a = tl.minimum(a, LIMIT)
    h = a * up
    if OUT_SCALE != 1.0:
        h = h * OUT_SCALE
        dh = dh * OUT_SCALE
    dup = dh * a
    dgate = dh * up * da
    if CLAMP != 0:
        dup = tl.where(up_passes, dup, 0.0)
        dgate = tl.where(gate_passes, dgate, 0.0)
    if GATE_SCALE != 1.0:
        dgate = dgate * GATE_SCALE
    return h, dgate, dup
