"""Patching trainable weights is quiet when nothing holds the old ones (an optimizer that does is
tests/training_stack/test_optimizer_before_patch.py), and PEFT's LoRA on a patched model's gate/up
with the user's own LoraConfig wraps them (training: tests/training_stack/test_peft_order.py)."""

import warnings

import pytest
import torch
from helpers import tiny_model

from swiglu_patch import apply_fused_mlp, unpatch


def test_patching_trainable_weights_in_train_mode_is_quiet_and_reports():
    """No optimizer holds the old weights: no warning; the report still says what to do."""
    model = tiny_model("llama").train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = apply_fused_mlp(model, backend="torch")
    assert report.trainable and "build the optimizer after patching" in str(report)


def test_inference_patch_is_quiet():
    """from_pretrained returns eval mode with weights that require grad: no warning there, the report says it."""
    model = tiny_model("llama")  # eval mode
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = apply_fused_mlp(model)
    assert report.trainable and "optimizer" not in str(report)
    frozen = tiny_model("llama").requires_grad_(False).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not apply_fused_mlp(frozen).trainable


def test_an_optimizer_built_after_patching_updates_the_packed_weight():
    model = tiny_model("llama").train()
    apply_fused_mlp(model, backend="torch")
    packed = model.model.layers[0].mlp.gate_up_interleaved
    before = packed.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randint(3, 100, (1, 5))).logits.sum().backward()
    opt.step()
    assert not torch.equal(packed.detach(), before)


@pytest.fixture
def peft():
    return pytest.importorskip("peft", reason="needs peft (pip install peft) for the LoRA guard")


@pytest.mark.parametrize("targets", [["gate_proj", "up_proj", "down_proj"], ["gate_proj"], ["up_proj", "q_proj"]])
def test_lora_on_patched_gate_up_wraps_the_targets(peft, targets):
    model = tiny_model("llama")
    apply_fused_mlp(model)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))
    wrapped = {n.rsplit(".", 1)[-1] for n, m in lora.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == set(targets)


def test_lora_after_unpatch_wraps_gate_and_up(peft):
    model = tiny_model("llama")
    apply_fused_mlp(model)
    unpatch(model)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"]))
    wrapped = {n.rsplit(".", 1)[-1] for n, m in lora.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {"gate_proj", "up_proj", "down_proj"}


def test_lora_on_down_proj_alone_still_works(peft):
    model = tiny_model("llama")
    apply_fused_mlp(model)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["down_proj"]))
    assert any(n.endswith("mlp.down_proj") and hasattr(m, "lora_A") for n, m in lora.named_modules())
