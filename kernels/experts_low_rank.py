"""LoRA on the experts through the fused grouped GEMMs, never materializing s * B_e @ A_e.

The math is `experts_reference.experts_reference` with an `ExpertsLowRank`: per pair p of
expert e, x_lr[p] = s x[t] @ A_e^T [S, r] (one small grouped projection,
`experts_low_rank_jit._experts_project_kernel`), then the gated GEMM runs r more K steps,
[x | x_lr] against [W_e | B_e], so its epilogue sees the whole pre-activation; likewise h_lr =
s h @ A_d^T before the down GEMM. The backward (`experts_backward_gemm.make_launcher` with
low_rank) adds s (dOut B_d) A_d to dH's G and s (dP B) A to dX as the same segments, and the
adapters' gradients are the weight-gradient kernel's sums over each expert's pairs:
dA = (s dP B)^T x, dB = dP^T x_lr, dA_d = (s dOut B_d)^T (w h), dB_d = dOut^T (w h_lr).

Rules and tiles are the experts ops' (`rules.EXPERTS_RULES`, `rules.EXPERTS_BACKWARD_RULES`),
the forward as ops "experts_low_rank[_preact]" (kernels with the "low_rank" feature: the
grouped one); the planner's extras carry the segments' BLOCK_R.
"""

from __future__ import annotations

import torch

from .dispatch import _call_key, _launch
from .experts import check_experts_operands
from .experts_backward import GRADIENTS, _sizes
from .experts_low_rank_jit import block_r
from .experts_reference import ExpertsEpilogue, ExpertsLayout, ExpertsLowRank
from .operands import resolve_approx_tanh

LOW_RANK_GRADIENTS = ("gate_up_a", "gate_up_b", "down_a", "down_b")
MAX_RANK = 128


def check_low_rank(fn: str, x: torch.Tensor, low_rank: ExpertsLowRank, num_experts: int, k: int, inter: int,
                   k_out: int) -> tuple[int, int]:
    """(BLOCK_R of gate_up, of down; 0 where no adapter), or an error naming the problem and the fix."""
    blocks = []
    for name, a, b, n_in, n_out in (("gate_up", low_rank.gate_up_a, low_rank.gate_up_b, k, 2 * inter),
                                    ("down", low_rank.down_a, low_rank.down_b, inter, k_out)):
        if (a is None) != (b is None):
            raise ValueError(f"{fn}: {name}'s adapter needs both A and B (or neither)")
        if a is None:
            blocks.append(0)
            continue
        r = a.shape[1] if a.dim() == 3 else -1
        if a.dim() != 3 or tuple(a.shape) != (num_experts, r, n_in) or tuple(b.shape) != (num_experts, n_out, r):
            raise ValueError(f"{fn}: {name}'s adapter must be A [E={num_experts}, r, {n_in}] and B [{num_experts}, "
                             f"{n_out}, r], got {tuple(a.shape)} and {tuple(b.shape)}")
        if not 0 < r <= MAX_RANK:
            raise ValueError(f"{fn}: {name}'s adapter rank must be in 1..{MAX_RANK}, got {r}")
        for t in (a, b):
            if t.dtype != x.dtype or t.device != x.device:
                raise TypeError(f"{fn}: {name}'s adapter must match x's dtype and device ({x.dtype} on {x.device}), "
                                f"got {t.dtype} on {t.device}; cast it with .to()")
        blocks.append(block_r(r))
    return blocks[0], blocks[1]


def _prologue(fn: str, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              gate_up: torch.Tensor, down: torch.Tensor, low_rank: ExpertsLowRank, layout: ExpertsLayout,
              gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None) -> tuple[int, int, tuple[int, int], int]:
    """What both entry points check and size first: the experts' operands, then the adapters.

    Returns:
        (I, K_out, (BLOCK_R of gate_up, of down; 0 where no adapter), S = T * top_k pairs).

    Raises:
        ValueError, TypeError: from `experts.check_experts_operands` or `check_low_rank`.
    """
    check_experts_operands(fn, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, layout)
    inter, k_out = _sizes(x, gate_up, down, layout)
    blocks = check_low_rank(fn, x, low_rank, gate_up.shape[0], x.shape[1], inter, k_out)
    return inter, k_out, blocks, top_k_index.numel()


def _lora(low_rank: ExpertsLowRank, x_lr: torch.Tensor | None, h_lr: torch.Tensor | None) -> tuple:
    """The launchers' lora tuple: gate_up's A, B and scale, down's A, B and scale, x_lr, h_lr [S, r]."""
    lr = low_rank
    return (lr.gate_up_a, lr.gate_up_b, float(lr.gate_up_scale), lr.down_a, lr.down_b, float(lr.down_scale), x_lr, h_lr)


