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
  tensor saved beyond x and the weights (2*M*I elements); h is not saved. From `SPLIT_MIN_TOKENS`
  tokens on (`preact_split`), P is written as two tensors, each half of h's columns by its own
  launch, so that the backward frees the first half of dP before it allocates dx: the peak drops
  by M*K elements (docs/training.md, "Memory").
- "recompute": only x and the weights are saved; the backward recomputes P with one GEMM.

Layers, bottom up: the kernels (`kernels/dispatch.py`: `gated_gemm_with_preact`, `gated_gemm`,
`gated_gemm_low_rank`, `gated_backward`); the registered ops in `swiglu_patch.ops`:
``swiglu_patch::gated_mlp`` (the gated GEMM: h, and P in store mode; the whole MLP's backward
is registered on it, so autograd, torch.compile and CUDA graphs see one op for it),
`ops.GatedMlpDown` (y = h @ Wd^T + bd, an autograd.Function; it saves nothing and its backward
hands dY to the op, so a checkpointed layer's recomputation stops before this GEMM) and
``swiglu_patch::gated_mlp_dpreact`` (the fused backward GEMM, writing dP over P); then
`gated_mlp_interleaved` (what a fused module calls with its parameters) and `gated_mlp` (which
takes a `PackedGateUp`). The plain GEMMs of the backward (dWd, dW, dx) run through torch (cuBLAS
on the GPU) and are skipped for inputs that need no gradient (frozen weights).

Numerics: fp32 accumulation and epilogue math in every kernel, one rounding per stored tensor
(P, h, dP, each gradient). The "torch" backend computes the same formulas with PyTorch ops
(float64 in, float64 out: what `torch.autograd.gradcheck` checks); its backward epilogue is
`gated_epilogue_grad_reference`, the spec the kernels' `jit_common.gated_epilogue_grad` follows.
"""

from __future__ import annotations

import torch

from .kernels.epilogue import GatedEpilogue
from .kernels.layout import GATE_UP_BLOCK, PackedGateUp
from .low_rank import check_low_rank
from .ops import epilogue_args, gated_epilogue_grad_reference, gated_mlp_autograd, GatedMlpDown, resolve_backend

__all__ = ["MODES", "gated_epilogue_grad_reference", "gated_mlp", "gated_mlp_interleaved", "preact_split"]

MODES = ("store", "recompute")
SPLIT_MIN_TOKENS = 1024


def preact_split(x: torch.Tensor, intermediate: int) -> int:
    """Where store mode cuts P [M, 2*I] into two tensors: h's column s (a multiple of the packing
    block, near I / 2), or 0 for one tensor. Split when the M*K elements it saves at the backward's
    peak outweigh two launches in place of one in each direction: from `SPLIT_MIN_TOKENS` tokens
    x [M, K] on, while dx's first part fits in the packed weight gradient's unwritten rows (M <= 2(I - s)).
    Never while torch.compile traces or a CUDA graph captures: the backward frees a saved tensor's
    storage, which neither may see."""
    m = x.shape[0]
    s = intermediate // 2 // GATE_UP_BLOCK * GATE_UP_BLOCK
    if m < SPLIT_MIN_TOKENS or s == 0 or m > 2 * (intermediate - s) or torch.compiler.is_compiling():
        return 0
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return 0
    return s


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
    backend = resolve_backend(backend, x.device, "gated_mlp")
    op_inputs = (x, weight, bias, down_weight, x_lr, b_lr)  # the gated op's: down_bias's gradient needs no P
    store = mode == "store" and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in op_inputs)
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    xlr2d = x_lr if x_lr is None or x_lr.dim() == 2 else x_lr.reshape(-1, x_lr.shape[-1])
    split_at = preact_split(x2d, weight.shape[0] // 2) if store and x_lr is None else 0
    h, _, _, dy_route = gated_mlp_autograd(x2d, weight, bias, down_weight, xlr2d, b_lr, *epilogue_args(epilogue), store,
                                           split_at, return_h, backend)
    y = GatedMlpDown.apply(h, down_weight, down_bias, dy_route)
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
