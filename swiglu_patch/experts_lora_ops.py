"""The registered ops of LoRA on the experts (torch.library), the adapters never materialized.

- ``swiglu_patch::experts_lora_train`` (`experts_lora_train_op`): the experts block with LoRA
  adapters on gate_up and/or down (`kernels/experts_low_rank.py`), storing the pairs'
  pre-activation or not (store or recompute mode), with its autograd formula registered on it;
- ``swiglu_patch::experts_lora_backward`` (`experts_lora_backward_op`): its gradients, to x, the
  routing weights, the 3-D weights and biases where they train, and the adapters' A and B.

Eager training calls go through `ExpertsLoraTrain` (`ops.eager_autograd`: the ops' own functions
without torch.library's per-call dispatch; `experts_lora_train_autograd` picks it, torch.compile
traces the registered op).

Shapes: x [T, K]; top_k_index, top_k_weights [T, top_k]; the experts' 3-D weights in their
layout (`kernels/experts_reference.py`); gate_up_a [E, r, K], gate_up_b [E, 2I, r], down_a
[E, r', I], down_b [E, K_out, r'] (any strides; None for a projection without an adapter);
one floating dtype for all but the routing weights.
"""

from __future__ import annotations

import torch

from .kernels.experts_reference import ExpertsLowRank
from .experts_ops import _experts_args
from .ops import declared_mutation, dispatcher, eager_autograd


def low_rank_kernels():
    """The LoRA experts kernels' entry module (`swiglu_patch.kernels.experts_low_rank`), imported on first use."""
    dispatcher()  # the same ImportError, with the fix, where Triton is missing
    from .kernels import experts_low_rank

    return experts_low_rank


