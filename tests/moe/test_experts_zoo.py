"""Every MoE family of the installed transformers on the fused experts' Triton kernels.

The zoo (tests/zoo) patches every model type through the PyTorch path; here the MoE types whose
experts `apply_fused_mlp` fuses (`moe.families`) run on the kernels, one per distinct signature (what
the kernels take: activation, scales, clamp, limit, alpha, layout, biases), the first by name; the
others skip, naming it, and so do the types whose experts are not fused, with the reason. Built tiny
(`zoo.tiny_zoo.build`) and patched with backend="triton" in fp32 (the interpreter on CPU; the
compiled kernels where CUDA is present, the model moved there): its logits and 4 greedy tokens must
equal the unpatched model's, and unpatch must restore them. About a minute on 2 cores, most of it
grouping the families: slow.
"""

from __future__ import annotations

import pytest
import torch
from moe.families import MOE_TYPES, skip_unless_representative
from zoo.examine import LOGIT_TOL, _generate, _logits, _prompt
from zoo.tiny_zoo import build, quiet

from swiglu_patch import apply_fused_mlp, unpatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # conftest turns the interpreter on where CUDA is absent

pytestmark = pytest.mark.slow


def test_the_moe_families_are_found():
    assert {"qwen3_moe", "mixtral", "olmoe", "gpt_oss", "qwen2_moe"} <= set(MOE_TYPES)


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_moe_family_on_the_triton_kernels(model_type):
    skip_unless_representative(model_type)
    built = build(model_type)
    model, ids = built.model.to(DEVICE), _prompt(built).to(DEVICE)
    ref = _logits(model, ids)
    try:
        tokens = _generate(model, ids)
    except Exception as e:  # noqa: BLE001 - the unpatched tiny model's own failure
        pytest.skip(f"the unpatched tiny model cannot generate: {type(e).__name__}: {str(e)[:120]}")
    with quiet():
        report = apply_fused_mlp(model, strict=False, backend="triton")
    assert report.experts, f"{model_type}: no experts fused, though its signature says they are"
    out = _logits(model, ids)
    assert (out - ref).abs().max().item() <= LOGIT_TOL * ref.abs().max().item()
    assert torch.equal(_generate(model, ids), tokens)
    unpatch(model)
    assert torch.equal(_logits(model, ids), ref)
