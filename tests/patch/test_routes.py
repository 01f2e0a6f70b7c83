"""FusedGatedMLP's routes, as a table: which named route each kind of call takes, that the module
runs it and shows it in its repr, and that `from_original` (not the constructor) frees and marks
the original's weights."""

import pytest
import torch
from helpers import tiny_model
from torch import nn

from swiglu_patch import FusedGatedMLP, apply_fused_mlp
from swiglu_patch import module as fused_module
from swiglu_patch.registry import structure_of

# (autograd on, down projection, an input requires grad, LoRA on gate/up) -> route
ROUTE_TABLE = [
    # autograd off: inference, with the low-rank segment when LoRA wraps gate/up
    *[((False, down, trains, False), "inference") for down in ("plain", "lora", "module") for trains in (False, True)],
    *[((False, down, trains, True), "low_rank_inference") for down in ("plain", "lora", "module")
      for trains in (False, True)],
    # autograd on, a plain nn.Linear down: the training op when something requires grad
    ((True, "plain", True, False), "training_op"),
    ((True, "plain", True, True), "training_op"),
    ((True, "plain", False, False), "inference"),
    ((True, "plain", False, True), "low_rank_inference"),
    # autograd on, PEFT's LoRA on down: the op returning h (its adapters train from it)
    *[((True, "lora", trains, low_rank), "training_op_lora_down") for trains in (False, True)
      for low_rank in (False, True)],
    # autograd on, any other down module (hooks, other wrappers): it runs as itself after the gated GEMM
    ((True, "module", True, False), "inference"),
    ((True, "module", False, False), "inference"),
    ((True, "module", True, True), "low_rank_inference"),
    ((True, "module", False, True), "low_rank_inference"),
]


def test_route_table_covers_every_call_once():
    cases = [case for case, _ in ROUTE_TABLE]
    assert len(cases) == len(set(cases)) == 2 * 3 * 2 * 2
    assert {name for name, _, _ in fused_module.ROUTES} == {route for _, route in ROUTE_TABLE}


@pytest.mark.parametrize("case,expected", ROUTE_TABLE, ids=[f"{c}->{r}" for c, r in ROUTE_TABLE])
def test_route_of_each_call(case, expected):
    assert fused_module.route(*case) == expected
    assert fused_module._ROUTE_OF[case] == expected


def _spy(monkeypatch):
    """Record which functional entry point the module's forward calls."""
    calls = []
    for name in ("gated_mlp_interleaved", "gated_linear_interleaved", "gated_linear_low_rank"):
        real = getattr(fused_module, name)
        monkeypatch.setattr(fused_module, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    return calls


def test_the_module_runs_its_route_and_shows_it(monkeypatch):
    model = tiny_model("llama").train()
    apply_fused_mlp(model, backend="torch")
    mlp = model.model.layers[0].mlp
    calls = _spy(monkeypatch)
    x = torch.randn(2, 3, mlp.gate_up_interleaved.shape[1])
    assert mlp.routes() == ("training_op", "inference")
    assert "route='training_op' (autograd on) / 'inference' (off)" in repr(mlp)
    mlp(x).sum().backward()
    with torch.no_grad():
        mlp(x)
    assert calls == ["gated_mlp_interleaved", "gated_linear_interleaved"]
    assert mlp.gate_up_interleaved.grad is not None
    model.requires_grad_(False)  # frozen: the inference route, autograd on or off
    calls.clear()
    mlp(x)
    assert calls == ["gated_linear_interleaved"] and mlp.routes() == ("inference", "inference")
    mlp(x.requires_grad_())  # x alone requiring grad: the training op (its gradient flows to x)
    assert calls[-1] == "gated_mlp_interleaved"


def test_a_hooked_down_projection_runs_as_a_module(monkeypatch):
    model = tiny_model("llama").train()
    apply_fused_mlp(model, backend="torch")
    mlp = model.model.layers[0].mlp
    seen = []
    mlp.down.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    calls = _spy(monkeypatch)
    assert mlp.routes() == ("inference", "inference")
    mlp(torch.randn(4, mlp.gate_up_interleaved.shape[1])).sum().backward()
    assert calls == ["gated_linear_interleaved"] and len(seen) == 1
    assert mlp.gate_up_interleaved.grad is not None  # the torch backend's gated GEMM is differentiable


def test_lora_on_down_takes_the_op_returning_h(monkeypatch):
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    apply_fused_mlp(model, backend="torch")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["down_proj"], init_lora_weights=False))
    mlp = model.base_model.model.model.layers[0].mlp
    calls = _spy(monkeypatch)
    assert mlp.routes()[0] == "training_op_lora_down"
    mlp(torch.randn(3, mlp.gate_up_interleaved.shape[1])).sum().backward()
    assert calls == ["gated_mlp_interleaved"]
    assert mlp.down.lora_A["default"].weight.grad is not None


def test_the_constructor_leaves_the_original_and_from_original_frees_it():
    model = tiny_model("llama").train()
    original = model.model.layers[0].mlp
    family = structure_of(original)
    gate = original.gate_proj.weight
    fused = FusedGatedMLP(original, family, "silu", backend="torch")
    assert original.gate_proj.weight is gate and not gate.is_meta  # __init__ only reads
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.step()  # nothing marked yet: the old parameters are still the model's
    with pytest.warns(UserWarning, match="repoint_optimizer"):  # a stepped optimizer holds them: said at once
        fused = FusedGatedMLP.from_original(original, family, "silu", backend="torch")
    assert original.gate_proj.weight.is_meta and original.up_proj.weight.is_meta
    assert isinstance(fused, FusedGatedMLP) and not fused.gate_up_interleaved.is_meta
    with pytest.raises(RuntimeError, match="repoint_optimizer"):
        optimizer.step()  # it holds gate/up parameters that now live packed
    assert isinstance(fused.restore().gate_proj, nn.Linear)
    assert not original.gate_proj.weight.is_meta
