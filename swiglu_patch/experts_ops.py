"""The registered ops of the MoE experts block (torch.library): what autograd, torch.compile and
CUDA graphs see of the experts kernels (`swiglu_patch.kernels.experts`, `experts_backward`).

- ``swiglu_patch::experts`` (`experts_op`): an MoE experts block on the 3-D weights (inference);
- ``swiglu_patch::experts_train`` (`experts_train_op`): the same for training, storing the pairs'
  pre-activation or not (store or recompute mode), with its autograd formula registered on it;
- ``swiglu_patch::experts_backward`` (`experts_backward_op`): the experts block's gradients, writing
  dP over P.

Eager training calls go through `ExpertsTrain`, an autograd.Function built from the ops' own
functions, which skips torch.library's per-call dispatch (`experts_train_autograd` picks it;
torch.compile traces the registered op). Every op takes the epilogue and layout as plain values
(`ops.epilogue_args`, then alpha, transposed, concatenated; read back by `_experts_args`).

Shapes: x [T, K], top_k_index and top_k_weights [T, top_k], gate_up and down 3-D [E, ...] in the
model's layout (`ExpertsLayout`), biases [E, 2I] and [E, K_out]; S = T * top_k pairs.
"""

from __future__ import annotations

import torch

from .kernels.experts_reference import ExpertsEpilogue, ExpertsLayout
from .ops import declared_mutation, dispatcher, eager_autograd, epilogue_of


def experts_kernels():
    """The experts kernels' entry module (`swiglu_patch.kernels.experts`), imported on first use."""
    dispatcher()  # the same ImportError, with the fix, where Triton is missing
    from .kernels import experts

    return experts


@torch.library.custom_op("swiglu_patch::experts", mutates_args=())
def experts_op(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, activation: str,
               gate_scale: float, out_scale: float, clamp: int, limit: float, alpha: float, transposed: bool,
               concatenated: bool) -> torch.Tensor:
    """[T, K_out] from x [T, K], top_k_index and top_k_weights [T, top_k] and the experts' 3-D weights in
    their layout (`kernels/experts_reference.py`): an MoE experts block; alpha > 0 is gpt-oss's gate."""
    epilogue = ExpertsEpilogue(epilogue_of(activation, gate_scale, out_scale, clamp, limit), alpha or None)
    return experts_kernels().experts_forward(x, top_k_index, top_k_weights, gate_up, down, epilogue,
                                             ExpertsLayout(transposed, concatenated), gate_up_bias, down_bias)


@experts_op.register_fake
def _(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, activation, gate_scale, out_scale, clamp,
      limit, alpha, transposed, concatenated):
    return x.new_empty((x.shape[0], down.shape[2] if transposed else down.shape[1]))


# -- training: the experts block with its backward ---------------------------------------------


def experts_training_kernels():
    """The experts backward's entry module (`swiglu_patch.kernels.experts_backward`), imported on first use."""
    dispatcher()  # the same ImportError, with the fix, where Triton is missing
    from .kernels import experts_backward

    return experts_backward


def _experts_args(activation, gate_scale, out_scale, clamp, limit, alpha, transposed, concatenated):
    """(ExpertsEpilogue, ExpertsLayout) from the experts ops' plain arguments."""
    return (ExpertsEpilogue(epilogue_of(activation, gate_scale, out_scale, clamp, limit), alpha or None),
            ExpertsLayout(transposed, concatenated))


