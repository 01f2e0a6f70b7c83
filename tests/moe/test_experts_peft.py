"""PEFT's LoRA on the experts' 3-D weights (`target_parameters`) on a patched MoE model.

PEFT's `ParamWrapper` parametrizes ``gate_up_proj`` and ``down_proj`` (the weight a forward
reads is W + s * B @ A, materialized as PEFT does); the fused experts read the parametrized
weight, so the kernels run on it and autograd carries the gradient back to A and B. Checked in
both orders (patch then `get_peft_model`, and the reverse), on the PyTorch path and the Triton
kernels (the interpreter on CPU, fp32): logits, loss and every adapter gradient equal plain
PEFT's on the unpatched model; `merge_and_unload` gives the same weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from swiglu_patch import apply_fused_mlp
from zoo.tiny_zoo import build

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TARGETS = {"qwen3_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
           "gpt_oss": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def _config(model_type: str) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=TARGETS[model_type],
                      init_lora_weights=False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("order", ["patch_then_peft", "peft_then_patch"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_lora_on_experts_trains_as_plain_peft(model_type, order, backend):
    base = build(model_type).model.to(DEVICE).float()
    ref = get_peft_model(copy.deepcopy(base), _config(model_type))
    ours = copy.deepcopy(base)
    if order == "patch_then_peft":
        apply_fused_mlp(ours, backend=backend)
        ours = get_peft_model(ours, _config(model_type))
    else:
        ours = get_peft_model(ours, _config(model_type))
        report = apply_fused_mlp(ours, backend=backend)
        assert report.experts, "the experts under PEFT's wrapper were not switched"
    ours.load_state_dict(ref.state_dict())
    lora = [n for n, _ in ref.named_parameters() if "lora_" in n]
    assert any("experts" in n for n in lora)
    ids = torch.randint(3, 100, (2, 9), device=DEVICE)
    losses, grads = [], []
    for model in (ref, ours):
        out = model(ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters() if "lora_" in n})
    assert abs(losses[1] - losses[0]) <= 1e-5 * abs(losses[0])
    assert grads[0].keys() == grads[1].keys() == set(lora)
    for name in lora:
        assert grads[1][name] is not None and _rel(grads[1][name], grads[0][name]) < 1e-4, name
    with torch.no_grad():
        merged_ref, merged = ref.merge_and_unload(), ours.merge_and_unload()
    ref_state = merged_ref.state_dict()
    assert all(torch.allclose(t, ref_state[k], atol=1e-6) for k, t in merged.state_dict().items() if "experts" in k)
