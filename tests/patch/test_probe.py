"""The numeric probe: passes what equals the fused module up to fp32 rounding, fails any dropped
piece of math (a multiplier, a clamp, a norm, a bias, swapped gate/up), never reads or changes the
module's weights or the global RNG, and runs once per class and setting, not per layer."""

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_model
from torch import nn

from swiglu_patch import GatedEpilogue, PatchError, apply_fused_mlp
from swiglu_patch.probe import TOLERANCE, NotProven, probe
from swiglu_patch.registry import STRUCTURES

PLAIN = STRUCTURES[0]  # gate_proj, up_proj, down_proj, act_fn


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), and `twist` for what a subclass computes on top."""

    def __init__(self, k=64, i=72, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(k, i, bias=bias)
        self.up_proj = nn.Linear(k, i, bias=bias)
        self.down_proj = nn.Linear(i, k, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class InFloat64(GatedMLP):
    """The same math through float64 and back: differs from the fused module by rounding only."""

    def forward(self, x):
        def lin64(lin):
            return F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())

        g, u = lin64(self.gate_proj), lin64(self.up_proj)
        h = (F.silu(g) * u).float()
        return self.down_proj(h)


class UpTimesAct(GatedMLP):
    """Equal math in another order (Falcon-H1 writes up * act(gate))."""

    def forward(self, x):
        return self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))


class Multiplier(GatedMLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x) * 1.001) * self.up_proj(x))


class Clamped(GatedMLP):
    limit = 7.0

    def forward(self, x):
        g = self.gate_proj(x).clamp(max=self.limit)
        u = self.up_proj(x).clamp(-self.limit, self.limit)
        return self.down_proj(self.act_fn(g) * u)


class Normed(GatedMLP):
    def forward(self, x):
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


class Swapped(GatedMLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


class DropsBias(GatedMLP):
    def forward(self, x):
        g = F.linear(x, self.gate_proj.weight)
        return self.down_proj(self.act_fn(g) * self.up_proj(x))


@pytest.mark.parametrize("cls", [GatedMLP, InFloat64, UpTimesAct])
@pytest.mark.parametrize("bias", [False, True])
def test_equal_math_passes_far_under_the_tolerance(cls, bias):
    err = probe(cls(bias=bias), PLAIN, GatedEpilogue("silu"))
    assert err <= TOLERANCE / 10, f"rounding alone reached {err:.2g}: too close to the tolerance {TOLERANCE:g}"


@pytest.mark.parametrize("cls, bias, why", [
    (Multiplier, False, "a gate multiplier of 1.001"),
    (Clamped, False, "a clamp at 7"),
    (Normed, False, "an RMS norm of h"),
    (Swapped, False, "gate and up swapped"),
    (DropsBias, True, "a dropped gate bias"),
])
def test_dropped_math_fails(cls, bias, why):
    with pytest.raises(NotProven, match="numeric probe differs"):
        probe(cls(bias=bias), PLAIN, GatedEpilogue("silu"))


def test_clamp_shows_only_at_large_scale_and_the_right_epilogue_passes():
    """The clamp's effect is visible at scale 30 and 1000, not 1: the probe names the scale."""
    with pytest.raises(NotProven, match="at input scale 30"):
        probe(Clamped(), PLAIN, GatedEpilogue("silu"))
    assert probe(Clamped(), PLAIN, GatedEpilogue("silu", limit=7.0, clamp="gate")) <= TOLERANCE / 10
    with pytest.raises(NotProven):  # the other clamp flavour is another function
        probe(Clamped(), PLAIN, GatedEpilogue("silu", limit=7.0, clamp="activation"))


def test_wrong_activation_fails():
    with pytest.raises(NotProven):
        probe(GatedMLP(), PLAIN, GatedEpilogue("gelu"))


def test_probe_never_touches_weights_or_the_global_rng():
    mlp = GatedMLP()
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    rng = torch.get_rng_state()
    probe(mlp, PLAIN, GatedEpilogue("silu"))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in mlp.state_dict().items())
    assert mlp.gate_proj.weight.device.type == "cpu" and type(mlp.gate_proj) is nn.Linear
    with torch.device("meta"):  # it needs only the class: weights on the meta device are fine
        on_meta = GatedMLP()
    assert probe(on_meta, PLAIN, GatedEpilogue("silu")) <= TOLERANCE / 10


def test_forward_that_is_not_one_tensor_in_one_tensor_out():
    class TwoOutputs(GatedMLP):
        def forward(self, x):
            return super().forward(x), None

    with pytest.raises(NotProven, match="returns tuple, not one tensor"):
        probe(TwoOutputs(), PLAIN, GatedEpilogue("silu"))

    class Fails(GatedMLP):
        def forward(self, x):
            return x.view(-1, 4096)

    with pytest.raises(NotProven, match="forward failed on the probe's small copy"):
        probe(Fails(), PLAIN, GatedEpilogue("silu"))


def test_one_probe_per_class_and_setting_not_per_layer():
    model = tiny_model("llama", num_hidden_layers=12)
    report = apply_fused_mlp(model)
    assert len(report.patched) == 12 and report.probes == 1


def test_unknown_class_with_more_math_is_refused_by_the_probe():
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.mlp.__class__ = Multiplier
    with pytest.raises(PatchError, match=r"model.layers.0.mlp \(Multiplier\): the numeric probe differs.*strict=False"):
        apply_fused_mlp(model)
    report = apply_fused_mlp(model, strict=False)
    assert not report.patched and [n.name for n in report.not_patched] == ["model.layers.0.mlp", "model.layers.1.mlp"]
