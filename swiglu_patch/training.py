"""`gated_mlp`: the whole gated MLP, through down_proj, as one differentiable op for training.

    P = x @ W^T + b                    [M, 2*I], gate/up columns interleaved (`kernels/layout.py`)
    h = epilogue(gate(P), up(P))       [M, I]    (`kernels/epilogue.py`)
    y = h @ Wd^T + bd                  [M, K]

W is the packed ``gate_up_interleaved`` [2*I, K], b its [2*I] bias, Wd the down projection's
weight [K, I] and bd its [K] bias. Gradients, given dY [M, K]:

    dH  = dY @ Wd                       fused: the backward GEMM's epilogue reads P and writes
    dP  = (dH * dh/dgate, dH * dh/dup)  dP (interleaved, over P) and h; dH stays in registers
    dWd = dY^T @ h        dbd = sum_m dY
    dW  = dP^T @ x        db  = sum_m dP      (dW stays packed: the packed parameter's gradient)
    dx  = dP @ W

LoRA rides in the same GEMMs. Adapters on gate and up enter as a low-rank segment of the
forward GEMM: P = x @ W^T + x_lr @ b_lr^T + b, with x_lr [M, r] and b_lr [2*I, r]
(`swiglu_patch.low_rank`); their gradients are dx_lr = dP @ b_lr and db_lr = dP^T @ x_lr, and
autograd carries them to A, B and x through the torch ops that built x_lr and b_lr. Adapters on
down_proj need h: with ``return_h`` the op also returns h, the caller adds the adapters' update
computed from it, and the gradient reaching h (dh_lora) is added to dH inside the backward
GEMM's epilogue (its HAS_DH_IN input) before the derivative.

Two modes:
- "store" (the default): the forward's gated GEMM also writes P (x's dtype); P is the one
  tensor saved beyond x and the weights (2*M*I elements); h is not saved.
- "recompute": only x and the weights are saved; the backward recomputes P with one GEMM.

Layers, bottom up: the kernels (`kernels/dispatch.py`: `gated_gemm_with_preact`, `gated_gemm`,
`gated_backward`); the registered ops ``swiglu_patch::gated_mlp`` (forward, with its autograd
formula registered on it, so autograd, torch.compile and CUDA graphs see one op) and
``swiglu_patch::gated_mlp_dpreact`` (the fused backward GEMM, writing dP over P); then
`gated_mlp_interleaved` (what a fused module calls with its parameters) and `gated_mlp`
(which takes a `PackedGateUp`). The plain GEMMs of the backward (dWd, dW, dx) run through
torch (cuBLAS on the GPU) and are skipped for inputs that need no gradient (frozen weights).

Numerics: fp32 accumulation and epilogue math in every kernel, one rounding per stored tensor
(P, h, dP, each gradient). The "torch" backend computes the same formulas with PyTorch ops
(float64 in, float64 out: what `torch.autograd.gradcheck` checks); its backward epilogue is
`gated_epilogue_grad_reference`, the spec the kernels' `jit_common.gated_epilogue_grad` follows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .functional import dispatcher, training_dispatcher
from .kernels.epilogue import CLAMP_CODES, GatedEpilogue
from .kernels.layout import PackedGateUp, interleave_gate_up, split_interleaved
from .low_rank import check_low_rank

MODES = ("store", "recompute")
BACKENDS = ("auto", "triton", "torch")
_CLAMPS = {code: name for name, code in CLAMP_CODES.items()}
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

# -- the backward epilogue, written out in PyTorch (the spec of the kernels' derivative) ----


def _activation_and_grad(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(g), act'(g)) in g's dtype."""
    if activation == "silu":
        s = torch.sigmoid(g)
        return g * s, s * (1 + g * (1 - s))
    if activation == "gelu_tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g**3))
        gc = g.clamp(-10, 10)  # past |g| = 10, 1 - t^2 is 0 and g^3 could overflow into 0 * inf
        return 0.5 * g * (1 + t), 0.5 * (1 + t) + 0.5 * gc * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 0.134145 * gc * gc)
    cdf = 0.5 * (1 + torch.erf(g * 0.7071067811865476))
    return g * cdf, cdf + g * _INV_SQRT_2PI * torch.exp(-0.5 * g * g)


