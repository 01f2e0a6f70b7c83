"""The patch report and the checks before replacement: every gated module is named, patched or left
with its reason; strict mode names module, class, reason and the way out; more math, hooks and
instance overrides are refused rather than dropped."""

import pytest
import torch
from helpers import tiny_model
from torch import nn

from swiglu_patch import PatchError, apply_fused_mlp, is_patched
from swiglu_patch.report import NotPatched, PatchReport


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_report_fields_and_text():
    model = tiny_model("qwen3")
    report = apply_fused_mlp(model)
    assert report.model_type == "qwen3" and report.patched == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert report.activations == {"model.layers.0.mlp": "silu", "model.layers.1.mlp": "silu"}
    assert report.has_gated_mlp and not report.not_patched and report.probes == 1
    assert str(report).splitlines()[0] == "apply_fused_mlp: patched 2 MLP(s) (silu), 0 gated module(s) left as they are"


def test_report_groups_modules_left_by_reason():
    why = "has_gate=False: these experts run act(up) with no gate, not a gated MLP"
    report = PatchReport(model_type="x", not_patched=[NotPatched(f"layers.{i}.experts", "XExperts", why)
                                                      for i in range(3)] + [NotPatched("merger", "M", "more math")])
    text = str(report)
    assert f"not patched: XExperts (3 modules: layers.0.experts, ..., layers.2.experts): {why}" in text
    assert "not patched: M (merger): more math" in text and "no gated MLP" not in text


class Normed(nn.Module):
    """A gated MLP with a norm between the product and down: more math than the fused module."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
        self.norm = nn.LayerNorm(mlp.gate_proj.out_features)

    def forward(self, x):
        return self.down_proj(self.norm(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


def test_more_math_is_refused_strict_and_left_lenient():
    model = tiny_model("llama")
    model.model.layers[1].mlp = Normed(model.model.layers[1].mlp)
    ids = torch.randint(3, 100, (1, 6))
    before = _logits(model, ids)
    with pytest.raises(PatchError) as err:
        apply_fused_mlp(model)
    msg = str(err.value)
    assert "cannot patch model.layers.1.mlp (Normed): it holds more than gate, up, down and the activation: norm " \
           "(LayerNorm)" in msg and "Pass strict=False to patch the 1 that can be" in msg
    assert not is_patched(model)
    report = apply_fused_mlp(model, strict=False)
    assert report.patched == ["model.layers.0.mlp"] and report.not_patched[0].module_class == "Normed"
    assert type(model.model.layers[1].mlp) is Normed
    assert torch.allclose(_logits(model, ids), before, rtol=0, atol=1e-5 * before.abs().max().item())


def test_hooks_and_instance_overrides_are_refused():
    model = tiny_model("llama")
    model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: o * 2)
    model.model.layers[1].mlp.up_proj.register_forward_pre_hook(lambda m, i: None)
    report = apply_fused_mlp(model, strict=False)
    reasons = {n.name: n.reason for n in report.not_patched}
    assert reasons["model.layers.0.mlp"].startswith("it has 1 forward/backward hook(s)")
    assert reasons["model.layers.1.mlp"].startswith("up_proj has 1 forward/backward hook(s)")

    model = tiny_model("llama")
    mlp = model.model.layers[0].mlp
    mlp.forward = lambda x: type(mlp).forward(mlp, x) * 2
    with pytest.raises(PatchError, match="its forward is overridden on the instance"):
        apply_fused_mlp(model)


def test_forward_with_more_inputs_is_refused():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
            self.act_fn = nn.SiLU()

        def forward(self, x, scale=1.0):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * scale

    with pytest.raises(PatchError, match=r"its forward takes \(x, scale\); the fused module takes one input"):
        apply_fused_mlp(nn.Sequential(TwoInputs()))

    class Keywords(TwoInputs):
        def forward(self, x, **kwargs):
            return super().forward(x, **kwargs)

    with pytest.raises(PatchError, match=r"its forward takes \(x, \*\*kwargs\)"):
        apply_fused_mlp(nn.Sequential(Keywords()))


def test_a_registry_class_that_no_longer_matches_its_record_is_refused():
    model = tiny_model("llama")
    del model.model.layers[0].mlp.act_fn
    model.model.layers[0].mlp.activation = nn.SiLU()
    report = apply_fused_mlp(model, strict=False)
    assert report.not_patched[0].reason == "the registry record names act_fn, which the module does not have"


def test_a_plain_fc1_fc2_mlp_is_no_gated_mlp():
    """fc1/fc2 is also a gated structure's name (chunked fc1), but only a [2*I, K] fc1 is one."""
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.act = nn.Linear(8, 32), nn.Linear(32, 8), nn.GELU()

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))

    report = apply_fused_mlp(nn.Sequential(Plain()), strict=False)
    assert not report.has_gated_mlp and "has no gated MLP" in str(report)
