"""Every family in the registry, on a tiny random model with its real structure and activation:
same logits and greedy tokens after patching, unpatch bit for bit, checkpoints in the original
layout both ways. On CPU the fused modules run the PyTorch reference (backend "auto"); the
`kernel` tests run the Triton kernel itself (through the interpreter on CPU)."""

import copy

import pytest
import torch
from helpers import TINY_CONFIGS, tiny_model
from transformers import AutoModelForCausalLM

from swiglu_patch import FusedGatedMLP, apply_fused_mlp, is_patched, unpatch
from swiglu_patch.registry import KNOWN_MLP_CLASSES

FAMILY_TYPES = sorted(TINY_CONFIGS)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_tiny_configs_are_registry_families():
    """helpers' tiny models are families of the registry (the zoo, tests/zoo/, builds every record's class)."""
    assert set(TINY_CONFIGS) <= {f.model_type for f in KNOWN_MLP_CLASSES.values()}


def _ids(model):
    torch.manual_seed(1)
    return torch.randint(3, model.config.vocab_size, (2, 9), device=DEVICE)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


def _bytes(sd):
    return {k: v.detach().cpu().view(torch.uint8).clone() for k, v in sd.items()}


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_family_patch_matches_eager(model_type):
    model = tiny_model(model_type, device=DEVICE)
    ids = _ids(model)
    before = _logits(model, ids)
    original = _bytes(model.state_dict())
    with torch.no_grad():
        gen_before = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)

    report = apply_fused_mlp(model)
    assert len(report.patched) == 2 and not report.not_patched and not report.by_structure
    assert all(isinstance(layer.mlp, FusedGatedMLP) for layer in model.model.layers)
    after = _logits(model, ids)
    scale = before.abs().max()
    assert (after - before).abs().max() <= 1e-5 * scale, "patched logits differ from eager"
    with torch.no_grad():
        gen_after = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(gen_before, gen_after)

    # the check above can fail: a wrong gate/up pairing moves the logits far more than the tolerance
    packed = model.model.layers[0].mlp.gate_up_interleaved
    saved = packed.detach().clone()
    with torch.no_grad():
        packed.copy_(packed.roll(1, 0))
    assert (_logits(model, ids) - before).abs().max() > 1e-3 * scale
    with torch.no_grad():
        packed.copy_(saved)

    # state dict speaks the original layout
    assert _bytes(model.state_dict()).keys() == original.keys()
    assert all(torch.equal(a, original[k]) for k, a in _bytes(model.state_dict()).items())

    # twice is a no-op
    again = apply_fused_mlp(model)
    assert not again.patched and len(again.already_patched) == 2

    assert unpatch(model) == 2 and not is_patched(model)
    restored = _bytes(model.state_dict())
    assert restored.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(restored[key], value), f"{key} not restored bit for bit"
    assert torch.equal(_logits(model, ids), before)


@pytest.mark.parametrize("model_type", ["llama", "phi3", "gemma3_text"])
def test_patched_checkpoint_loads_in_plain_transformers(model_type, tmp_path):
    model = tiny_model(model_type, device=DEVICE)
    ids = _ids(model)
    before = _logits(model, ids)
    apply_fused_mlp(model)
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).to(DEVICE).eval()
    assert not is_patched(plain)
    assert torch.equal(_logits(plain, ids), before)


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_original_state_dict_loads_into_patched_model(model_type):
    source = tiny_model(model_type, device=DEVICE)
    with torch.no_grad():  # different weights than the target's init
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = _ids(source)
    expected = _logits(source, ids)
    target = tiny_model(model_type, device=DEVICE)
    apply_fused_mlp(target)
    result = target.load_state_dict(source.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert (_logits(target, ids) - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_missing_keys_are_reported():
    target = tiny_model("llama", device=DEVICE)
    apply_fused_mlp(target)
    sd = target.state_dict()
    del sd["model.layers.0.mlp.up_proj.weight"]
    result = target.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["model.layers.0.mlp.up_proj.weight"]


@pytest.mark.parametrize("model_type", ["llama", "phi3", "gemma2"])
def test_kernel_path_matches_eager(model_type):
    """The Triton kernel itself inside the model (interpreter on CPU), fp32, greedy tokens identical."""
    model = tiny_model(model_type, device=DEVICE)
    ids = _ids(model)
    before = _logits(model, ids)
    with torch.no_grad():
        gen_before = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    apply_fused_mlp(model, backend="triton")
    assert (_logits(model, ids) - before).abs().max() <= 1e-4 * before.abs().max()
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4), gen_before)


