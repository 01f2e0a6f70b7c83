"""`gated_linear`: the one functional entry point from model glue to the kernels.

Layers, bottom up: the Triton kernel (`swiglu_patch.kernels.gated_gemm`), the registered op
``swiglu_patch::gated_gemm`` (what torch.compile and CUDA graphs see), and `gated_linear`,
which checks its arguments once, picks a backend and flattens leading dims.
"""

from __future__ import annotations

import torch

from .kernels.activations import check_activation
from .kernels.reference import gated_linear_reference

BACKENDS = ("auto", "triton", "torch")


_gated_gemm_module = None


def _triton():
    """The Triton kernels' module, imported on first use (the torch backend needs no Triton)."""
    global _gated_gemm_module
    if _gated_gemm_module is None:
        try:
            from .kernels import gated_gemm
        except ImportError as e:  # triton missing (not Linux) or broken
            raise ImportError(
                f"gated_linear: backend='triton' needs Triton ({e}); `pip install triton` on Linux, "
                "or use backend='torch'"
            ) from e
        _gated_gemm_module = gated_gemm
    return _gated_gemm_module


@torch.library.custom_op("swiglu_patch::gated_gemm", mutates_args=())
def _gated_gemm_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    return _triton().gated_gemm(x, packed, activation, bias)


@_gated_gemm_op.register_fake
def _(x, packed, bias, activation):
    return x.new_empty((x.shape[0], packed.shape[0] // 2))


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
    if backend == "triton" and device.type != "cuda" and not _triton().interpreting():
        raise RuntimeError(
            f"gated_linear: backend='triton' on {device.type} tensors needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 before importing swiglu_patch, move the tensors to CUDA, or use backend='torch'"
        )
    return backend


def _check(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
    if packed.dim() != 2 or packed.shape[0] % 2 or packed.shape[0] == 0:
        raise ValueError(f"gated_linear: packed_weight must be [2*I, K] with I >= 1, got shape {tuple(packed.shape)}")
    k = packed.shape[1]
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(
            f"gated_linear: x must have last dim {k} (the packed weight's K), got shape {tuple(x.shape)}"
        )
    if not x.dtype.is_floating_point:
        raise TypeError(f"gated_linear: x must be a floating-point tensor, got {x.dtype}")
    if packed.dtype != x.dtype or packed.device != x.device:
        raise TypeError(
            f"gated_linear: packed_weight must match x's dtype and device ({x.dtype} on {x.device}), "
            f"got {packed.dtype} on {packed.device}; cast one with .to()"
        )
    if bias is not None and (bias.shape != (packed.shape[0],) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(
            f"gated_linear: bias must be [{packed.shape[0]}] ({x.dtype} on {x.device}), got "
            f"{tuple(bias.shape)} ({bias.dtype} on {bias.device})"
        )


def gated_linear(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    activation: str = "silu",
    bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """act(x @ Wg^T + bg) * (x @ Wu^T + bu), with gate and up read from one packed weight.

    Args:
        x: [..., K] input, any leading dims and strides; bf16, fp16 or fp32.
        packed_weight: [2*I, K] gate/up weight interleaved by `pack_gate_up`; x's dtype/device.
        activation: "silu", "gelu_tanh" or "gelu".
        bias: optional [2*I] gate/up bias packed by `pack_gate_up`.
        backend: "auto" (Triton on CUDA tensors, PyTorch reference elsewhere), "triton" (the
            kernel; on CPU only under TRITON_INTERPRET=1) or "torch" (the chunked reference,
            differentiable).

    Returns:
        [..., I] tensor in x's dtype.

    Raises:
        ValueError, TypeError: shapes, dtypes or devices that do not fit.
        NotImplementedError: an unsupported activation, or the Triton backend asked for a
            gradient (it has no backward yet).
    """
    check_activation("gated_linear", activation)
    _check(x, packed_weight, bias)
    backend = resolve_backend(backend, x.device)
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if backend == "torch":
        return _unflatten(gated_linear_reference(x2d, packed_weight, activation, bias), x)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"gated_linear: the Triton kernel takes bfloat16, float16 or float32, got {x.dtype}; "
                        "cast x and the weight, or use backend='torch'")
    if torch.is_grad_enabled() and (
        x.requires_grad or packed_weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        raise NotImplementedError(
            "gated_linear: the Triton kernel has no backward yet and an input requires grad; run inference "
            "under torch.inference_mode() or torch.no_grad(), freeze the weights (model.requires_grad_(False)), "
            "or use backend='torch' for training"
        )
    if torch.compiler.is_compiling():
        out = _gated_gemm_op(x2d, packed_weight, bias, activation)
    else:  # eager: skip the dispatcher's overhead on the hot path
        out = _triton().gated_gemm(x2d, packed_weight, activation, bias)
    return _unflatten(out, x)


def _unflatten(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[M, I] back to x's leading dims."""
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
