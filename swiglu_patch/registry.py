"""Model families whose gated MLP swiglu-patch knows, one frozen record per `model_type`.

A record says which class is the MLP, where its projections live, how its checkpoint
stores gate and up (two Linears, or Phi-3's one chunked [gate; up] Linear) and which config
key names its activation (Gemma 2 and 3 read ``hidden_activation``, the rest ``hidden_act``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import activations as hf_act


@dataclass(frozen=True)
class MLPFamily:
    """Where a family's gated MLP keeps its pieces.

    Attributes:
        model_type: the HF ``config.model_type`` of the MLP's config.
        mlp_class: the class name of the MLP module.
        activation_key: the config attribute that names the activation.
        gate, up: names of the gate and up nn.Linear, or None when the checkpoint holds one
            chunked Linear (`gate_up_chunked`) whose first I output rows are gate, the rest up.
        gate_up_chunked: name of that chunked Linear (Phi-3's ``gate_up_proj``), else None.
        down: name of the down nn.Linear.
        act: name of the activation module attribute.
    """

    model_type: str
    mlp_class: str
    activation_key: str = "hidden_act"
    gate: str | None = "gate_proj"
    up: str | None = "up_proj"
    gate_up_chunked: str | None = None
    down: str = "down_proj"
    act: str = "act_fn"


FAMILIES: dict[str, MLPFamily] = {
    f.model_type: f
    for f in (
        MLPFamily("llama", "LlamaMLP"),
        MLPFamily("mistral", "MistralMLP"),
        MLPFamily("gemma", "GemmaMLP"),
        MLPFamily("gemma2", "Gemma2MLP", activation_key="hidden_activation"),
        MLPFamily("gemma3_text", "Gemma3MLP", activation_key="hidden_activation"),
        MLPFamily("qwen2", "Qwen2MLP"),
        MLPFamily("qwen3", "Qwen3MLP"),
        MLPFamily("phi3", "Phi3MLP", gate=None, up=None, gate_up_chunked="gate_up_proj", act="activation_fn"),
    )
}

# Structures an unknown MLP class may have to be patched by structure.
STRUCTURES: tuple[MLPFamily, ...] = (
    MLPFamily("(structure)", "*"),
    MLPFamily("(structure)", "*", gate=None, up=None, gate_up_chunked="gate_up_proj", act="activation_fn"),
)

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
    if isinstance(act, _SILU):
        return "silu"
    if isinstance(act, _GELU_TANH):
        return "gelu_tanh"
    if isinstance(act, _GELU):
        return "gelu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    return None


def supported_model_types() -> str:
    return ", ".join(FAMILIES)
