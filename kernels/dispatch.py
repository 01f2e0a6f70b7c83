"""The planner: which kernel runs each call of every op, from `rules.TABLES`; and the entry points.

    forward   out[M, I] = epilogue(x @ Wg^T + bg, x @ Wu^T + bu)              (layout: `layout.py`)
    backward  dP [M, 2*I] and h [M, I] from dY [M, K], Wd [K, I] and P (`gated_backward_pointer.py`)

Entry points and their ops (`OPS`: op -> its table in `rules.TABLES`, the features it needs):
`gated_gemm` "forward"; `gated_gemm_with_preact` "forward_preact" (stores P for the backward);
`gated_gemm_low_rank` "forward_low_rank[_preact]" (LoRA); `gated_backward` "backward[_dh_in]".

A call's candidates are the rules of its op's table matching its device, M bucket, K, I, rows per
expert (experts ops) and capture state, in table order, whose kernel serves the table and has the
op's features (the kernel file's ``CAPABILITY``, a `configs.KernelCapability`); the first whose
``can_run`` accepts the tensors launches (each table ends with rules whose kernel runs every
call). The launchers are built once per call signature and kept in one table of plain values,
`_PLANS` (no tensors): a repeated call costs its checks, one dictionary lookup and the launch
(`gated_gemm`, the inference hot path, checks its arguments only when it builds a plan); a call
naming its kernel keeps that kernel's launcher there too. Rule bounds on M sit at bucket edges
(`configs.m_bucket`; a test checks), so a plan per bucket is exact. A call that names its kernel
or config takes `_forced`. `explain(..., op=)` says which rule a call takes and why each earlier
one did not; `choose` returns it.

A new op family (grouped MoE GEMMs, say) needs no new dispatcher: kernel files whose
``CAPABILITY.ops`` names its table, with ``can_run`` and ``make_launcher``, listed in
`_KERNEL_FILES`; its table in `rules.TABLES` and its ops in `OPS`; and an entry point that
checks its operands and calls `_launch` (call key, epilogue, launcher arguments, tensors).
"""

from __future__ import annotations

import dataclasses

import torch

from . import (experts_backward_gemm, experts_gemm, experts_gemv, experts_gemv_transposed, gated_backward_pointer,
               gated_backward_split, gated_backward_tma, gated_backward_ws, gated_gemm_pointer, gated_gemm_tma,
               gated_gemm_tma_grid, gated_gemv)
from .configs import GatedGemmConfig, m_bucket, rows_bucket
from .device import capability, gpu_name, interpreter_blocker, interpreting
from .epilogue import GatedEpilogue
from .operands import (BF16_INTERPRETER, check_backward_operands, check_low_rank_operands, check_operands,
                       default_approx_tanh, output, resolve_approx_tanh)
from .rules import DEFAULT_CONFIGS, TABLES, Rule

_KERNEL_FILES = (gated_gemv, gated_gemm_pointer, gated_gemm_tma_grid, gated_gemm_tma, gated_backward_pointer,
                 gated_backward_tma, gated_backward_ws, gated_backward_split, experts_gemv, experts_gemv_transposed,
                 experts_gemm, experts_backward_gemm)
MODULES = {module.CAPABILITY.name: module for module in _KERNEL_FILES}  # kernel name -> its file
OPS: dict[str, tuple[str, frozenset[str]]] = {  # op -> (its table in rules.TABLES, features its kernel needs)
    "forward": ("forward", frozenset()),
    "forward_preact": ("forward", frozenset({"store_preact"})),
    "forward_low_rank": ("forward", frozenset({"low_rank"})),
    "forward_low_rank_preact": ("forward", frozenset({"low_rank", "store_preact"})),
    "backward": ("backward", frozenset()),
    "backward_dh_in": ("backward", frozenset({"dh_in"})),
    "experts": ("experts", frozenset()),  # the entry point: `experts.experts_forward`
    "experts_preact": ("experts", frozenset({"store_preact"})),  # `experts_backward.experts_forward_with_preact`
    "experts_low_rank": ("experts", frozenset({"low_rank"})),  # `experts_low_rank.experts_low_rank_forward`
    "experts_low_rank_preact": ("experts", frozenset({"low_rank", "store_preact"})),
    "experts_backward": ("experts_backward", frozenset()),  # `experts_backward.experts_backward`
}
__all__ = ["MODULES", "OPS", "CallKey", "candidates", "check_operands", "choose", "default_approx_tanh", "expert_rows",
           "explain", "gated_backward", "gated_gemm", "gated_gemm_low_rank", "gated_gemm_with_preact", "interpreter_blocker",
           "interpreting", "mismatch", "refusal", "resolve_approx_tanh"]


