"""MoE experts: transformers' `@use_experts_implementation` classes run on the fused experts kernels.

transformers 5.x picks an experts module's forward by ``config._experts_implementation``
through `transformers.integrations.moe.ExpertsInterface`. This module registers ours there
under `IMPLEMENTATION` ("swiglu_patch"), so that

    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="swiglu_patch")
    model.set_experts_implementation("swiglu_patch")

select it, and `apply_fused_mlp` switches every fusable experts module to it. Nothing is
repacked: the kernels read the 3-D weights in the layout the model holds them
(`kernels/experts_reference.py`), so `state_dict`, `save_pretrained` and transformers' TP and EP
plans see the model's own parameters, and switching back restores the model exactly.

A class is fused only when it is shown to compute what the kernels run (`experts_spec`, then
`probe_experts`): its forward is the decorator's dispatcher; it has a gate and no post-expert
norm; its `_apply_gate` is transformers' default act(gate) * up (the activation read from
`act_fn`) or one of `KNOWN_GATES`; and the class's own eager forward agrees with the fused
math on a small fp32 copy. Anything else is refused with the reason.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from . import experts_lora, experts_lora_ops, experts_ops, ops
from .kernels.epilogue import GatedEpilogue
from .kernels.experts_reference import ExpertsEpilogue, ExpertsLayout, experts_reference
from .registry import Refused, activation_of_module

IMPLEMENTATION = "swiglu_patch"
PROBE_EXPERTS, PROBE_K, PROBE_I, PROBE_TOKENS, PROBE_TOP_K = 4, 24, 20, 7, 2
TOLERANCE = 1e-5


@dataclass(frozen=True)
class ExpertsSpec:
    """What one experts module computes, in the kernels' terms.

    Attributes:
        epilogue: the gated math of one expert.
        layout: how gate_up and down are stored.
        has_bias: gate_up_proj_bias and down_proj_bias are added.
    """

    epilogue: ExpertsEpilogue
    layout: ExpertsLayout
    has_bias: bool

    def describe(self) -> str:
        return f"{self.epilogue.describe()}; {self.layout.describe()}" + ("; bias" if self.has_bias else "")


def _clamped(attr: str, where: str) -> Callable[[nn.Module], ExpertsEpilogue]:
    def build(module: nn.Module) -> ExpertsEpilogue:
        act = _activation(module) if hasattr(module, "act_fn") else "silu"
        return ExpertsEpilogue(GatedEpilogue(act, limit=float(getattr(module, attr)), clamp=where))
    return build


def _gpt_oss(limit_attr: str, alpha_attr: str) -> Callable[[nn.Module], ExpertsEpilogue]:
    def build(module: nn.Module) -> ExpertsEpilogue:
        return ExpertsEpilogue(GatedEpilogue("silu", limit=float(getattr(module, limit_attr))),
                               alpha=float(getattr(module, alpha_attr)))
    return build


# `_apply_gate` overrides the kernels express, by the function's qualified name. Each is still
# proven by the probe on its own class before it is fused.
KNOWN_GATES: dict[str, Callable[[nn.Module], ExpertsEpilogue]] = {
    "transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts._apply_gate": _gpt_oss("limit", "alpha"),
    "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLExperts._apply_gate":
        _gpt_oss("swiglu_limit", "swiglu_alpha"),
    "transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts._apply_gate": _clamped("limit", "gate"),
    "transformers.models.glm5_next.modeling_glm5_next.Glm5NextTextExperts._apply_gate":
        _clamped("swiglu_limit", "gate"),
    "transformers.models.hy_v4.modeling_hy_v4.HYV4Experts._apply_gate": _clamped("swiglu_limit", "gate"),
    "transformers.models.hy_v4_vl.modeling_hy_v4_vl.HYV4VLExperts._apply_gate": _clamped("swiglu_limit", "gate"),
    "transformers.models.step3p7.modeling_step3p7.Step3p7Experts._apply_gate": _clamped("limit", "activation"),
}


def _dispatcher_code():
    """The code object of the forward that `@use_experts_implementation` installs."""
    from transformers.integrations.moe import use_experts_implementation

    class _Probe(nn.Module):
        def forward(self, x):
            return x

    return use_experts_implementation(_Probe).forward.__code__


def is_experts_class(module: nn.Module) -> bool:
    """Whether `module`'s class is decorated with transformers' `@use_experts_implementation`."""
    try:
        return type(module).forward.__code__ is _dispatcher_code()
    except ImportError:
        return False


# Activation functions (not modules) an experts class may keep in `act_fn` (LFM2-MoE: F.silu).
_ACTIVATION_FUNCTIONS = {torch.nn.functional.silu: "silu"}


def _activation(module: nn.Module) -> str:
    act = _ACTIVATION_FUNCTIONS.get(module.act_fn) if not isinstance(module.act_fn, nn.Module) else None
    act = act or activation_of_module(module.act_fn)
    if act is None:
        raise Refused(f"its act_fn ({type(module.act_fn).__name__}) is not an activation the fused kernels compute "
                      "(silu, gelu_tanh, gelu)")
    return act


def experts_spec(module: nn.Module) -> ExpertsSpec:
    """What `module` computes, from its class, flags and `_apply_gate`; not yet proven (`probe_experts`).

    Raises:
        Refused: the module's math or layout is not one the fused experts kernels run (the message says which).
    """
    if not is_experts_class(module):
        raise Refused("its forward is not transformers' @use_experts_implementation dispatcher (a custom experts "
                      "class); only the decorated classes are fused")
    if not getattr(module, "has_gate", True):
        raise Refused("has_gate=False: these experts run act(up) with no gate, not a gated MLP")
    if getattr(module, "has_post_expert_norm", False):
        raise Refused("has_post_expert_norm=True: a norm runs on each expert's output before the routing weight, "
                      "which the fused down GEMM does not apply")
    params = module._parameters
    for name in ("gate_up_proj", "down_proj"):
        if not isinstance(params.get(name), torch.Tensor) or params[name].dim() != 3:
            raise Refused(f"it has no 3-D {name} parameter (found {type(params.get(name)).__name__})")
    gate = type(module)._apply_gate
    key = f"{gate.__module__}.{gate.__qualname__}"
    if key == "transformers.integrations.moe._default_apply_gate":
        epilogue = ExpertsEpilogue(GatedEpilogue(_activation(module)))
    elif key in KNOWN_GATES:
        epilogue = KNOWN_GATES[key](module)
    else:
        raise Refused(f"its _apply_gate ({gate.__qualname__}) is not one the fused kernels are known to compute")
    layout = ExpertsLayout(transposed=bool(getattr(module, "is_transposed", False)),
                           concatenated=bool(getattr(module, "is_concatenated", True)))
    has_bias = bool(getattr(module, "has_bias", False))
    if has_bias and not all(isinstance(params.get(n), torch.Tensor) for n in ("gate_up_proj_bias", "down_proj_bias")):
        raise Refused("has_bias=True but gate_up_proj_bias or down_proj_bias is missing")
    return ExpertsSpec(epilogue, layout, has_bias)


def _small_copy(module: nn.Module, spec: ExpertsSpec, gen: torch.Generator) -> nn.Module:
    """A shallow copy of `module` with small random fp32 experts (`module` untouched)."""
    small = copy.copy(module)
    small._parameters = dict(module._parameters)  # own dicts: setting parameters leaves `module` alone
    small._buffers = dict(module._buffers)
    small._modules = dict(module._modules)
    e, k, i = PROBE_EXPERTS, PROBE_K, PROBE_I
    shapes = {"gate_up_proj": (e, k, 2 * i) if spec.layout.transposed else (e, 2 * i, k),
              "down_proj": (e, i, k) if spec.layout.transposed else (e, k, i)}
    if spec.has_bias:
        shapes.update(gate_up_proj_bias=(e, 2 * i), down_proj_bias=(e, k))
    for name, shape in shapes.items():
        scale = 0.5 if "bias" in name else shape[-1 if not spec.layout.transposed else -2] ** -0.5
        small._parameters[name] = nn.Parameter(torch.randn(shape, generator=gen) * scale, requires_grad=False)
    small.num_experts = e
    return small


def probe_experts(module: nn.Module, spec: ExpertsSpec, seed: int = 0) -> float:
    """Run the class's own eager forward and the fused math (`experts_reference`) on a small fp32
    copy; return the worst relative error, at most `TOLERANCE`.

    Raises:
        Refused: the eager forward failed or returned something else, or the two differ.
    """
    gen = torch.Generator().manual_seed(seed)
    small = _small_copy(module, spec, gen)
    eager = type(module).forward.__wrapped__
    worst = 0.0
    for scale in (1.0, 8.0):  # 8: past gpt-oss's clamp limit, so the clamps are exercised
        x = torch.randn(PROBE_TOKENS, PROBE_K, generator=gen) * scale
        index = torch.stack([torch.randperm(PROBE_EXPERTS, generator=gen)[:PROBE_TOP_K] for _ in range(PROBE_TOKENS)])
        index[-1] = index[0]  # two tokens on the same experts, and (7 tokens, 4 experts) every expert hit
        weights = torch.rand(PROBE_TOKENS, PROBE_TOP_K, generator=gen)
        with torch.no_grad():
            try:
                ref = eager(small, x, index, weights)
            except Exception as e:  # noqa: BLE001 - any failure means "not proven", with its message
                raise Refused(f"its eager forward failed on the probe's small copy ({type(e).__name__}: {e})") from None
            if not isinstance(ref, torch.Tensor) or ref.shape != x.shape:
                raise Refused("its eager forward does not return one tensor of its input's shape")
            out = experts_reference(x, index, weights, small.gate_up_proj, small.down_proj, spec.epilogue,
                                    spec.layout, small._parameters.get("gate_up_proj_bias") if spec.has_bias else None,
                                    small._parameters.get("down_proj_bias") if spec.has_bias else None)
        top = ref.abs().max().item()
        err = (out - ref).abs().max().item() / top if top > 0 else float("inf")
        if not err <= TOLERANCE:
            raise Refused(f"the fused experts ({spec.describe()}) differ from its eager forward by {err:.2g} "
                          f"(relative, tolerance {TOLERANCE:g}) on the probe's small copy: swiglu-patch's reading of "
                          "this class is wrong; please report it with the model type and transformers version")
        worst = max(worst, err)
    return worst


# -- the forward transformers calls -------------------------------------------------------------


def spec_of(module: nn.Module) -> ExpertsSpec:
    """`module`'s proven spec, found and probed on its first call and kept on the module (no tensors).

    Raises:
        Refused: the module cannot run on the fused kernels (the message says why).
    """
    spec = module.__dict__.get("_swiglu_experts_spec")
    if spec is None:
        spec = experts_spec(module)
        probe_experts(module, spec)
        module.__dict__["_swiglu_experts_spec"] = spec
    return spec


MODES = ("store", "recompute")


def fused_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The `ExpertsInterface` function registered as `IMPLEMENTATION`: hidden_states [T, K],
    top_k_index and top_k_weights [T, top_k] -> [T, K], in hidden_states' dtype.

    On CUDA (or with backend "triton") the fused kernels run; on CPU `experts_reference`. Where
    autograd needs a gradient, the kernels run as ``swiglu_patch::experts_train`` (eager calls:
    `experts_ops.ExpertsTrain`, the same functions without the op's dispatch), whose backward
    (`kernels/experts_backward.py`) gives x, the 3-D weights, the biases and
    the routing weights their gradients, saving what the module's mode says (`set_experts_mode`:
    "store" keeps the pairs' [S, 2I] pre-activation, "recompute" only x); `experts_reference` is
    differentiable as it is. A module set by `apply_fused_mlp` keeps its backend in `_swiglu_backend`.
    PEFT's LoRA adapters bound to the module for this forward (`experts_lora`) are added inside the
    grouped GEMMs (``swiglu_patch::experts_lora_train``), or inside `experts_reference`'s loop.

    Raises:
        ValueError: the module's math is not one the fused kernels run (`experts_spec`).
    """
    spec = spec_of(module)
    params = module._parameters
    if "gate_up_proj" in params and "down_proj" in params:
        gate_up, down = params["gate_up_proj"], params["down_proj"]
        gate_up_bias = params["gate_up_proj_bias"] if spec.has_bias else None
        down_bias = params["down_proj_bias"] if spec.has_bias else None
    else:  # parametrized (PEFT's LoRA where `experts_lora` refused it: W + s*B@A, materialized as PEFT does)
        gate_up, down = module.gate_up_proj, module.down_proj
        gate_up_bias = module.gate_up_proj_bias if spec.has_bias else None
        down_bias = module.down_proj_bias if spec.has_bias else None
    low_rank = experts_lora.bound_low_rank(module, hidden_states.dtype)  # PEFT's adapters, unmaterialized
    backend = module.__dict__.get("_swiglu_backend", "auto")
    if backend == "auto":
        backend = "triton" if hidden_states.is_cuda else "torch"
    elif backend == "triton":
        ops.resolve_backend(backend, hidden_states.device, "fused experts")  # names the fix off CUDA
    if backend == "torch":
        return experts_reference(hidden_states, top_k_index, top_k_weights, gate_up, down, spec.epilogue, spec.layout,
                                 gate_up_bias, down_bias, low_rank)
    epilogue, layout = spec.epilogue, spec.layout
    args = (*ops.epilogue_args(epilogue.gated), epilogue.alpha or 0.0, layout.transposed, layout.concatenated)
    store = module.__dict__.get("_swiglu_experts_mode", "store") == "store"
    if low_rank is not None:
        needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (
            hidden_states, top_k_weights, gate_up, down, gate_up_bias, down_bias, *low_rank[:2], *low_rank[3:5]))
        return experts_lora_ops.experts_lora_train_autograd(
            hidden_states, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, *low_rank[:2],
            *low_rank[3:5], low_rank.gate_up_scale, low_rank.down_scale, *args, store and needs_grad)[0]
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden_states, top_k_weights, gate_up, down, gate_up_bias, down_bias))
    operands = (hidden_states, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias)
    if needs_grad:  # training: the op with its backward (`experts_ops.experts_train_autograd`)
        return experts_ops.experts_train_autograd(*operands, *args, store)[0]
    if torch.compiler.is_compiling():  # one opaque op for the compiler
        return experts_ops.experts_op(*operands, *args)
    return experts_ops.experts_kernels().experts_forward(*operands[:5], epilogue, layout, gate_up_bias, down_bias)


