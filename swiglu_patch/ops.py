"""The registered ops (torch.library): what autograd, torch.compile and CUDA graphs see of the kernels.

- ``swiglu_patch::gated_gemm`` (`gated_gemm_op`): out [M, I] = epilogue(x @ W^T + b), inference;
- ``swiglu_patch::gated_gemm_low_rank`` (`gated_gemm_low_rank_op`): the same with LoRA's
  low-rank segment, P = x @ W^T + x_lr @ b_lr^T + b (inference);
- ``swiglu_patch::gated_mlp`` (`gated_mlp_op`): the gated MLP's first half (h, and P in store
  mode), with the whole MLP's backward registered on it (`swiglu_patch.training` has the formulas
  and modes); then `GatedMlpDown` (an autograd.Function, not a registered op) computes
  y = h @ Wd^T + bd and its backward only hands dY back to it;
- ``swiglu_patch::gated_mlp_dpreact`` (`gated_mlp_dpreact_op`): the backward GEMM, writing dP over P
  (over both halves where store mode keeps P as two tensors, `training.preact_split`);

The experts ops are `experts_ops.py`'s. Eager calls of the training op go through an
autograd.Function built from the same functions (`GatedMlp`, picked by `gated_mlp_autograd`),
which skips torch.library's per-call dispatch; torch.compile traces the registered ops.

Every op takes the epilogue as plain values (`epilogue_args`, read back by `epilogue_of`) and
runs the kernels (`dispatcher()`: `swiglu_patch.kernels.dispatch`, imported on first use so
that the torch backend needs no Triton) or, for the MLP ops with backend "torch", the same
formulas in PyTorch. `resolve_backend` is the one backend choice of every functional entry point.

Shapes: x [M, K] (2-D: callers flatten leading dims), packed weight [2*I, K] and bias [2*I]
interleaved (`kernels/layout.py`), down weight [K', I] and bias [K'], x_lr [M, r], b_lr [2*I, r];
one floating dtype for all.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .kernels.epilogue import CLAMP_CODES, CLIP_GRAD_AT_BOUND, MIN_GRAD_AT_BOUND, GatedEpilogue
from .kernels.layout import interleave_gate_up, split_interleaved

BACKENDS = ("auto", "triton", "torch")
_CLAMPS = {code: name for name, code in CLAMP_CODES.items()}
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

DISPATCH = None  # swiglu_patch.kernels.dispatch, once imported


def dispatcher():
    """The kernels' planner module (`swiglu_patch.kernels.dispatch`), imported on first use.

    Raises:
        ImportError: Triton is missing or broken, with the fix."""
    global DISPATCH
    if DISPATCH is None:
        try:
            from .kernels import dispatch
        except ImportError as e:  # triton missing (not Linux) or broken
            raise ImportError(f"swiglu_patch: backend='triton' needs Triton ({e}); `pip install triton` on Linux, or "
                              "use backend='torch'") from e
        DISPATCH = dispatch
    return DISPATCH


def resolve_backend(backend: str, device: torch.device, fn: str = "gated_linear") -> str:
    """The backend a call on tensors on `device` runs for `backend`: "auto" takes Triton on CUDA,
    PyTorch elsewhere (`fn` names the caller in errors).

    Raises:
        ValueError: an unknown backend name.
        RuntimeError: "triton" on a non-CUDA device without TRITON_INTERPRET=1, or with an interpreter
            that cannot run the kernels (`kernels.device.interpreter_blocker`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda":
        if not dispatcher().interpreting():
            raise RuntimeError(f"{fn}: backend='triton' on {device.type} tensors needs Triton's interpreter: set "
                               "TRITON_INTERPRET=1 before importing swiglu_patch, move the tensors to CUDA, or use "
                               "backend='torch'")
        blocker = dispatcher().interpreter_blocker()
        if blocker:
            raise RuntimeError(f"{fn}: backend='triton' on {device.type} tensors: {blocker}; or use backend='torch'")
    return backend


def epilogue_args(epilogue: GatedEpilogue) -> tuple:
    """(activation, gate_scale, out_scale, clamp code, limit): the epilogue as the ops take it."""
    return (epilogue.activation, epilogue.gate_scale, epilogue.out_scale,
            CLAMP_CODES[None if epilogue.limit is None else epilogue.clamp], epilogue.limit or 0.0)


def epilogue_of(activation: str, gate_scale: float, out_scale: float, clamp: int, limit: float) -> GatedEpilogue:
    """The `GatedEpilogue` that `epilogue_args` wrote."""
    return GatedEpilogue(activation, gate_scale, out_scale, limit if clamp else None, _CLAMPS[clamp] or "gate")


# -- inference ---------------------------------------------------------------------------------


@torch.library.custom_op("swiglu_patch::gated_gemm", mutates_args=())
def gated_gemm_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str,
                  gate_scale: float, out_scale: float, clamp: int, limit: float) -> torch.Tensor:
    """[M, I] from x [M, K], weight [2*I, K], bias [2*I] or None: the gated GEMM."""
    return dispatcher().gated_gemm(x, weight, epilogue_of(activation, gate_scale, out_scale, clamp, limit), bias)


