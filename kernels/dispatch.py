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

Training's entry points (the forward that stores the pre-activation, the backward GEMM, the
low-rank segment) are in `dispatch_training`, which builds on this module.
"""

from __future__ import annotations

import dataclasses

import torch

from . import gated_gemm_pointer, gated_gemm_tma, gated_gemm_tma_grid, gated_gemv
from .configs import GatedGemmConfig, m_bucket
from .device import capability, gpu_name, interpreting
from .epilogue import GatedEpilogue
from .rules import DEFAULT_CONFIGS, KERNELS, RULES, Rule

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
    approx = resolve_approx_tanh(x, approx_tanh)
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
        return _forced(x, weight, bias, out, epilogue, resolve_approx_tanh(x, approx_tanh), config, kernel)
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


def resolve_approx_tanh(x: torch.Tensor, approx_tanh: bool | None, fn: str = "gated_gemm") -> bool:
    """Whether a call on x takes `tanh.approx.f32`: the caller's choice, or `default_approx_tanh`.

    Raises:
        ValueError: approx_tanh=True under the CPU interpreter (`fn` names the caller)."""
    if approx_tanh is None:
        return default_approx_tanh(x)
    if approx_tanh and interpreting():
        raise ValueError(f"{fn}: approx_tanh=True needs the GPU (inline PTX `tanh.approx.f32`), which "
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
