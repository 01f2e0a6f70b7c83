"""PEFT LoRA on a patched model (`swiglu_patch.lora`), in both orders, against plain PEFT on the
unpatched model: training (losses, gradients, dropout masks), saved adapters, merged weights,
unload, several adapters, unpatching, and the refusals (QLoRA, DoRA, ...). The user's own LoraConfig
in either order: no `swiglu_patch.lora.register`, no `adapters_aside` (except to unpatch).

Tiny Llama (gate_proj/up_proj) and Phi-3 (one chunked gate_up_proj); fp32; the Triton cases on CUDA on a GPU
machine (`training_common.device_of`).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import rel_err, tiny_model
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora.layer import Linear as LoraLinear
from safetensors.torch import load_file
from training_common import device_of, token_batches, train_backends

from swiglu_patch import PatchError, apply_fused_mlp, unpatch
from swiglu_patch.lora import PackedLoraLinear, adapters_aside, register
from swiglu_patch.module import PackedProjection

TARGETS = {"llama": ["q_proj", "gate_proj", "up_proj", "down_proj"], "phi3": ["qkv_proj", "gate_up_proj", "down_proj"]}
PACKED = {"llama": ["gate_proj", "up_proj"], "phi3": ["gate_up_proj"]}
ORDERS = ["patch_then_peft", "peft_then_patch"]


def lora_config(family: str, **overrides) -> LoraConfig:
    return LoraConfig(**(dict(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=TARGETS[family]) | overrides))


def peft_pair(family: str, order: str, backend: str = "torch", **overrides):
    """(base, plain PEFT on the unpatched base, PEFT on a patched copy) with the same initial adapters,
    on `backend`'s device (`training_common.device_of`)."""
    base = tiny_model(family, device=device_of(backend))
    torch.manual_seed(0)
    ref = get_peft_model(copy.deepcopy(base), lora_config(family, **overrides))
    ours = copy.deepcopy(base)
    if order == "patch_then_peft":
        apply_fused_mlp(ours, backend=backend)
        torch.manual_seed(0)
        ours = get_peft_model(ours, lora_config(family, **overrides))
    else:
        torch.manual_seed(0)
        ours = get_peft_model(ours, lora_config(family, **overrides))
        apply_fused_mlp(ours, backend=backend)
    init, ref_init = get_peft_model_state_dict(ours), get_peft_model_state_dict(ref)
    assert init.keys() == ref_init.keys(), "PEFT targeted other modules than on the unpatched model"
    assert all(torch.equal(init[k], ref_init[k]) for k in init), "adapters drawn in another order than plain PEFT's"
    return base, ref, ours


def mlp(model, layer=0):
    return model.base_model.model.model.layers[layer].mlp


@pytest.mark.parametrize("backend", train_backends())
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_training_matches_plain_peft(family, order, backend):
    """Plain PEFT trains 4 AdamW steps. At each step ours starts from plain PEFT's adapters and gives
    the same loss and the same gradient in every adapter (1e-5), dropout drawing the same masks.

    Ours is set to plain PEFT's adapters each step rather than left on its own trajectory: AdamW
    divides each update by the gradient's running size, and where an element's gradient cancels
    across steps it turns fp32's 1e-6 into 1e-4 in the adapter (docs/history.md `lora_dropout_gpu`).
    Two free trajectories would test AdamW's conditioning, not the op."""
    _, ref, ours = peft_pair(family, order, backend)
    fused = mlp(ours)
    assert all(isinstance(getattr(fused, n), PackedLoraLinear) for n in PACKED[family])
    assert isinstance(fused.down_proj, LoraLinear) and not fused.gate_up_interleaved.requires_grad
    packed_before = fused.gate_up_interleaved.detach().clone()
    models = (ref, ours)
    trainable = [{n: p for n, p in m.named_parameters() if p.requires_grad} for m in models]
    assert trainable[1].keys() == trainable[0].keys()
    opt = torch.optim.AdamW(list(trainable[0].values()), lr=1e-2)
    for step, ids in enumerate(token_batches(4, 2, 12, 128)):
        ids = ids.to(device_of(backend))
        with torch.no_grad():
            for name, p in trainable[1].items():
                p.copy_(trainable[0][name])
        losses = []
        for model in models:
            model.train()
            torch.manual_seed(step)  # the same dropout masks in both (drawn in the same order)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[1] - losses[0]) <= 1e-5 * losses[0], (step, losses)
        for name, p in trainable[0].items():
            g, ours_g = p.grad, trainable[1][name].grad
            assert ours_g is not None, f"{name}: no gradient reached it"
            if g.norm() == 0:  # lora_A at the first step: B is still zero
                assert ours_g.norm() == 0, (step, name)
            else:
                assert rel_err(ours_g, g) < 1e-5, (step, name, rel_err(ours_g, g))
        opt.step()
        for model in models:
            model.zero_grad()
    assert torch.equal(fused.gate_up_interleaved, packed_before), "the frozen packed weight changed"


