"""The configurations on which the patch used to change a model's output without a word, or crash
(issue 16): each one now exact after patching (module outputs at input scales 1 and 30, logits,
greedy tokens, unpatch, save/reload; `examine`), or refused with its true reason, module by module.
And the report naming MoE experts, which are not fused yet."""

import pytest

from swiglu_patch import GatedEpilogue, PatchError, apply_fused_mlp, is_patched
from swiglu_patch.kernels.experts_reference import ExpertsEpilogue
from zoo.examine import examine
from zoo.tiny_zoo import build, build_or_skip, skip_if_older


def _exact(model_type, variant="default", save=True):
    row = examine(model_type, variant, save=save)
    if row.status == "could not build":
        skip_if_older(model_type, row.notes[0])
    assert row.status != "could not build", row.notes
    assert not row.failures, "\n".join(row.failures) + f"\n{row.report}"
    return row


def _reasons(row):
    return {n.name: n.reason for n in row.report.not_patched}


def test_gemma3n_activation_sparsity_is_refused_layer_by_layer():
    row = _exact("gemma3n_text", "activation_sparsity", save=False)  # pattern [0.95, 0.0]
    assert row.report.patched == ["model.layers.1.mlp"]
    assert "activation_sparsity=0.95" in _reasons(row)["model.layers.0.mlp"]
    assert "Gaussian top-k" in _reasons(row)["model.layers.0.mlp"]


def test_falcon_h1_mlp_multipliers_are_fused():
    row = _exact("falcon_h1", "mlp_multipliers")
    assert row.patched == row.gated == 2
    assert set(row.report.epilogues.values()) == {GatedEpilogue("silu", gate_scale=0.8839, out_scale=0.5859)}


def test_falcon_h1_down_multiplier_with_a_down_bias_is_refused():
    row = _exact("falcon_h1", "mlp_multipliers_bias", save=False)
    assert row.patched == 0 and row.gated == 2
    assert all("down_multiplier=0.5859 with a bias on down_proj" in r for r in _reasons(row).values())


@pytest.mark.parametrize("model_type, variant, clamp", [
    ("deepseek_v4", "swiglu_limit", "gate"),
    ("glm5_next", "swiglu_limit", "gate"),
])
def test_swiglu_clamps_are_fused_exactly_at_large_inputs(model_type, variant, clamp):
    row = _exact(model_type, variant, save=False)
    epilogues = set(row.report.epilogues.values())
    assert epilogues == {GatedEpilogue("silu", limit=1.0, clamp=clamp)}
    specs = {s.epilogue for s in row.report.experts.values()}  # the routed experts clamp the same way
    assert specs == {ExpertsEpilogue(GatedEpilogue("silu", limit=1.0, clamp=clamp))}
    assert not [n for n in row.report.not_patched if "Experts" in n.module_class]


def test_step37_per_layer_clamp_on_the_activation():
    row = _exact("step3p7", "swiglu_limits_shared", save=False)  # limits [0 (none), 1]
    by_layer = {name.split(".layers.")[1]: e for name, e in row.report.epilogues.items()}
    assert by_layer == {"0.mlp": GatedEpilogue("silu"),  # dense layer, then a sparse one's shared expert
                        "1.mlp.shared_experts": GatedEpilogue("silu", limit=1.0, clamp="activation")}


@pytest.mark.parametrize("model_type", ["glm4v", "glm46v", "glmga", "glm4v_moe", "glm_ocr"])
def test_glm4v_vision_patch_merger_is_refused_never_replaced(model_type):
    row = _exact(model_type, save=model_type == "glm4v")
    mergers = {n: r for n, r in _reasons(row).items() if n.endswith("merger")}
    assert len(mergers) == 1
    assert "proj (Linear), post_projection_norm (LayerNorm), act1 (GELU)" in next(iter(mergers.values()))
    assert row.patched > 0  # the plain vision and text MLPs are


def test_doge_moe_is_reported_and_nothing_is_dropped():
    row = _exact("doge", "is_moe")  # the state dict keeps router and expert embeddings (examine checks keys)
    assert row.patched == 0 and row.gated == 2
    assert all("mixture-of-experts block with a router" in r for r in _reasons(row).values())


def test_bitnet_ffn_sub_norm_is_refused():
    row = _exact("bitnet", "silu")
    assert all("ffn_sub_norm (BitNetRMSNorm)" in r for r in _reasons(row).values()) and row.gated == 2


def test_diffusion_gemma_self_conditioning_is_not_replaced():
    built = build_or_skip("diffusion_gemma")
    with pytest.raises(PatchError, match=r"\(DiffusionGemmaSelfConditioning\)|strict=False"):
        apply_fused_mlp(built.model)
    assert not is_patched(built.model)
    report = apply_fused_mlp(built.model, strict=False)
    refused = {n.module_class: n.reason for n in report.not_patched}
    assert "pre_norm (DiffusionGemmaRMSNorm)" in refused["DiffusionGemmaSelfConditioning"]
    assert report.patched and all(type(built.model.get_submodule(n)).__name__ == "FusedGatedMLP"
                                  for n in report.patched if n not in report.experts)
    assert report.experts  # its MoE experts run on the fused experts kernels


def test_diffusion_gemma_patched_model_runs_and_is_exact():
    _exact("diffusion_gemma")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_report_names_moe_experts(model_type):
    built = build(model_type)
    report = apply_fused_mlp(built.model)
    layers = built.config.num_hidden_layers
    assert list(report.experts) == [f"model.layers.{i}.mlp.experts" for i in range(layers)]
    assert report.patched == list(report.experts) and not report.not_patched
    assert f"and {layers} MoE experts module(s)" in str(report) and "silu; gate_up [E, 2I, K] [gate; up]" in str(report)


def test_lfm2_and_llama4_mlps_with_other_names_are_patched():
    assert _exact("lfm2", save=True).classes == ["Lfm2MLP (silu)"]  # w1/w3/w2, silu written in the forward
    row = _exact("llama4_text", save=False)  # activation_fn
    assert "Llama4TextMLP (silu)" in row.classes
    assert [n.reason for n in row.report.not_patched if n.module_class == "Llama4TextExperts"]


def test_the_zoo_checks_catch_a_patch_that_drops_math(monkeypatch):
    """Negative control: without the probe and with the clamp left out of the registry, the zoo's own
    checks see the dropped clamp (module outputs, logits)."""
    import swiglu_patch.patch as patch_module
    from swiglu_patch.registry import KNOWN_MLP_CLASSES, plain

    record = KNOWN_MLP_CLASSES["DeepseekV4MLP"]
    monkeypatch.setitem(KNOWN_MLP_CLASSES, "DeepseekV4MLP", type(record)(**{**record.__dict__, "settings": plain}))
    monkeypatch.setattr(patch_module, "probe", lambda *args, **kwargs: 0.0)
    row = examine("deepseek_v4", "swiglu_limit", save=False)
    assert any("fused output off by" in f and "at input scale 30" in f for f in row.failures), row.failures
    assert any(f.startswith("logits differ") for f in row.failures), row.failures
