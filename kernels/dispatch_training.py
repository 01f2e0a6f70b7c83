"""Training's entry points to the kernels, chosen by the rules the way `dispatch.gated_gemm` chooses.

- `gated_gemm_with_preact`: `gated_gemm` that also stores the pre-activation P for the
  backward (the pointer and TMA kernels' STORE_PREACT).
- `gated_backward`: the backward GEMM dY @ Wd with the gated derivative in its epilogue, chosen
  from `rules.BACKWARD_RULES`; `explain_backward` says which rule.
- `gated_gemm_low_rank`: the gated GEMM with a low-rank segment (LoRA adapters of gate and up,
  `swiglu_patch.low_rank`) accumulated into the same tile, optionally storing P.

Plans are cached per call signature in plain-value tables (launchers, no tensors), as in `dispatch`.
"""

from __future__ import annotations

import dataclasses

import torch

from . import gated_backward_pointer, gated_backward_tma, gated_gemm_tma
from .configs import GatedGemmConfig, m_bucket
from .device import interpreting
from .dispatch import (
    _DTYPES, _MODULES, CallKey, _call_key, _fit_dtype, _known_capability, candidates, check_operands,
    mismatch, resolve_approx_tanh,
)
from .epilogue import GatedEpilogue
from .rules import BACKWARD_RULES, DEFAULT_CONFIGS, LOW_RANK_KERNELS, PREACT_KERNELS


_BACKWARD_MODULES = {"backward_pointer": gated_backward_pointer, "backward_tma": gated_backward_tma}
# (CallKey, has_bias, epilogue, approx_tanh, tf32) -> ((can_run, launcher), ...): STORE_PREACT plans.
_PREACT_PLANS: dict[tuple, tuple] = {}
# (CallKey, epilogue, approx_tanh, tf32) -> ((can_run, launcher), ...): backward plans.
_BACKWARD_PLANS: dict[tuple, tuple] = {}
# (CallKey, has_bias, epilogue, approx_tanh, tf32, store_preact) -> ((can_run, launcher), ...): low-rank plans.
_LOW_RANK_PLANS: dict[tuple, object] = {}


def _check_out(fn: str, name: str, t: torch.Tensor, shape: tuple, like: torch.Tensor) -> None:
    if tuple(t.shape) != shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{fn}: {name} must be {list(shape)} ({like.dtype} on {like.device}), got "
                         f"{list(t.shape)} ({t.dtype} on {t.device})")


