"""Memory tools: what the fused MLP saves in activations, and what that buys in KV cache.

- :mod:`~swiglu_patch.memory.activation_model`: predicted peak activation memory of a HF forward
  (one MLP or experts block, or a full prefill), eager MLP against fused, from what is live at each step.
- :mod:`~swiglu_patch.memory.kv_capacity`: weights, activation peak per prefill chunk and KV-cache
  tokens per GPU, eager against fused.
- :mod:`~swiglu_patch.memory.profiler`: the same peaks measured on CUDA with torch's allocator stats.
- Presets: real configs of popular gated-MLP models (``list_presets()``, ``resolve_model(name)``).

CLI: ``swiglu-patch memory`` (profile_cli) and ``swiglu-patch kv-capacity`` (kv_cli).
"""

from swiglu_patch.memory.activation_model import predict_mlp_peak, predict_moe_peak, predict_prefill_peak
from swiglu_patch.memory.configs import ResolvedModel, list_presets, resolve_model
from swiglu_patch.memory.kv_capacity import (
    CapacityResult,
    InsufficientMemoryError,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_capacity,
    smallest_tp,
)
from swiglu_patch.memory.live_set import LiveSet, Peak
from swiglu_patch.memory.shape import DECODER_LAYOUTS, DecoderLayout, ModelShape
from swiglu_patch.memory.weights import count_params, weight_bytes_per_gpu

__all__ = [
    "DECODER_LAYOUTS",
    "CapacityResult",
    "DecoderLayout",
    "InsufficientMemoryError",
    "LiveSet",
    "ModelShape",
    "Peak",
    "ResolvedModel",
    "count_params",
    "kv_bytes_per_sequence",
    "kv_bytes_per_token",
    "kv_capacity",
    "list_presets",
    "predict_mlp_peak",
    "predict_moe_peak",
    "predict_prefill_peak",
    "resolve_model",
    "smallest_tp",
    "weight_bytes_per_gpu",
]
