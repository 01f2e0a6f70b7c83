"""`apply_fused_mlp` and `unpatch`: swap every gated MLP of a model for a `FusedGatedMLP` and back.

A module is replaced only when it is shown to compute what the fused module runs:

1. find: every gated module of the model (`find_gated`): MLPs by class (`KNOWN_MLP_CLASSES`)
   or by structure (`STRUCTURES`), and MoE experts (3-D gated parameters), which stay in place
   and are switched to the fused experts kernels through transformers' experts interface
   (`experts.py`: matched by class, flags and `_apply_gate`, proven by their own probe);
2. check (`CHECKS`, then the activation, the class's settings and the numeric probe): each
   check raises ValueError with the reason it refuses; the probe (`probe.py`) runs once per
   class and setting;
3. pack: only after every module passed (strict) or was listed as refused (strict=False).
"""

from __future__ import annotations

import importlib.util
from os import PathLike
from dataclasses import dataclass

import torch
from torch import nn

from . import experts, tensor_parallel
from .functional import BACKENDS
from .kernels.epilogue import ACTIVATIONS, GatedEpilogue
from .module import FusedGatedMLP
from .probe import forward_arity_problem, probe, refusal
from .registry import (
    EXPERT_PARAMETERS,
    HF_ACTIVATIONS,
    KNOWN_MLP_CLASSES,
    MLPFamily,
    activation_of_module,
    structure_of,
    supported_model_types,
)
from .report import NotPatched, PatchReport

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class PatchError(ValueError):
    """A gated module cannot be patched (strict mode), or the model has none."""


@dataclass(frozen=True)
class Gated:
    """A gated module found in a model.

    Attributes:
        name, module: where it is and what it is.
        family: where it keeps its projections (None for MoE experts).
        known: its class is in `KNOWN_MLP_CLASSES` (else matched by structure).
        reason: why it cannot be patched, known at once, else None.
        experts: an MoE experts module (3-D gate/up and down parameters).
    """

    name: str
    module: nn.Module
    family: MLPFamily | None
    known: bool = False
    reason: str | None = None
    experts: bool = False


def _is_experts(module: nn.Module) -> bool:
    params = [(n, p) for n, p in module._parameters.items() if p is not None and p.dim() >= 3]
    return any(n in EXPERT_PARAMETERS for n, _ in params) or (bool(params) and "Expert" in type(module).__name__)


def find_gated(model: nn.Module) -> tuple[list[Gated], list[str]]:
    """(every gated module not yet fused, names of the `FusedGatedMLP`s already there)."""
    found, fused, claimed = [], [], []
    for name, module in model.named_modules():
        if any(name.startswith(c + ".") for c in claimed):
            continue  # inside a module already found: its projections, not MLPs of their own
        if isinstance(module, FusedGatedMLP) or experts.is_switched(module):
            fused.append(name)
        elif _is_experts(module):
            found.append(Gated(name, module, None, experts=True))
        elif type(module).__name__ in KNOWN_MLP_CLASSES:
            found.append(Gated(name, module, KNOWN_MLP_CLASSES[type(module).__name__], known=True))
        elif (family := structure_of(module)) is not None:
            found.append(Gated(name, module, family))
        else:
            continue
        claimed.append(name)
    return found, fused


# -- the checks: each raises ValueError with the reason it refuses --------------------------------------


def _describe(names: list[str], module: nn.Module) -> str:
    parts = []
    for n in names:
        obj = module._modules.get(n)
        obj = obj if obj is not None else module._parameters.get(n, module._buffers.get(n))
        parts.append(f"{n} ({type(obj).__name__})")
    return ", ".join(parts)


def check_structure(module: nn.Module, family: MLPFamily) -> None:
    """Nothing beyond gate, up, down and the activation: anything more is more math."""
    own = set(family.projections) | ({family.act} if family.act else set())
    missing = [n for n in own if not isinstance(module._modules.get(n), nn.Module)]
    if missing:
        raise ValueError(f"the registry record names {', '.join(sorted(missing))}, which the module does not have")
    extra = [n for n, m in module._modules.items() if n not in own and m is not None]
    extra += [n for n, p in module._parameters.items() if p is not None]
    extra += [n for n, b in module._buffers.items() if b is not None]
    if extra:
        if any(word in n.lower() for n in extra for word in ("router", "expert")):
            raise ValueError(f"a mixture-of-experts block with a router ({_describe(extra, module)}): not fused yet")
        raise ValueError(
            f"it holds more than gate, up, down and the activation: {_describe(extra, module)}; its forward "
            "computes more than the gated MLP"
        )


def check_forward(module: nn.Module, family: MLPFamily) -> None:
    """The class's forward takes one tensor and nothing replaced it on the instance or hooks into it."""
    problem = forward_arity_problem(module)
    if problem:
        raise ValueError(problem)
    if "forward" in module.__dict__ and getattr(module, "_hf_hook", None) is None:
        raise ValueError("its forward is overridden on the instance; the fused module would not run that override")
    for owner, label in [(module, "it")] + [(getattr(module, n), n) for n in family.projections]:
        hooks = sum(len(getattr(owner, h)) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                      "_backward_pre_hooks"))
        if hooks:
            raise ValueError(f"{label} has {hooks} forward/backward hook(s), which the fused module would not run")