def gated_gemm_with_preact(
    x: torch.Tensor,
    weight: torch.Tensor,
    epilogue: GatedEpilogue | str = "silu",
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    preact_out: torch.Tensor | None = None,
    config: GatedGemmConfig | None = None,
    kernel: str = "auto",
    approx_tanh: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_gemm` that also stores the pre-activation P = x @ W^T + b, for the backward.

    Args:
        x, weight, epilogue, bias, out, approx_tanh: as `gated_gemm`.
        preact_out: optional [M, 2*I] tensor (x's dtype and device, any strides) for P, in the
            packed weight's interleaved column order; allocated if None.
        config: a launch config for `kernel` (None: the rule's, or the bucket's pointer rule).
        kernel: "auto" (the first rule of `rules.RULES` whose kernel has a STORE_PREACT path,
            "pointer" or "tma", and can run the call), or one of those two.

    Returns:
        (out [M, I], preact [M, 2*I]), x's dtype; P rounded once, before scales and clamps.

    Raises:
        ValueError, TypeError: operands the kernels cannot take.
    """
    fn = "gated_gemm_with_preact"
    check_operands(fn, x, weight, bias)
    epilogue = GatedEpilogue.of(epilogue)
    m, n = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty((m, n // 2), dtype=x.dtype, device=x.device)
    _check_out(fn, "out", out, (m, n // 2), x)
    if preact_out is None:
        preact_out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _check_out(fn, "preact_out", preact_out, (m, n), x)
    if m == 0:
        return out, preact_out
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    approx_tanh = resolve_approx_tanh(x, approx_tanh, fn)
    if kernel == "auto" and config is None:
        captured = x.is_cuda and torch.cuda.is_current_stream_capturing()
        key = _call_key(x, n // 2, captured)
        tf32 = key.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
        cache_key = (key, bias is not None, epilogue, approx_tanh, tf32)
        plan = _PREACT_PLANS.get(cache_key)
        if plan is None:
            epi = dict(epilogue.constexprs(), APPROX_TANH=approx_tanh)
            plan = _PREACT_PLANS[cache_key] = tuple(
                (_MODULES[r.kernel].can_run, _MODULES[r.kernel].make_launcher(
                    _fit_dtype(r.config, key.dtype), epi, bias is not None, key.dtype, True))
                for _, r in candidates(key) if r.kernel in PREACT_KERNELS)
        for can_run, launch in plan:
            if can_run(x, weight, out, preact_out):
                launch(x, weight, bias, out, preact_out)
                return out, preact_out
        raise AssertionError("rules.RULES ends with pointer rules that match every call")  # unreachable
    module, config = _forced_forward(fn, kernel, config, x, weight, out, preact_out)
    epi = dict(epilogue.constexprs(), APPROX_TANH=approx_tanh)
    module.make_launcher(config, epi, bias is not None, x.dtype, True)(x, weight, bias, out, preact_out)
    return out, preact_out


_CAN_RUN_NEEDS = {
    "tma": "bf16/fp16 tensors with unit inner strides, 16-byte-aligned rows and I % 16 == 0",
    "gemv": "M == 1, I % 16 == 0 and no stored pre-activation",
}


def _forced_forward(fn: str, kernel: str, config: GatedGemmConfig | None, x: torch.Tensor, weight: torch.Tensor,
                    *outputs_and_low_rank: torch.Tensor | None,
                    kernels: tuple[str, ...] = PREACT_KERNELS) -> tuple[object, GatedGemmConfig]:
    """(kernel module, config fitted to x's dtype) for a call that names its forward kernel, one of
    `kernels`; config None takes that kernel's rule for the call's shape (the GEMV's default
    config where no rule has one)."""
    if kernel not in kernels:
        what = "the kernels that store the pre-activation" if kernels == PREACT_KERNELS else "those with the segment"
        raise ValueError(f"{fn}: kernel must be 'auto' or one of {kernels} ({what}), got {kernel!r}")
    module = _MODULES[kernel]
    if not module.can_run(x, weight, *outputs_and_low_rank):
        raise ValueError(f"{fn}: kernel={kernel!r} needs {_CAN_RUN_NEEDS[kernel]}; got x {tuple(x.shape)} {x.dtype}, "
                         f"weight {tuple(weight.shape)}; use kernel='auto'")
    if config is None:
        m_rule = max(x.shape[0], 65) if kernel == "tma" else x.shape[0]
        key = dataclasses.replace(_call_key(x, weight.shape[0] // 2, False, m_rule), capability=(9, 0), gpu="")
        config = next((r.config for _, r in candidates(key) if r.kernel == kernel and not r.gpus),
                      DEFAULT_CONFIGS.get(kernel))
    return module, _fit_dtype(config, x.dtype)


def check_backward_operands(fn: str, dy: torch.Tensor, down_weight: torch.Tensor, preact: torch.Tensor) -> None:
    """Raise an error naming the problem and the fix for backward operands the kernels cannot take."""
    if down_weight.dim() != 2:
        raise ValueError(f"{fn}: the down weight must be [K, I], got shape {tuple(down_weight.shape)}")
    k, i = down_weight.shape
    if dy.dim() != 2 or dy.shape[1] != k:
        raise ValueError(f"{fn}: dy must be [M, {k}] (the down weight's K), got shape {tuple(dy.shape)}")
    if preact.dim() != 2 or tuple(preact.shape) != (dy.shape[0], 2 * i):
        raise ValueError(f"{fn}: preact must be [M, 2*I] = [{dy.shape[0]}, {2 * i}], got shape {tuple(preact.shape)}")
    if dy.dtype not in _DTYPES:
        raise TypeError(f"{fn}: the Triton kernels take bfloat16, float16 or float32, got {dy.dtype}")
    for name, t in (("down weight", down_weight), ("preact", preact)):
        if t.dtype != dy.dtype or t.device != dy.device:
            raise TypeError(f"{fn}: the {name} must match dy's dtype and device ({dy.dtype} on {dy.device}), got "
                            f"{t.dtype} on {t.device}; cast one with .to()")
    if dy.dtype == torch.bfloat16 and not dy.is_cuda and interpreting():
        raise TypeError(f"{fn}: Triton's CPU interpreter computes bfloat16 matrix products wrongly; run bf16 on "
                        "the GPU or use float16/float32 with TRITON_INTERPRET=1")


def gated_backward(
    dy: torch.Tensor,
    down_weight: torch.Tensor,
    preact: torch.Tensor,
    epilogue: GatedEpilogue | str = "silu",
    dpreact_out: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None,
    config: GatedGemmConfig | None = None,
    kernel: str = "auto",
    approx_tanh: bool | None = None,
    dh_in: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated MLP's backward GEMM: dH = dY @ Wd with the epilogue's derivative fused in.

    For y = epilogue(P) @ Wd^T (+ bd), P = x @ W^T + b the interleaved pre-activation:
    dP = (dH * dh/dgate, dH * dh/dup) interleaved as P, and h = epilogue(P) (what dWd = dY^T @ h
    needs); dH stays in registers (`gated_backward_pointer.py` has the layout and rounding).

    Args:
        dy: [M, K] gradient of the MLP's output, any strides; bf16/fp16/fp32 (bf16 only on the GPU).
        down_weight: Wd, [K, I] (nn.Linear's [out, in]), dy's dtype and device, any strides.
        preact: P, [M, 2*I], dy's dtype, any strides (as `gated_gemm_with_preact` stores it).
        epilogue: the forward's `GatedEpilogue` (or activation name).
        dpreact_out: where dP goes, [M, 2*I]; may be `preact` itself (in place: saves M * 2*I
            elements); None allocates it.
        h_out: where h goes, [M, I]; None allocates it.
        config, kernel: a launch config and the kernel it is for ("auto", or one of
            `rules.BACKWARD_KERNELS`: "backward_pointer", "backward_tma").
        approx_tanh: silu and gelu_tanh through `tanh.approx.f32`; None: `default_approx_tanh`.
        dh_in: optional [M, I] further gradient of h (dy's dtype, any strides), added to dY @ Wd
            before the derivative (LoRA on the down projection).

    Returns:
        (dpreact [M, 2*I], h [M, I]) in dy's dtype.

    Raises:
        ValueError, TypeError: operands the kernels cannot take (the message names the fix).
    """
    fn = "gated_backward"
    check_backward_operands(fn, dy, down_weight, preact)
    epilogue = GatedEpilogue.of(epilogue)
    m, i = dy.shape[0], down_weight.shape[1]
    if dpreact_out is None:
        dpreact_out = torch.empty_like(preact, memory_format=torch.contiguous_format)
    _check_out(fn, "dpreact_out", dpreact_out, (m, 2 * i), dy)
    if h_out is None:
        h_out = torch.empty((m, i), dtype=dy.dtype, device=dy.device)
    _check_out(fn, "h_out", h_out, (m, i), dy)
    if m == 0:
        return dpreact_out, h_out
    approx_tanh = resolve_approx_tanh(dy, approx_tanh, fn)
    args = (dy, down_weight, preact, dpreact_out, h_out)
    has_dh_in = dh_in is not None
    if has_dh_in:
        _check_out(fn, "dh_in", dh_in, (m, i), dy)
    if kernel == "auto" and config is None:
        captured = dy.is_cuda and torch.cuda.is_current_stream_capturing()
        key = _call_key(dy, i, captured)
        tf32 = key.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
        cache_key = (key, epilogue, approx_tanh, tf32, has_dh_in)
        plan = _BACKWARD_PLANS.get(cache_key)
        if plan is None:
            epi = dict(epilogue.constexprs(), APPROX_TANH=approx_tanh)
            plan = _BACKWARD_PLANS[cache_key] = tuple(
                (_BACKWARD_MODULES[r.kernel].can_run, _BACKWARD_MODULES[r.kernel].make_launcher(
                    _fit_dtype(r.config, key.dtype), epi, key.dtype, has_dh_in))
                for r in BACKWARD_RULES if mismatch(r, key) is None)
        for can_run, launch in plan:
            if can_run(*args, dh_in):
                gated_gemm_tma.ensure_allocator()  # the TMA kernel's device-built descriptors
                launch(*args, dh_in)
                return dpreact_out, h_out
        raise AssertionError("rules.BACKWARD_RULES ends with pointer rules that match every call")  # unreachable
    if kernel not in _BACKWARD_MODULES:
        raise ValueError(f"{fn}: kernel must be 'auto' or one of {tuple(_BACKWARD_MODULES)}, got {kernel!r}")
    module = _BACKWARD_MODULES[kernel]
    if not module.can_run(*args, dh_in):
        raise ValueError(f"{fn}: kernel={kernel!r} needs bf16/fp16 tensors with unit inner strides, 16-byte-aligned "
                         f"rows and I % 16 == 0; got dy {tuple(dy.shape)} {dy.dtype}, I = {i}; use kernel='auto'")
    if config is None:
        key = dataclasses.replace(_call_key(dy, i, False, max(m, 129)), capability=(9, 0), gpu="")
        config = next(r.config for r in BACKWARD_RULES if r.kernel == kernel and mismatch(r, key) is None)
    config = _fit_dtype(config, dy.dtype)
    epi = dict(epilogue.constexprs(), APPROX_TANH=approx_tanh)
    gated_gemm_tma.ensure_allocator()
    module.make_launcher(config, epi, dy.dtype, has_dh_in)(*args, dh_in)
    return dpreact_out, h_out


def explain_backward(gpu: str, dtype: torch.dtype, m: int, k: int, i: int, captured: bool = False,
                     capability_: tuple[int, int] | None = None, tma_aligned: bool = True) -> str:
    """Which rule of `rules.BACKWARD_RULES` a backward call takes and why every earlier rule did not."""
    cap = capability_ or _known_capability(gpu)
    key = CallKey(gpu, cap, dtype, m_bucket(m), k, i, captured)
    lines = [f"backward call: {gpu}, capability {cap}, {str(dtype).replace('torch.', '')}, M={m}, K={k}, I={i}"]
    for n, rule in enumerate(BACKWARD_RULES):
        why_not = mismatch(rule, key)
        runs = rule.kernel != "backward_tma" or (dtype in (torch.bfloat16, torch.float16) and i % 16 == 0
                                                 and tma_aligned)
        if why_not is None and not runs:
            why_not = f"matches, but the {rule.kernel} kernel cannot run these tensors"
        if why_not is not None:
            lines.append(f"  rule {n:2d} {rule.kernel:16s} skipped: {why_not}")
            continue
        lines.append(f"  rule {n:2d} {rule.kernel:16s} CHOSEN: {_fit_dtype(rule.config, dtype).short()}")
        lines.append(f"  why: {rule.why}")
        return "\n".join(lines)
    raise AssertionError("rules.BACKWARD_RULES ends with pointer rules that match every call")  # unreachable


def check_low_rank_operands(fn: str, x: torch.Tensor, weight: torch.Tensor, x_lr: torch.Tensor,
                            b_lr: torch.Tensor) -> None:
    """Raise an error naming the problem and the fix for low-rank operands the kernel cannot take."""
    if x_lr.dim() != 2 or x_lr.shape[0] != x.shape[0] or x_lr.shape[1] == 0:
        raise ValueError(f"{fn}: x_lr must be [M, r] = [{x.shape[0]}, r] with r >= 1, got shape {tuple(x_lr.shape)}")
    if b_lr.dim() != 2 or tuple(b_lr.shape) != (weight.shape[0], x_lr.shape[1]):
        raise ValueError(f"{fn}: b_lr must be [2*I, r] = [{weight.shape[0]}, {x_lr.shape[1]}], got shape "
                         f"{tuple(b_lr.shape)}")
    for name, t in (("x_lr", x_lr), ("b_lr", b_lr)):
        if t.dtype != x.dtype or t.device != x.device:
            raise TypeError(f"{fn}: {name} must match x's dtype and device ({x.dtype} on {x.device}), got "
                            f"{t.dtype} on {t.device}; cast it with .to()")


def gated_gemm_low_rank(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_lr: torch.Tensor,
    b_lr: torch.Tensor,
    epilogue: GatedEpilogue | str = "silu",
    bias: torch.Tensor | None = None,
    store_preact: bool = False,
    approx_tanh: bool | None = None,
    out: torch.Tensor | None = None,
    preact_out: torch.Tensor | None = None,
    config: GatedGemmConfig | None = None,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated GEMM over [x | x_lr] against [W | b_lr], neither concatenated (LoRA's update).

        P = x @ W^T + x_lr @ b_lr^T + b,   out = epilogue(gate(P), up(P))

    Runs the low-rank segment of the first rule of `rules.RULES` whose kernel has one ("gemv",
    "pointer" or "tma", `rules.LOW_RANK_KERNELS`; the GEMV only without store_preact) and can
    run the call: the TMA kernel needs x_lr and b_lr TMA-aligned too (r % 8 == 0 for 16-bit
    contiguous operands).

    Args:
        x: [M, K]; weight: [2*I, K] interleaved; bias: [2*I] or None (as `gated_gemm`).
        x_lr: [M, r] low-rank input, x's dtype, any strides.
        b_lr: [2*I, r] low-rank weight in the packed row layout, x's dtype, any strides.
        epilogue, approx_tanh: as `gated_gemm`.
        store_preact: also return P [M, 2*I] (x's dtype, interleaved, rounded once), for the backward.
        out, preact_out: optional [M, I] and [M, 2*I] tensors to write (x's dtype, any strides);
            allocated if None (preact_out only with store_preact).
        config, kernel: as `gated_gemm_with_preact`; kernel may also be "gemv" (M = 1, no store_preact).

    Returns:
        (out [M, I], P or None) in x's dtype.

    Raises:
        ValueError, TypeError: operands the kernel cannot take (the message names the fix).
    """
    fn = "gated_gemm_low_rank"
    check_operands(fn, x, weight, bias)
    check_low_rank_operands(fn, x, weight, x_lr, b_lr)
    if type(epilogue) is not GatedEpilogue:
        epilogue = GatedEpilogue.of(epilogue)
    m, n = x.shape[0], weight.shape[0]
    if out is None:
        out = x.new_empty((m, n >> 1))
    _check_out(fn, "out", out, (m, n >> 1), x)
    preact = None
    if store_preact:
        preact = x.new_empty((m, n)) if preact_out is None else preact_out
        _check_out(fn, "preact_out", preact, (m, n), x)
    if m == 0:
        return out, preact
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    approx = resolve_approx_tanh(x, approx_tanh, fn)
    if kernel != "auto" or config is not None:
        module, config = _forced_forward(fn, "pointer" if kernel == "auto" else kernel, config, x, weight, out,
                                         preact, x_lr, b_lr,
                                         kernels=PREACT_KERNELS if store_preact else LOW_RANK_KERNELS)
        epi = dict(epilogue.constexprs(), APPROX_TANH=approx)
        module.make_launcher(config, epi, bias is not None, x.dtype, store_preact, low_rank=True)(
            x, weight, bias, out, preact, x_lr, b_lr)
        return out, preact
    captured = x.is_cuda and torch.cuda.is_current_stream_capturing()
    key = _call_key(x, n >> 1, captured)
    tf32 = key.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    cache_key = (key, bias is not None, epilogue, approx, tf32, store_preact)
    plan = _LOW_RANK_PLANS.get(cache_key)
    if plan is None:
        epi = dict(epilogue.constexprs(), APPROX_TANH=approx)
        plan = _LOW_RANK_PLANS[cache_key] = tuple(
            (_MODULES[r.kernel].can_run, _MODULES[r.kernel].make_launcher(
                _fit_dtype(r.config, key.dtype), epi, bias is not None, key.dtype, store_preact, low_rank=True))
            for _, r in candidates(key) if r.kernel in (PREACT_KERNELS if store_preact else LOW_RANK_KERNELS))
    for can_run, launch in plan:
        if can_run(x, weight, out, preact, x_lr, b_lr):
            launch(x, weight, bias, out, preact, x_lr, b_lr)
            return out, preact
    raise AssertionError("rules.RULES ends with pointer rules that match every call")  # unreachable
