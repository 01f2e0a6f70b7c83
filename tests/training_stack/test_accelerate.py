"""accelerate's `Accelerator` (CPU): prepare + backward + step on a patched model gives the
unpatched model's losses (fp32: 1e-5; mixed_precision="bf16", autocast on CPU: 2e-2)."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from helpers import tiny_model
from training_common import assert_losses_close, device_of, token_batches, train_backends

from swiglu_patch import apply_fused_mlp


def run(model, mixed_precision: str, device: str) -> list[float]:
    AcceleratorState._reset_state(reset_partial_state=True)  # one Accelerator per run in this process
    accelerator = Accelerator(cpu=device == "cpu", mixed_precision=mixed_precision)
    data = torch.utils.data.DataLoader(torch.cat(token_batches(1, 16, 12, 128)), batch_size=4)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model, opt, data = accelerator.prepare(model, opt, data)
    model.train()
    torch.manual_seed(0)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    AcceleratorState._reset_state(reset_partial_state=True)
    return losses


@pytest.mark.parametrize("backend", train_backends())
@pytest.mark.parametrize("mixed_precision,rtol", [("no", 1e-5), ("bf16", 2e-2)])
def test_accelerator_matches_unpatched(mixed_precision, rtol, backend):
    device = device_of(backend)
    if backend == "triton" and mixed_precision == "bf16" and device == "cpu":
        pytest.skip("Triton's CPU interpreter computes tl.dot on bf16 operands wrongly; bf16 autocast runs on the GPU")
    base = tiny_model("llama", device=device)
    ref = run(copy.deepcopy(base), mixed_precision, device)
    model = copy.deepcopy(base)
    apply_fused_mlp(model, backend=backend)
    losses = run(model, mixed_precision, device)
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert_losses_close(losses, ref, rtol, f"accelerate, mixed_precision={mixed_precision}")
