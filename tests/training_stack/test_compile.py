"""`torch.compile` of a whole training step (forward, backward, AdamW step) on a patched model:
the same losses and weights as the eager step, and as the unpatched model's. Inductor on CPU
compiles for minutes on 2 cores, so one layer and three steps (marked slow). On a GPU machine the
Triton cases run on CUDA (`training_common.device_of`)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import rel_err, tiny_model
from training_common import assert_losses_close, device_of, token_batches, train_backends

from swiglu_patch import apply_fused_mlp, unpatch

pytestmark = pytest.mark.slow


def run(model, batches, compiled: bool) -> list[float]:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    fn = torch.compile(step) if compiled else step
    device = next(model.parameters()).device
    return [fn(ids.to(device)).item() for ids in batches]


@pytest.mark.parametrize("backend", train_backends())
def test_compiled_training_step_matches_eager(backend):
    torch._dynamo.reset()
    batches = token_batches(3, 2, 12, 128)
    base = tiny_model("llama", device=device_of(backend), num_hidden_layers=1)
    ref = copy.deepcopy(base)
    ref_losses = run(ref, batches, compiled=False)
    model = copy.deepcopy(base)
    apply_fused_mlp(model, backend=backend)
    losses = run(model, batches, compiled=True)
    assert_losses_close(losses, ref_losses, 1e-5, "compiled patched step vs eager unpatched")
    unpatch(model)
    ref_state = ref.state_dict()
    for k, v in model.state_dict().items():
        assert rel_err(v, ref_state[k]) < 1e-5, k


@pytest.mark.parametrize("backend", train_backends())
def test_compiled_lora_step_matches_eager_plain_peft(backend):
    """PEFT LoRA on gate/up/down of a patched model (their updates inside the fused op), compiled:
    the losses and trained adapters of the eager step on the unpatched model with plain PEFT."""
    from peft import LoraConfig, get_peft_model

    torch._dynamo.reset()
    batches = token_batches(3, 2, 12, 128)
    base = tiny_model("llama", device=device_of(backend), num_hidden_layers=1)
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"],
                  init_lora_weights=False)
    torch.manual_seed(0)
    ref = get_peft_model(copy.deepcopy(base), LoraConfig(**config))
    ref_losses = run(ref, batches, compiled=False)
    model = copy.deepcopy(base)
    apply_fused_mlp(model, backend=backend)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(**config))
    losses = run(model, batches, compiled=True)
    assert_losses_close(losses, ref_losses, 1e-5, "compiled patched LoRA step vs eager plain PEFT")
    ref_adapters = {k: v for k, v in ref.named_parameters() if "lora_" in k}
    for k, v in model.named_parameters():
        if "lora_" in k:
            assert rel_err(v, ref_adapters[k]) < 1e-5, k
