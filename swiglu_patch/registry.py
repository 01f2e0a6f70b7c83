"""The gated MLP classes swiglu-patch knows, one frozen record per class, and the structures an
unknown class may have.

A record says where the class keeps its projections (two Linears, Phi-3's one chunked
[gate; up] Linear, or LFM2's ``w1``/``w3``/``w2``), where its activation lives (a module
attribute, or written in the forward, as LFM2's ``F.silu``), which config key names that
activation (Gemma reads ``hidden_activation``), and which of the module's settings change the
math. `settings` maps those settings to the `GatedEpilogue` the fused kernel runs, or refuses
with the reason (`Refused`). The settings, per class (each read from the module's own
attributes, which its ``__init__`` takes from the config):

- ``FalconH1MLP``: ``gate_multiplier``, ``down_multiplier`` (config ``mlp_multipliers``):
  ``down(act(gate * m_g) * up) * m_d`` -> gate_scale m_g, out_scale m_d (refused where
  ``down_proj`` has a bias and m_d != 1: the multiplier would scale the bias too).
- ``DeepseekV4MLP`` (``limit``), ``Glm5NextTextMLP`` and ``Glm5NextVisionMLP``
  (``swiglu_limit``), all from config ``swiglu_limit``: ``act(min(gate, L)) * clip(up, -L, L)``
  -> clamp="gate", limit L.
- ``Step3p7MLP``: ``limit``, per layer from config ``swiglu_limits_shared[layer]`` (0 or no
  list: inf): ``min(act(gate), L) * clip(up, -L, L)`` -> clamp="activation", limit L.
- ``Gemma3nTextMLP``: ``activation_sparsity``, per layer from config
  ``activation_sparsity_pattern[layer]``: above 0 the forward keeps only gate values above
  mean + std * Phi^-1(sparsity) of their row (a row-wise Gaussian top-k), which no epilogue
  expresses -> refused for that layer; layers with 0 are plain.
- ``MiniMaxM3VLDenseMLP``: ``(up + 1) * gate * sigmoid(alpha * gate)`` with clamps (gpt-oss's
  SwiGLU) -> refused.
- Every other record: the activation only.

Whatever a record says, `apply_fused_mlp` also checks the module's structure and runs the
numeric probe (`probe.py`) before replacing it: the records say what to run, the probe shows
that the class computes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from torch import nn
from transformers import activations as hf_act

from .kernels.epilogue import GatedEpilogue


class Refused(ValueError):
    """A module's settings ask for math the fused kernel does not do; the message says which."""


def plain(module: nn.Module, activation: str) -> GatedEpilogue:
    """act(gate) * up: no setting of the module changes the math."""
    return GatedEpilogue(activation)


def falcon_h1_multipliers(module: nn.Module, activation: str) -> GatedEpilogue:
    """Falcon-H1: down(act(gate * gate_multiplier) * up) * down_multiplier."""
    gate_m, down_m = float(module.gate_multiplier), float(module.down_multiplier)
    if down_m != 1.0 and getattr(module.down_proj, "bias", None) is not None:
        raise Refused(
            f"down_multiplier={down_m:g} with a bias on down_proj: the multiplier scales the bias too, so it does "
            "not fold into the fused epilogue (not supported yet)"
        )
    return GatedEpilogue(activation, gate_scale=gate_m, out_scale=down_m)


def _clamp(attr: str, where: str) -> Callable[[nn.Module, str], GatedEpilogue]:
    def settings(module: nn.Module, activation: str) -> GatedEpilogue:
        limit = getattr(module, attr)
        if limit is None or math.isinf(limit):  # Step-3.7 writes "no clamp" as inf
            return GatedEpilogue(activation)
        return GatedEpilogue(activation, limit=float(limit), clamp=where)

    settings.__name__ = f"clamp_{where}_{attr}"
    settings.__doc__ = f"SwiGLU clamp at the module's `{attr}` ({where} side)."
    return settings


