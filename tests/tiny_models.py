"""Tiny random-init models, one per family in the registry: 2 layers, hidden 64, real structure.

intermediate_size 72 is not a multiple of the layout's block of 16, so the last gate/up
block of every MLP is partial. initializer_range 0.2 (HF's default is 0.02) makes the MLPs
move the logits enough that a wrong MLP shows.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

_COMMON = dict(
    hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, max_position_embeddings=128, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(hidden_act="silu"),
    "mistral": dict(hidden_act="silu", sliding_window=32),
    "gemma": dict(hidden_act="gelu_pytorch_tanh", head_dim=16),
    "gemma2": dict(hidden_activation="gelu_pytorch_tanh", head_dim=16, sliding_window=32, query_pre_attn_scalar=16),
    "gemma3_text": dict(hidden_activation="gelu_pytorch_tanh", head_dim=16, sliding_window=32, query_pre_attn_scalar=16),
    "qwen2": dict(hidden_act="silu"),
    "qwen3": dict(hidden_act="silu", head_dim=16),
    "phi3": dict(hidden_act="silu"),
}


def tiny_config(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, **(_COMMON | TINY_CONFIGS[model_type] | overrides))


def tiny_model(model_type: str, dtype=torch.float32, device="cpu", **overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    return model.to(device).eval()