def check_linears(module: nn.Module, family: MLPFamily) -> None:
    """Plain float nn.Linear projections on a real device; gate and up alike."""
    names = list(family.projections)
    linears = [getattr(module, n) for n in names]
    for name, lin in zip(names, linears):
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
        if (type(w.data) is not torch.Tensor and not tensor_parallel.is_dtensor(w)) or w.dtype not in _FLOAT_DTYPES:
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


def check_tensor_parallel(module: nn.Module, family: MLPFamily) -> None:
    """A tensor-parallel MLP is sharded the way the fused MLP runs it (`tensor_parallel.check_sharding`)."""
    tensor_parallel.check_sharding(module, family)


# Structural checks, in order; each raises ValueError with the reason it refuses.
CHECKS = [check_structure, check_tensor_parallel, check_forward, check_linears]


def activation_of(module: nn.Module, family: MLPFamily, known: bool) -> str:
    """The kernel activation the module applies to the gate; ValueError with the reason if none fits."""
    if family.act is None:
        if family.activation is None:
            raise ValueError("it has no activation module (its forward writes the activation) and its class is "
                             "not in the registry")
        return family.activation
    act = getattr(module, family.act)
    from_module = activation_of_module(act)
    config = getattr(module, "config", None)
    key = family.activation_key if known else None
    name = getattr(config, key, None) if key and config is not None else None
    if from_module is None:
        what = f"{key}={name!r} ({type(act).__name__})" if name is not None else type(act).__name__
        raise ValueError(f"activation {what} is not supported; supported: {', '.join(HF_ACTIVATIONS)} (the "
                         f"kernel's {', '.join(ACTIVATIONS)})")
    if name is not None and HF_ACTIVATIONS.get(name) != from_module:
        raise ValueError(
            f"config says {key}={name!r} but the module's {family.act} is {type(act).__name__}; refusing to guess "
            "which one the model computes"
        )
    return from_module


def _probe_key(g: Gated, epilogue: GatedEpilogue) -> tuple:
    """What the probe's verdict depends on: the class, structure, epilogue, biases and plain attributes."""
    attrs = []
    for k, v in sorted(vars(g.module).items()):
        if k.startswith("_") or k == "forward":
            continue
        attrs.append((k, v if isinstance(v, (bool, int, float, str, type(None))) else id(v)))
    bias = tuple(getattr(g.module, n).bias is not None for n in g.family.projections)
    return (type(g.module), g.family, epilogue, bias, tuple(attrs))


def plan_one(g: Gated, proven: dict) -> GatedEpilogue:
    """The epilogue that computes `g.module` exactly; ValueError with the reason otherwise.

    `proven` caches the probe's verdict per `_probe_key` (one probe per class and setting).
    """
    for check in CHECKS:
        check(g.module, g.family)
    epilogue = g.family.settings(g.module, activation_of(g.module, g.family, g.known))
    key = _probe_key(g, epilogue)
    if key not in proven:
        try:
            probe(g.module, g.family, epilogue)
            proven[key] = None
        except ValueError as e:
            proven[key] = refusal(g.module, g.known, e)
    if proven[key] is not None:
        raise ValueError(proven[key])
    return epilogue


# -- the packing step -----------------------------------------------------------------------------------


def _replace(model: nn.Module, name: str, module: nn.Module, family: MLPFamily, epilogue: GatedEpilogue,
             backend: str) -> FusedGatedMLP:
    shards = tensor_parallel.localize(module, family)  # None unless tensor-parallel
    fused = FusedGatedMLP.from_original(module, family, epilogue, backend)
    tensor_parallel.attach(fused, shards)
    hook = getattr(module, "_hf_hook", None)
    if hook is not None:  # accelerate's device-alignment hook travels with the module
        from accelerate.hooks import add_hook_to_module

        add_hook_to_module(fused, hook)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, fused)
    return fused


def _require_module(fn: str, model: object) -> None:
    """TypeError naming what to pass unless `model` is an nn.Module (a hub id or path is not loaded for you)."""
    if not isinstance(model, nn.Module):
        name = repr(model) if isinstance(model, (str, type(None))) else type(model).__name__
        source = repr(str(model)) if isinstance(model, (str, PathLike)) else "..."
        raise TypeError(f"{fn}: expected a loaded model (a torch.nn.Module), got {name[:100]}; load it first, e.g. "
                        f"model = AutoModelForCausalLM.from_pretrained({source[:100]})")


