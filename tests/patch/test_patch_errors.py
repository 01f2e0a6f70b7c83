"""Bad input to apply_fused_mlp: a clear error in strict mode, a listed skip otherwise."""

import pytest
import torch
from helpers import tiny_config, tiny_model
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config

from swiglu_patch import PackedGateUp, PatchError, apply_fused_mlp, gated_linear, is_patched


def test_model_without_gated_mlp():
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(PatchError, match=r"model_type 'gpt2' has no gated MLP; supported: llama, mistral"):
        apply_fused_mlp(model)
    report = apply_fused_mlp(model, strict=False)
    assert not report.patched and not report.not_patched and not report.has_gated_mlp
    assert "model_type 'gpt2' has no gated MLP" in str(report)


def test_unsupported_activation():
    model = tiny_model("llama", hidden_act="relu")
    with pytest.raises(PatchError, match=r"model.layers.0.mlp \(LlamaMLP\): activation hidden_act='relu' \(ReLU\) is not supported; supported:"):
        apply_fused_mlp(model)
    assert not is_patched(model)


def test_config_and_module_activation_disagree():
    model = tiny_model("llama")
    model.model.layers[1].mlp.act_fn = nn.GELU()
    with pytest.raises(PatchError, match="refusing to guess"):
        apply_fused_mlp(model)


class FakeLinear4bit(nn.Linear):
    """Stands in for bitsandbytes' Linear4bit, which subclasses nn.Linear."""


def test_quantized_linear_strict_and_lenient():
    model = tiny_model("mistral")
    old = model.model.layers[1].mlp.up_proj
    model.model.layers[1].mlp.up_proj = FakeLinear4bit(old.in_features, old.out_features, bias=False)
    with pytest.raises(PatchError, match=r"model.layers.1.mlp .*up_proj is .*FakeLinear4bit, not a plain torch.nn.Linear"):
        apply_fused_mlp(model)
    assert not is_patched(model), "strict mode must not half-patch"
    report = apply_fused_mlp(model, strict=False)
    assert report.patched == ["model.layers.0.mlp"]
    assert report.not_patched[0].name == "model.layers.1.mlp" and "FakeLinear4bit" in report.not_patched[0].reason
    assert "not patched: MistralMLP (model.layers.1.mlp): up_proj is" in str(report)


def test_fp8_weights():
    model = tiny_model("qwen3")
    lin = model.model.layers[0].mlp.gate_proj
    lin.weight = nn.Parameter(lin.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(PatchError, match="float8_e4m3fn"):
        apply_fused_mlp(model)


def test_meta_weights():
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("gemma2"))
    with pytest.raises(PatchError, match="meta device or offloaded"):
        apply_fused_mlp(model)


def test_accelerate_offload():
    from accelerate import cpu_offload

    model = tiny_model("llama")
    cpu_offload(model, execution_device="cpu")
    with pytest.raises(PatchError, match="meta device or offloaded"):
        apply_fused_mlp(model)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        apply_fused_mlp(tiny_model("llama"), backend="cutlass")


@pytest.mark.parametrize("fn", ["apply_fused_mlp", "unpatch"])
@pytest.mark.parametrize("model", ["a/hub-id", None])
def test_a_model_that_is_not_loaded_names_what_to_pass(fn, model):
    import swiglu_patch

    with pytest.raises(TypeError, match=rf"{fn}: expected a loaded model \(a torch.nn.Module\), got {model!r}; load "
                                        r"it first, e.g. model = AutoModelForCausalLM.from_pretrained\("):
        getattr(swiglu_patch, fn)(model)


def test_kernel_backend_trains_like_the_reference():
    """With weights that require grad the fused module runs the training op (swiglu_patch.training):
    the Triton path's gradients equal the PyTorch reference's (fp32; the interpreter on CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.randint(3, 100, (2, 5), device=device)
    grads = {}
    for backend in ("triton", "torch"):
        model = tiny_model("llama", device=device)
        apply_fused_mlp(model, backend=backend)
        model(ids, labels=ids).loss.backward()
        mlp = model.model.layers[0].mlp
        grads[backend] = (mlp.gate_up_interleaved.grad, mlp.down_proj.weight.grad)
    for ours, ref in zip(grads["triton"], grads["torch"]):
        assert ours is not None and (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_torch_backend_trains():
    model = tiny_model("llama")
    apply_fused_mlp(model, backend="torch")
    model(torch.randint(3, 100, (1, 5))).logits.sum().backward()
    assert model.model.layers[0].mlp.gate_up_interleaved.grad is not None


def test_gated_linear_rejects_mismatched_weight():
    with pytest.raises(ValueError, match=r"\[2\*I, K\]"):
        gated_linear(torch.randn(2, 8), PackedGateUp.from_interleaved(torch.randn(7, 8)))