def test_mlp_bias_is_fused():
    model = tiny_model("llama", device=DEVICE, mlp_bias=True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.bias.normal_()
            layer.mlp.up_proj.bias.normal_()
    ids = _ids(model)
    before = _logits(model, ids)
    original = _bytes(model.state_dict())
    apply_fused_mlp(model, backend="triton")
    assert model.model.layers[0].mlp.gate_up_interleaved_bias is not None
    assert (_logits(model, ids) - before).abs().max() <= 1e-4 * before.abs().max()
    unpatch(model)
    assert all(torch.equal(v, original[k]) for k, v in _bytes(model.state_dict()).items())


def test_patching_frees_original_weights_and_keeps_dtype_device():
    model = tiny_model("qwen2", dtype=torch.float16, device=DEVICE)
    apply_fused_mlp(model)
    mlp = model.model.layers[1].mlp
    assert mlp.gate_up_interleaved.dtype == torch.float16
    assert mlp.gate_up_interleaved.device.type == DEVICE
    assert mlp._original.gate_proj.weight.device.type == "meta"
    names = [n for n, _ in model.named_parameters()]
    assert not any("gate_proj" in n or "up_proj" in n for n in names)
    ids = _ids(model)  # a patched model deep-copies into an independent, equal model
    twin = copy.deepcopy(model)
    assert twin.model.layers[1].mlp.gate_up_interleaved.data_ptr() != mlp.gate_up_interleaved.data_ptr()
    assert torch.equal(_logits(twin, ids), _logits(model, ids))


def test_unknown_class_with_gated_structure_is_patched_by_structure():
    model = tiny_model("llama", device=DEVICE)
    ids = _ids(model)
    before = _logits(model, ids)
    for layer in model.model.layers:  # a class the registry does not know, same structure
        layer.mlp.__class__ = type("MyMLP", (layer.mlp.__class__,), {})
    report = apply_fused_mlp(model)
    assert len(report.by_structure) == 2 and "by structure" in str(report)
    assert (_logits(model, ids) - before).abs().max() <= 1e-5 * before.abs().max()


def test_accelerate_alignment_hook_moves_with_the_module():
    """An MLP under accelerate's (non-offloading) device-alignment hook keeps it once fused."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model = tiny_model("llama", device=DEVICE)
    ids = _ids(model)
    before = _logits(model, ids)
    for layer in model.model.layers:
        add_hook_to_module(layer.mlp, AlignDevicesHook(execution_device=DEVICE, io_same_device=True))
    apply_fused_mlp(model)
    assert all(hasattr(layer.mlp, "_hf_hook") for layer in model.model.layers)
    assert (_logits(model, ids) - before).abs().max() <= 1e-5 * before.abs().max()


def test_down_proj_hooks_still_run_when_set():
    """The fused module runs a plain down_proj as F.linear (no module call) only while no hook would
    see the difference: a forward hook on down_proj, or a global one, still runs, and the output is
    the same either way."""
    model = tiny_model("llama").eval()
    apply_fused_mlp(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 3, model.config.hidden_size)
    with torch.inference_mode():
        plain = mlp(x)
    seen = []
    handle = mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append("down"))
    with torch.inference_mode():
        hooked = mlp(x)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append(type(m).__name__))
    try:
        with torch.inference_mode():
            globally = mlp(x)
    finally:
        handle.remove()
    assert seen[0] == "down" and "Linear" in seen[1:]
    assert torch.equal(plain, hooked) and torch.equal(plain, globally)
