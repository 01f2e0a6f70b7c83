"""Gradient checkpointing (`gradient_checkpointing_enable`, reentrant and not) through the fused
MLP: the same gradients as without it, and as the unpatched model's; full fine-tuning and LoRA."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import rel_err, tiny_model
from peft import LoraConfig, get_peft_model
from training_common import device_of, token_batches, train_backends

from swiglu_patch import apply_fused_mlp
from swiglu_patch.kernels.layout import interleave_gate_up


def grads(model, ids, mlp_calls: int = 1) -> dict[str, torch.Tensor]:
    """Parameter gradients of one causal-LM step; checks the first MLP was entered `mlp_calls`
    times (2 under checkpointing: the forward, then its replay in backward, which stops early
    inside the MLP once the last saved tensor is recomputed: a pre-hook sees it, a hook would not)."""
    mlp = next(m for name, m in model.named_modules() if name.endswith("layers.0.mlp"))
    calls = []
    handle = mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = ids.to(next(model.parameters()).device)
    model.train()
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    handle.remove()
    assert len(calls) == mlp_calls, f"the MLP ran {len(calls)} times, expected {mlp_calls}"
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("backend", train_backends())
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_full_fine_tuning_gradients(reentrant, backend):
    ids = token_batches(1, 2, 12, 128)[0]
    base = tiny_model("llama", device=device_of(backend))
    ref = grads(copy.deepcopy(base), ids)
    model = copy.deepcopy(base)
    apply_fused_mlp(model, backend=backend)
    plain = grads(model, ids)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    checkpointed = grads(model, ids, mlp_calls=2)
    assert plain.keys() == checkpointed.keys()
    for k in plain:  # recomputation replays the same ops: the same bits
        assert torch.equal(checkpointed[k], plain[k]), k
    for layer in range(2):
        key = f"model.layers.{layer}.mlp."
        packed_ref = interleave_gate_up(ref[key + "gate_proj.weight"], ref[key + "up_proj.weight"])
        assert rel_err(checkpointed[key + "gate_up_interleaved"], packed_ref) < 1e-5
        assert rel_err(checkpointed[key + "down_proj.weight"], ref[key + "down_proj.weight"]) < 1e-5


@pytest.mark.parametrize("backend", train_backends())
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_lora_gradients(reentrant, backend):
    ids = token_batches(1, 2, 12, 128)[0]
    config = dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False)
    base = tiny_model("llama", device=device_of(backend))
    torch.manual_seed(0)
    ref = get_peft_model(copy.deepcopy(base), LoraConfig(**config))
    patched = copy.deepcopy(base)
    apply_fused_mlp(patched, backend=backend)
    torch.manual_seed(0)
    model = get_peft_model(patched, LoraConfig(**config))
    plain = grads(model, ids)
    # PEFT's recipe: the frozen embeddings' output must require grad for reentrant checkpointing
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    checkpointed, ref_grads = grads(model, ids, mlp_calls=2), grads(ref, ids)
    assert checkpointed.keys() == ref_grads.keys() and len(checkpointed) == 12
    for k in checkpointed:
        assert torch.equal(checkpointed[k], plain[k]), k
        assert rel_err(checkpointed[k], ref_grads[k]) < 1e-5, k
