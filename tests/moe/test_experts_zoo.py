"""Every MoE family of the installed transformers on the fused experts' Triton kernels.

The zoo (tests/zoo) patches every model type through the PyTorch path; here each type whose config
holds routed experts is built tiny (`zoo.tiny_zoo.build`) and patched with backend="triton" in fp32
(the interpreter on CPU; the compiled kernels where CUDA is present, the model moved there): its logits and 4 greedy tokens must equal the unpatched model's, and
unpatch must restore them. A type whose experts are refused (the report's reason) or whose tiny
model cannot run unpatched is skipped with that reason. About 5 minutes on 2 cores: slow.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from zoo.examine import LOGIT_TOL, _generate, _logits, _prompt
from zoo.tiny_zoo import CannotBuild, build, model_types, quiet

from swiglu_patch import apply_fused_mlp, unpatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # conftest turns the interpreter on where CUDA is absent

pytestmark = pytest.mark.slow

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _routed_experts(model_type: str) -> bool:
    """Whether the type's default config (or a sub-config) asks for routed experts."""
    try:
        config = AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 - a config that cannot be built here has no zoo model either
        return False
    configs = [config] + [getattr(config, k, None) for k in getattr(config, "sub_configs", {})]
    return any(isinstance(getattr(c, k, None), int) and getattr(c, k) > 1 for c in configs if c is not None
               for k in _EXPERT_KEYS)


MOE_TYPES = [t for t in model_types() if _routed_experts(t)]


def test_the_moe_families_are_found():
    assert {"qwen3_moe", "mixtral", "olmoe", "gpt_oss", "qwen2_moe"} <= set(MOE_TYPES)


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_moe_family_on_the_triton_kernels(model_type):
    try:
        built = build(model_type)
    except CannotBuild as e:
        pytest.skip(f"cannot be built small: {e}")
    model, ids = built.model.to(DEVICE), _prompt(built).to(DEVICE)
    try:
        ref, tokens = _logits(model, ids), _generate(model, ids)
    except Exception as e:  # noqa: BLE001 - the unpatched tiny model's own failure
        pytest.skip(f"the unpatched tiny model fails: {type(e).__name__}: {str(e)[:120]}")
    with quiet():
        report = apply_fused_mlp(model, strict=False, backend="triton")
    if not report.experts:
        reasons = sorted({n.reason for n in report.not_patched if "Experts" in n.module_class})
        pytest.skip(f"its experts are refused: {reasons[:1] or 'no experts module'}")
    out = _logits(model, ids)
    assert (out - ref).abs().max().item() <= LOGIT_TOL * ref.abs().max().item()
    assert torch.equal(_generate(model, ids), tokens)
    unpatch(model)
    assert torch.equal(_logits(model, ids), ref)
