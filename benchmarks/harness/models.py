"""Whole models the end-to-end benchmarks build: real dimensions, random weights, fewer layers.

Each entry holds what `transformers` needs to build the model from a config (no hub, no
checkpoint): the MLP's K and I come from `shapes.SHAPES` (the one table of MLP dimensions),
the rest from the model's config.json. `build_model` makes a random-init causal LM of
`layers` decoder layers (the full depth is `full_layers`) on a device, in a dtype, SDPA
attention, in eval mode with gradients off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .shapes import SHAPES, MLPShape


def _shape(name: str) -> MLPShape:
    return next(s for s in SHAPES if s.name == name)


@dataclass(frozen=True)
class ModelDims:
    """One model's dimensions.

    Attributes:
        name: key on the command line (the `shapes.SHAPES` name of its MLP, or "tiny").
        label: what the reports call it.
        model_type: transformers' model_type ("llama", "qwen2").
        hidden, intermediate: K and I of the MLP.
        heads, kv_heads, vocab: attention heads, KV heads, vocabulary.
        full_layers: the real model's decoder layers (a run builds fewer).
        config: the other config.json fields that matter (rope theta, norm epsilon, token ids).
    """

    name: str
    label: str
    model_type: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    full_layers: int
    config: dict = field(default_factory=dict)


_LLAMA3 = _shape("llama-3-8b")
_QWEN25 = _shape("qwen2.5-7b")

MODELS: dict[str, ModelDims] = {
    "llama-3-8b": ModelDims(
        "llama-3-8b", "Llama-3-8B", "llama", _LLAMA3.hidden, _LLAMA3.intermediate, 32, 8, 128256, 32,
        dict(rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000,
             eos_token_id=128001, pad_token_id=128001, hidden_act="silu")),
    "qwen2.5-7b": ModelDims(
        "qwen2.5-7b", "Qwen2.5-7B", "qwen2", _QWEN25.hidden, _QWEN25.intermediate, 28, 4, 152064, 28,
        dict(rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643,
             eos_token_id=151643, pad_token_id=151643, hidden_act="silu", use_sliding_window=False)),
}

# --dry-run: the same structures at hidden 64, on CPU in seconds.
TINY: dict[str, ModelDims] = {
    name: ModelDims(name, f"tiny {d.model_type} (dry run)", d.model_type, 64, 160, 4, 2, 256, 2,
                    dict(d.config, rope_theta=10000.0, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    for name, d in MODELS.items()
}


def build_model(dims: ModelDims, layers: int, device: torch.device | str, dtype: torch.dtype, seed: int,
                vocab: int | None = None):
    """Random-init causal LM with `dims` and `layers` decoder layers, on `device`, in `dtype`.

    Args:
        vocab: override the vocabulary (bench_host builds the MLP only and needs no 1 GB head).

    Returns:
        The model in eval mode with requires_grad off; the same seed gives the same weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(dims.config)
    if vocab is not None:  # special token ids must stay inside the smaller vocabulary
        extra.update({k: min(v, vocab - 1) for k, v in extra.items() if k.endswith("token_id") and v is not None})
    config = AutoConfig.for_model(
        dims.model_type, hidden_size=dims.hidden, intermediate_size=dims.intermediate,
        num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads, vocab_size=vocab or dims.vocab,
        num_hidden_layers=layers, max_position_embeddings=16384, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)  # .to(): a no-op unless init ignored the device


def mlps(model) -> list[torch.nn.Module]:
    """The MLP module of every decoder layer (patched or not)."""
    return [layer.mlp for layer in model.model.layers]
