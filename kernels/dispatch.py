"""`gated_gemm`: the one entry point to the kernels, choosing a named kernel by `rules.RULES`.

    out[M, I] = epilogue(x @ Wg^T + bg, x @ Wu^T + bu)        (layout: `layout.py`)

For a call, the candidates are the rules that match its device, M, K, I and capture state, in
table order; the first whose kernel can run the call's tensors launches. The candidate list
and each kernel's launch keywords are built once per (device, dtype, K, I, M bucket, captured,
bias, epilogue) and kept in a small table of plain values (no tensors), so a call costs the
argument checks, one dictionary lookup and the launch. Every rule bound on M is at a bucket
edge (`configs.m_bucket`: powers of two, and one past them), which a test checks, so one
entry per bucket is exact.

`explain(...)` says which rule a call takes and why each earlier rule did not match
(`swiglu-patch explain` on the command line).

Training (the section at the end): `gated_gemm_with_preact` also stores the pre-activation
for the backward (the pointer and TMA kernels' STORE_PREACT), and `gated_backward` runs the
backward GEMM dY @ Wd with the gated derivative in its epilogue, chosen from
`rules.BACKWARD_RULES` the same way; `explain_backward` says which rule.
"""

from __future__ import annotations

import dataclasses

import torch

from . import (
    gated_backward_pointer, gated_backward_tma, gated_gemm_pointer, gated_gemm_tma, gated_gemm_tma_grid, gated_gemv,
)
from .configs import GatedGemmConfig, m_bucket
from .device import capability, gpu_name, interpreting
from .epilogue import GatedEpilogue
from .rules import BACKWARD_RULES, DEFAULT_CONFIGS, KERNELS, PREACT_KERNELS, RULES, Rule

_MODULES = {"gemv": gated_gemv, "pointer": gated_gemm_pointer, "grid": gated_gemm_tma_grid, "tma": gated_gemm_tma}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class CallKey:
    """What the choice of kernel depends on, apart from the tensors' alignment."""

    gpu: str  # CUDA device name, or "cpu"
    capability: tuple[int, int] | None
    dtype: torch.dtype
    m: int
    k: int
    i: int
    captured: bool


def _within(value: int, bounds: tuple[int | None, int | None]) -> bool:
    low, high = bounds
    return (low is None or value >= low) and (high is None or value <= high)


def mismatch(rule: Rule, key: CallKey) -> str | None:
    """Why `rule` does not match the call `key`, or None if it does."""
    if rule.captured is not None and rule.captured != key.captured:
        return "only for calls captured into a CUDA graph" if rule.captured else "not for captured calls"
    if rule.gpus and not any(g in key.gpu for g in rule.gpus):
        return f"GPU {key.gpu!r} is not one of {', '.join(rule.gpus)}"
    if rule.min_capability and (key.capability is None or key.capability < rule.min_capability):
        return f"needs compute capability {'.'.join(map(str, rule.min_capability))}+, this is {key.capability or 'no GPU'}"
    for name, bounds in (("M", rule.m), ("K", rule.k), ("I", rule.i)):
        value = getattr(key, name.lower())
        if not _within(value, bounds):
            return f"{name} = {value} is outside {bounds[0] or ''}..{bounds[1] or ''}"
    return None