def set_experts_mode(model: nn.Module, mode: str) -> int:
    """What training saves in every experts module `apply_fused_mlp` switched in `model`: "store"
    (the default: x and the pairs' [T * top_k, 2I] pre-activation) or "recompute" (x only; the
    backward runs the gated GEMM again). Returns how many modules were set.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"set_experts_mode: mode must be one of {MODES}, got {mode!r}")
    count = 0
    for module in model.modules():
        if is_switched(module):
            module.__dict__["_swiglu_experts_mode"] = mode
            count += 1
    return count


def register_implementation() -> None:
    """Register `fused_experts_forward` with transformers' `ExpertsInterface` as `IMPLEMENTATION` (idempotent)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:  # a transformers without the experts interface: nothing to register with
        return
    ExpertsInterface.register(IMPLEMENTATION, fused_experts_forward)
    experts_lora.install(IMPLEMENTATION)  # PEFT's LoRA on these experts: inside the grouped GEMMs


# -- switching a model's experts modules (apply_fused_mlp, unpatch) -------------------------------------------

_PREVIOUS = "_swiglu_previous_experts"  # on a switched module: its config's implementation before


def plan_experts(module: nn.Module, proven: dict) -> ExpertsSpec:
    """`module`'s spec, proven by the probe once per (class, spec, plain attributes); `proven` keeps the verdicts.

    Raises:
        Refused: the module cannot run on the fused kernels (the message says why).
    """
    spec = experts_spec(module)
    if getattr(module, "config", None) is None:
        raise Refused("it has no config, where transformers reads the experts implementation")
    attrs = tuple(sorted((k, v) for k, v in vars(module).items()
                         if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))))
    key = (type(module), spec, attrs)
    if key not in proven:
        try:
            probe_experts(module, spec)
            proven[key] = None
        except Refused as e:
            proven[key] = str(e)
    if proven[key] is not None:
        raise Refused(proven[key])
    return spec


def is_switched(module: nn.Module) -> bool:
    """Whether `apply_fused_mlp` switched this experts module to the fused kernels."""
    return _PREVIOUS in module.__dict__


def switch(module: nn.Module, spec: ExpertsSpec, backend: str, previous: str | None) -> None:
    """Run `module` (and every experts module sharing its config) on `IMPLEMENTATION`; `previous`:
    its config's implementation before any module of it was switched, for `restore`."""
    register_implementation()
    config = module.config
    module.__dict__[_PREVIOUS] = previous
    module.__dict__["_swiglu_experts_spec"] = spec
    module.__dict__["_swiglu_backend"] = backend
    config._experts_implementation_internal = IMPLEMENTATION  # this config only: not its sub-configs


def restore(model: nn.Module) -> int:
    """Switch every experts module `switch` set back to its config's earlier implementation; how many."""
    count = 0
    for module in model.modules():
        if is_switched(module):
            module.config._experts_implementation_internal = module.__dict__.pop(_PREVIOUS)
            module.__dict__.pop("_swiglu_experts_spec", None)
            module.__dict__.pop("_swiglu_backend", None)
            module.__dict__.pop("_swiglu_experts_mode", None)
            count += 1
    return count
