"""PEFT's LoRA on a patched MoE model beyond one training step: saving, loading, 16-bit, refusals, unpatch.

- Adapter files of a patched model are byte-for-byte plain PEFT's, and load into plain
  transformers + PEFT to give the same logits.
- fp16 on the Triton kernels (interpreter): every adapter gradient within twice plain PEFT's own
  fp16 error against float64 PEFT (which, in 16-bit, would build W + s*B@A twice per forward).
- Several active adapters run fused as their sum; a refused adapter (rank past 128) is named in a warning and
  runs PEFT's own path, with PEFT's results.
- `disable_adapter` and `unpatch` give PEFT's own behaviour.
- A step with LoRA on attention and the experts, gradient-checkpointed or under torch.compile: plain PEFT's.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

from swiglu_patch import unpatch
from moe.test_experts_peft import DEVICE, TARGETS, _config, _rel, never_materialized, patched_peft
from zoo.tiny_zoo import build

IDS = (2, 9)


def _ids():
    return torch.randint(3, 100, IDS, device=DEVICE)


def test_saved_adapters_are_plain_pefts_and_load_in_plain_transformers(tmp_path):
    base = build("qwen3_moe").model.to(DEVICE).float()
    ref = get_peft_model(copy.deepcopy(base), _config("qwen3_moe"))
    ours = patched_peft(base, _config("qwen3_moe"), "patch_then_peft", "triton")
    ours.load_state_dict(ref.state_dict())
    ids = _ids()
    with torch.no_grad(), never_materialized():
        logits = ours(ids).logits
    ref.save_pretrained(tmp_path / "ref")
    ours.save_pretrained(tmp_path / "ours")
    mine, theirs = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("ours", "ref"))
    assert mine.keys() == theirs.keys() and any("experts" in k for k in mine)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    configs = [json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ours", "ref")]
    assert configs[0] == configs[1]
    plain = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "ours")
    with torch.no_grad():
        assert _rel(plain(ids).logits, logits) < 1e-5


def test_fp16_gradients_within_twice_plain_pefts_own_error():
    base = build("qwen3_moe").model.to(DEVICE).float()
    config = _config("qwen3_moe")
    base64 = copy.deepcopy(base).double()
    base64.set_experts_implementation("eager")  # grouped_mm takes no float64
    ref64 = get_peft_model(base64, config)
    state = ref64.state_dict()
    theirs = get_peft_model(copy.deepcopy(base).half(), _config("qwen3_moe"))
    ours = patched_peft(base.half(), _config("qwen3_moe"), "patch_then_peft", "triton")
    for model in (theirs, ours):
        model.load_state_dict({k: v.half() for k, v in state.items()})
    ids = _ids()
    grads = []
    for model in (ref64, theirs, ours):
        with never_materialized() if model is ours else torch.enable_grad():
            model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if "lora_" in n and "experts" in n})
    assert grads[0]
    for name, g64 in grads[0].items():
        err, own = _rel(grads[2][name], g64), _rel(grads[1][name], g64)
        assert err <= 2 * own + 2e-3, f"{name}: {err:.3g} against plain PEFT's fp16 {own:.3g}"


def test_several_active_adapters_run_fused_as_their_sum():
    base = build("qwen3_moe").model.to(DEVICE).float()
    models = [get_peft_model(copy.deepcopy(base), _config("qwen3_moe")),
              patched_peft(base, _config("qwen3_moe"), "patch_then_peft", "triton")]
    for model in models:
        model.add_adapter("second", LoraConfig(r=3, lora_alpha=5, target_modules=[],
                                               target_parameters=TARGETS["qwen3_moe"], init_lora_weights=False))
        model.base_model.set_adapter(["default", "second"])
    models[1].load_state_dict(models[0].state_dict())
    ids = _ids()
    losses, grads = [], []
    for model in models:
        with never_materialized() if model is models[1] else torch.enable_grad():
            loss = model(ids, labels=ids).loss
            loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters() if "lora_" in n and "experts" in n})
    assert abs(losses[1] - losses[0]) <= 1e-5 * abs(losses[0])
    assert any("second" in n for n in grads[0])
    for name, g in grads[0].items():
        assert _rel(grads[1][name], g) < 1e-4, name


def test_a_refused_adapter_is_named_and_runs_as_peft():
    """Rank 130 (past the segments' 128): a warning naming it, then PEFT's own path, with PEFT's logits."""
    base = build("qwen3_moe").model.to(DEVICE).float()
    config = lambda: LoraConfig(r=130, lora_alpha=8, target_modules=[], target_parameters=TARGETS["qwen3_moe"],  # noqa: E731
                                init_lora_weights=False)
    ref = get_peft_model(copy.deepcopy(base), config())
    ours = patched_peft(base, config(), "patch_then_peft", "triton")
    ours.load_state_dict(ref.state_dict())
    ids = _ids()
    with torch.no_grad():
        with pytest.warns(UserWarning, match="materialized W [+] s[*]B@A for rank 130"):
            logits = ours(ids).logits
        assert _rel(logits, ref(ids).logits) < 1e-5


def test_disable_adapter_and_unpatch_are_pefts_own():
    base = build("qwen3_moe").model.to(DEVICE).float()
    ref = get_peft_model(copy.deepcopy(base), _config("qwen3_moe"))
    ours = patched_peft(base, _config("qwen3_moe"), "peft_then_patch", "triton")
    ours.load_state_dict(ref.state_dict())
    ids = _ids()
    with torch.no_grad():
        with ref.disable_adapter(), ours.disable_adapter():
            assert _rel(ours(ids).logits, ref(ids).logits) < 1e-5
        assert unpatch(ours) > 0
        with pytest.raises(AssertionError, match="materialized"), never_materialized():
            ours(ids)  # unpatched: PEFT's own path again
        assert _rel(ours(ids).logits, ref(ids).logits) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["checkpointing", "compile"])
def test_a_step_with_attention_and_experts_lora_checkpointed_or_compiled(mode):
    """LoRA on q_proj and the experts; gradient checkpointing, or torch.compile of the step: plain PEFT's loss
    and adapter gradients, the experts' delta never built."""
    base = build("qwen3_moe").model.to(DEVICE).float()
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    config = lambda: LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=targets,  # noqa: E731
                                init_lora_weights=False)
    ref = get_peft_model(copy.deepcopy(base), config())
    ours = patched_peft(base, config(), "patch_then_peft", "triton")
    ours.load_state_dict(ref.state_dict())
    if mode == "checkpointing":
        for model in (ref, ours):
            model.train()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
    ids = _ids()
    losses, grads = [], []
    for model in (ref, ours):
        step = lambda i, m=model: m(i, labels=i).loss  # noqa: E731
        if mode == "compile" and model is ours:
            step = torch.compile(step)
        with never_materialized() if model is ours else torch.enable_grad():
            loss = step(ids)
            loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters() if "lora_" in n})
    assert abs(losses[1] - losses[0]) <= 1e-5 * abs(losses[0])
    assert any("q_proj" in n for n in grads[0]) and any("experts" in n for n in grads[0])
    for name, g in grads[0].items():
        assert _rel(grads[1][name], g) < 1e-4, name
