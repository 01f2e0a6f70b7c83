"""An optimizer built before `apply_fused_mlp`: its next step is refused with the fix, and
`repoint_optimizer` moves it (parameters and state) onto the packed weights so that training goes
on exactly as the unpatched model's would (fp32, AdamW and SGD with momentum, Llama and Phi-3)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import rel_err, tiny_model
from training_common import assert_losses_close, device_of, token_batches, train, train_backends

from swiglu_patch import apply_fused_mlp, unpatch
from swiglu_patch.optimizer import repoint_optimizer

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=5e-2, momentum=0.9),
}


@pytest.mark.parametrize("backend", train_backends())
@pytest.mark.parametrize("family,opt_name", [("llama", "adamw"), ("llama", "sgd"), ("phi3", "adamw")])
def test_repointed_optimizer_continues_as_unpatched(family, opt_name, backend):
    batches = token_batches(6, 2, 12, 128)
    ref = tiny_model(family, device=device_of(backend), **({"mlp_bias": True} if family == "llama" else {}))  # packed biases move too
    model = copy.deepcopy(ref)
    ref_losses = train(ref, batches, optimizer=OPTIMIZERS[opt_name](ref.parameters()))

    opt = OPTIMIZERS[opt_name](model.parameters())
    losses = train(model, batches[:3], optimizer=opt)
    apply_fused_mlp(model, backend=backend)
    assert repoint_optimizer(opt) == (4 if family == "llama" else 2)  # per MLP: weight (+ bias)
    losses += train(model, batches[3:], optimizer=opt)
    assert_losses_close(losses, ref_losses, 1e-5, f"{family} {opt_name}: patched mid-training")
    unpatch(model)
    ref_state = ref.state_dict()
    assert model.state_dict().keys() == ref_state.keys()
    for k, v in model.state_dict().items():
        assert rel_err(v, ref_state[k]) < 1e-5, k


def test_stale_optimizer_is_refused_at_step():
    model = tiny_model("llama").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    apply_fused_mlp(model, backend="torch")
    ids = token_batches(1, 2, 8, 128)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match="repoint_optimizer"):
        opt.step()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built after patching: steps
    fresh.step()
    frozen = tiny_model("llama").requires_grad_(False)  # inference: nothing trainable was packed, nothing refused
    frozen_opt = torch.optim.SGD(frozen.parameters(), lr=0.1)
    apply_fused_mlp(frozen, backend="torch")
    frozen_opt.step()


def test_gate_and_up_in_different_groups_are_refused():
    model = tiny_model("llama")
    gates = [layer.mlp.gate_proj.weight for layer in model.model.layers]
    others = [p for p in model.parameters() if all(p is not g for g in gates)]
    opt = torch.optim.AdamW([{"params": gates, "lr": 1e-3}, {"params": others}], lr=1e-2)
    before = [list(g["params"]) for g in opt.param_groups]
    apply_fused_mlp(model, backend="torch")
    with pytest.raises(ValueError, match="different param groups"):
        repoint_optimizer(opt)
    assert [list(g["params"]) for g in opt.param_groups] == before, "a refused repoint changed the optimizer"
    only_gate = torch.optim.AdamW(copy.copy(gates), lr=1e-2)
    with pytest.raises(ValueError, match="but not up"):
        repoint_optimizer(only_gate)


def _optimizer_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "optimizer" in str(w.message)]


def test_patching_warns_only_when_an_optimizer_holds_the_old_weights():
    """Mid-training (an optimizer that has stepped holds gate/up): one warning naming the fix.
    Built after patching (the README's order), or built before but not stepped yet (its first
    step raises, above): no warning."""
    ids = token_batches(1, 2, 8, 128)[0]
    model = tiny_model("llama").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    found = _optimizer_warnings(lambda: apply_fused_mlp(model, backend="torch"))
    assert found and all("repoint_optimizer" in w and "AdamW" in w for w in found), found

    readme = tiny_model("llama")
    assert _optimizer_warnings(lambda: apply_fused_mlp(readme.train(), backend="torch")) == []
    after = torch.optim.AdamW(readme.parameters(), lr=1e-3)
    assert _optimizer_warnings(lambda: (readme(ids, labels=ids).loss.backward(), after.step())) == []

    unstepped = tiny_model("llama").train()
    held = torch.optim.SGD(unstepped.parameters(), lr=0.1)
    assert _optimizer_warnings(lambda: apply_fused_mlp(unstepped, backend="torch")) == []
    assert held.param_groups[0]["params"], "the optimizer was alive while patching"
