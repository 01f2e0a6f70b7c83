"""PEFT's LoRA on the experts' 3-D weights, run inside the fused grouped GEMMs: no materialized delta.

PEFT's `ParamWrapper` (`target_parameters=["experts.gate_up_proj", "experts.down_proj"]`)
parametrizes the experts' weight for the duration of its forward, so that whoever reads it gets
W + s * B @ A: a tensor the size of the whole expert stack, built on every forward (and in
16-bit dtypes, or with several adapters, a second one, the delta). `install` wraps the class's
`_activate_lora` once: where the wrapped experts module runs on the fused kernels (its config's
experts implementation is swiglu-patch's) and the adapter is one this module proves exact, the
wrapper does not parametrize; it binds its adapter to the experts module for the duration of the
forward instead, and `bound_low_rank` gives `experts.fused_experts_forward` the factors as they
lie in PEFT's weights, which the kernels add inside the grouped GEMMs (`kernels/experts_low_rank.py`).

Factors: PEFT's lora_A.weight [E * r, in] and lora_B.weight [out, r * E] are, per expert,
A_e = A.view(E, r, in)[e] and B_e = B.view(out, r, E)[..., e], the delta s * B_e @ A_e in the
projection's (out, in) orientation whatever the layout (PEFT swaps in/out for [E, out, in]
weights and transposes the delta for [E, in, out] ones), with s = PEFT's `scaling`.

Several active adapters on one weight run as one of their ranks summed (`stacked_factors`).
Anything else runs PEFT's own materialized path, with a warning that names why, once per
experts module and reason (`refusal`): an adapter on another parameter, dropout, DoRA, a LoRA
bias (PEFT refuses these three on 3-D weights itself), a weight carrying another
parametrization, ranks summing past `MAX_RANK`. Merging, saving and unloading are PEFT's,
untouched: the adapters' parameters are PEFT's own.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from .kernels.experts_reference import ExpertsLowRank

ADAPTED = ("gate_up_proj", "down_proj")
MAX_RANK = 128  # `kernels.experts_low_rank.MAX_RANK`, the segments' largest r
_BOUND = "_swiglu_lora"  # on an experts module during a wrapper's forward: {parameter name: (wrapper, adapters)}
_WARNED = "_swiglu_lora_warned"
_MATERIALIZE = "_swiglu_lora_materialize"  # set by `materialize`: PEFT's own path, asked for
_ORIGINAL = "_swiglu_original_activate_lora"  # on ParamWrapper: PEFT's own _activate_lora
_fused_implementation: str | None = None  # the experts implementation name that runs fused (`install`'s)


def _param_wrapper():
    """PEFT's `ParamWrapper` class, or None where PEFT (or that class) is missing."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:
        return None
    return ParamWrapper if hasattr(ParamWrapper, "_activate_lora") else None


def install(implementation: str) -> bool:
    """Route PEFT's experts LoRA through the fused kernels for experts modules whose config runs the
    experts implementation named `implementation` (idempotent); False where PEFT has no `ParamWrapper`."""
    global _fused_implementation
    _fused_implementation = implementation
    cls = _param_wrapper()
    if cls is None:
        return False
    if _ORIGINAL not in cls.__dict__:
        setattr(cls, _ORIGINAL, cls._activate_lora)
        cls._activate_lora = _activate_lora
    return True


def runs_fused(experts: nn.Module) -> bool:
    """Whether `experts` runs on swiglu-patch's experts implementation (the name `install` was given)."""
    config = getattr(experts, "config", None)
    return _fused_implementation is not None and getattr(config, "_experts_implementation", None) == _fused_implementation


