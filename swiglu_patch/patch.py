"""`apply_fused_mlp` and `unpatch`: swap every gated MLP of a model for a `FusedGatedMLP` and back."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from . import tensor_parallel
from .functional import BACKENDS
from .kernels.epilogue import ACTIVATIONS
from .module import FusedGatedMLP
from .registry import FAMILIES, HF_ACTIVATIONS, STRUCTURES, MLPFamily, activation_of_module, supported_model_types

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class PatchError(ValueError):
    """A module that looks like a gated MLP cannot be patched (strict mode)."""


@dataclass
class PatchReport:
    """What `apply_fused_mlp` did.

    Attributes:
        patched: names of the MLP modules replaced.
        by_structure: the subset of `patched` whose class is not in the registry, matched by
            their gate/up/down/act structure alone.
        skipped: (module name, reason) for every gated MLP left alone (strict=False).
        already_patched: names of MLPs that were fused before this call.
        activations: module name -> kernel activation, for the patched ones.
    """

    patched: list[str] = field(default_factory=list)
    by_structure: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    already_patched: list[str] = field(default_factory=list)
    activations: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        acts = sorted(set(self.activations.values()))
        lines = [f"apply_fused_mlp: patched {len(self.patched)} MLP(s)" + (f" ({', '.join(acts)})" if acts else "")]
        if self.by_structure:
            lines.append(f"  {len(self.by_structure)} patched by structure (class not in the registry): "
                         + ", ".join(self.by_structure[:3]) + (" ..." if len(self.by_structure) > 3 else ""))
        if self.already_patched:
            lines.append(f"  {len(self.already_patched)} already patched, left as they were")
        for name, reason in self.skipped:
            lines.append(f"  skipped {name}: {reason}")
        return "\n".join(lines)


def _family_of(module: nn.Module, model_config) -> tuple[MLPFamily | None, bool]:
    """(family, by_structure) if `module` is a gated MLP, else (None, False)."""
    config = getattr(module, "config", None) or model_config
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is not None and type(module).__name__ == family.mlp_class:
        return family, False
    for f in ((family,) if family else ()) + STRUCTURES:
        names = [f.gate_up_chunked] if f.gate_up_chunked else [f.gate, f.up]
        if all(hasattr(module, n) for n in names + [f.down, f.act]) and all(
            isinstance(getattr(module, n), nn.Module) for n in names + [f.down]
        ):
            return f, True
    return None, False


def _activation(module: nn.Module, family: MLPFamily, by_structure: bool, model_config) -> str:
    """The kernel activation for `module`; raises ValueError with the reason if unsupported."""
    from_module = activation_of_module(getattr(module, family.act))
    if by_structure:
        if from_module is None:
            raise ValueError(
                f"activation {type(getattr(module, family.act)).__name__} is not supported; supported: "
                f"{', '.join(ACTIVATIONS)}"
            )
        return from_module
    config = getattr(module, "config", None) or model_config
    name = getattr(config, family.activation_key, None)
    if name not in HF_ACTIVATIONS:
        raise ValueError(
            f"activation {family.activation_key}={name!r} is not supported; supported: {', '.join(HF_ACTIVATIONS)}"
        )
    if from_module is not None and from_module != HF_ACTIVATIONS[name]:
        raise ValueError(
            f"config says {family.activation_key}={name!r} but the module's {family.act} is "
            f"{type(getattr(module, family.act)).__name__}; refusing to guess which one the model computes"
        )
    return HF_ACTIVATIONS[name]


def _check_linears(module: nn.Module, family: MLPFamily) -> None:
    """Raise ValueError naming why the projections are not plain float nn.Linear on a real device."""
    names = [family.gate_up_chunked] if family.gate_up_chunked else [family.gate, family.up]
    linears = [getattr(module, n) for n in names + [family.down]]
    sharded = tensor_parallel.check_sharding(module, family)  # raises for a tensor-parallel layout it cannot run
    for name, lin in zip(names + [family.down], linears):
        if type(lin) is not nn.Linear:
            raise ValueError(
                f"{name} is {type(lin).__module__}.{type(lin).__name__}, not a plain torch.nn.Linear "
                "(quantized, LoRA-wrapped or custom layers are not supported yet)"
            )
        hook = getattr(lin, "_hf_hook", None) or getattr(module, "_hf_hook", None)
        if getattr(hook, "offload", False) or lin.weight.device.type == "meta":
            raise ValueError(
                f"{name}.weight is on the meta device or offloaded by accelerate; load the model onto real "
                "devices (no disk/CPU offload) before patching"
            )
        w = lin.weight
        if (type(w.data) is not torch.Tensor and not sharded) or w.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{name}.weight is {type(w.data).__name__} of dtype {w.dtype}; the fused kernel needs a plain "
                "(or tensor-parallel DTensor) bfloat16/float16/float32 tensor (quantized and fp8 weights are not "
                "supported yet)"
            )
    gate_up = linears[:-1]
    if len({(lin.weight.dtype, lin.weight.device) for lin in gate_up}) != 1:
        raise ValueError("gate and up weights differ in dtype or device")
    if len({lin.bias is None for lin in gate_up}) != 1:
        raise ValueError("gate has a bias and up has none, or the other way round")


def apply_fused_mlp(model: nn.Module, *, strict: bool = True, backend: str = "auto") -> PatchReport:
    """Replace every gated MLP in `model` with a `FusedGatedMLP`, in place.

    Each MLP's gate and up weights are packed (`interleave_gate_up`) on their own device and dtype
    and the originals freed, one layer at a time, so patching holds at most one extra
    layer's gate/up weights. Calling it again on a patched model changes nothing.

    Args:
        model: a transformers model (or any nn.Module holding gated MLPs).
        strict: raise on the first gated MLP that cannot be patched (default); with False,
            skip it and list it in the report.
        backend: `gated_linear` backend for the fused modules ("auto", "triton", "torch").

    Returns:
        A `PatchReport`.

    Raises:
        PatchError: strict and a gated MLP cannot be patched (quantized or non-Linear
            projections, meta/offloaded weights, an unsupported activation), or no gated
            MLP exists in the model at all.
        ValueError: unknown backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"apply_fused_mlp: backend must be one of {BACKENDS}, got {backend!r}")
    model_config = getattr(model, "config", None)
    report = PatchReport()
    targets = []
    for name, module in model.named_modules():
        if isinstance(module, FusedGatedMLP):
            report.already_patched.append(name)
            continue
        family, by_structure = _family_of(module, model_config)
        if family is not None:
            targets.append((name, module, family, by_structure))
    if not targets and not report.already_patched:
        model_type = getattr(model_config, "model_type", None)
        msg = (
            f"apply_fused_mlp: no gated MLP found in {type(model).__name__} (model_type {model_type!r}): "
            f"model_type {model_type!r} has no gated MLP; supported: {supported_model_types()}"
        )
        if strict:
            raise PatchError(msg)
        report.skipped.append(("<model>", msg))
        return report

    plan = []  # check every MLP before touching any, so strict mode never half-patches
    for name, module, family, by_structure in targets:
        try:
            _check_linears(module, family)
            plan.append((name, module, family, by_structure, _activation(module, family, by_structure, model_config)))
        except ValueError as e:
            if strict:
                raise PatchError(
                    f"apply_fused_mlp: cannot patch {name} ({type(module).__name__}): {e}. "
                    "Pass strict=False to skip it and patch the rest."
                ) from None
            report.skipped.append((name, str(e)))

    for name, module, family, by_structure, activation in plan:
        shards = tensor_parallel.localize(module, family)  # None unless tensor-parallel
        fused = FusedGatedMLP(module, family, activation, backend)
        tensor_parallel.attach(fused, shards)
        hook = getattr(module, "_hf_hook", None)
        if hook is not None:  # accelerate's device-alignment hook travels with the module
            from accelerate.hooks import add_hook_to_module

            add_hook_to_module(fused, hook)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, fused)
        report.patched.append(name)
        report.activations[name] = activation
        if by_structure:
            report.by_structure.append(name)
    return report


def unpatch(model: nn.Module) -> int:
    """Put back every original MLP module, with gate/up weights restored bit for bit.

    Args:
        model: a model patched by `apply_fused_mlp` (an unpatched model is left as it is).

    Returns:
        The number of MLPs restored.
    """
    fused = [(name, m) for name, m in model.named_modules() if isinstance(m, FusedGatedMLP)]
    for name, module in fused:
        parent_name, _, child = name.rpartition(".")
        original = module.restore()
        tensor_parallel.restore_sharding(module, original)
        setattr(model.get_submodule(parent_name) if parent_name else model, child, original)
    return len(fused)


def is_patched(model: nn.Module) -> bool:
    """True if any MLP in `model` is a `FusedGatedMLP`."""
    return any(isinstance(m, FusedGatedMLP) for m in model.modules())
