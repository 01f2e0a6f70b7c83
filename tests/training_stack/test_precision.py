"""Mixed and low precision through the fused MLP: bf16 autocast over fp32 weights, and bf16
weights. Logits and gradients against the float64 model: the patched model's error within twice
the unpatched model's own error in the same precision, plus a small epsilon; then a few training
steps track the unpatched model's losses (bf16: rtol 2e-2, a few bf16 roundings per step).

The Triton cases run on the GPU only, the model moved there: Triton's CPU interpreter computes tl.dot
on bf16 operands wrongly. The PyTorch reference runs on CPU."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from helpers import rel_err, tiny_model
from training_common import assert_losses_close, device_of, gpu_kernels, token_batches, train

from swiglu_patch import apply_fused_mlp
from swiglu_patch.kernels.layout import interleave_gate_up

EPS = 8e-3  # bf16, as helpers.EPS
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not gpu_kernels(), reason="Triton's CPU interpreter computes tl.dot on bf16 operands wrongly: bf16 runs on the "
                              "GPU's compiled kernels"))]


def logits_and_grads(model, ids, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and the gradients of the first layer's MLP weights and of the embeddings, in fp64."""
    model.train()
    model.zero_grad(set_to_none=True)
    ids = ids.to(model.device)
    with torch.autocast(model.device.type, dtype=torch.bfloat16) if autocast else nullcontext():
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    mlp = model.model.layers[0].mlp
    if hasattr(mlp, "gate_up_interleaved"):
        gate_up = mlp.gate_up_interleaved.grad
    else:
        gate_up = interleave_gate_up(mlp.gate_proj.weight.grad, mlp.up_proj.weight.grad)
    grads = {"gate_up": gate_up, "down": mlp.down_proj.weight.grad, "embed": model.model.embed_tokens.weight.grad}
    return out.logits.detach().double(), {k: v.double() for k, v in grads.items()}


def check_against_float64(ours, eager, ref64, what):
    for name, a, b, r in [("logits", ours[0], eager[0], ref64[0])] + [
            (k, ours[1][k], eager[1][k], ref64[1][k]) for k in ref64[1]]:
        bound = 2 * rel_err(b, r) + EPS
        assert rel_err(a, r) <= bound, f"{what} {name}: error {rel_err(a, r):.3g} > bound {bound:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_autocast(backend):
    ids = token_batches(1, 2, 12, 128)[0]
    base = tiny_model("llama", device=device_of(backend))
    ref64 = logits_and_grads(copy.deepcopy(base).double(), ids, autocast=False)
    eager = logits_and_grads(copy.deepcopy(base), ids, autocast=True)
    model = copy.deepcopy(base)
    apply_fused_mlp(model, backend=backend)
    check_against_float64(logits_and_grads(model, ids, autocast=True), eager, ref64, "autocast")

    batches = token_batches(5, 2, 12, 128)
    with torch.autocast(device_of(backend), dtype=torch.bfloat16):
        ref_losses = train(copy.deepcopy(base), batches)
        losses = train(model, batches)
    assert losses[-1] < losses[0]
    assert_losses_close(losses, ref_losses, 2e-2, "bf16 autocast training")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_weights(backend):
    ids = token_batches(1, 2, 12, 128)[0]
    base = tiny_model("llama", dtype=torch.bfloat16, device=device_of(backend))
    ref64 = logits_and_grads(copy.deepcopy(base).double(), ids, autocast=False)
    eager = logits_and_grads(copy.deepcopy(base), ids, autocast=False)
    model = copy.deepcopy(base)
    apply_fused_mlp(model, backend=backend)
    assert model.model.layers[0].mlp.gate_up_interleaved.dtype == torch.bfloat16
    check_against_float64(logits_and_grads(model, ids, autocast=False), eager, ref64, "bf16 weights")

    batches = token_batches(5, 2, 12, 128)
    ref_losses, losses = train(copy.deepcopy(base), batches, lr=1e-3), train(model, batches, lr=1e-3)
    assert losses[-1] < losses[0]
    assert_losses_close(losses, ref_losses, 2e-2, "bf16 weights training")