@pytest.mark.parametrize("backend", [b for b in train_backends() if b != "torch"])
@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_lora_trains_through_the_fused_op(family, backend, monkeypatch):
    """With the Triton backend, adapters on gate/up and on down_proj train inside the fused op:
    the forward runs the low-rank segment storing P, and the backward GEMM takes down_proj's
    adapter gradient as dh_in; no fallback path runs."""
    from swiglu_patch.kernels import dispatch as dispatch_training

    calls = []
    for name in ("gated_gemm_low_rank", "gated_backward"):
        real = getattr(dispatch_training, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, kwargs.get("dh_in") is not None, args[6] if _name == "gated_gemm_low_rank" else None))
            return _real(*args, **kwargs)

        monkeypatch.setattr(dispatch_training, name, spy)
    _, _, ours = peft_pair(family, "patch_then_peft", backend)
    ours.train()
    ids = token_batches(1, 2, 8, 128)[0].to(device_of(backend))
    ours(input_ids=ids, labels=ids).loss.backward()
    layers = len(ours.base_model.model.model.layers)
    assert calls.count(("gated_gemm_low_rank", False, True)) == layers, calls
    assert calls.count(("gated_backward", True, None)) == layers, calls
    assert len(calls) == 2 * layers, calls


@pytest.mark.parametrize("backend", train_backends())
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_saved_adapter_merge_and_unload_match_plain_peft(family, order, backend, tmp_path):
    base, ref, ours = peft_pair(family, order, backend, init_lora_weights=False)  # random A and B: a real update
    ids = token_batches(1, 2, 9, 128)[0].to(device_of(backend))
    ref.eval(), ours.eval()
    with torch.no_grad():
        ref_logits = ref(ids).logits
        assert rel_err(ours(ids).logits, ref_logits) < 1e-6
        base_logits = base(ids).logits
        assert rel_err(base_logits, ref_logits) > 1e-3, "the adapters change nothing: the test could not fail"

    ref.save_pretrained(tmp_path / "ref"), ours.save_pretrained(tmp_path / "ours")
    ref_files, our_files = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("ref", "ours"))
    assert our_files.keys() == ref_files.keys()
    assert all(torch.equal(our_files[k], ref_files[k]) for k in ref_files)
    configs = [json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ref", "ours")]
    assert configs[0] == configs[1]

    # the saved adapter loads onto a freshly patched base
    patched = copy.deepcopy(base)
    apply_fused_mlp(patched, backend=backend)
    loaded = PeftModel.from_pretrained(patched, tmp_path / "ours")
    with torch.no_grad():
        assert rel_err(loaded(ids).logits, ref_logits) < 1e-6

    merged_ref, merged = ref.merge_and_unload(), copy.deepcopy(ours).merge_and_unload()
    assert all(type(getattr(mlp_, n)) is PackedProjection for mlp_ in [m.mlp for m in merged.model.layers]
               for n in PACKED[family])
    with torch.no_grad():
        assert rel_err(merged(ids).logits, merged_ref(ids).logits) < 1e-6
    unpatch(merged)
    ref_state, state = merged_ref.state_dict(), merged.state_dict()
    assert state.keys() == ref_state.keys()
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state), "merged weights differ from plain PEFT's"

    unloaded = ours.unload()
    unpatch(unloaded)
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in unloaded.state_dict().items())