def _fit_dtype(config: GatedGemmConfig, dtype: torch.dtype) -> GatedGemmConfig:
    """fp32 tiles take twice the shared memory: halve block_k."""
    return dataclasses.replace(config, block_k=max(16, config.block_k // 2)) if dtype == torch.float32 else config


def candidates(key: CallKey) -> list[tuple[int, Rule]]:
    """(index, rule) of every rule matching `key`, in table order."""
    return [(n, r) for n, r in enumerate(RULES) if mismatch(r, key) is None]


# Per call signature (see `_signature`) the candidates' (can_run or None, launcher), in rule order.
# Plain values only: predicates and launchers (closures over configs and constexprs), no tensors.
_PLANS: dict[tuple, tuple] = {}
_BUCKETS = [m_bucket(m) for m in range(8193)]


def _signature(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, epilogue: GatedEpilogue,
               approx_tanh: bool | None) -> tuple:
    """Everything the plan and the argument checks depend on, as one hashable tuple: a call whose
    signature was seen before needs neither again."""
    m, k = x.shape
    return (x.dtype, x.device, _BUCKETS[m] if m <= 8192 else 8192, k, weight.dtype,
            weight.device, weight.shape, None if bias is None else (bias.dtype, bias.device, bias.shape), epilogue,
            approx_tanh, x.is_cuda and torch.cuda.is_current_stream_capturing(),
            x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32)


def _build_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, epilogue: GatedEpilogue,
                approx_tanh: bool | None, captured: bool) -> tuple:
    check_operands("gated_gemm", x, weight, bias)
    approx = _approx_tanh(x, approx_tanh)
    epi = dict(epilogue.constexprs(), APPROX_TANH=approx)
    plan = []
    for _, rule in candidates(_call_key(x, weight.shape[0] // 2, captured)):
        config = _fit_dtype(rule.config, x.dtype)
        module = _MODULES[rule.kernel]
        plan.append((None if module is gated_gemm_pointer else module.can_run,
                     module.make_launcher(config, epi, bias is not None, x.dtype)))
    return tuple(plan)


def _call_key(x: torch.Tensor, i: int, captured: bool, m: int | None = None) -> CallKey:
    m = m_bucket(x.shape[0] if m is None else m)
    if x.is_cuda:
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        return CallKey(gpu_name(index), capability(index), x.dtype, m, x.shape[1], i, captured)
    return CallKey("cpu", None, x.dtype, m, x.shape[1], i, captured)


def default_approx_tanh(x: torch.Tensor) -> bool:
    """Whether silu and gelu_tanh take `tanh.approx.f32` by default: for bf16/fp16 x on the GPU.
    Its error (at most 2^-11 of tanh) is below a 16-bit output's rounding; fp32 keeps exp and a
    reciprocal, and the CPU interpreter runs no inline PTX."""
    return x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda and not interpreting()


def check_operands(fn: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise an error naming the problem and the fix for operands the kernels cannot take."""
    if weight.dim() != 2 or weight.shape[0] % 2 or weight.shape[0] == 0:
        raise ValueError(f"{fn}: the packed weight must be [2*I, K] with I >= 1, got shape {tuple(weight.shape)}")
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{fn}: x must be [M, {weight.shape[1]}] (the weight's K), got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{fn}: the Triton kernels take floating-point tensors in bfloat16, float16 or float32, got "
                        f"{x.dtype}; cast x and the weight, or use backend='torch'")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise TypeError(f"{fn}: the weight must match x's dtype and device ({x.dtype} on {x.device}), got "
                        f"{weight.dtype} on {weight.device}; cast one with .to()")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != x.dtype
                             or bias.device != x.device):
        raise ValueError(f"{fn}: the bias must be [{weight.shape[0]}] ({x.dtype} on {x.device}), got "
                         f"{tuple(bias.shape)} ({bias.dtype} on {bias.device})")
    if x.dtype == torch.bfloat16 and not x.is_cuda and interpreting():
        raise TypeError(f"{fn}: Triton's CPU interpreter computes bfloat16 matrix products wrongly; run bf16 on "
                        "the GPU, use float16/float32 with TRITON_INTERPRET=1, or use backend='torch'")


def gated_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    epilogue: GatedEpilogue | str = "silu",
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: GatedGemmConfig | None = None,
    kernel: str = "auto",
    approx_tanh: bool | None = None,
) -> torch.Tensor:
    """Launch the fused gated GEMM on 2-D x.

    Args:
        x: [M, K], any strides, bf16/fp16/fp32 (bf16 only on the GPU).
        weight: [2*I, K] interleaved gate/up weight (`layout.py`), x's dtype and device, any strides.
        epilogue: a `GatedEpilogue`, or an activation name for the plain act(gate) * up.
        bias: optional [2*I] interleaved bias, x's dtype, any strides (copied if not contiguous).
        out: optional [M, I] output to write (any strides); allocated if None.
        config: a launch config for `kernel` (None: the rule's, or the named kernel's default).
        kernel: "auto" (the first rule of `rules.RULES` that matches and can run the call), or
            one of `rules.KERNELS` to force it (ValueError if it cannot run these tensors).
        approx_tanh: silu and gelu_tanh through PTX `tanh.approx.f32`; None: `default_approx_tanh`.

    Returns:
        out, [M, I] in x's dtype.

    Raises:
        ValueError, TypeError: operands the kernels cannot take (the message names the fix).
    """
    if type(epilogue) is not GatedEpilogue:
        epilogue = GatedEpilogue.of(epilogue)
    if kernel != "auto" or config is not None or x.dim() != 2:
        check_operands("gated_gemm", x, weight, bias)
        return _forced(x, weight, bias, out, epilogue, _approx_tanh(x, approx_tanh), config, kernel)
    signature = _signature(x, weight, bias, epilogue, approx_tanh)
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS[signature] = _build_plan(x, weight, bias, epilogue, approx_tanh, signature[-2])
    m = x.shape[0]
    if out is None:
        out = x.new_empty((m, weight.shape[0] >> 1))
    if m == 0:
        return out
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    for can_run, launch in plan:
        if can_run is None or can_run(x, weight, out):
            return launch(x, weight, bias, out)
    raise AssertionError("rules.RULES ends with pointer rules that match every call")  # unreachable


def _approx_tanh(x: torch.Tensor, approx_tanh: bool | None) -> bool:
    if approx_tanh is None:
        return default_approx_tanh(x)
    if approx_tanh and interpreting():
        raise ValueError("gated_gemm: approx_tanh=True needs the GPU (inline PTX `tanh.approx.f32`), which "
                         "Triton's CPU interpreter cannot run; pass approx_tanh=None or False")
    return approx_tanh


def _forced(x, weight, bias, out, epilogue, approx_tanh, config, kernel) -> torch.Tensor:
    """A call that names its kernel or its config (checked arguments; no plan cache)."""
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0] // 2), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    if kernel == "auto":
        raise ValueError(f"gated_gemm: a config needs the kernel it is for: pass kernel= one of {KERNELS}")
    if kernel not in _MODULES:
        raise ValueError(f"gated_gemm: kernel must be 'auto' or one of {KERNELS}, got {kernel!r}")
    module = _MODULES[kernel]
    if not module.can_run(x, weight, out):
        need = {"gemv": "M == 1 and I % 16 == 0",
                "grid": "bf16/fp16 tensors with unit inner strides, 16-byte-aligned rows and I % 16 == 0",
                "tma": "bf16/fp16 tensors with unit inner strides, 16-byte-aligned rows and I % 16 == 0"}[kernel]
        raise ValueError(f"gated_gemm: kernel={kernel!r} needs {need}; got x {tuple(x.shape)} {x.dtype}, "
                         f"weight {tuple(weight.shape)}; use kernel='auto'")
    if config is None:
        config = DEFAULT_CONFIGS.get(kernel)
        if config is None:  # pointer, tma: the bucket rule for this M (tma: for M >= 65, its least)
            m = max(x.shape[0], 65) if kernel == "tma" else x.shape[0]
            key = dataclasses.replace(_call_key(x, weight.shape[0] // 2, False, m), capability=(9, 0), gpu="")
            config = next(r.config for _, r in candidates(key) if r.kernel == kernel and not r.gpus)
        config = _fit_dtype(config, x.dtype)
    epi = dict(epilogue.constexprs(), APPROX_TANH=approx_tanh)
    return module.make_launcher(config, epi, bias is not None, x.dtype)(x, weight, bias, out)


def choose(gpu: str, dtype: torch.dtype, m: int, k: int, i: int, captured: bool = False,
           capability_: tuple[int, int] | None = None, tma_aligned: bool = True) -> tuple[int, Rule, GatedGemmConfig]:
    """(rule index, rule, config) a call takes: what `gated_gemm` runs, computed without tensors.

    gpu: the CUDA device name ("cpu" for the interpreter); capability_: its compute capability
    (None: 9.0 for names with H100/H200/H20, else none); tma_aligned: whether x, the weight and
    out meet the TMA kernels' alignment (16-bit dtype and I % 16 are checked here).
    """
    key = CallKey(gpu, capability_ or _known_capability(gpu), dtype, m, k, i, captured)
    for n, rule in candidates(key):
        if _runs(rule.kernel, dtype, m, i, tma_aligned):
            return n, rule, _fit_dtype(rule.config, dtype)
    raise AssertionError("rules.RULES ends with pointer rules that match every call")  # unreachable


def _known_capability(gpu: str) -> tuple[int, int] | None:
    return (9, 0) if any(h in gpu for h in ("H100", "H200", "H20", "GH200")) else None


def _runs(kernel: str, dtype: torch.dtype, m: int, i: int, tma_aligned: bool) -> bool:
    if kernel == "gemv":
        return m == 1 and i % 16 == 0
    if kernel in ("grid", "tma"):
        return dtype in (torch.bfloat16, torch.float16) and i % 16 == 0 and tma_aligned
    return True


def explain(gpu: str, dtype: torch.dtype, m: int, k: int, i: int, captured: bool = False,
            capability_: tuple[int, int] | None = None, tma_aligned: bool = True) -> str:
    """Which rule a call takes and why every earlier rule did not, as text (see `choose`)."""
    cap = capability_ or _known_capability(gpu)
    key = CallKey(gpu, cap, dtype, m, k, i, captured)
    lines = [f"call: {gpu}, capability {cap}, {str(dtype).replace('torch.', '')}, M={m}, "
             f"K={k}, I={i}, {'captured into a CUDA graph' if captured else 'eager'}"]
    for n, rule in enumerate(RULES):
        why_not = mismatch(rule, key)
        if why_not is None and not _runs(rule.kernel, dtype, m, i, tma_aligned):
            why_not = f"matches, but the {rule.kernel} kernel cannot run these tensors"
        if why_not is not None:
            lines.append(f"  rule {n:2d} {rule.kernel:7s} skipped: {why_not}")
            continue
        config = _fit_dtype(rule.config, dtype)
        lines.append(f"  rule {n:2d} {rule.kernel:7s} CHOSEN: {config.short()}"
                     + (" (fp32: block_k halved)" if dtype == torch.float32 else ""))
        lines.append(f"  why: {rule.why}")
        if rule.sweep:
            lines.append(f"  measured in: {', '.join('benchmarks/results/' + s for s in rule.sweep)}")
        return "\n".join(lines)
    raise AssertionError("rules.RULES ends with pointer rules that match every call")  # unreachable


# ===================================================================================== #
# Training: the forward that keeps the pre-activation, and the backward GEMM.            #
# ===================================================================================== #

_BACKWARD_MODULES = {"backward_pointer": gated_backward_pointer, "backward_tma": gated_backward_tma}
# (CallKey, has_bias, epilogue, approx_tanh, tf32) -> ((can_run, launcher), ...): STORE_PREACT plans.
_PREACT_PLANS: dict[tuple, tuple] = {}
# (CallKey, epilogue, approx_tanh, tf32) -> ((can_run, launcher), ...): backward plans.
_BACKWARD_PLANS: dict[tuple, tuple] = {}


def _resolve_approx_tanh(fn: str, t: torch.Tensor, approx_tanh: bool | None) -> bool:
    if approx_tanh is None:
        return default_approx_tanh(t)
    if approx_tanh and interpreting():
        raise ValueError(f"{fn}: approx_tanh=True needs the GPU (inline PTX `tanh.approx.f32`), which Triton's "
                         "CPU interpreter cannot run; pass approx_tanh=None or False")
    return approx_tanh


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
    approx_tanh = _resolve_approx_tanh(fn, x, approx_tanh)
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
    if kernel not in PREACT_KERNELS:
        raise ValueError(f"{fn}: kernel must be 'auto' or one of {PREACT_KERNELS} (the kernels that store the "
                         f"pre-activation), got {kernel!r}")
    module = _MODULES[kernel]
    if not module.can_run(x, weight, out, preact_out):
        raise ValueError(f"{fn}: kernel='tma' needs bf16/fp16 tensors with unit inner strides, 16-byte-aligned "
                         f"rows and I % 16 == 0; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)}; "
                         "use kernel='auto'")
    if config is None:
        m_rule = max(m, 65) if kernel == "tma" else m
        key = dataclasses.replace(_call_key(x, n // 2, False, m_rule), capability=(9, 0), gpu="")
        config = next(r.config for _, r in candidates(key) if r.kernel == kernel and not r.gpus)
    config = _fit_dtype(config, x.dtype)
    epi = dict(epilogue.constexprs(), APPROX_TANH=approx_tanh)
    module.make_launcher(config, epi, bias is not None, x.dtype, True)(x, weight, bias, out, preact_out)
    return out, preact_out


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
    approx_tanh = _resolve_approx_tanh(fn, dy, approx_tanh)
    args = (dy, down_weight, preact, dpreact_out, h_out)
    if kernel == "auto" and config is None:
        captured = dy.is_cuda and torch.cuda.is_current_stream_capturing()
        key = _call_key(dy, i, captured)
        tf32 = key.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
        cache_key = (key, epilogue, approx_tanh, tf32)
        plan = _BACKWARD_PLANS.get(cache_key)
        if plan is None:
            epi = dict(epilogue.constexprs(), APPROX_TANH=approx_tanh)
            plan = _BACKWARD_PLANS[cache_key] = tuple(
                (_BACKWARD_MODULES[r.kernel].can_run, _BACKWARD_MODULES[r.kernel].make_launcher(
                    _fit_dtype(r.config, key.dtype), epi, key.dtype))
                for r in BACKWARD_RULES if mismatch(r, key) is None)
        for can_run, launch in plan:
            if can_run(*args):
                gated_gemm_tma.ensure_allocator()  # the TMA kernel's device-built descriptors
                launch(*args)
                return dpreact_out, h_out
        raise AssertionError("rules.BACKWARD_RULES ends with pointer rules that match every call")  # unreachable
    if kernel not in _BACKWARD_MODULES:
        raise ValueError(f"{fn}: kernel must be 'auto' or one of {tuple(_BACKWARD_MODULES)}, got {kernel!r}")
    module = _BACKWARD_MODULES[kernel]
    if not module.can_run(*args):
        raise ValueError(f"{fn}: kernel={kernel!r} needs bf16/fp16 tensors with unit inner strides, 16-byte-aligned "
                         f"rows and I % 16 == 0; got dy {tuple(dy.shape)} {dy.dtype}, I = {i}; use kernel='auto'")
    if config is None:
        key = dataclasses.replace(_call_key(dy, i, False, max(m, 129)), capability=(9, 0), gpu="")
        config = next(r.config for r in BACKWARD_RULES if r.kernel == kernel and mismatch(r, key) is None)
    config = _fit_dtype(config, dy.dtype)
    epi = dict(epilogue.constexprs(), APPROX_TANH=approx_tanh)
    gated_gemm_tma.ensure_allocator()
    module.make_launcher(config, epi, dy.dtype)(*args)
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