@gated_gemm_op.register_fake
def _(x, weight, bias, activation, gate_scale, out_scale, clamp, limit):
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


@torch.library.custom_op("swiglu_patch::gated_gemm_low_rank", mutates_args=())
def gated_gemm_low_rank_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x_lr: torch.Tensor,
                           b_lr: torch.Tensor, activation: str, gate_scale: float, out_scale: float, clamp: int,
                           limit: float) -> torch.Tensor:
    """[M, I] from x [M, K], weight [2*I, K], x_lr [M, r], b_lr [2*I, r]: the kernel's low-rank segment."""
    epilogue = epilogue_of(activation, gate_scale, out_scale, clamp, limit)
    return dispatcher().gated_gemm_low_rank(x, weight, x_lr, b_lr, epilogue, bias)[0]


@gated_gemm_low_rank_op.register_fake
def _(x, weight, bias, x_lr, b_lr, activation, gate_scale, out_scale, clamp, limit):
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


# -- training: the backward epilogue in PyTorch (the spec of the kernels' derivative) ----------


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
    where act(gate_scale * gate) > limit. At the bound itself, as the installed torch's clamp does
    (`epilogue.CLIP_GRAD_AT_BOUND`, `MIN_GRAD_AT_BOUND`).

    Args:
        gate, up, dh: [M, I] each, one floating dtype (the caller upcasts 16-bit ones).

    Returns:
        (h, dgate, dup), [M, I] each in that dtype.
    """
    e = epilogue
    g = gate * e.gate_scale if e.gate_scale != 1.0 else gate
    gate_passes = up_passes = None
    if e.limit is not None:
        up_passes = (up >= -e.limit) & (up <= e.limit) if CLIP_GRAD_AT_BOUND else (up > -e.limit) & (up < e.limit)
        up = up.clamp(-e.limit, e.limit)
        if e.clamp == "gate":
            gate_passes = g <= e.limit if MIN_GRAD_AT_BOUND else g < e.limit
            g = g.clamp(max=e.limit)
    a, da = _activation_and_grad(g, e.activation)
    if e.limit is not None and e.clamp == "activation":
        gate_passes = a <= e.limit if MIN_GRAD_AT_BOUND else a < e.limit
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


def declared_mutation(fn, *mutated: int):
    """fn, then autograd's version counter of each argument at the positions `mutated` bumped (those
    not None), as the registered op's ADInplaceOrView kernel does for an argument it declares mutated:
    the kernels write dP over P by pointer, and a second backward through the graph must find the
    saved P changed and raise."""
    def call(*args):
        out = fn(*args)
        for position in mutated:
            if args[position] is not None:
                torch.autograd.graph.increment_version(args[position])
        return out
    return call


def eager_autograd(name: str, doc: str, forward, setup_context, backward, **ctx_functions) -> type:
    """The autograd.Function that eager calls of a registered training op run instead of the op:
    `forward` (the op's own function), the `setup_context` and `backward` registered on the op,
    and each of `ctx_functions` set on ctx over what that setup put there (the backward's own
    registered op: its function called directly, wrapped in `declared_mutation`). It skips
    torch.library's per-call dispatch, whose `fill_defaults` alone walks an op's schema once per
    argument: 56 µs a call for `gated_mlp`'s 14 arguments on the CI machine's CPU."""
    def setup(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        for attr, fn in ctx_functions.items():
            setattr(ctx, attr, fn)

    return type(name, (torch.autograd.Function,), {"__doc__": doc, "forward": staticmethod(forward),
                                                    "setup_context": staticmethod(setup),
                                                    "backward": staticmethod(backward)})


# -- training: the MLP op and its backward ------------------------------------------------------


def _gated_mlp(x: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
               down_weight: torch.Tensor, x_lr: torch.Tensor | None, b_lr: torch.Tensor | None, activation: str,
               gate_scale: float, out_scale: float, clamp: int, limit: float, store_preact: bool, split_at: int,
               return_h: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MLP's first half, and its whole backward: (h [M, I], P [M, 2*I], P_hi, dy_route [M, K])
    for 2-D x [M, K]. P is a 0-element tensor unless store_preact. With split_at (store mode, no
    low-rank segment; `training.preact_split`) P is stored as two tensors that the backward frees
    one at a time: P [M, 2*split_at], the packed columns of h's columns [0, split_at), and P_hi
    [M, 2*(I - split_at)], the rest; else P_hi is a 0-element tensor. dy_route is one element seen
    as [M, K] (strides 0, 0): `GatedMlpDown` takes it and hands dY back through it, so this op's
    backward gets dY and runs every GEMM of the MLP's backward. Wd [K, I] is an input for that
    backward (dH = dY @ Wd and dWd); y = h @ Wd^T + bd is `GatedMlpDown`'s. h is
    differentiable only with return_h (the gradient of adapters on down_proj).
    x_lr [M, r] and b_lr [2*I, r]: the low-rank segment."""
    epilogue = epilogue_of(activation, gate_scale, out_scale, clamp, limit)
    preact_hi = None
    if backend == "triton":
        kernels = dispatcher()
        if split_at:
            lo = 2 * split_at
            h = x.new_empty((x.shape[0], gate_up_weight.shape[0] // 2))
            _, preact = kernels.gated_gemm_with_preact(x, gate_up_weight[:lo], epilogue, _rows(gate_up_bias, 0, lo),
                                                       out=h[:, :split_at])
            _, preact_hi = kernels.gated_gemm_with_preact(x, gate_up_weight[lo:], epilogue,
                                                          _rows(gate_up_bias, lo, None), out=h[:, split_at:])
        elif x_lr is not None:
            h, preact = kernels.gated_gemm_low_rank(x, gate_up_weight, x_lr, b_lr, epilogue, gate_up_bias,
                                                    store_preact)
        elif store_preact:
            h, preact = kernels.gated_gemm_with_preact(x, gate_up_weight, epilogue, gate_up_bias)
        else:
            h, preact = kernels.gated_gemm(x, gate_up_weight, epilogue, gate_up_bias), None
    else:
        acc = _acc_dtype(x.dtype)
        p = F.linear(x, gate_up_weight, gate_up_bias)
        p_acc = p.to(acc) if x_lr is None else p.to(acc) + F.linear(x_lr, b_lr).to(acc)
        gate, up = split_interleaved(p_acc, -1)
        h = epilogue.apply(gate, up).to(x.dtype)
        preact = (p if x_lr is None else p_acc.to(x.dtype)) if store_preact else None
        if split_at:
            preact, preact_hi = p[:, :2 * split_at].clone(), p[:, 2 * split_at:].clone()
    return (h, x.new_empty(0) if preact is None else preact, x.new_empty(0) if preact_hi is None else preact_hi,
            _dy_route(x, down_weight))


def _rows(t: torch.Tensor | None, start: int, stop: int | None) -> torch.Tensor | None:
    return None if t is None else t[start:stop]


gated_mlp_op = torch.library.custom_op("swiglu_patch::gated_mlp", _gated_mlp, mutates_args=())


def _dy_route(x: torch.Tensor, down_weight: torch.Tensor) -> torch.Tensor:
    return x.new_zeros(()).expand(x.shape[0], down_weight.shape[0])


@gated_mlp_op.register_fake
def _(x, gate_up_weight, gate_up_bias, down_weight, x_lr, b_lr, activation, gate_scale, out_scale, clamp, limit,
      store_preact, split_at, return_h, backend):
    m, n = x.shape[0], gate_up_weight.shape[0]
    lo = 2 * split_at if split_at else n
    preact = x.new_empty((m, lo)) if store_preact else x.new_empty(0)
    preact_hi = x.new_empty((m, n - lo)) if split_at else x.new_empty(0)
    return x.new_empty((m, down_weight.shape[1])), preact, preact_hi, _dy_route(x, down_weight)


class GatedMlpDown(torch.autograd.Function):
    """y [M, K] = h @ Wd^T + bd, for h [M, I] from `gated_mlp_op`. It saves nothing: its backward
    hands dY to dy_route (`gated_mlp_op`'s third output, whose backward computes dWd and the rest)
    and gives dbd. Saving nothing is what lets a checkpointed layer's recomputation stop before
    this GEMM: non-reentrant `torch.utils.checkpoint` reruns a forward only until the last tensor
    the backward needs is saved, and `gated_mlp_op` saves them all. An autograd.Function, not a
    registered op: it runs no kernel of ours, and a call costs the host about a fifth of a
    custom op's (10 against 54 µs on the CI machine's CPU); torch.compile traces through it."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, down_weight: torch.Tensor, down_bias: torch.Tensor | None,
                dy_route: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        return F.linear(h, down_weight, down_bias)

    @staticmethod
    def backward(ctx, dy):
        if dy is None:
            return None, None, None, None
        return None, None, _sum_rows(dy) if ctx.needs_input_grad[2] else None, dy


def _gated_mlp_dpreact(dy: torch.Tensor, down_weight: torch.Tensor, preact: torch.Tensor,
                       preact_hi: torch.Tensor | None, dh_in: torch.Tensor | None, activation: str, gate_scale: float,
                       out_scale: float, clamp: int, limit: float, backend: str) -> torch.Tensor:
    """Writes dP over P (`preact`, [M, 2*I]) and returns h [M, I], from dY [M, K], Wd [K, I] and
    an optional further gradient of h, dh_in [M, I] (added to dY @ Wd). With `preact_hi`, P is in
    two tensors (`_gated_mlp`'s split): `preact` [M, 2*s] for h's columns [0, s) and `preact_hi`
    [M, 2*(I - s)] for the rest; dP goes over each."""
    epilogue = epilogue_of(activation, gate_scale, out_scale, clamp, limit)
    if preact_hi is not None:
        s = preact.shape[1] // 2
        h = dy.new_empty((dy.shape[0], down_weight.shape[1]))
        for cols, p in ((slice(0, s), preact), (slice(s, None), preact_hi)):
            dh_cols = None if dh_in is None else dh_in[:, cols]
            if backend == "triton":
                dispatcher().gated_backward(dy, down_weight[:, cols], p, epilogue, dpreact_out=p, h_out=h[:, cols],
                                            dh_in=dh_cols)
            else:
                h[:, cols] = _gated_mlp_dpreact(dy, down_weight[:, cols], p, None, dh_cols, activation, gate_scale,
                                                out_scale, clamp, limit, backend)
        return h
    if backend == "triton":
        _, h = dispatcher().gated_backward(dy, down_weight, preact, epilogue, dpreact_out=preact, dh_in=dh_in)
        return h
    acc = _acc_dtype(dy.dtype)
    gate, up = split_interleaved(preact.to(acc), -1)
    dh = dy.to(acc) @ down_weight.to(acc)
    if dh_in is not None:
        dh = dh + dh_in.to(acc)
    h, dgate, dup = gated_epilogue_grad_reference(gate, up, dh, epilogue)
    preact.copy_(interleave_gate_up(dgate.t(), dup.t()).t())
    return h.to(dy.dtype)


gated_mlp_dpreact_op = torch.library.custom_op("swiglu_patch::gated_mlp_dpreact", _gated_mlp_dpreact,
                                               mutates_args=("preact", "preact_hi"))


@gated_mlp_dpreact_op.register_fake
def _(dy, down_weight, preact, preact_hi, dh_in, activation, gate_scale, out_scale, clamp, limit, backend):
    return dy.new_empty((dy.shape[0], down_weight.shape[1]))


def _setup_context(ctx, inputs, output):
    x, gate_up_weight, gate_up_bias, down_weight, x_lr, b_lr, *epilogue, store_preact, split_at, return_h, backend = inputs
    h, preact, preact_hi, _ = output
    ctx.mark_non_differentiable(preact, preact_hi)
    if not return_h:
        ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)  # no [M, 2*I] of zeros for P's (absent) gradient
    ctx.save_for_backward(x, gate_up_weight, None if store_preact else gate_up_bias, down_weight,
                          preact if store_preact else None, preact_hi if split_at else None, x_lr, b_lr)
    ctx.epilogue_args, ctx.store_preact, ctx.return_h, ctx.backend = tuple(epilogue), store_preact, return_h, backend
    ctx.dpreact = gated_mlp_dpreact_op


def _sum_rows(t: torch.Tensor) -> torch.Tensor:
    """sum over dim 0 in fp32 (or wider), rounded once to t's dtype."""
    return t.sum(0, dtype=_acc_dtype(t.dtype)).to(t.dtype)


def _backward(ctx, dh_in, _dpreact, _dpreact_hi, dy):
    need_x, need_w, need_b, need_wd, need_xlr, need_blr = ctx.needs_input_grad[:6]
    none = (None,) * 9
    if not ctx.return_h:  # h went to the down op only, which gives it no gradient (a traced backward may pass zeros)
        dh_in = None
    if dy is None and dh_in is None:
        return (None,) * 6 + none
    x, gate_up_weight, gate_up_bias, down_weight, preact, preact_hi, x_lr, b_lr = ctx.saved_tensors
    dy = x.new_zeros((x.shape[0], down_weight.shape[0])) if dy is None else dy.contiguous()
    dx = dw = db = dwd = dxlr = dblr = None
    if need_x or need_w or need_b or need_wd or need_xlr or need_blr:
        if not ctx.store_preact:  # recompute: one GEMM (and the low-rank segment's)
            preact = F.linear(x, gate_up_weight, gate_up_bias)
            if x_lr is not None:
                preact = torch.addmm(preact, x_lr, b_lr.t())
        h = ctx.dpreact(dy, down_weight, preact, preact_hi, dh_in, *ctx.epilogue_args, ctx.backend)
        dpreact = preact  # dP now, written over P
        # dWd [K, I] needs h [M, I]; the other GEMMs need dP [M, 2I], alive to the last of them. Either h
        # or dWd lives beside dP, dW and dx at the peak: dWd first (h freed) unless M < K in recompute
        # mode, where dP is this function's own and can be freed before dWd (docs/training.md, "Memory").
        dwd_last = need_wd and not ctx.store_preact and x.shape[0] < down_weight.shape[0]
        if need_wd and not dwd_last:
            dwd = dy.t() @ h
        if not dwd_last:
            del h
        if preact_hi is not None:
            return _backward_split(x, gate_up_weight, dpreact, preact_hi, need_x, need_w, need_b) + (dwd, None, None) + none
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
        if dwd_last:
            del preact, dpreact
            dwd = dy.t() @ h
    return (dx, dw, db, dwd, dxlr, dblr) + none


def _backward_split(x, gate_up_weight, dpreact_lo, dpreact_hi, need_x, need_w, need_b) -> tuple:
    """(dx, dW, db) with dP in two tensors (store mode's split: `_gated_mlp`), the
    order that frees dP_lo [M, 2s] before dx [M, K] is allocated (docs/training.md, "Memory"):
    dW [2I, K] is allocated, its rows [0, 2s) get dP_lo^T x, dx's first part dP_lo @ W[:2s] goes
    into its rows [2s, 2s + M) (not yet written: M <= 2I - 2s), dP_lo's storage is freed (a saved
    tensor, so by resizing it to 0 bytes; a second backward through the graph raises first, on P's
    bumped version), dx = that part + dP_hi @ W[2s:] is allocated, and dW's rows [2s, 2I) get
    dP_hi^T x over the part. dx is rounded twice (the part, then the sum), as eager's
    dx_gate + dx_up is."""
    dx = dw = db = None
    lo, m = dpreact_lo.shape[1], x.shape[0]
    if need_b:
        db = torch.cat((_sum_rows(dpreact_lo), _sum_rows(dpreact_hi)))
    if need_w:
        dw = gate_up_weight.new_empty(gate_up_weight.shape)
        torch.mm(dpreact_lo.t(), x, out=dw[:lo])
    if need_x:
        part = torch.mm(dpreact_lo, gate_up_weight[:lo], out=dw[lo:lo + m] if need_w else None)
        dpreact_lo.untyped_storage().resize_(0)
        if need_w:
            dx = torch.addmm(part, dpreact_hi, gate_up_weight[lo:])
        else:
            dx = part.addmm_(dpreact_hi, gate_up_weight[lo:])
    if need_w:
        torch.mm(dpreact_hi.t(), x, out=dw[lo:])
    return dx, dw, db


gated_mlp_op.register_autograd(_backward, setup_context=_setup_context)


GatedMlp = eager_autograd(
    "GatedMlp", "`gated_mlp_op` for eager calls (`eager_autograd`): `_gated_mlp`, `_setup_context` and "
    "`_backward`, whose backward GEMM runs as `_gated_mlp_dpreact` with P's version bumped.",
    _gated_mlp, _setup_context, _backward, dpreact=declared_mutation(_gated_mlp_dpreact, 2, 3))


def gated_mlp_autograd(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gated_mlp_op`'s arguments and outputs, differentiable: `GatedMlp` for eager calls on the
    kernels; the registered op while torch.compile traces (one opaque op, its backward registered)
    and for backend "torch" (the reference, whose PyTorch temporaries the op's boundary keeps out
    of what `tests/training/test_backward_memory.py` counts, as the kernels have none)."""
    if torch.compiler.is_compiling() or args[-1] != "triton":
        return gated_mlp_op(*args)
    return GatedMlp.apply(*args)
