"""MoE models patched end to end: transformers' experts classes on the fused experts kernels.

Tiny random models (the zoo's `build`) of one family per layout and gate, patched with the
Triton backend (the interpreter on CPU, fp32): logits and greedy tokens equal eager's; the
report names every experts module; unpatch restores the implementation and leaves the state
dict bit for bit; `save_pretrained` reloads in plain transformers. Classes whose math the
kernels do not run are refused with the reason. (The zoo runs every MoE family through the
PyTorch path; tests/zoo.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.integrations.moe import use_experts_implementation

from swiglu_patch import PatchError, apply_fused_mlp, is_patched, unpatch
from swiglu_patch.experts import IMPLEMENTATION, experts_spec, register_implementation
from swiglu_patch.registry import Refused
from zoo.tiny_zoo import build

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAMILIES = [  # (model_type, variant): one per layout and gate
    ("qwen3_moe", "default"),  # chunked [gate; up], silu
    ("gpt_oss", "default"),  # transposed, interleaved, biased, gpt-oss's clamped SwiGLU
    ("qwen2_moe", "default"),  # a shared expert beside the routed ones (a dense MLP, fused as such)
    ("deepseek_v4", "swiglu_limit"),  # silu with the gate clamped
    ("olmoe", "default"),
]


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


def _greedy(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("model_type, variant", FAMILIES)
def test_patched_moe_model_matches_eager_on_the_triton_kernels(model_type, variant):
    model = build(model_type, variant).model.to(DEVICE)
    ids = torch.randint(3, 100, (2, 9), device=DEVICE)
    ref, tokens = _logits(model, ids), _greedy(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = apply_fused_mlp(model, backend="triton")
    assert report.experts and set(report.experts) <= set(report.patched)
    assert all(model.get_submodule(n).config._experts_implementation == IMPLEMENTATION for n in report.experts)
    out = _logits(model, ids)
    assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    assert torch.equal(_greedy(model, ids), tokens)
    assert unpatch(model) == len(report.patched) and not is_patched(model)
    assert all(model.get_submodule(n).config._experts_implementation != IMPLEMENTATION for n in report.experts)
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    assert torch.equal(_logits(model, ids), ref)


def test_patched_moe_model_saves_a_checkpoint_plain_transformers_loads(tmp_path):
    model = build("qwen3_moe").model
    ids = torch.randint(3, 100, (1, 7))
    ref = _logits(model, ids)
    apply_fused_mlp(model)
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not is_patched(plain) and plain.config._experts_implementation != IMPLEMENTATION
    assert torch.allclose(_logits(plain, ids), ref, rtol=0, atol=1e-5 * ref.abs().max().item())


def test_from_pretrained_and_set_experts_implementation_select_ours(tmp_path):
    build("mixtral").model.save_pretrained(tmp_path)
    register_implementation()
    model = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation=IMPLEMENTATION)
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
    ids = torch.randint(3, 100, (1, 6))
    assert model.config._experts_implementation == IMPLEMENTATION
    assert torch.allclose(_logits(model, ids), _logits(eager, ids), rtol=0, atol=1e-5)
    eager.set_experts_implementation(IMPLEMENTATION)
    assert eager.config._experts_implementation == IMPLEMENTATION


def _experts_class(**flags):
    @use_experts_implementation(**flags)
    class ToyExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 8))
            self.up_proj = nn.Parameter(torch.randn(4, 8, 8))
            self.down_proj = nn.Parameter(torch.randn(4, 8, 8))
            self.act_fn = nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

    return ToyExperts


class _Config:
    _experts_implementation = "grouped_mm"


def test_experts_the_kernels_do_not_run_are_refused_with_the_reason():
    no_gate = _experts_class()(_Config())
    no_gate.has_gate = False  # the decorator's flag (set as transformers sets it)
    with pytest.raises(Refused, match="has_gate=False"):
        experts_spec(no_gate)
    post_norm = _experts_class()(_Config())
    post_norm.has_post_expert_norm = True  # a flag older transformers versions do not take
    with pytest.raises(Refused, match="has_post_expert_norm=True"):
        experts_spec(post_norm)
    odd = _experts_class()
    odd._apply_gate = lambda self, gate_up: gate_up[..., :8] * gate_up[..., 8:]
    with pytest.raises(Refused, match="_apply_gate .* is not one the fused kernels"):
        experts_spec(odd(_Config()))

    class Custom(nn.Module):  # 3-D experts without the decorator
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 8))

    with pytest.raises(Refused, match="not transformers' @use_experts_implementation"):
        experts_spec(Custom())


def test_a_wrong_reading_of_a_class_is_caught_by_the_probe(monkeypatch):
    """Negative control: a gate table entry that misreads gpt-oss (no clamp) is refused by the probe."""
    import swiglu_patch.experts as experts
    from swiglu_patch.kernels.epilogue import GatedEpilogue
    from swiglu_patch.kernels.experts_reference import ExpertsEpilogue

    key = "transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts._apply_gate"
    monkeypatch.setitem(experts.KNOWN_GATES, key, lambda m: ExpertsEpilogue(GatedEpilogue("silu")))
    model = build("gpt_oss").model
    with pytest.raises(PatchError, match="differ from its eager forward .* please report it"):
        apply_fused_mlp(model)
    assert not is_patched(model)
    report = apply_fused_mlp(model, strict=False)
    assert not report.experts and any(n.module_class == "GptOssExperts" for n in report.not_patched)


def test_a_training_step_on_a_patched_moe_model_matches_the_unpatched_one():
    """Where autograd needs a gradient the patched experts train on their own backward (on CPU through the
    differentiable `experts_reference`): loss and every gradient (experts and router included) as without the patch."""
    ids = torch.randint(3, 100, (2, 9))
    grads = []
    for patched in (False, True):
        model = build("qwen3_moe").model.train()
        if patched:
            apply_fused_mlp(model)
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss0, g0), (loss1, g1) = grads
    assert torch.allclose(loss0, loss1, rtol=1e-6)
    assert g0.keys() == g1.keys() and any("experts" in n for n in g0) and any("gate.weight" in n for n in g0)
    assert all(torch.allclose(g0[n], g1[n], rtol=1e-5, atol=1e-7) for n in g0)
