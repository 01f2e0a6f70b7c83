"""Training's entry points to the experts kernels, chosen by the planner (`dispatch`).

- `experts_forward_with_preact` (op "experts_preact", table "experts"): `experts.experts_forward`
  that also stores each pair's pre-activation P [S, 2I] (S = T * TOP_K, row p = t * TOP_K + j;
  bias added, in the model's gate/up column order, rounded once to x's dtype): what the
  backward's store mode saves.
- `experts_backward` (op "experts_backward", table `rules.EXPERTS_BACKWARD_RULES`, kernel file
  `experts_backward_gemm.py`): the gradients of `experts_reference` with respect to x, the
  3-D weights (in the layout the model holds them), the biases and the routing weights, from
  dOut and P, or from x alone (recompute mode: P is computed again, one grouped GEMM).

`dispatch.explain(..., op="experts_backward")` says which rule a call takes (M is the tokens T).
Every launch is asynchronous; no host synchronisation.
"""

from __future__ import annotations

import torch

from .dispatch import _call_key, _launch
from .experts import check_experts_operands
from .experts_reference import ExpertsEpilogue, ExpertsLayout
from .operands import resolve_approx_tanh

EXPERTS_BACKWARD_KERNELS = ("experts_backward_grouped",)
GRADIENTS = ("x", "gate_up", "down", "gate_up_bias", "down_bias", "top_k_weights")


def _sizes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, layout: ExpertsLayout) -> tuple[int, int]:
    """(I, K_out) of the experts."""
    inter = (gate_up.shape[2] if layout.transposed else gate_up.shape[1]) // 2
    return inter, (down.shape[2] if layout.transposed else down.shape[1])


def experts_forward_with_preact(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    epilogue: ExpertsEpilogue,
    layout: ExpertsLayout = ExpertsLayout(),
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    kernel: str = "auto",
    config=None,
    approx_tanh: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts block (`experts.experts_forward`'s arguments and math) storing P for the backward.

    Returns:
        (out [T, K_out], preact [S, 2I]), x's dtype; rows of sentinel pairs (ids >= E) of preact
        are not written (the backward never reads them).

    Raises:
        ValueError, TypeError: operands the kernels cannot take (the message names the fix).
    """
    fn = "experts_forward_with_preact"
    check_experts_operands(fn, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, layout)
    inter, k_out = _sizes(x, gate_up, down, layout)
    out = x.new_empty((x.shape[0], k_out))
    preact = x.new_empty((top_k_index.numel(), 2 * inter))
    if x.shape[0] == 0:
        return out, preact
    key = _call_key(x, inter, x.is_cuda and torch.cuda.is_current_stream_capturing(),
                    (gate_up.shape[0], top_k_index.shape[1]))
    extras = (layout, gate_up_bias is not None, top_k_index.shape[1], True)
    _launch(fn, "experts_preact", key, epilogue, resolve_approx_tanh(x, approx_tanh, fn), extras, (x,),
            (x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, out, preact), kernel, config)
    return out, preact


def experts_backward(
    dout: torch.Tensor,
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    epilogue: ExpertsEpilogue,
    layout: ExpertsLayout = ExpertsLayout(),
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    preact: torch.Tensor | None = None,
    needs: tuple[bool, ...] = (True,) * 6,
    kernel: str = "auto",
    config=None,
    approx_tanh: bool | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of the experts block `out = experts(x, ...)` for dOut = d(loss)/d(out).

    Args:
        dout: [T, K_out], x's dtype, any strides.
        x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, epilogue, layout:
            the forward's (`experts.experts_forward`).
        preact: P [S, 2I] as `experts_forward_with_preact` stored it (store mode), overwritten
            with dP; None recomputes it (recompute mode).
        needs: which of `GRADIENTS` to compute, six bools.
        kernel: "auto" (the planner's rule for T) or one of `EXPERTS_BACKWARD_KERNELS`.
        config: an `ExpertsBackwardConfig` for it (None: the rule's).
        approx_tanh: as `experts.experts_forward` (None: on the GPU for 16-bit x).

    Returns:
        (dx [T, K], dgate_up, ddown (the weights' shapes, contiguous), dgate_up_bias [E, 2I],
        ddown_bias [E, K_out], dtop_k_weights [T, TOP_K] in top_k_weights' dtype): x's dtype
        otherwise; None where `needs` is False or there is no bias. Sentinel slots (ids >= E)
        contribute nothing and get a zero routing-weight gradient; an expert with no pairs gets
        zero weight gradients.

    Raises:
        ValueError, TypeError: operands the kernels cannot take (the message names the fix).
    """
    fn = "experts_backward"
    check_experts_operands(fn, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, layout)
    inter, k_out = _sizes(x, gate_up, down, layout)
    tokens, num_pairs = x.shape[0], top_k_index.numel()
    if tuple(dout.shape) != (tokens, k_out) or dout.dtype != x.dtype or dout.device != x.device:
        raise ValueError(f"{fn}: dout must be [{tokens}, {k_out}] ({x.dtype} on {x.device}) like the block's output, "
                         f"got {list(dout.shape)} ({dout.dtype} on {dout.device})")
    if preact is not None and (tuple(preact.shape) != (num_pairs, 2 * inter) or preact.dtype != x.dtype
                               or preact.device != x.device or preact.stride(1) != 1):
        raise ValueError(f"{fn}: preact must be [{num_pairs}, {2 * inter}] ({x.dtype} on {x.device}) with unit "
                         f"column stride, as experts_forward_with_preact returns it, got {list(preact.shape)} "
                         f"({preact.dtype} on {preact.device})")
    if len(needs) != len(GRADIENTS):
        raise ValueError(f"{fn}: needs must be {len(GRADIENTS)} bools, for {GRADIENTS}, got {needs!r}")
    has_bias = gate_up_bias is not None
    needs = tuple(bool(n) for n in needs)
    if not has_bias:
        needs = needs[:3] + (False, False) + needs[5:]
    if tokens == 0 or not any(needs):
        empty = (x.new_zeros((tokens, x.shape[1])), torch.zeros_like(gate_up), torch.zeros_like(down),
                 None if not has_bias else torch.zeros_like(gate_up_bias),
                 None if not has_bias else torch.zeros_like(down_bias), torch.zeros_like(top_k_weights))
        return tuple(g if n else None for g, n in zip(empty, needs))
    key = _call_key(x, inter, x.is_cuda and torch.cuda.is_current_stream_capturing(),
                    (gate_up.shape[0], top_k_index.shape[1]))
    extras = (layout, has_bias, top_k_index.shape[1])
    return _launch(fn, "experts_backward", key, epilogue, resolve_approx_tanh(x, approx_tanh, fn), extras, (x,),
                   (dout, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, preact, needs),
                   kernel, config)
