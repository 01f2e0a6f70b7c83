"""`gated_linear`: the one functional entry point from model glue to the kernels.

Layers, bottom up: the kernels and their dispatcher (`swiglu_patch.kernels.dispatch.gated_gemm`),
the registered op ``swiglu_patch::gated_gemm`` (what torch.compile and CUDA graphs see),
`gated_linear_interleaved` (checks, picks a backend, flattens leading dims; what the fused
module calls with its parameters) and `gated_linear`, which takes a `PackedGateUp` so that a
weight in another layout cannot be passed by mistake.
"""

from __future__ import annotations

import torch

from .kernels.epilogue import CLAMP_CODES, GatedEpilogue
from .kernels.layout import PackedGateUp
from .kernels.reference import gated_linear_reference

BACKENDS = ("auto", "triton", "torch")
_CLAMPS = {code: name for name, code in CLAMP_CODES.items()}

_dispatch_module = None
_training_dispatch_module = None


def _import_kernels(name: str):
    import importlib

    try:
        return importlib.import_module(f"{__package__}.kernels.{name}")
    except ImportError as e:  # triton missing (not Linux) or broken
        raise ImportError(
            f"swiglu_patch: backend='triton' needs Triton ({e}); `pip install triton` on Linux, or use backend='torch'"
        ) from e


def dispatcher():
    """The kernels' dispatcher module (`swiglu_patch.kernels.dispatch`), imported on first use:
    the torch backend needs no Triton."""
    global _dispatch_module
    if _dispatch_module is None:
        _dispatch_module = _import_kernels("dispatch")
    return _dispatch_module


def training_dispatcher():
    """Training's entry points to the kernels (`swiglu_patch.kernels.dispatch_training`:
    the forward that stores P, the backward GEMM, the low-rank segment), imported on first use."""
    global _training_dispatch_module
    if _training_dispatch_module is None:
        _training_dispatch_module = _import_kernels("dispatch_training")
    return _training_dispatch_module


@torch.library.custom_op("swiglu_patch::gated_gemm", mutates_args=())
def _gated_gemm_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str,
                   gate_scale: float, out_scale: float, clamp: int, limit: float) -> torch.Tensor:
    epilogue = GatedEpilogue(activation, gate_scale, out_scale, limit if clamp else None, _CLAMPS[clamp] or "gate")
    return dispatcher().gated_gemm(x, weight, epilogue, bias)


@_gated_gemm_op.register_fake
def _(x, weight, bias, activation, gate_scale, out_scale, clamp, limit):
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend `gated_linear` runs for `backend` on tensors on `device`.

    Raises:
        ValueError: unknown backend name.
        RuntimeError: "triton" on a non-CUDA device without TRITON_INTERPRET=1.
    """
    if backend not in BACKENDS:
        raise ValueError(f"gated_linear: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not dispatcher().interpreting():
        raise RuntimeError(
            f"gated_linear: backend='triton' on {device.type} tensors needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 before importing swiglu_patch, move the tensors to CUDA, or use backend='torch'"
        )
    return backend


def gated_linear_interleaved(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    epilogue: GatedEpilogue,
    backend: str = "auto",
) -> torch.Tensor:
    """`gated_linear` on tensors the caller states are in the interleaved layout (a fused
    module's parameters). Arguments as `gated_linear`'s, with the weight and bias unwrapped.

    The hot path of a patched model's MLP: on CUDA it costs a few attribute reads before the
    dispatcher (which checks a call's arguments once per call signature)."""
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    elif backend != "torch":
        backend = resolve_backend(backend, x.device)
    if x.dim() < 1 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"gated_linear: x must be [..., {weight.shape[-1]}] (the weight's K), got shape "
                         f"{tuple(x.shape)}")
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if backend == "torch":
        if not x.dtype.is_floating_point:
            raise TypeError(f"gated_linear: x must be a floating-point tensor, got {x.dtype}")
        if weight.dtype != x.dtype or weight.device != x.device:
            raise TypeError(f"gated_linear: the weight must match x's dtype and device ({x.dtype} on {x.device}), "
                            f"got {weight.dtype} on {weight.device}; cast one with .to()")
        out = gated_linear_reference(x2d, weight, bias, epilogue)
    else:
        if torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        ):
            raise NotImplementedError(
                "gated_linear: the Triton kernel has no backward yet and an input requires grad; run inference "
                "under torch.inference_mode() or torch.no_grad(), freeze the weights (model.requires_grad_(False)), "
                "or use backend='torch' for training"
            )
        if torch.compiler.is_compiling():
            out = _gated_gemm_op(x2d, weight, bias, epilogue.activation, epilogue.gate_scale, epilogue.out_scale,
                                 CLAMP_CODES[None if epilogue.limit is None else epilogue.clamp], epilogue.limit or 0.0)
        else:  # eager: skip the dispatcher's overhead on the hot path
            out = (_dispatch_module or dispatcher()).gated_gemm(x2d, weight, epilogue, bias)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def gated_linear(
    x: torch.Tensor,
    weight: PackedGateUp,
    epilogue: GatedEpilogue | str = "silu",
    backend: str = "auto",
) -> torch.Tensor:
    """act(x @ Wg^T + bg) * (x @ Wu^T + bu), with gate and up read from one packed weight.

    Args:
        x: [..., K] input, any leading dims and strides; bf16, fp16 or fp32.
        weight: a `PackedGateUp` from `pack_gate_up(gate_weight, up_weight[, gate_bias, up_bias])`:
            [2*I, K] weight and optional [2*I] bias in the interleaved layout, x's dtype/device.
        epilogue: an activation name ("silu", "gelu_tanh", "gelu") or a `GatedEpilogue`
            (scales on the gate and the output, a SwiGLU clamp).
        backend: "auto" (Triton on CUDA tensors, PyTorch reference elsewhere), "triton" (the
            kernel; on CPU only under TRITON_INTERPRET=1, fp16/fp32) or "torch" (the chunked
            reference, differentiable).

    Returns:
        [..., I] tensor in x's dtype.

    Raises:
        TypeError: weight is not a `PackedGateUp` (a raw tensor could be in another layout,
            e.g. Phi-3's chunked [gate; up]), or dtypes that do not fit.
        ValueError: shapes or devices that do not fit.
        NotImplementedError: an unsupported activation, or the Triton backend asked for a
            gradient (it has no backward yet).
    """
    if not isinstance(weight, PackedGateUp):
        raise TypeError(
            f"gated_linear: weight must be a PackedGateUp, got {type(weight).__name__}. Build it with "
            "pack_gate_up(gate_weight, up_weight): a raw [2*I, K] tensor is ambiguous (torch.cat([gate, up]) "
            "is another layout and would give wrong numbers). Tensors already interleaved by pack_gate_up "
            "can be wrapped with PackedGateUp.from_interleaved(weight, bias)."
        )
    return gated_linear_interleaved(x, weight.weight, weight.bias, GatedEpilogue.of(epilogue), backend)