@dataclasses.dataclass(frozen=True)
class CallKey:
    """What the choice of kernel depends on, apart from the op and the tensors' alignment."""

    gpu: str  # CUDA device name, or "cpu"
    capability: tuple[int, int] | None
    dtype: torch.dtype
    m: int
    k: int
    i: int
    captured: bool
    rows: int | None = None  # experts ops: mean rows per expert at M's rows bucket (`expert_rows`); else None


def expert_rows(m: int, num_experts: int, top_k: int) -> int:
    """The experts ops' key of rows per expert: `configs.rows_bucket(M)` (half an octave finer than
    M's bucket) times top_k over the experts (at least 1).
    `num_experts` is the experts the weights hold (a rank's own under expert parallelism, so there
    the count is high by the ranks' factor and the larger tiles' rules take the call)."""
    return max(1, rows_bucket(m) * top_k // num_experts)


def mismatch(rule: Rule, key: CallKey) -> str | None:
    """Why `rule` does not match the call `key`, or None if it does."""
    if rule.captured is not None and rule.captured != key.captured:
        return "only for calls captured into a CUDA graph" if rule.captured else "not for captured calls"
    if rule.gpus and not any(g in key.gpu for g in rule.gpus):
        return f"GPU {key.gpu!r} is not one of {', '.join(rule.gpus)}"
    if rule.min_capability and (key.capability is None or key.capability < rule.min_capability):
        need = ".".join(map(str, rule.min_capability))
        return f"needs compute capability {need}+, this is {key.capability or 'no GPU'}"
    if rule.rows != (None, None) and key.rows is None:
        return "bounds the rows per expert: give the call's experts and top_k"
    for name, (low, high), value in (("M", rule.m, key.m), ("K", rule.k, key.k), ("I", rule.i, key.i),
                                     ("rows per expert", rule.rows, key.rows)):
        if value is None:
            continue
        if (low is not None and value < low) or (high is not None and value > high):
            return f"{name} = {value} is outside {low or ''}..{high or ''}"
    return None


def _lacks(kernel: str, op: str) -> str | None:
    """What `kernel` lacks to serve `op` (a table it does not serve, missing features), or None."""
    table, features = OPS[op]
    cap = MODULES[kernel].CAPABILITY
    if table not in cap.ops:
        return f"serves {', '.join(cap.ops)}, not {table}"
    missing = features - cap.features
    return f"has no {', '.join(sorted(missing))}" if missing else None


def _fit_dtype(config: GatedGemmConfig, dtype: torch.dtype) -> GatedGemmConfig:
    """fp32 tiles take twice the shared memory: halve block_k."""
    return dataclasses.replace(config, block_k=max(16, config.block_k // 2)) if dtype == torch.float32 else config


def candidates(key: CallKey, op: str = "forward") -> list[tuple[int, Rule]]:
    """(index, rule) of every rule of op's table that matches `key` and whose kernel serves op, in table order."""
    table = TABLES[OPS[op][0]]
    return [(n, r) for n, r in enumerate(table) if _lacks(r.kernel, op) is None and mismatch(r, key) is None]


# Per call signature the candidates' (can_run or None, launcher), in rule order: `gated_gemm`'s
# signatures (`_signature`) and (op, CallKey, epilogue, ...) for the other entry points; and per
# (op, CallKey, epilogue, ..., kernel, config) of a call naming its kernel, that launcher. Plain values
# only: predicates and launchers (closures over configs and constexprs), no tensors.
_PLANS: dict[tuple, object] = {}
_BUCKETS = [m_bucket(m) for m in range(8193)]


def _build(op: str, key: CallKey, epilogue: GatedEpilogue, approx: bool, extras: tuple) -> tuple:
    """Op's plan for `key`: per candidate (can_run, None if it runs every call; its launcher)."""
    epi = dict(epilogue.constexprs(), APPROX_TANH=approx)
    modules = [(MODULES[r.kernel], r.config) for _, r in candidates(key, op)]
    return tuple((None if m.CAPABILITY.runs_every_call else m.can_run,
                  m.make_launcher(_fit_dtype(c, key.dtype), epi, *extras)) for m, c in modules)


def _launch(fn: str, op: str, key: CallKey, epilogue: GatedEpilogue, approx: bool, extras: tuple, can_args: tuple,
            launch_args: tuple, kernel: str, config: GatedGemmConfig | None):
    """Run op's call: its plan's first candidate that can run `can_args` (kernel "auto", no config),
    or the named kernel (`_forced`), launched on `launch_args`; a launcher is the kernel file's
    ``make_launcher(config, epilogue constexprs, *extras)``."""
    tf32 = key.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    if kernel == "auto" and config is None:
        plan_key = (op, key, epilogue, approx, tf32, extras)
        plan = _PLANS.get(plan_key)
        if plan is None:
            plan = _PLANS[plan_key] = _build(op, key, epilogue, approx, extras)
        for can_run, launch in plan:
            if can_run is None or can_run(*can_args):
                return launch(*launch_args)
        raise AssertionError(f"rules.TABLES[{OPS[op][0]!r}] ends with rules whose kernel runs every call")
    module, config = _forced(fn, op, key, kernel, config, can_args)
    plan_key = (op, key, epilogue, approx, tf32, extras, module.CAPABILITY.name, config)
    launch = _PLANS.get(plan_key)
    if launch is None:  # a named kernel's launcher is kept too: a repeated call pays no build or first launch
        launch = _PLANS[plan_key] = module.make_launcher(config, dict(epilogue.constexprs(), APPROX_TANH=approx),
                                                         *extras)
    return launch(*launch_args)


def _forced(fn: str, op: str, key: CallKey, kernel: str, config: GatedGemmConfig | None, can_args: tuple):
    """(kernel module, config) for a call naming its kernel or config: a config runs as given; None
    takes `rules.DEFAULT_CONFIGS`, else the kernel's GPU-independent rule at the call's M (at
    least its rules' least M), fitted to the dtype."""
    names = tuple(name for name in MODULES if _lacks(name, op) is None)
    if kernel == "auto":
        raise ValueError(f"{fn}: a config needs the kernel it is for: pass kernel= one of {names}")
    if kernel not in names:
        raise ValueError(f"{fn}: kernel must be 'auto' or one of {names} (the kernels for {op}), got {kernel!r}")
    module = MODULES[kernel]
    if not module.can_run(*can_args):
        shapes = [tuple(t.shape) for t in can_args if isinstance(t, torch.Tensor)]
        raise ValueError(f"{fn}: kernel={kernel!r} needs {module.CAPABILITY.needs()}; got {can_args[0].dtype} "
                         f"tensors of shapes {shapes}; use kernel='auto'")
    if config is not None:
        return module, config
    config = DEFAULT_CONFIGS.get(kernel)
    if config is None:
        rules = [r for r in TABLES[OPS[op][0]] if r.kernel == kernel and not r.gpus]
        least = min(r.m[0] or 1 for r in rules)
        generic = dataclasses.replace(key, gpu="", capability=(9, 0), captured=False, m=m_bucket(max(key.m, least)))
        config = next(r.config for r in rules if mismatch(r, generic) is None)
    return module, _fit_dtype(config, key.dtype)


def _call_key(x: torch.Tensor, i: int, captured: bool, experts: tuple[int, int] | None = None) -> CallKey:
    """The call key of x [M, K]; `experts` (num_experts, top_k) for the experts ops."""
    m = m_bucket(x.shape[0])
    rows = None if experts is None else expert_rows(x.shape[0], *experts)
    if x.is_cuda:
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        return CallKey(gpu_name(index), capability(index), x.dtype, m, x.shape[1], i, captured, rows)
    return CallKey("cpu", None, x.dtype, m, x.shape[1], i, captured, rows)


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
    """Launch the fused gated GEMM on 2-D x (op "forward").

    Args:
        x: [M, K], any strides, bf16/fp16/fp32 (bf16 only on the GPU).
        weight: [2*I, K] interleaved gate/up weight (`layout.py`), x's dtype and device, any strides.
        epilogue: a `GatedEpilogue`, or an activation name for the plain act(gate) * up.
        bias: optional [2*I] interleaved bias, x's dtype, any strides (copied if not contiguous).
        out: optional [M, I] output to write (any strides); allocated if None.
        config: a launch config for `kernel`, run as given (None: the rule's, or the kernel's default).
        kernel: "auto" (the planner's choice), or one of `rules.KERNELS` to force it.
        approx_tanh: silu and gelu_tanh through PTX `tanh.approx.f32`; None: `default_approx_tanh`.

    Returns:
        out, [M, I] in x's dtype.

    Raises:
        ValueError, TypeError: operands the kernels cannot take (the message names the fix).
    """
    if type(epilogue) is not GatedEpilogue:
        epilogue = GatedEpilogue.of(epilogue)
    if kernel != "auto" or config is not None or x.dim() != 2:
        return _forward("gated_gemm", "forward", x, weight, None, None, epilogue, bias, out, None, config, kernel,
                        approx_tanh)[0]
    signature = _signature(x, weight, bias, epilogue, approx_tanh)
    plan = _PLANS.get(signature)
    if plan is None:
        check_operands("gated_gemm", x, weight, bias)
        plan = _PLANS[signature] = _build("forward", _call_key(x, weight.shape[0] // 2, signature[-2]), epilogue,
                                          resolve_approx_tanh(x, approx_tanh), (bias is not None, x.dtype))
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


def _signature(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, epilogue: GatedEpilogue,
               approx_tanh: bool | None) -> tuple:
    """Everything `gated_gemm`'s plan and argument checks depend on, as one hashable tuple: a call
    whose signature was seen before needs neither again."""
    m, k = x.shape
    return (x.dtype, x.device, _BUCKETS[m] if m <= 8192 else 8192, k, weight.dtype,
            weight.device, weight.shape, None if bias is None else (bias.dtype, bias.device, bias.shape), epilogue,
            approx_tanh, x.is_cuda and torch.cuda.is_current_stream_capturing(),
            x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32)


def _forward(fn, op, x, weight, x_lr, b_lr, epilogue, bias, out, preact_out, config, kernel, approx_tanh):
    """The forward ops' checked path: (out, preact or None)."""
    check_operands(fn, x, weight, bias)
    if x_lr is not None:
        check_low_rank_operands(fn, x, weight, x_lr, b_lr)
    epilogue = GatedEpilogue.of(epilogue)
    m, n = x.shape[0], weight.shape[0]
    out = output(fn, "out", out, (m, n >> 1), x)
    preact = output(fn, "preact_out", preact_out, (m, n), x) if op.endswith("_preact") else None
    if m == 0:
        return out, preact
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    approx = resolve_approx_tanh(x, approx_tanh, fn)
    key = _call_key(x, n >> 1, x.is_cuda and torch.cuda.is_current_stream_capturing())
    if op == "forward":  # the kernels' plain launchers: the grid kernel has no other
        _launch(fn, op, key, epilogue, approx, (bias is not None, x.dtype), (x, weight, out), (x, weight, bias, out),
                kernel, config)
    else:
        _launch(fn, op, key, epilogue, approx, (bias is not None, x.dtype, preact is not None, x_lr is not None),
                (x, weight, out, preact, x_lr, b_lr), (x, weight, bias, out, preact, x_lr, b_lr), kernel, config)
    return out, preact


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
    """`gated_gemm` that also stores the pre-activation P = x @ W^T + b, for the backward (op "forward_preact").

    Args:
        x, weight, epilogue, bias, out, config, approx_tanh: as `gated_gemm`.
        preact_out: optional [M, 2*I] tensor (x's dtype and device, any strides) for P, in the
            packed weight's interleaved column order; allocated if None.
        kernel: "auto", or a kernel with the "store_preact" feature ("pointer", "tma").

    Returns:
        (out [M, I], preact [M, 2*I]), x's dtype; P rounded once, before scales and clamps.

    Raises:
        ValueError, TypeError: operands the kernels cannot take.
    """
    return _forward("gated_gemm_with_preact", "forward_preact", x, weight, None, None, epilogue, bias, out, preact_out,
                    config, kernel, approx_tanh)


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

    Op "forward_low_rank" ("forward_low_rank_preact" with store_preact): kernels with the
    "low_rank" feature ("gemv", "pointer", "tma"; the GEMV stores no P); the TMA kernel needs
    x_lr and b_lr TMA-aligned too (r % 8 == 0 for 16-bit contiguous operands).

    Args:
        x, weight, epilogue, bias, out, config, approx_tanh: as `gated_gemm`.
        x_lr, b_lr: [M, r] low-rank input, [2*I, r] weight (packed rows); x's dtype, any strides.
        store_preact, preact_out: also return P [M, 2*I] (as `gated_gemm_with_preact`).
        kernel: "auto", or a kernel with the "low_rank" feature (and "store_preact" if asked).

    Returns:
        (out [M, I], P or None) in x's dtype.

    Raises:
        ValueError, TypeError: operands the kernels cannot take (the message names the fix).
    """
    op = "forward_low_rank_preact" if store_preact else "forward_low_rank"
    return _forward("gated_gemm_low_rank", op, x, weight, x_lr, b_lr, epilogue, bias, out, preact_out, config, kernel,
                    approx_tanh)


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
    """The gated MLP's backward GEMM dH = dY @ Wd with the epilogue's derivative fused in (op "backward").

    For y = epilogue(P) @ Wd^T (+ bd), P the interleaved pre-activation: dP = (dH * dh/dgate,
    dH * dh/dup) interleaved as P, and h = epilogue(P) (for dWd = dY^T @ h); dH stays in
    registers (`gated_backward_pointer.py` has the layout and rounding).

    Args:
        dy: [M, K] gradient of the MLP's output, any strides; bf16/fp16/fp32 (bf16 only on the GPU).
        down_weight: Wd, [K, I] (nn.Linear's [out, in]), dy's dtype and device, any strides.
        preact: P, [M, 2*I], dy's dtype, any strides (as `gated_gemm_with_preact` stores it).
        epilogue: the forward's `GatedEpilogue` (or activation name).
        dpreact_out: where dP goes, [M, 2*I]; may be `preact` itself (in place: saves M * 2*I
            elements); None allocates it.
        h_out: where h goes, [M, I]; None allocates it.
        config, kernel, approx_tanh: as `gated_gemm`; kernels: `rules.BACKWARD_KERNELS`.
        dh_in: optional [M, I] further gradient of h (dy's dtype, any strides), added to dY @ Wd
            before the derivative (LoRA on the down projection; op "backward_dh_in").

    Returns:
        (dpreact [M, 2*I], h [M, I]) in dy's dtype.

    Raises:
        ValueError, TypeError: operands the kernels cannot take (the message names the fix).
    """
    fn = "gated_backward"
    check_backward_operands(fn, dy, down_weight, preact)
    m, i = dy.shape[0], down_weight.shape[1]
    epilogue = GatedEpilogue.of(epilogue)
    if dpreact_out is None:
        dpreact_out = torch.empty_like(preact, memory_format=torch.contiguous_format)
    dpreact_out = output(fn, "dpreact_out", dpreact_out, (m, 2 * i), dy)
    h_out = output(fn, "h_out", h_out, (m, i), dy)
    if m == 0:
        return dpreact_out, h_out
    approx = resolve_approx_tanh(dy, approx_tanh, fn)
    has_dh_in = dh_in is not None
    if has_dh_in:
        output(fn, "dh_in", dh_in, (m, i), dy)
    args = (dy, down_weight, preact, dpreact_out, h_out, dh_in)
    key = _call_key(dy, i, dy.is_cuda and torch.cuda.is_current_stream_capturing())
    gated_gemm_tma.ensure_allocator()  # the TMA kernel's device-built descriptors
    _launch(fn, "backward_dh_in" if has_dh_in else "backward", key, epilogue, approx, (dy.dtype, has_dh_in), args,
            args, kernel, config)
    return dpreact_out, h_out


def refusal(gpu: str, dtype: torch.dtype) -> str | None:
    """Why every call on `gpu` in `dtype` is refused before any rule is read, or None."""
    return BF16_INTERPRETER if gpu == "cpu" and dtype == torch.bfloat16 else None


def _walk(gpu, dtype, m, k, i, captured, capability_, tma_aligned, op, transposed=False, experts=None):
    """(the call key, [(index, rule, why not or None)] up to the chosen rule, which comes last)."""
    if op not in OPS:
        raise ValueError(f"explain: op must be one of {tuple(OPS)}, got {op!r}")
    why = refusal(gpu, dtype)
    if why is not None:
        raise ValueError(f"{op} calls in {str(dtype).replace('torch.', '')} on {gpu} are refused: {why}")
    known = (9, 0) if any(h in gpu for h in ("H100", "H200", "H20", "GH200")) else None
    rows = None if experts is None else expert_rows(m, *experts)
    key = CallKey(gpu, capability_ or known, dtype, m_bucket(m), k, i, captured, rows)
    walk = []
    for n, rule in enumerate(TABLES[OPS[op][0]]):
        cap = MODULES[rule.kernel].CAPABILITY
        lacks = _lacks(rule.kernel, op)
        why_not = f"the {rule.kernel} kernel {lacks}" if lacks else mismatch(rule, key)
        if why_not is None and not cap.runs(dtype, m, i, tma_aligned, on_gpu=gpu != "cpu", transposed=transposed):
            why_not = f"matches, but the {rule.kernel} kernel cannot run these tensors (needs {cap.needs()})"
        walk.append((n, rule, why_not))
        if why_not is None:
            return key, walk
    raise AssertionError(f"rules.TABLES[{OPS[op][0]!r}] ends with rules whose kernel runs every call")


def choose(gpu: str, dtype: torch.dtype, m: int, k: int, i: int, captured: bool = False,
           capability_: tuple[int, int] | None = None, tma_aligned: bool = True,
           op: str = "forward", transposed: bool = False,
           experts: tuple[int, int] | None = None) -> tuple[int, Rule, GatedGemmConfig]:
    """(rule index, rule, config) a call of `op` takes: what its entry point runs, computed without tensors.

    gpu: the CUDA device name ("cpu": the interpreter); capability_: None for 9.0 on names with
    H100/H200/H20, else none; tma_aligned: whether the tensors meet TMA's alignment; transposed:
    experts' weights in the transposed layout (gpt-oss's: op "experts" and its kin); experts:
    (num_experts, top_k) of an experts call (None: rules bounding rows per expert are skipped).

    Raises:
        ValueError: an unknown op, or a call refused before any rule is read (`refusal`).
    """
    _, walk = _walk(gpu, dtype, m, k, i, captured, capability_, tma_aligned, op, transposed, experts)
    n, rule, _ = walk[-1]
    return n, rule, _fit_dtype(rule.config, dtype)


def explain(gpu: str, dtype: torch.dtype, m: int, k: int, i: int, captured: bool = False,
            capability_: tuple[int, int] | None = None, tma_aligned: bool = True, op: str = "forward",
            transposed: bool = False, experts: tuple[int, int] | None = None) -> str:
    """Which rule a call of `op` takes and why every earlier rule did not, as text (see `choose`)."""
    key, walk = _walk(gpu, dtype, m, k, i, captured, capability_, tma_aligned, op, transposed, experts)
    lines = [f"{op} call: {gpu}, capability {key.capability}, {str(dtype).replace('torch.', '')}, M={m}, "
             f"K={k}, I={i}, {'captured into a CUDA graph' if captured else 'eager'}"
             + (", transposed weights" if transposed else "")
             + (f", {experts[0]} experts, top {experts[1]}: {key.rows} rows per expert (at M's rows bucket)"
                if experts else "")]
    width = max(len(name) for name in MODULES)
    for n, rule, why_not in walk[:-1]:
        lines.append(f"  rule {n:2d} {rule.kernel:{width}s} skipped: {why_not}")
    n, rule, _ = walk[-1]
    lines.append(f"  rule {n:2d} {rule.kernel:{width}s} CHOSEN: {_fit_dtype(rule.config, dtype).short()}"
                 + (" (fp32: block_k halved)" if dtype == torch.float32 else ""))
    lines.append(f"  why: {rule.why}")
    if rule.sweep:
        lines.append(f"  measured in: {', '.join('benchmarks/results/' + s for s in rule.sweep)}")
    return "\n".join(lines)