def refusal(wrapper: nn.Module, experts: nn.Module, adapters: list[str]) -> str | None:
    """Why this wrapper's adapters cannot run inside the fused GEMMs (None: they can)."""
    name = wrapper.parameter_name
    if experts.__dict__.get(_MATERIALIZE):
        return "materialize(model) asked for it"
    if name not in ADAPTED:
        return f"LoRA on {name} (only {ADAPTED} are fused)"
    if nn.utils.parametrize.is_parametrized(experts, name):
        return f"{name} is already parametrized (another parametrization beside PEFT's)"
    weight = experts._parameters.get(name)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or wrapper.num_experts != weight.shape[0]:
        return f"{name} is not a 3-D [E, ...] weight with E = the adapter's {wrapper.num_experts} experts"
    rank = 0
    for adapter in adapters:
        if not isinstance(wrapper.lora_dropout[adapter], nn.Identity):
            return "lora_dropout > 0"
        if wrapper.use_dora.get(adapter, False):
            return "DoRA"
        if wrapper.lora_bias.get(adapter, False):
            return "lora_bias=True"
        a, b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
        if a.shape[0] % weight.shape[0] or b.shape[1] != a.shape[0]:
            return "lora_A and lora_B whose rows are not rank x experts"
        rank += a.shape[0] // weight.shape[0]
    if rank > MAX_RANK:
        return f"rank {rank} (the active adapters' ranks summed; 1..{MAX_RANK} are fused)"
    return None


def _activate_lora(self, active_adapters):
    """`ParamWrapper._activate_lora`, binding the adapter to fused experts instead of parametrizing (`install`)."""
    experts = self.get_base_layer()
    adapters = [a for a in (active_adapters or []) if a in self.lora_A]
    if not adapters or not runs_fused(experts):
        return getattr(type(self), _ORIGINAL)(self, active_adapters)
    reason = refusal(self, experts, adapters)
    if reason is not None:
        warned = experts.__dict__.setdefault(_WARNED, set())
        if reason not in warned and not experts.__dict__.get(_MATERIALIZE):
            warned.add(reason)
            warnings.warn(f"swiglu-patch: the fused experts run PEFT's materialized W + s*B@A for {reason}",
                          stacklevel=3)
        return getattr(type(self), _ORIGINAL)(self, active_adapters)
    return _bound(experts, self, tuple(adapters))


@contextlib.contextmanager
def _bound(experts: nn.Module, wrapper: nn.Module, adapters: tuple[str, ...]):
    bound = experts.__dict__.setdefault(_BOUND, {})
    bound[wrapper.parameter_name] = (wrapper, adapters)
    try:
        yield
    finally:
        bound.pop(wrapper.parameter_name, None)


def factors(wrapper: nn.Module, adapter: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A [E, r, in], B [E, out, r], s) of one PEFT adapter: views of its weights (cast to `dtype`
    where they differ, as PEFT casts its delta to the weight's dtype)."""
    a, b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
    e = wrapper.num_experts
    a3 = a.view(e, a.shape[0] // e, a.shape[1])
    b3 = b.view(b.shape[0], b.shape[1] // e, e).permute(2, 0, 1)
    return a3.to(dtype), b3.to(dtype), float(wrapper.scaling[adapter])


def stacked_factors(wrapper: nn.Module, adapters: tuple[str, ...], dtype: torch.dtype) -> tuple:
    """(A, B, s) of one adapter (`factors`), or of several summed: s_i * A_i stacked along r, the B_i beside
    them, s = 1 (sum_i s_i B_i A_i = [B_1 ... B_n] @ [s_1 A_1; ...; s_n A_n]; small copies, never the delta)."""
    if len(adapters) == 1:
        return factors(wrapper, adapters[0], dtype)
    parts = [factors(wrapper, adapter, dtype) for adapter in adapters]
    return torch.cat([a * s for a, _, s in parts], 1), torch.cat([b for _, b, _ in parts], 2), 1.0


def bound_low_rank(module: nn.Module, dtype: torch.dtype) -> ExpertsLowRank | None:
    """The adapters bound to `module` for this forward (`ExpertsLowRank`, in `dtype`), or None."""
    bound = module.__dict__.get(_BOUND)
    if not bound:
        return None
    parts = []
    for name in ADAPTED:
        if name in bound:
            parts.extend(stacked_factors(*bound[name], dtype))
        else:
            parts.extend((None, None, 1.0))
    return ExpertsLowRank(*parts)


def materialize(model: nn.Module, on: bool = True) -> int:
    """Run PEFT's own materialized LoRA (W + s*B@A) on every fused experts module in `model` (on=False:
    the fused low-rank segments again): for comparisons and debugging. Returns how many modules were set."""
    count = 0
    for module in model.modules():
        if runs_fused(module) and isinstance(module._parameters.get("gate_up_proj"), torch.Tensor):
            module.__dict__[_MATERIALIZE] = on
            count += 1
    return count
