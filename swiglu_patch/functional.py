"""`gated_linear`: the one functional entry point from model glue to the gated GEMM.

Layers, bottom up: the kernels and their planner (`swiglu_patch.kernels.dispatch.gated_gemm`),
the registered op ``swiglu_patch::gated_gemm`` (`swiglu_patch.ops`: what torch.compile and CUDA
graphs see), `gated_linear_interleaved` (checks, picks a backend, flattens leading dims; what the
fused module calls with its parameters) and `gated_linear`, which takes a `PackedGateUp` so that
a weight in another layout cannot be passed by mistake. Training runs the whole MLP as one
differentiable op instead: `swiglu_patch.training.gated_mlp`.
"""

from __future__ import annotations

import torch

from . import ops
from .kernels.epilogue import GatedEpilogue
from .kernels.layout import PackedGateUp
from .kernels.reference import gated_linear_reference
from .ops import BACKENDS, resolve_backend

__all__ = ["BACKENDS", "gated_linear", "gated_linear_interleaved", "resolve_backend"]


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
                "gated_linear: the Triton backend of gated_linear is for inference and an input requires grad; "
                "train through the whole MLP, whose op has a fused backward (swiglu_patch.training.gated_mlp, what "
                "a patched model's FusedGatedMLP runs), run under torch.no_grad(), or use backend='torch'"
            )
        if torch.compiler.is_compiling():
            out = ops.gated_gemm_op(x2d, weight, bias, *ops.epilogue_args(epilogue))
        else:  # eager: skip the op's overhead on the hot path
            out = (ops.DISPATCH or ops.dispatcher()).gated_gemm(x2d, weight, epilogue, bias)
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
            kernel, for inference; on CPU only under TRITON_INTERPRET=1, fp16/fp32) or "torch"
            (the chunked reference, differentiable). To train, run the whole MLP through
            `swiglu_patch.training.gated_mlp`, whose Triton op has a fused backward.

    Returns:
        [..., I] tensor in x's dtype.

    Raises:
        TypeError: weight is not a `PackedGateUp` (a raw tensor could be in another layout,
            e.g. Phi-3's chunked [gate; up]), or dtypes that do not fit.
        ValueError: shapes or devices that do not fit.
        NotImplementedError: an unsupported activation, or the Triton backend asked for a
            gradient (the gated GEMM alone is for inference; `gated_mlp` trains).
    """
    if not isinstance(weight, PackedGateUp):
        raise TypeError(
            f"gated_linear: weight must be a PackedGateUp, got {type(weight).__name__}. Build it with "
            "pack_gate_up(gate_weight, up_weight): a raw [2*I, K] tensor is ambiguous (torch.cat([gate, up]) "
            "is another layout and would give wrong numbers). Tensors already interleaved by pack_gate_up "
            "can be wrapped with PackedGateUp.from_interleaved(weight, bias)."
        )
    return gated_linear_interleaved(x, weight.weight, weight.bias, GatedEpilogue.of(epilogue), backend)