def gemma3n_sparsity(module: nn.Module, activation: str) -> GatedEpilogue:
    """Gemma 3n: plain where activation_sparsity is 0, refused where the Gaussian top-k runs."""
    sparsity = float(module.activation_sparsity)
    if sparsity > 0.0:
        raise Refused(
            f"activation_sparsity={sparsity:g}: the forward keeps only gate values above mean + std * "
            "Phi^-1(sparsity) of each row (a row-wise Gaussian top-k), which no fused epilogue expresses; this "
            "layer keeps its original MLP"
        )
    return GatedEpilogue(activation)


def gpt_oss_swiglu(module: nn.Module, activation: str) -> GatedEpilogue:
    raise Refused(
        "its forward computes (up + 1) * gate * sigmoid(alpha * gate) with clamps (gpt-oss's SwiGLU), which the "
        "fused epilogue does not express (not supported yet)"
    )


@dataclass(frozen=True)
class MLPFamily:
    """Where a gated MLP class keeps its pieces, and what its settings mean.

    Attributes:
        model_type: the model type whose modeling file defines the class (docs, zoo coverage).
        mlp_class: the class name ("*" for a structure that any class may have).
        gate, up: names of the gate and up nn.Linear, or None when one chunked Linear
            (`gate_up_chunked`) holds both: its first I output rows are gate, the rest up.
        gate_up_chunked: name of that chunked Linear (Phi-3's ``gate_up_proj``), else None.
        down: name of the down nn.Linear.
        act: name of the activation module attribute, or None when the forward calls the
            activation itself (then `activation` names it).
        activation: the kernel activation of a forward that calls it itself (LFM2: "silu").
        activation_key: the config key that names the activation, checked against the act
            module where the module keeps its config (None: not checked).
        settings: (module, activation) -> the `GatedEpilogue` its settings ask for; raises
            `Refused` with the reason when no epilogue computes them.
    """

    model_type: str
    mlp_class: str
    gate: str | None = "gate_proj"
    up: str | None = "up_proj"
    gate_up_chunked: str | None = None
    down: str = "down_proj"
    act: str | None = "act_fn"
    activation: str | None = None
    activation_key: str | None = "hidden_act"
    settings: Callable[[nn.Module, str], GatedEpilogue] = plain

    @property
    def projections(self) -> tuple[str, ...]:
        """The Linear attributes: (gate, up, down) or (gate_up_chunked, down)."""
        return ((self.gate_up_chunked,) if self.gate_up_chunked else (self.gate, self.up)) + (self.down,)

    @property
    def packed(self) -> tuple[str, ...]:
        """The Linear attributes the packed weight replaces: (gate, up) or (gate_up_chunked,)."""
        return self.projections[:-1]


_CHUNKED = dict(gate=None, up=None, gate_up_chunked="gate_up_proj")
_W132 = dict(gate="w1", up="w3", down="w2", act=None, activation="silu", activation_key=None)

# Gated MLP classes by class name.
KNOWN_MLP_CLASSES: dict[str, MLPFamily] = {
    f.mlp_class: f
    for f in (
        MLPFamily("llama", "LlamaMLP"),
        MLPFamily("mistral", "MistralMLP"),
        MLPFamily("gemma", "GemmaMLP"),
        MLPFamily("gemma2", "Gemma2MLP", activation_key="hidden_activation"),
        MLPFamily("gemma3_text", "Gemma3MLP", activation_key="hidden_activation"),
        MLPFamily("qwen2", "Qwen2MLP"),
        MLPFamily("qwen3", "Qwen3MLP"),
        MLPFamily("phi3", "Phi3MLP", **_CHUNKED, act="activation_fn"),
        MLPFamily("llama4_text", "Llama4TextMLP", act="activation_fn"),
        MLPFamily("lfm2", "Lfm2MLP", **_W132),
        MLPFamily("lfm2_moe", "Lfm2MoeMLP", **_W132),
        MLPFamily("lfm3", "Lfm3MLP", **_W132),
        MLPFamily("lfm3_vl", "Lfm3VlVisionMLP", **_W132),
        MLPFamily("falcon_h1", "FalconH1MLP", settings=falcon_h1_multipliers),
        MLPFamily("deepseek_v4", "DeepseekV4MLP", settings=_clamp("limit", "gate")),
        MLPFamily("glm5_next", "Glm5NextTextMLP", settings=_clamp("swiglu_limit", "gate")),
        MLPFamily("glm5_next", "Glm5NextVisionMLP", activation_key=None, settings=_clamp("swiglu_limit", "gate")),
        MLPFamily("step3p7", "Step3p7MLP", settings=_clamp("limit", "activation")),
        MLPFamily("gemma3n_text", "Gemma3nTextMLP", activation_key="hidden_activation", settings=gemma3n_sparsity),
        MLPFamily("minimax_m3_vl", "MiniMaxM3VLDenseMLP", **_CHUNKED, act=None, activation="silu",
                  activation_key=None, settings=gpt_oss_swiglu),
    )
}