def experts_low_rank_forward(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    low_rank: ExpertsLowRank,
    epilogue: ExpertsEpilogue,
    layout: ExpertsLayout = ExpertsLayout(),
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    store_preact: bool = False,
    approx_tanh: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The experts block with LoRA on its projections (`experts.experts_forward`'s arguments and math
    plus `low_rank`), the adapters read as they lie (any strides).

    Returns:
        (out [T, K_out], preact [S, 2I] or None (store_preact: bias and the adapter added, as
        `experts_backward.experts_forward_with_preact`), x_lr [S, r] or None, h_lr [S, r'] or None):
        x's dtype; x_lr and h_lr are what the backward needs of the adapters (rows of sentinel pairs zero).

    Raises:
        ValueError, TypeError: operands the kernels cannot take (the message names the fix).
    """
    fn = "experts_low_rank_forward"
    inter, k_out, blocks, num_pairs = _prologue(fn, x, top_k_index, top_k_weights, gate_up, down, low_rank, layout,
                                                gate_up_bias, down_bias)
    out = x.new_empty((x.shape[0], k_out))
    preact = x.new_empty((num_pairs, 2 * inter)) if store_preact else None
    x_lr, h_lr = (x.new_zeros((num_pairs, a.shape[1])) if a is not None else None  # sentinel pairs' rows stay 0
                  for a in (low_rank.gate_up_a, low_rank.down_a))
    if x.shape[0] > 0:
        key = _call_key(x, inter, x.is_cuda and torch.cuda.is_current_stream_capturing(),
                        (gate_up.shape[0], top_k_index.shape[1]))
        extras = (layout, gate_up_bias is not None, top_k_index.shape[1], store_preact, blocks)
        _launch(fn, "experts_low_rank_preact" if store_preact else "experts_low_rank", key, epilogue,
                resolve_approx_tanh(x, approx_tanh, fn), extras, (x,),
                (x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, out, preact,
                 _lora(low_rank, x_lr, h_lr)), "auto", None)
    return out, preact, x_lr, h_lr


def experts_low_rank_backward(
    dout: torch.Tensor,
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    low_rank: ExpertsLowRank,
    x_lr: torch.Tensor | None,
    h_lr: torch.Tensor | None,
    epilogue: ExpertsEpilogue,
    layout: ExpertsLayout = ExpertsLayout(),
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    preact: torch.Tensor | None = None,
    needs: tuple[bool, ...] = (True,) * 10,
    approx_tanh: bool | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of `experts_low_rank_forward`'s out for dOut = d(loss)/d(out).

    Args:
        dout: [T, K_out], x's dtype.
        x_lr, h_lr: as `experts_low_rank_forward` returned them.
        preact: P [S, 2I] as stored by the forward (overwritten with dP), or None to recompute it.
        needs: ten bools: `experts_backward.GRADIENTS` then `LOW_RANK_GRADIENTS`.
        (the rest: `experts_low_rank_forward`'s)

    Returns:
        (dx, dgate_up, ddown, dgate_up_bias, ddown_bias, dtop_k_weights, dgate_up_a, dgate_up_b,
        ddown_a, ddown_b): the first six as `experts_backward.experts_backward`, the adapters' in
        their shapes, contiguous, x's dtype; None where not needed or absent.

    Raises:
        ValueError, TypeError: operands the kernels cannot take (the message names the fix).
    """
    fn = "experts_low_rank_backward"
    inter, k_out, blocks, num_pairs = _prologue(fn, x, top_k_index, top_k_weights, gate_up, down, low_rank, layout,
                                                gate_up_bias, down_bias)
    tokens = x.shape[0]
    if len(needs) != len(GRADIENTS) + len(LOW_RANK_GRADIENTS):
        raise ValueError(f"{fn}: needs must be 10 bools, for {GRADIENTS + LOW_RANK_GRADIENTS}, got {needs!r}")
    if tuple(dout.shape) != (tokens, k_out) or dout.dtype != x.dtype or dout.device != x.device:
        raise ValueError(f"{fn}: dout must be [{tokens}, {k_out}] ({x.dtype} on {x.device}) like the block's output, "
                         f"got {list(dout.shape)} ({dout.dtype} on {dout.device})")
    for name, t, a in (("x_lr", x_lr, low_rank.gate_up_a), ("h_lr", h_lr, low_rank.down_a)):
        if a is not None and (t is None or tuple(t.shape) != (num_pairs, a.shape[1]) or t.stride(1) != 1):
            raise ValueError(f"{fn}: {name} must be [{num_pairs}, {a.shape[1]}] with unit column stride, as "
                             f"experts_low_rank_forward returns it, got {None if t is None else tuple(t.shape)}")
    has_bias = gate_up_bias is not None
    needs = tuple(bool(n) for n in needs)
    needs = needs[:3] + ((needs[3], needs[4]) if has_bias else (False, False)) + needs[5:6] + tuple(
        n and a is not None for n, a in zip(needs[6:], (low_rank.gate_up_a, low_rank.gate_up_b, low_rank.down_a,
                                                        low_rank.down_b)))
    if tokens == 0 or not any(needs):
        likes = (x, gate_up, down, gate_up_bias, down_bias, top_k_weights) + tuple(low_rank[:2]) + tuple(low_rank[3:5])
        return tuple(torch.zeros_like(t, memory_format=torch.contiguous_format) if n else None
                     for t, n in zip(likes, needs))
    key = _call_key(x, inter, x.is_cuda and torch.cuda.is_current_stream_capturing(),
                    (gate_up.shape[0], top_k_index.shape[1]))
    extras = (layout, has_bias, top_k_index.shape[1], blocks)
    return _launch(fn, "experts_backward", key, epilogue, resolve_approx_tanh(x, approx_tanh, fn), extras, (x,),
                   (dout, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, preact, needs[:6],
                    _lora(low_rank, x_lr, h_lr), needs[6:]), "auto", None)