def gated_epilogue_grad_reference(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor,
                                  epilogue: GatedEpilogue) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, dgate, dup): h = epilogue.apply(gate, up) and the gradients of sum(dh * h).

    A clamp passes no gradient where it clips (torch.clamp's backward): up where it is outside
    [-limit, limit]; clamp "gate": gate where gate_scale * gate > limit; clamp "activation":
    where act(gate_scale * gate) > limit.

    Args:
        gate, up, dh: [M, I] each, one floating dtype (the caller upcasts 16-bit ones).

    Returns:
        (h, dgate, dup), [M, I] each in that dtype.
    """
    e = epilogue
    g = gate * e.gate_scale if e.gate_scale != 1.0 else gate
    gate_passes = up_passes = None
    if e.limit is not None:
        up_passes = (up >= -e.limit) & (up <= e.limit)
        up = up.clamp(-e.limit, e.limit)
        if e.clamp == "gate":
            gate_passes = g <= e.limit
            g = g.clamp(max=e.limit)
    a, da = _activation_and_grad(g, e.activation)
    if e.limit is not None and e.clamp == "activation":
        gate_passes = a <= e.limit
        a = a.clamp(max=e.limit)
    h = a * up
    if e.out_scale != 1.0:
        h = h * e.out_scale
        dh = dh * e.out_scale
    dup = dh * a
    dgate = dh * up * da
    if up_passes is not None:
        dup = torch.where(up_passes, dup, 0)
        dgate = torch.where(gate_passes, dgate, 0)
    if e.gate_scale != 1.0:
        dgate = dgate * e.gate_scale
    return h, dgate, dup


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _epilogue_of(activation: str, gate_scale: float, out_scale: float, clamp: int, limit: float) -> GatedEpilogue:
    return GatedEpilogue(activation, gate_scale, out_scale, limit if clamp else None, _CLAMPS[clamp] or "gate")


def _epilogue_args(epilogue: GatedEpilogue) -> tuple:
    return (epilogue.activation, epilogue.gate_scale, epilogue.out_scale,
            CLAMP_CODES[None if epilogue.limit is None else epilogue.clamp], epilogue.limit or 0.0)


# -- the registered ops ----------------------------------------------------------------


@torch.library.custom_op("swiglu_patch::gated_mlp", mutates_args=())
def _gated_mlp_op(x: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
                  down_weight: torch.Tensor, down_bias: torch.Tensor | None, x_lr: torch.Tensor | None,
                  b_lr: torch.Tensor | None, activation: str, gate_scale: float, out_scale: float, clamp: int,
                  limit: float, store_preact: bool, return_h: bool,
                  backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [M, K], P [M, 2*I], h [M, I]) for 2-D x [M, K]; P and h are 0-element tensors unless
    store_preact and return_h ask for them. x_lr [M, r] and b_lr [2*I, r]: the low-rank segment."""
    epilogue = _epilogue_of(activation, gate_scale, out_scale, clamp, limit)
    if backend == "triton":
        if x_lr is not None:
            h, preact = training_dispatcher().gated_gemm_low_rank(x, gate_up_weight, x_lr, b_lr, epilogue, gate_up_bias,
                                                        store_preact)
        elif store_preact:
            h, preact = training_dispatcher().gated_gemm_with_preact(x, gate_up_weight, epilogue, gate_up_bias)
        else:
            h, preact = dispatcher().gated_gemm(x, gate_up_weight, epilogue, gate_up_bias), None
    else:
        acc = _acc_dtype(x.dtype)
        p = F.linear(x, gate_up_weight, gate_up_bias)
        p_acc = p.to(acc) if x_lr is None else p.to(acc) + F.linear(x_lr, b_lr).to(acc)
        gate, up = split_interleaved(p_acc, -1)
        h = epilogue.apply(gate, up).to(x.dtype)
        preact = (p if x_lr is None else p_acc.to(x.dtype)) if store_preact else None
    y = F.linear(h, down_weight, down_bias)
    return y, x.new_empty(0) if preact is None else preact, h if return_h else x.new_empty(0)


@_gated_mlp_op.register_fake
def _(x, gate_up_weight, gate_up_bias, down_weight, down_bias, x_lr, b_lr, activation, gate_scale, out_scale, clamp,
      limit, store_preact, return_h, backend):
    preact = x.new_empty((x.shape[0], gate_up_weight.shape[0])) if store_preact else x.new_empty(0)
    h = x.new_empty((x.shape[0], down_weight.shape[1])) if return_h else x.new_empty(0)
    return x.new_empty((x.shape[0], down_weight.shape[0])), preact, h


@torch.library.custom_op("swiglu_patch::gated_mlp_dpreact", mutates_args=("preact",))
def _dpreact_op(dy: torch.Tensor, down_weight: torch.Tensor, preact: torch.Tensor, dh_in: torch.Tensor | None,
                activation: str, gate_scale: float, out_scale: float, clamp: int, limit: float,
                backend: str) -> torch.Tensor:
    """Writes dP over P (`preact`, [M, 2*I]) and returns h [M, I], from dY [M, K], Wd [K, I] and
    an optional further gradient of h, dh_in [M, I] (added to dY @ Wd)."""
    epilogue = _epilogue_of(activation, gate_scale, out_scale, clamp, limit)
    if backend == "triton":
        _, h = training_dispatcher().gated_backward(dy, down_weight, preact, epilogue, dpreact_out=preact, dh_in=dh_in)
        return h
    acc = _acc_dtype(dy.dtype)
    gate, up = split_interleaved(preact.to(acc), -1)
    dh = dy.to(acc) @ down_weight.to(acc)
    if dh_in is not None:
        dh = dh + dh_in.to(acc)
    h, dgate, dup = gated_epilogue_grad_reference(gate, up, dh, epilogue)
    preact.copy_(interleave_gate_up(dgate.t(), dup.t()).t())
    return h.to(dy.dtype)


@_dpreact_op.register_fake
def _(dy, down_weight, preact, dh_in, activation, gate_scale, out_scale, clamp, limit, backend):
    return dy.new_empty((dy.shape[0], down_weight.shape[1]))


def _setup_context(ctx, inputs, output):
    x, gate_up_weight, gate_up_bias, down_weight, down_bias, x_lr, b_lr, *epilogue, store_preact, _, backend = inputs
    _, preact, _ = output
    ctx.mark_non_differentiable(preact)
    ctx.set_materialize_grads(False)  # no [M, 2*I] of zeros for P's (absent) gradient
    ctx.save_for_backward(x, gate_up_weight, None if store_preact else gate_up_bias, down_weight,
                          preact if store_preact else None, x_lr, b_lr)
    ctx.epilogue_args, ctx.store_preact, ctx.backend = tuple(epilogue), store_preact, backend


def _sum_rows(t: torch.Tensor) -> torch.Tensor:
    """sum over dim 0 in fp32 (or wider), rounded once to t's dtype."""
    return t.sum(0, dtype=_acc_dtype(t.dtype)).to(t.dtype)


def _backward(ctx, dy, _dpreact, dh_in):
    need_x, need_w, need_b, need_wd, need_bd, need_xlr, need_blr = ctx.needs_input_grad[:7]
    none = (None,) * 8
    if dh_in is not None and dh_in.numel() == 0:  # h was not returned (a traced backward materializes its 0 elements)
        dh_in = None
    if dy is None and dh_in is None:
        return (None,) * 7 + none
    x, gate_up_weight, gate_up_bias, down_weight, preact, x_lr, b_lr = ctx.saved_tensors
    dy = x.new_zeros((x.shape[0], down_weight.shape[0])) if dy is None else dy.contiguous()
    dx = dw = db = dwd = dbd = dxlr = dblr = None
    if need_bd:
        dbd = _sum_rows(dy)
    if need_x or need_w or need_b or need_wd or need_xlr or need_blr:
        if not ctx.store_preact:  # recompute: one GEMM (and the low-rank segment's)
            preact = F.linear(x, gate_up_weight, gate_up_bias)
            if x_lr is not None:
                preact = torch.addmm(preact, x_lr, b_lr.t())
        h = _dpreact_op(dy, down_weight, preact, dh_in, *ctx.epilogue_args, ctx.backend)
        dpreact = preact  # dP now, written over P
        if need_wd:
            dwd = dy.t() @ h
        del h
        if need_x:
            dx = dpreact @ gate_up_weight
        if need_w:
            dw = dpreact.t() @ x
        if need_b:
            db = _sum_rows(dpreact)
        if need_xlr:
            dxlr = dpreact @ b_lr
        if need_blr:
            dblr = dpreact.t() @ x_lr
    return (dx, dw, db, dwd, dbd, dxlr, dblr) + none


_gated_mlp_op.register_autograd(_backward, setup_context=_setup_context)


# -- the functional entry points -------------------------------------------------------


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """The backend `gated_mlp` runs for `backend` on x: "auto" takes Triton on CUDA, the
    PyTorch formulas elsewhere.

    Raises:
        ValueError: an unknown backend name.
        RuntimeError: "triton" on a non-CUDA device without TRITON_INTERPRET=1.
    """
    if backend not in BACKENDS:
        raise ValueError(f"gated_mlp: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if x.is_cuda else "torch"
    if backend == "triton" and not x.is_cuda and not dispatcher().interpreting():
        raise RuntimeError(f"gated_mlp: backend='triton' on {x.device.type} tensors needs Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before importing swiglu_patch, move the tensors to CUDA, or use "
                           "backend='torch'")
    return backend


def _check(x, weight, bias, down_weight, down_bias) -> None:
    if weight.dim() != 2 or weight.shape[0] % 2 or weight.shape[0] == 0:
        raise ValueError(f"gated_mlp: the packed weight must be [2*I, K] with I >= 1, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"gated_mlp: x must be [..., {k}] (the packed weight's K), got shape {tuple(x.shape)}")
    if tuple(down_weight.shape) != (k, n // 2):
        raise ValueError(f"gated_mlp: the down weight must be [K, I] = [{k}, {n // 2}], got shape "
                         f"{tuple(down_weight.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"gated_mlp: x must be a floating-point tensor, got {x.dtype}")
    for name, t, shape in (("packed weight", weight, None), ("packed bias", bias, (n,)),
                           ("down weight", down_weight, None), ("down bias", down_bias, (k,))):
        if t is None:
            continue
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"gated_mlp: the {name} must be {list(shape)}, got shape {tuple(t.shape)}")
        if t.dtype != x.dtype or t.device != x.device:
            raise TypeError(f"gated_mlp: the {name} must match x's dtype and device ({x.dtype} on {x.device}), got "
                            f"{t.dtype} on {t.device}; cast one with .to()")


def gated_mlp_interleaved(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    epilogue: GatedEpilogue,
    mode: str = "store",
    backend: str = "auto",
    x_lr: torch.Tensor | None = None,
    b_lr: torch.Tensor | None = None,
    return_h: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`gated_mlp` on tensors the caller states are in the interleaved layout (a fused module's
    parameters). Arguments as `gated_mlp`'s, with the packed weight and bias unwrapped, and:

    Args:
        x_lr: [..., r] low-rank input with x's leading dims (LoRA on gate/up:
            `low_rank.low_rank_operands`), or None; b_lr: [2*I, r] in the packed row layout.
        return_h: also return h = epilogue(P) [..., I] (differentiable: a gradient reaching it
            joins dY @ Wd inside the backward GEMM), for adapters on the down projection.

    Returns:
        y [..., K], or (y, h) with return_h.
    """
    if mode not in MODES:
        raise ValueError(f"gated_mlp: mode must be one of {MODES}, got {mode!r}")
    _check(x, weight, bias, down_weight, down_bias)
    if (x_lr is None) != (b_lr is None):
        raise ValueError("gated_mlp: x_lr and b_lr come together (the low-rank input and weight); got one of them")
    if x_lr is not None:
        check_low_rank("gated_mlp", x, weight, x_lr, b_lr)
    backend = resolve_backend(backend, x)
    tensors = (x, weight, bias, down_weight, down_bias, x_lr, b_lr)
    store = mode == "store" and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    xlr2d = x_lr if x_lr is None or x_lr.dim() == 2 else x_lr.reshape(-1, x_lr.shape[-1])
    y, _, h = _gated_mlp_op(x2d, weight, bias, down_weight, down_bias, xlr2d, b_lr, *_epilogue_args(epilogue), store,
                            return_h, backend)
    if x.dim() != 2:
        y = y.view(*x.shape[:-1], y.shape[-1])
        h = h.view(*x.shape[:-1], h.shape[-1]) if return_h else h
    return (y, h) if return_h else y


def gated_mlp(
    x: torch.Tensor,
    weight: PackedGateUp,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None = None,
    epilogue: GatedEpilogue | str = "silu",
    mode: str = "store",
    backend: str = "auto",
) -> torch.Tensor:
    """down_proj(act(x @ Wg^T + bg) * (x @ Wu^T + bu)), differentiable, gate/up from one packed weight.

    Args:
        x: [..., K] input, any leading dims and strides; bf16, fp16 or fp32 (float64 with
            backend="torch").
        weight: a `PackedGateUp` ([2*I, K] weight, optional [2*I] bias, interleaved; x's dtype).
        down_weight: [K, I], the down projection's nn.Linear weight; x's dtype and device.
        down_bias: optional [K].
        epilogue: an activation name ("silu", "gelu_tanh", "gelu") or a `GatedEpilogue`.
        mode: "store" (save the [M, 2*I] pre-activation for the backward) or "recompute"
            (save nothing beyond x and the weights; the backward recomputes it, one more GEMM).
            Either way nothing is saved when no input requires grad or grad is disabled.
        backend: "auto" (Triton on CUDA tensors, PyTorch elsewhere), "triton" (the kernels; on
            CPU only under TRITON_INTERPRET=1, fp16/fp32) or "torch" (the same formulas in PyTorch).

    Returns:
        [..., K] tensor in x's dtype. Its backward gives x, both weights and both biases their
        gradients (the packed weight's in the packed layout).

    Raises:
        TypeError: weight is not a `PackedGateUp`, or dtypes that do not fit.
        ValueError: shapes that do not fit, an unknown mode or backend.
        RuntimeError: backend="triton" on CPU without the interpreter.
        NotImplementedError: an unsupported activation.
    """
    if not isinstance(weight, PackedGateUp):
        raise TypeError(f"gated_mlp: weight must be a PackedGateUp, got {type(weight).__name__}; build it with "
                        "pack_gate_up(gate_weight, up_weight), or wrap tensors interleaved already with "
                        "PackedGateUp.from_interleaved(weight, bias)")
    return gated_mlp_interleaved(x, weight.weight, weight.bias, down_weight, down_bias, GatedEpilogue.of(epilogue),
                                 mode, backend)