def apply_fused_mlp(model: nn.Module, *, strict: bool = True, backend: str = "auto") -> PatchReport:
    """Replace every gated MLP of `model` that is shown to be exact with a `FusedGatedMLP`, in place.

    Each gated module is checked first (structure, forward, projections, activation, the
    class's settings) and its class is run against the fused module by the numeric probe
    (`probe.py`; once per class and setting, on small fp32 copies, never the model's weights).
    Then gate and up weights are packed (`interleave_gate_up`) on their own device and dtype
    and the originals freed, one module at a time. Calling it again changes nothing.

    Args:
        model: a transformers model (or any nn.Module holding gated MLPs).
        strict: raise unless every gated module can be patched (default), before changing
            anything; with False, patch the ones that can and list the others in the report.
        backend: `gated_linear` backend for the fused modules ("auto", "triton", "torch").

    Returns:
        A `PatchReport` naming every gated module: patched, or left with the reason.

    Raises:
        PatchError: strict and a gated module cannot be patched (more math than the gated MLP,
            quantized or non-Linear projections, meta/offloaded weights, an unsupported
            activation or setting, MoE experts whose math the kernels do not run), or the
            model has no gated MLP at all.
        ValueError: unknown backend.
        TypeError: `model` is not an nn.Module (a hub id or path: load it first).
    """
    _require_module("apply_fused_mlp", model)
    if backend not in BACKENDS:
        raise ValueError(f"apply_fused_mlp: backend must be one of {BACKENDS}, got {backend!r}")
    if importlib.util.find_spec("peft") is not None:  # PEFT in either order (swiglu_patch.lora)
        from .lora import lora_layers_aside

        if (aside := lora_layers_aside(model)) is not None:  # a PEFT model: its LoRA layers go onto the fused MLPs
            with aside:
                return apply_fused_mlp(model, strict=strict, backend=backend)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    found, fused_names = find_gated(model)
    report = PatchReport(model_type=model_type, already_patched=fused_names, training=model.training)
    if not found and not fused_names:
        if strict:
            raise PatchError(
                f"apply_fused_mlp: no gated MLP found in {type(model).__name__}: model_type {model_type!r} has no "
                f"gated MLP; supported: {supported_model_types()}"
            )
        return report

    plan, proven = [], {}  # check every module before touching any, so strict mode never half-patches
    for g in found:
        try:
            if g.reason:
                raise ValueError(g.reason)
            plan.append((g, experts.plan_experts(g.module, proven) if g.experts else plan_one(g, proven)))
        except ValueError as e:
            report.not_patched.append(NotPatched(g.name, type(g.module).__name__, str(e)))
    plan = _experts_by_config(found, plan, report)
    report.probes = len(proven)
    if strict and report.not_patched:
        first, more = report.not_patched[0], len(report.not_patched) - 1
        raise PatchError(
            f"apply_fused_mlp: cannot patch {first.name} ({first.module_class}): {first.reason}"
            + (f" ({more} more gated module(s) cannot be patched either)" if more else "")
            + (f". Pass strict=False to patch the {len(plan)} that can be and leave these as they are." if plan else
               ". None of the model's gated modules can be patched; strict=False returns the report without raising.")
        )

    previous = {id(g.module.config): g.module.config._experts_implementation for g, _ in plan if g.experts}
    for g, epilogue in plan:
        if g.experts:  # the experts module stays; its config now picks the fused experts kernels
            experts.switch(g.module, epilogue, backend, previous[id(g.module.config)])
            report.patched.append(g.name)
            report.experts[g.name] = epilogue
            continue
        fused = _replace(model, g.name, g.module, g.family, epilogue, backend)
        report.patched.append(g.name)
        report.epilogues[g.name] = epilogue
        if not g.known:
            report.by_structure.append(g.name)
        report.trainable |= fused.gate_up_interleaved.requires_grad
    return report


def _experts_by_config(found: list[Gated], plan: list, report: PatchReport) -> list:
    """`plan` less the experts modules that share a config with one that cannot be fused (now
    listed in the report): transformers reads the experts implementation from the config, so
    the modules of one config switch together or not at all."""
    refused = {n.name for n in report.not_patched}
    blocked = {id(g.module.config): g.name for g in found
               if g.experts and g.name in refused and getattr(g.module, "config", None) is not None}
    kept = []
    for g, spec in plan:
        if g.experts and id(g.module.config) in blocked:
            report.not_patched.append(NotPatched(
                g.name, type(g.module).__name__, f"shares its config with {blocked[id(g.module.config)]}, which cannot "
                "be fused, and transformers picks the experts implementation per config"))
        else:
            kept.append((g, spec))
    return kept


def unpatch(model: nn.Module) -> int:
    """Put back every original MLP module, with gate/up weights restored bit for bit.

    Args:
        model: a model patched by `apply_fused_mlp` (an unpatched model is left as it is).

    Returns:
        The number of MLPs restored.

    Raises:
        TypeError: `model` is not an nn.Module.
    """
    _require_module("unpatch", model)
    restored = experts.restore(model)
    fused = [(name, m) for name, m in model.named_modules() if isinstance(m, FusedGatedMLP)]
    for name, module in fused:
        parent_name, _, child = name.rpartition(".")
        original = module.restore()
        tensor_parallel.restore_sharding(module, original)
        setattr(model.get_submodule(parent_name) if parent_name else model, child, original)
    return len(fused) + restored


def is_patched(model: nn.Module) -> bool:
    """True if any MLP in `model` is a `FusedGatedMLP` or any experts module runs on the fused experts kernels."""
    return any(isinstance(m, FusedGatedMLP) or experts.is_switched(m) for m in model.modules())