def _empty_if_none(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if t is None else t


def _experts_lora_train(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None,
                        down_bias: torch.Tensor | None, gate_up_a: torch.Tensor | None,
                        gate_up_b: torch.Tensor | None, down_a: torch.Tensor | None, down_b: torch.Tensor | None,
                        gate_up_scale: float, down_scale: float, activation: str, gate_scale: float,
                        out_scale: float, clamp: int, limit: float, alpha: float, transposed: bool,
                        concatenated: bool, store_preact: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, K_out], P [S, 2I], x_lr [S, r], h_lr [S, r']): the experts block with the adapters
    added inside the grouped GEMMs; P with store_preact, x_lr and h_lr where the projection has an
    adapter, else 0-element tensors."""
    epilogue, layout = _experts_args(activation, gate_scale, out_scale, clamp, limit, alpha, transposed, concatenated)
    low_rank = ExpertsLowRank(gate_up_a, gate_up_b, gate_up_scale, down_a, down_b, down_scale)
    out, preact, x_lr, h_lr = low_rank_kernels().experts_low_rank_forward(
        x, top_k_index, top_k_weights, gate_up, down, low_rank, epilogue, layout, gate_up_bias, down_bias,
        store_preact)
    return out, _empty_if_none(preact, x), _empty_if_none(x_lr, x), _empty_if_none(h_lr, x)


experts_lora_train_op = torch.library.custom_op("swiglu_patch::experts_lora_train", _experts_lora_train,
                                                mutates_args=())


@experts_lora_train_op.register_fake
def _(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, gate_up_a, gate_up_b, down_a, down_b,
      gate_up_scale, down_scale, activation, gate_scale, out_scale, clamp, limit, alpha, transposed, concatenated,
      store_preact):
    n = gate_up.shape[2] if transposed else gate_up.shape[1]
    s = top_k_index.numel()
    return (x.new_empty((x.shape[0], down.shape[2] if transposed else down.shape[1])),
            x.new_empty((s, n)) if store_preact else x.new_empty(0),
            x.new_empty((s, gate_up_a.shape[1])) if gate_up_a is not None else x.new_empty(0),
            x.new_empty((s, down_a.shape[1])) if down_a is not None else x.new_empty(0))


def _experts_lora_grads(dout: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                        gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                        gate_up_a: torch.Tensor | None, gate_up_b: torch.Tensor | None,
                        down_a: torch.Tensor | None, down_b: torch.Tensor | None, x_lr: torch.Tensor | None,
                        h_lr: torch.Tensor | None, preact: torch.Tensor | None, gate_up_scale: float,
                        down_scale: float, activation: str, gate_scale: float, out_scale: float, clamp: int,
                        limit: float, alpha: float, transposed: bool, concatenated: bool,
                        needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor, torch.Tensor]:
    """(dx, dgate_up, ddown, dgate_up_bias, ddown_bias, dtop_k_weights, dgate_up_a, dgate_up_b,
    ddown_a, ddown_b) for dOut [T, K_out] (`experts_low_rank.experts_low_rank_backward`), a 0-element
    tensor for each one `needs` leaves out; a stored P is overwritten with dP, None recomputes it."""
    epilogue, layout = _experts_args(activation, gate_scale, out_scale, clamp, limit, alpha, transposed, concatenated)
    low_rank = ExpertsLowRank(gate_up_a, gate_up_b, gate_up_scale, down_a, down_b, down_scale)
    grads = low_rank_kernels().experts_low_rank_backward(dout, x, top_k_index, top_k_weights, gate_up, down, low_rank,
                                                         x_lr, h_lr, epilogue, layout, gate_up_bias, down_bias, preact,
                                                         tuple(needs))
    return tuple(x.new_empty(0) if g is None else g for g in grads)


experts_lora_backward_op = torch.library.custom_op("swiglu_patch::experts_lora_backward", _experts_lora_grads,
                                                   mutates_args=("preact",))


@experts_lora_backward_op.register_fake
def _(dout, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, gate_up_a, gate_up_b, down_a,
      down_b, x_lr, h_lr, preact, gate_up_scale, down_scale, activation, gate_scale, out_scale, clamp, limit, alpha,
      transposed, concatenated, needs):
    likes = (x, gate_up, down, gate_up_bias, down_bias, top_k_weights, gate_up_a, gate_up_b, down_a, down_b)
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) if n and t is not None else x.new_empty(0)
                 for t, n in zip(likes, needs))


_INPUTS = 11  # x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, and the four adapters


def _setup_context(ctx, inputs, output):
    (x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, gate_up_a, gate_up_b, down_a, down_b,
     gate_up_scale, down_scale, *args, store_preact) = inputs
    _, preact, x_lr, h_lr = output
    ctx.mark_non_differentiable(preact, x_lr, h_lr)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, gate_up_a, gate_up_b,
                          down_a, down_b, x_lr if gate_up_a is not None else None,
                          h_lr if down_a is not None else None, preact if store_preact else None)
    ctx.scales, ctx.experts_args = (gate_up_scale, down_scale), tuple(args)
    ctx.grads = experts_lora_backward_op


def _backward(ctx, dout, _dpreact, _dx_lr, _dh_lr):
    n = ctx.needs_input_grad
    none = (None,) * (len(n) - _INPUTS)
    if dout is None:
        return (None,) * len(n)
    (x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, gate_up_a, gate_up_b, down_a, down_b,
     x_lr, h_lr, preact) = ctx.saved_tensors
    needs = [n[0], n[3], n[4], n[5] and gate_up_bias is not None, n[6] and down_bias is not None, n[2],
             n[7] and gate_up_a is not None, n[8] and gate_up_b is not None, n[9] and down_a is not None,
             n[10] and down_b is not None]
    grads = ctx.grads(dout.contiguous(), x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                      gate_up_a, gate_up_b, down_a, down_b, x_lr, h_lr, preact, *ctx.scales, *ctx.experts_args, needs)
    dx, dgu, dd, dgub, ddb, dw, dagu, dbgu, dad, dbd = (g if k else None for g, k in zip(grads, needs))
    return (dx, None, dw, dgu, dd, dgub, ddb, dagu, dbgu, dad, dbd) + none


experts_lora_train_op.register_autograd(_backward, setup_context=_setup_context)

ExpertsLoraTrain = eager_autograd(
    "ExpertsLoraTrain", "`experts_lora_train_op` for eager calls (`ops.eager_autograd`): `_experts_lora_train`, "
    "`_setup_context` and `_backward`, whose gradients run as `_experts_lora_grads` with P's version bumped.",
    _experts_lora_train, _setup_context, _backward, grads=declared_mutation(_experts_lora_grads, 14))


def experts_lora_train_autograd(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`experts_lora_train_op`'s arguments and outputs, differentiable: the registered op while
    torch.compile traces, `ExpertsLoraTrain` otherwise."""
    if torch.compiler.is_compiling():
        return experts_lora_train_op(*args)
    return ExpertsLoraTrain.apply(*args)
