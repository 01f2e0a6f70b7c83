"""The checks every entry point of `dispatch` makes on its tensors, with errors that name the fix.

- `check_operands`: the forward's x [M, K], packed weight [2*I, K] and bias [2*I];
- `check_low_rank_operands`: LoRA's x_lr [M, r] and b_lr [2*I, r];
- `check_backward_operands`: the backward's dY [M, K], Wd [K, I] and P [M, 2*I];
- `output`: an output tensor given by the caller (shape, dtype, device), or a new one;
- `resolve_approx_tanh`, `default_approx_tanh`: whether a call takes PTX `tanh.approx.f32`.
"""

from __future__ import annotations

import torch

from .device import interpreting

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BF16_INTERPRETER = ("Triton's CPU interpreter computes bfloat16 matrix products wrongly; run bf16 on the GPU, use "
                    "float16/float32 with TRITON_INTERPRET=1, or use backend='torch'")


def default_approx_tanh(x: torch.Tensor) -> bool:
    """Whether silu and gelu_tanh take `tanh.approx.f32` by default: for bf16/fp16 x on the GPU.
    Its error (at most 2^-11 of tanh) is below a 16-bit output's rounding; fp32 keeps exp and a
    reciprocal, and the CPU interpreter runs no inline PTX."""
    return x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda and not interpreting()


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


def _check_dtype(fn: str, x: torch.Tensor) -> None:
    if x.dtype not in DTYPES:
        raise TypeError(f"{fn}: the Triton kernels take floating-point tensors in bfloat16, float16 or float32, got "
                        f"{x.dtype}; cast the tensors, or use backend='torch'")
    if x.dtype == torch.bfloat16 and not x.is_cuda and interpreting():
        raise TypeError(f"{fn}: {BF16_INTERPRETER}")


def _check_like(fn: str, name: str, t: torch.Tensor, x: torch.Tensor, x_name: str = "x") -> None:
    if t.dtype != x.dtype or t.device != x.device:
        raise TypeError(f"{fn}: {name} must match {x_name}'s dtype and device ({x.dtype} on {x.device}), got "
                        f"{t.dtype} on {t.device}; cast one with .to()")


def check_operands(fn: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise an error naming the problem and the fix (`fn`: the caller) for forward operands the
    kernels cannot take: x [M, K], weight [2*I, K], bias [2*I] or None, one dtype and device."""
    if weight.dim() != 2 or weight.shape[0] % 2 or weight.shape[0] == 0:
        raise ValueError(f"{fn}: the packed weight must be [2*I, K] with I >= 1, got shape {tuple(weight.shape)}")
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{fn}: x must be [M, {weight.shape[1]}] (the weight's K), got shape {tuple(x.shape)}")
    _check_dtype(fn, x)
    _check_like(fn, "the weight", weight, x)
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != x.dtype
                             or bias.device != x.device):
        raise ValueError(f"{fn}: the bias must be [{weight.shape[0]}] ({x.dtype} on {x.device}), got "
                         f"{tuple(bias.shape)} ({bias.dtype} on {bias.device})")


def check_low_rank_operands(fn: str, x: torch.Tensor, weight: torch.Tensor, x_lr: torch.Tensor,
                            b_lr: torch.Tensor) -> None:
    """As `check_operands` for the low-rank input x_lr [M, r] (r >= 1) and weight b_lr [2*I, r]."""
    if x_lr.dim() != 2 or x_lr.shape[0] != x.shape[0] or x_lr.shape[1] == 0:
        raise ValueError(f"{fn}: x_lr must be [M, r] = [{x.shape[0]}, r] with r >= 1, got shape {tuple(x_lr.shape)}")
    if b_lr.dim() != 2 or tuple(b_lr.shape) != (weight.shape[0], x_lr.shape[1]):
        raise ValueError(f"{fn}: b_lr must be [2*I, r] = [{weight.shape[0]}, {x_lr.shape[1]}], got shape "
                         f"{tuple(b_lr.shape)}")
    _check_like(fn, "x_lr", x_lr, x)
    _check_like(fn, "b_lr", b_lr, x)


def check_backward_operands(fn: str, dy: torch.Tensor, down_weight: torch.Tensor, preact: torch.Tensor) -> None:
    """As `check_operands` for the backward: dy [M, K], down_weight [K, I], preact [M, 2*I]."""
    if down_weight.dim() != 2:
        raise ValueError(f"{fn}: the down weight must be [K, I], got shape {tuple(down_weight.shape)}")
    k, i = down_weight.shape
    if dy.dim() != 2 or dy.shape[1] != k:
        raise ValueError(f"{fn}: dy must be [M, {k}] (the down weight's K), got shape {tuple(dy.shape)}")
    if preact.dim() != 2 or tuple(preact.shape) != (dy.shape[0], 2 * i):
        raise ValueError(f"{fn}: preact must be [M, 2*I] = [{dy.shape[0]}, {2 * i}], got shape {tuple(preact.shape)}")
    _check_dtype(fn, dy)
    _check_like(fn, "the down weight", down_weight, dy, "dy")
    _check_like(fn, "the preact", preact, dy, "dy")


def output(fn: str, name: str, t: torch.Tensor | None, shape: tuple, x: torch.Tensor) -> torch.Tensor:
    """`t` checked against `shape` and x's dtype and device, or a new tensor like that if None.

    Raises:
        ValueError: t of another shape, dtype or device (the message names what it must be)."""
    if t is None:
        return x.new_empty(shape)
    if tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device:
        raise ValueError(f"{fn}: {name} must be {list(shape)} ({x.dtype} on {x.device}), got "
                         f"{list(t.shape)} ({t.dtype} on {t.device})")
    return t
