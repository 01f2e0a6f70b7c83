"""The MoE families of the installed transformers, grouped by what the fused experts kernels see.

`MOE_TYPES` is every zoo model type (`zoo.tiny_zoo.model_types`) whose default config, or one of
its sub-configs, asks for routed experts. `family(model_type)` builds the type tiny
(`zoo.tiny_zoo.build`, fp32, CPU), runs it once unpatched (no grad) and patches it with the PyTorch
backend; its `signature` is the sorted distinct `kernel_key`s of the experts modules that
`apply_fused_mlp` switched, or empty with the `reason` the type has none (cannot be built small, the
unpatched model fails, its experts are refused).

`kernel_key(spec)` is everything the fused experts kernels take from an `ExpertsSpec`: the
non-tensor arguments of ``swiglu_patch::experts_train`` (activation, gate_scale, out_scale, clamp
code, limit, alpha, transposed, concatenated) and whether the two bias tensors are passed.
`spec_of_key` rebuilds the spec from it (the key loses nothing). What the key leaves out is the
tensors' sizes (E, K, I, top_k), which the tiny builds share (`zoo.tiny_zoo`) and which pick no
other code path in the kernels.

`representatives()` groups the families by signature: per signature, its families sorted by name;
the first stands for the others on the kernels, where the interpreter makes every family too slow
(`skip_unless_representative` skips the others, naming it). The grouping builds every MoE type once,
on first use (about a minute on 2 cores); only strings and tuples are cached (no tensors).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import pytest
from transformers import AutoConfig
from zoo.examine import _logits, _prompt
from zoo.tiny_zoo import CannotBuild, build, model_types, quiet

from swiglu_patch import apply_fused_mlp, ops
from swiglu_patch.experts import ExpertsSpec
from swiglu_patch.kernels.experts_reference import ExpertsEpilogue, ExpertsLayout

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


def kernel_key(spec: ExpertsSpec) -> tuple:
    """(activation, gate_scale, out_scale, clamp code, limit, alpha, transposed, concatenated, has_bias):
    what `fused_experts_forward` passes the kernels besides tensors (alpha 0.0: no gpt-oss gate)."""
    return (*ops.epilogue_args(spec.epilogue.gated), spec.epilogue.alpha or 0.0, spec.layout.transposed,
            spec.layout.concatenated, spec.has_bias)


def spec_of_key(key: tuple) -> ExpertsSpec:
    """The `ExpertsSpec` that `kernel_key` read."""
    *gated, alpha, transposed, concatenated, has_bias = key
    return ExpertsSpec(ExpertsEpilogue(ops.epilogue_of(*gated), alpha or None), ExpertsLayout(transposed, concatenated),
                       has_bias)


def describe(signature: tuple) -> str:
    """The signature in words: each spec's `describe()`, joined by " | "."""
    return " | ".join(spec_of_key(k).describe() for k in signature)


class Family(NamedTuple):
    """One model type's experts as the kernels see them: `signature` (sorted `kernel_key`s), or () and `reason`."""

    model_type: str
    signature: tuple
    reason: str = ""


@functools.lru_cache(maxsize=None)
def family(model_type: str) -> Family:
    """`model_type`'s signature, from a tiny build patched with backend="torch" (see the module docstring)."""
    try:
        built = build(model_type)
    except CannotBuild as e:
        return Family(model_type, (), f"cannot be built small: {e}")
    try:
        _logits(built.model, _prompt(built))
    except Exception as e:  # noqa: BLE001 - the unpatched tiny model's own failure, recorded as the reason
        return Family(model_type, (), f"the unpatched tiny model fails: {type(e).__name__}: {str(e)[:120]}")
    with quiet():
        report = apply_fused_mlp(built.model, strict=False, backend="torch")
    if not report.experts:
        reasons = sorted({n.reason for n in report.not_patched if "Experts" in n.module_class})
        return Family(model_type, (), f"its experts are refused: {reasons[:1] or 'no experts module'}")
    return Family(model_type, tuple(sorted({kernel_key(s) for s in report.experts.values()})))


@functools.lru_cache(maxsize=None)
def representatives() -> dict[tuple, tuple[str, ...]]:
    """signature -> the families that have it, sorted by name (the first runs on the kernels for all)."""
    groups: dict[tuple, list[str]] = {}
    for t in MOE_TYPES:
        f = family(t)
        if f.signature:
            groups.setdefault(f.signature, []).append(t)
    return {sig: tuple(members) for sig, members in sorted(groups.items(), key=lambda kv: kv[1][0])}


def skip_unless_representative(model_type: str) -> None:
    """`pytest.skip` unless `model_type` is the first family by name of its signature, with the reason: its
    experts are not fused (`Family.reason`), or which family runs on the kernels for it."""
    f = family(model_type)
    if not f.signature:
        pytest.skip(f.reason)
    first = representatives()[f.signature][0]
    if first != model_type:
        pytest.skip(f"runs on the kernels as {first}, the first family by name with its experts signature "
                    f"({describe(f.signature)})")