def _experts_train(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                   activation: str, gate_scale: float, out_scale: float, clamp: int, limit: float, alpha: float,
                   transposed: bool, concatenated: bool, store_preact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, K_out], P [S, 2I] or a 0-element tensor): `experts_op` that, with store_preact, also
    stores the pairs' pre-activation for the backward; its autograd formula is registered below
    (gradients to x, the 3-D weights, the biases and the routing weights)."""
    epilogue, layout = _experts_args(activation, gate_scale, out_scale, clamp, limit, alpha, transposed, concatenated)
    if store_preact:
        return experts_training_kernels().experts_forward_with_preact(x, top_k_index, top_k_weights, gate_up, down,
                                                                      epilogue, layout, gate_up_bias, down_bias)
    out = experts_kernels().experts_forward(x, top_k_index, top_k_weights, gate_up, down, epilogue, layout,
                                            gate_up_bias, down_bias)
    return out, x.new_empty(0)


experts_train_op = torch.library.custom_op("swiglu_patch::experts_train", _experts_train, mutates_args=())


@experts_train_op.register_fake
def _(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, activation, gate_scale, out_scale, clamp,
      limit, alpha, transposed, concatenated, store_preact):
    n = gate_up.shape[2] if transposed else gate_up.shape[1]
    preact = x.new_empty((top_k_index.numel(), n)) if store_preact else x.new_empty(0)
    return x.new_empty((x.shape[0], down.shape[2] if transposed else down.shape[1])), preact


def _experts_grads(dout: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None,
                   down_bias: torch.Tensor | None, preact: torch.Tensor | None, activation: str, gate_scale: float,
                   out_scale: float, clamp: int, limit: float, alpha: float, transposed: bool, concatenated: bool,
                   needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor]:
    """(dx, dgate_up, ddown, dgate_up_bias, ddown_bias, dtop_k_weights) of the experts block for dOut
    [T, K_out] (`kernels/experts_backward.py`), a 0-element tensor for each one `needs` leaves out;
    a stored P (`preact`, [S, 2I]) is overwritten with dP, None recomputes it."""
    epilogue, layout = _experts_args(activation, gate_scale, out_scale, clamp, limit, alpha, transposed, concatenated)
    grads = experts_training_kernels().experts_backward(dout, x, top_k_index, top_k_weights, gate_up, down, epilogue,
                                                        layout, gate_up_bias, down_bias, preact, tuple(needs))
    return tuple(x.new_empty(0) if g is None else g for g in grads)


experts_backward_op = torch.library.custom_op("swiglu_patch::experts_backward", _experts_grads,
                                              mutates_args=("preact",))


@experts_backward_op.register_fake
def _(dout, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, preact, activation, gate_scale,
      out_scale, clamp, limit, alpha, transposed, concatenated, needs):
    likes = (x, gate_up, down, gate_up_bias, down_bias, top_k_weights)
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) if n and t is not None else x.new_empty(0)
                 for t, n in zip(likes, needs))


def _experts_setup_context(ctx, inputs, output):
    x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, *args, store_preact = inputs
    _, preact = output
    ctx.mark_non_differentiable(preact)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                          preact if store_preact else None)
    ctx.experts_args = tuple(args)
    ctx.grads = experts_backward_op


def _experts_backward(ctx, dout, _dpreact):
    need_x, _, need_w, need_gu, need_d, need_gub, need_db = ctx.needs_input_grad[:7]
    none = (None,) * 9
    if dout is None:
        return (None,) * 7 + none
    x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, preact = ctx.saved_tensors
    needs = [need_x, need_gu, need_d, need_gub and gate_up_bias is not None, need_db and down_bias is not None, need_w]
    grads = ctx.grads(dout, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, preact,
                      *ctx.experts_args, needs)
    dx, dgu, dd, dgub, ddb, dw = (g if n else None for g, n in zip(grads, needs))
    return (dx, None, dw, dgu, dd, dgub, ddb) + none


experts_train_op.register_autograd(_experts_backward, setup_context=_experts_setup_context)


ExpertsTrain = eager_autograd(
    "ExpertsTrain", "`experts_train_op` for eager calls (`ops.eager_autograd`): `_experts_train`, "
    "`_experts_setup_context` and `_experts_backward`, whose gradients run as `_experts_grads` with P's version bumped.",
    _experts_train, _experts_setup_context, _experts_backward, grads=declared_mutation(_experts_grads, 8))


def experts_train_autograd(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """`experts_train_op`'s arguments and outputs, differentiable: the registered op while
    torch.compile traces, `ExpertsTrain` otherwise."""
    if torch.compiler.is_compiling():
        return experts_train_op(*args)
    return ExpertsTrain.apply(*args)
