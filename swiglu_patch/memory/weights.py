"""Parameter counts and weight bytes of a decoder, whole and per tensor-parallel GPU.

Counted from the config alone: embeddings V*K (plus an untied lm_head V*K), per layer the
q/k/v/o projections (and their biases), the three MLP matrices 3*K*I, and the norm weights
(2 or 4 per layer of K, q/k norms of D, the final norm of K). Under tensor parallelism every
matrix (and the vocabulary) splits ``tp`` ways and the norm weights are replicated; replicated
key/value heads (KV < tp) are counted once per GPU, as vLLM stores them.
"""

from __future__ import annotations

from dataclasses import dataclass

from swiglu_patch.memory.shape import ModelShape

WEIGHT_DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class ParamCount:
    """Parameters by where they live.

    Attributes:
        embedding: V*K (+ V*K for an untied lm_head).
        attention: q/k/v/o weights and biases, all layers.
        mlp: gate/up/down weights and biases, all layers.
        norms: all RMSNorm weights (replicated under tensor parallelism).
    """

    embedding: int
    attention: int
    mlp: int
    norms: int

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms


def count_params(shape: ModelShape) -> ParamCount:
    """The model's parameters, as the checkpoint stores them (one copy of tied embeddings)."""
    s = shape
    K, I, D, L = s.hidden_size, s.intermediate_size, s.head_dim, s.num_layers
    q, kv = s.q_dim, s.kv_dim
    attn = K * q + 2 * K * kv + q * K
    if s.qkv_bias:
        attn += q + 2 * kv
    if s.o_bias:
        attn += K
    mlp = 3 * K * I + (2 * I + K if s.mlp_bias else 0)
    norms_per_layer = s.layout.norms_per_layer * K + (2 * D if s.layout.qk_norm else 0)
    embedding = s.vocab_size * K * (1 if s.tie_word_embeddings else 2)
    return ParamCount(embedding=embedding, attention=L * attn, mlp=L * mlp, norms=L * norms_per_layer + K)


def weight_bytes_per_gpu(shape: ModelShape, weight_dtype: str = "bf16", tp: int = 1) -> float:
    """Bytes of weights one GPU holds under tensor parallelism ``tp``.

    Args:
        shape: the whole model (not sharded).
        weight_dtype: a key of :data:`WEIGHT_DTYPE_BYTES` (quantization scales are not counted).
        tp: tensor-parallel degree.

    Raises:
        ValueError: unknown dtype, or a tp that does not divide the heads / I (see ``ModelShape.sharded``).
    """
    if weight_dtype not in WEIGHT_DTYPE_BYTES:
        raise ValueError(f"weight dtype must be one of {', '.join(WEIGHT_DTYPE_BYTES)}, got {weight_dtype!r}")
    per_gpu = shape.sharded(tp)  # validates tp
    p = count_params(shape)
    attention = p.attention / tp
    if shape.num_kv_heads < tp:  # replicated K/V heads: each GPU holds a whole head's k/v projections
        L, K, D = shape.num_layers, shape.hidden_size, shape.head_dim
        sharded_kv = L * 2 * K * shape.kv_dim / tp
        attention += L * 2 * K * per_gpu.num_kv_heads * D - sharded_kv
    return (p.embedding / tp + attention + p.mlp / tp + p.norms) * WEIGHT_DTYPE_BYTES[weight_dtype]