# Structures a class outside the registry may have (its activation module is found by name,
# `ACT_NAMES`); such a class is patched only when the numeric probe shows the plain epilogue.
STRUCTURES: tuple[MLPFamily, ...] = (
    MLPFamily("(structure)", "*"),
    MLPFamily("(structure)", "*", **_CHUNKED),
    MLPFamily("(structure)", "*", gate="w1", up="w3", down="w2"),
    MLPFamily("(structure)", "*", gate="wi_0", up="wi_1", down="wo"),
    MLPFamily("(structure)", "*", gate="proj_up_gate", up="proj_up", down="proj_down"),
    MLPFamily("(structure)", "*", gate=None, up=None, gate_up_chunked="input_linear", down="output_linear"),
    MLPFamily("(structure)", "*", gate=None, up=None, gate_up_chunked="Wi", down="Wo"),
    MLPFamily("(structure)", "*", gate=None, up=None, gate_up_chunked="fc1", down="fc2"),
    MLPFamily("(structure)", "*", gate=None, up=None, gate_up_chunked="linear_1", down="linear_2"),
)
ACT_NAMES = ("act_fn", "activation_fn", "act", "activation")

# Parameter names that hold MoE experts' gated weights as 3-D [experts, ...] tensors.
EXPERT_PARAMETERS = ("gate_up_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "v1")

# HF activation names -> the kernel's activation.
HF_ACTIVATIONS: dict[str, str] = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu",
    "gelu_python": "gelu",
}


def _classes(*names: str) -> tuple[type, ...]:
    return tuple(getattr(hf_act, n) for n in names if hasattr(hf_act, n))  # names vary across versions


_SILU = _classes("SiLUActivation") + (nn.SiLU,)
_GELU_TANH = _classes("GELUTanh", "PytorchGELUTanh", "NewGELUActivation")
_GELU = _classes("GELUActivation")


def activation_of_module(act: nn.Module) -> str | None:
    """The kernel activation an HF/torch activation module computes, or None if none fits."""
    if type(act) in _SILU:
        return "silu"
    if type(act) in _GELU_TANH:
        return "gelu_tanh"
    if type(act) in _GELU:
        return "gelu"
    if type(act) is nn.GELU:
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    return None


def _gated_shapes(module: nn.Module, family: MLPFamily) -> bool:
    """The projections' sizes fit a gated MLP: gate and up [I, K] (or chunked [2*I, K]), down
    [K', I] (K' = K for an MLP; a projector maps to another width). Layers without
    in/out_features (custom ones) are not ruled out here."""
    sizes = [(getattr(m, "in_features", None), getattr(m, "out_features", None))
             for m in (getattr(module, n) for n in family.projections)]
    if any(None in s for s in sizes):
        return True
    i_down = sizes[-1][0]
    width = 2 * i_down if family.gate_up_chunked else i_down
    return all(out == width for _, out in sizes[:-1]) and len({k for k, _ in sizes[:-1]}) == 1


def structure_of(module: nn.Module) -> MLPFamily | None:
    """The structure record `module` matches: its projections are child modules of gated-MLP
    sizes (a plain fc1/fc2 MLP does not match) and an activation module sits under one of
    `ACT_NAMES` (the record's `act`, None when there is none); else None."""
    children = module._modules
    for s in STRUCTURES:
        if all(isinstance(children.get(n), nn.Module) for n in s.projections) and _gated_shapes(module, s):
            act = next((n for n in ACT_NAMES if isinstance(children.get(n), nn.Module)), None)
            return replace(s, act=act)
    return None


def supported_model_types() -> str:
    return ", ".join(dict.fromkeys(f.model_type for f in KNOWN_MLP_CLASSES.values()))
