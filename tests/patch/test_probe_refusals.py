"""The probe's refusals say what they mean: a numeric mismatch on a known class points at
swiglu-patch and says how to report it; a class matched by structure alone does more math; a
forward that cannot run as the gated MLP is named."""

import pytest
import transformers
from helpers import tiny_model
from torch import nn

from swiglu_patch import PatchError, apply_fused_mlp
from swiglu_patch.kernels.epilogue import GatedEpilogue


def test_numeric_mismatch_on_a_known_class_points_at_swiglu_patch(monkeypatch):
    """A bug in the fused path (here: its epilogue off by 1%) on LlamaMLP, whose structure matches."""
    model = tiny_model("llama")
    apply = GatedEpilogue.apply
    monkeypatch.setattr(GatedEpilogue, "apply", lambda self, g, u: apply(self, g, u) * 1.01)
    with pytest.raises(PatchError) as info:
        apply_fused_mlp(model)
    msg = str(info.value)
    assert "model.layers.0.mlp (LlamaMLP): the numeric probe differs" in msg
    assert "the fused path disagrees with LlamaMLP.forward" in msg
    assert "points at swiglu-patch itself" in msg and "not at your model" in msg
    assert "open an issue" in msg and "model type (llama)" in msg and f"transformers version ({transformers.__version__})" in msg


def test_numeric_mismatch_on_an_unknown_class_means_more_math():
    class Scaled(nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 1.5)

    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.mlp = Scaled(layer.mlp)
    with pytest.raises(PatchError) as info:
        apply_fused_mlp(model)
    msg = str(info.value)
    assert "(Scaled): the numeric probe differs" in msg and "Scaled is not in swiglu-patch's registry" in msg
    assert "points at swiglu-patch" not in msg


def test_structural_mismatch_names_the_class():
    class Reshapes(nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)).view(-1, 4096)

    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.mlp = Reshapes(layer.mlp)
    with pytest.raises(PatchError, match=r"forward failed on the probe's small copy .*Reshapes is not built as the gated MLP"):
        apply_fused_mlp(model)
