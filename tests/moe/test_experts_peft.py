"""PEFT's LoRA on the experts' 3-D weights (`target_parameters`) on a patched MoE model, inside the grouped GEMMs.

PEFT's `ParamWrapper` would parametrize ``gate_up_proj`` and ``down_proj`` (W + s * B @ A, the whole
expert stack built on every forward); on a patched model `swiglu_patch.experts_lora` binds the
adapter to the fused experts instead, which add it inside the grouped GEMMs. Checked in both
orders (patch then `get_peft_model`, and the reverse), on the PyTorch path and the Triton kernels
(the interpreter on CPU, fp32), with PEFT's ways of building the full weight made to raise while
ours runs: logits, loss and every adapter gradient equal plain PEFT's on the unpatched model;
`merge_and_unload` gives the same weights.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import ParamWrapper

from swiglu_patch import apply_fused_mlp
from zoo.tiny_zoo import build

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TARGETS = {"qwen3_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
           "gpt_oss": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def _config(model_type: str, targets=None) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=targets or TARGETS[model_type],
                      init_lora_weights=False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@contextlib.contextmanager
def never_materialized():
    """PEFT's ways of building W + s*B@A (its delta, its factors' baddbmm, the parametrization) raise inside."""
    def refuse(*args, **kwargs):
        raise AssertionError("the LoRA delta on the experts was materialized")

    saved = {name: getattr(ParamWrapper, name) for name in ("get_delta_weight", "get_delta_factors")
             if hasattr(ParamWrapper, name)}
    register = torch.nn.utils.parametrize.register_parametrization
    for name in saved:
        setattr(ParamWrapper, name, refuse)
    torch.nn.utils.parametrize.register_parametrization = refuse
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(ParamWrapper, name, fn)
        torch.nn.utils.parametrize.register_parametrization = register


def patched_peft(base, config, order: str, backend: str):
    """`base` (copied) with PEFT's adapters, patched before or after `get_peft_model`."""
    ours = copy.deepcopy(base)
    if order == "patch_then_peft":
        apply_fused_mlp(ours, backend=backend)
        return get_peft_model(ours, config)
    ours = get_peft_model(ours, config)
    report = apply_fused_mlp(ours, backend=backend)
    assert report.experts, "the experts under PEFT's wrapper were not switched"
    return ours


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("order", ["patch_then_peft", "peft_then_patch"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_lora_on_experts_trains_as_plain_peft(model_type, order, backend):
    base = build(model_type).model.to(DEVICE).float()
    ref = get_peft_model(copy.deepcopy(base), _config(model_type))
    ours = patched_peft(base, _config(model_type), order, backend)
    ours.load_state_dict(ref.state_dict())
    lora = [n for n, _ in ref.named_parameters() if "lora_" in n]
    assert any("experts" in n for n in lora)
    ids = torch.randint(3, 100, (2, 9), device=DEVICE)
    losses, grads = [], []
    for model in (ref, ours):
        with never_materialized() if model is ours else contextlib.nullcontext():
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


def test_the_guard_catches_plain_peft():
    """never_materialized can fail: plain PEFT on an unpatched model builds the delta."""
    model = get_peft_model(build("qwen3_moe").model.to(DEVICE).float(), _config("qwen3_moe"))
    ids = torch.randint(3, 100, (1, 5), device=DEVICE)
    with never_materialized(), pytest.raises(AssertionError, match="materialized"):
        model(ids)