@pytest.mark.parametrize("order", ORDERS)
def test_several_adapters_disable_and_merge_round_trip(order):
    _, ref, ours = peft_pair("llama", order, init_lora_weights=False)
    second = dict(r=2, lora_alpha=3, init_lora_weights=False)
    ref.add_adapter("second", lora_config("llama", **second))
    ours.add_adapter("second", lora_config("llama", **second))
    set_peft_model_state_dict(ours, get_peft_model_state_dict(ref, adapter_name="second"), adapter_name="second")
    ids = token_batches(1, 2, 9, 128)[0]
    ref.eval(), ours.eval()
    with torch.no_grad():
        for active in (["second"], ["default", "second"]):
            ref.base_model.set_adapter(active), ours.base_model.set_adapter(active)
            assert rel_err(ours(ids).logits, ref(ids).logits) < 1e-6, active
        with ref.disable_adapter(), ours.disable_adapter():
            assert rel_err(ours(ids).logits, ref(ids).logits) < 1e-6
        packed = mlp(ours).gate_up_interleaved.detach().clone()
        ours.merge_adapter(), ref.merge_adapter()
        assert not torch.equal(mlp(ours).gate_up_interleaved, packed)
        assert rel_err(ours(ids).logits, ref(ids).logits) < 1e-6
        ours.unmerge_adapter()
        assert torch.allclose(mlp(ours).gate_up_interleaved, packed, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_inference_follows_every_change_to_the_adapters(family):
    """Calls without autograd keep the stacked A and packed B between calls: an optimizer's in-place
    step, a replaced .data, a new scale and a switched adapter each reach the next call."""
    _, ref, ours = peft_pair(family, "patch_then_peft", init_lora_weights=False, lora_dropout=0.0)
    ids = token_batches(1, 2, 9, 128)[0]
    ref.eval(), ours.eval()

    def agree(what):
        with torch.no_grad():
            assert rel_err(ours(ids).logits, ref(ids).logits) < 1e-6, what

    def both(fn):
        for model in (ref, ours):
            for name, p in model.named_parameters():
                if "lora_" in name and any(t in name for t in PACKED[family]):
                    fn(name, p)

    agree("first call")
    assert "_swiglu_low_rank_cache" in vars(mlp(ours))
    with torch.no_grad():
        both(lambda name, p: p.mul_(1.5))  # in place, as an optimizer step
    agree("after an in-place update")
    both(lambda name, p: setattr(p, "data", p.data * -0.5))  # a new storage under the same parameter
    agree("after replacing .data")
    for model in (ref, ours):
        for module in model.modules():
            if isinstance(module, LoraLinear):
                module.scaling["default"] *= 3
    agree("after a new scaling")
    for model in (ref, ours):
        model.add_adapter("other", lora_config(family, r=2, init_lora_weights=False, lora_dropout=0.0))
    set_peft_model_state_dict(ours, get_peft_model_state_dict(ref, adapter_name="other"), adapter_name="other")
    ref.base_model.set_adapter("other"), ours.base_model.set_adapter("other")
    agree("after switching adapters")


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_unpatch_keeps_adapters_only_when_set_aside(family):
    _, ref, ours = peft_pair(family, "patch_then_peft", init_lora_weights=False)
    with pytest.raises(ValueError, match="would drop its adapters"):
        unpatch(ours)
    with adapters_aside(ours):
        assert unpatch(ours) == 2
    for name in PACKED[family]:
        assert type(getattr(mlp(ours), name)) is LoraLinear
    ids = token_batches(1, 2, 9, 128)[0]
    with torch.no_grad():
        assert rel_err(ours.eval()(ids).logits, ref.eval()(ids).logits) < 1e-6
    ref_state, state = ref.state_dict(), ours.state_dict()
    assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in ref_state)


def test_unsupported_options_are_refused():
    patched = tiny_model("llama")
    apply_fused_mlp(patched, backend="torch")
    before = {k: v.clone() for k, v in patched.state_dict().items()}
    for options, words in [(dict(use_dora=True), "DoRA"), (dict(init_lora_weights="pissa"), "reads or rewrites"),
                           (dict(lora_bias=True), "lora_bias")]:
        with pytest.raises(ValueError, match=f"gate_proj, a projection packed by apply_fused_mlp: .*{words}"):
            get_peft_model(patched, lora_config("llama", **options))
        assert all(type(m) is not LoraLinear for m in patched.modules()), "PEFT changed the model before refusing"
    assert patched.state_dict().keys() == before.keys()
    # the same options on layers that are not packed are plain PEFT's business
    get_peft_model(copy.deepcopy(patched), lora_config("llama", use_dora=True, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="DoRA"):
        register(lora_config("llama", use_dora=True))
    with pytest.raises(TypeError, match="LoraConfig"):
        register(dict(r=4))

    dora = get_peft_model(tiny_model("llama"), lora_config("llama", use_dora=True))
    before = {k: v.clone() for k, v in dora.state_dict().items()}
    with pytest.raises(ValueError, match="LoRA variant"):
        apply_fused_mlp(dora, backend="torch")
    assert all(torch.equal(v, before[k]) for k, v in dora.state_dict().items())

    ours = get_peft_model(patched, lora_config("llama"))
    ours.eval()
    with pytest.raises(NotImplementedError, match="adapter_names"):
        ours(token_batches(1, 2, 5, 128)[0], adapter_names=["default", "__base__"])


def test_qlora_is_refused(tmp_path):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (pip install bitsandbytes; CPU works)")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama").save_pretrained(tmp_path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant, device_map="cpu")
    with pytest.raises(PatchError, match="Linear4bit"):  # patch first: the 4-bit base itself is refused
        apply_fused_mlp(copy.deepcopy(model))
    qlora = get_peft_model(model, lora_config("llama"))
    with pytest.raises(ValueError, match="QLoRA"):
        apply_fused_mlp(qlora)
    assert type(mlp(qlora).gate_proj).__name__ == "Linear4bit" and mlp(qlora).gate_proj.base_layer is not None
