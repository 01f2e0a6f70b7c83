"""Parameter counts and weight bytes of a decoder, whole and per tensor-parallel GPU.

Counted from the config alone: embeddings V*K (plus an untied lm_head V*K), per layer the
q/k/v/o projections (and their biases), the three MLP matrices 3*K*I, and the norm weights
(2 or 4 per layer of K, q/k norms of D, the final norm of K). Under tensor parallelism every
matrix (and the vocabulary) splits ``tp`` ways and the norm weights are replicated; replicated
key/value heads (KV < tp) are counted once per GPU, as vLLM stores them. Loaded by transformers'
own ``tp_plan`` (``hf_tp_plan``), an untied input embedding stays whole on every rank up to
transformers 5.20 (`hf_releases`), and the count follows the installed release.

Mixture-of-experts layers count every expert (all are resident): E x 3*K*I_e (gpt-oss adds
its per-expert biases), the shared expert's 3*K*I_s, and the router's E*K (replicated under
tensor parallelism, as vLLM keeps it). DeepSeek's latent attention counts q_a [K, q_lora],
q_b [q_lora, H*(nope + rope)], kv_a [K, kv_lora + rope], kv_b [kv_lora, H*(nope + v)] and
o [H*v, K]; its q_a and kv_a are replicated under tensor parallelism, the rest split. A hybrid
model's linear-attention layers (Qwen3.5's Gated DeltaNet) count their own projections, causal
convolution and per-head parameters (`LinearAttnShape.params`) instead of q/k/v/o, and its gated
attention's q_proj writes the output gate too ([K, 2 H D]).
"""

from __future__ import annotations

from dataclasses import dataclass

from swiglu_patch.memory.hf_releases import hf_shards_input_embedding
from swiglu_patch.memory.shape import ModelShape

WEIGHT_DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class ParamCount:
    """Parameters by where they live.

    Attributes:
        embedding: V*K (+ V*K for an untied lm_head).
        attention: q/k/v/o weights and biases, all layers.
        mlp: gate/up/down weights and biases, all layers: dense MLPs, every routed expert, shared experts.
        norms: all RMSNorm weights (replicated under tensor parallelism).
        router: the MoE routers' weights and biases (replicated under tensor parallelism).
        replicated_attention: the part of ``attention`` every GPU holds whole (MLA's q_a and kv_a).
    """

    embedding: int
    attention: int
    mlp: int
    norms: int
    router: int = 0
    replicated_attention: int = 0

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.router


def count_params(shape: ModelShape) -> ParamCount:
    """The model's parameters, as the checkpoint stores them (one copy of tied embeddings)."""
    s = shape
    K, I, D, L = s.hidden_size, s.intermediate_size, s.head_dim, s.num_layers
    q, kv = s.q_dim, s.kv_dim
    attn, replicated, norms_per_layer = K * q + 2 * K * kv + q * K, 0, s.layout.norms_per_layer * K
    if s.mla:
        attn, replicated, mla_norms = _mla_params(s)
        norms_per_layer += mla_norms
    if s.qkv_bias:
        attn += q + 2 * kv
    if s.o_bias:
        attn += K
    if s.attention_sinks:
        attn += s.num_heads
    if s.layout.output_gate:
        attn += K * q
    dense = 3 * K * I + (2 * I + K if s.mlp_bias else 0)
    mlp = router = 0
    for layer in range(L):
        if not s.is_sparse(layer):
            mlp += dense
            continue
        m, lay = s.moe, s.moe.layout
        mlp += m.num_experts * (3 * K * m.intermediate_size + (2 * m.intermediate_size + K if lay.expert_bias else 0))
        mlp += 3 * K * m.shared_intermediate_size + (K if lay.shared_gate else 0)
        router += m.num_experts * K + (m.num_experts if lay.router_bias else 0)
    qk_norms = 2 * D if s.layout.qk_norm else 0
    linear = s.num_linear_layers
    linear_weights, linear_norms = s.linear.params(K) if linear else (0, 0)
    embedding = s.vocab_size * K * (1 if s.tie_word_embeddings else 2)
    return ParamCount(embedding=embedding, attention=(L - linear) * attn + linear * linear_weights, mlp=mlp,
                      norms=L * norms_per_layer + (L - linear) * qk_norms + linear * linear_norms + K, router=router,
                      replicated_attention=L * replicated)


def _mla_params(s: ModelShape) -> tuple[int, int, int]:
    """(projection weights, the replicated part of them, norm weights) of one latent-attention layer."""
    a, K, H = s.mla, s.hidden_size, s.num_heads
    q = K * a.q_lora_rank + a.q_lora_rank * H * a.qk_head_dim if a.q_lora_rank else K * H * a.qk_head_dim
    replicated = K * a.q_lora_rank + K * a.latent_dim
    weights = q + K * a.latent_dim + a.kv_lora_rank * H * (a.qk_nope_head_dim + a.v_head_dim) + H * a.v_head_dim * K
    return weights, replicated, a.q_lora_rank + a.kv_lora_rank


def weight_bytes_per_gpu(shape: ModelShape, weight_dtype: str = "bf16", tp: int = 1, hf_tp_plan: bool = False) -> float:
    """Bytes of weights one GPU holds under tensor parallelism ``tp``.

    Args:
        shape: the whole model (not sharded).
        weight_dtype: a key of :data:`WEIGHT_DTYPE_BYTES` (quantization scales are not counted).
        tp: tensor-parallel degree.
        hf_tp_plan: sharded as transformers' own ``tp_plan`` loads it (the installed release's layout),
            not as a serving engine does.

    Raises:
        ValueError: unknown dtype, or a tp that does not divide the heads / I (see ``ModelShape.sharded``).
    """
    if weight_dtype not in WEIGHT_DTYPE_BYTES:
        raise ValueError(f"weight dtype must be one of {', '.join(WEIGHT_DTYPE_BYTES)}, got {weight_dtype!r}")
    per_gpu = shape.sharded(tp)  # validates tp
    p = count_params(shape)
    attention = p.replicated_attention + (p.attention - p.replicated_attention) / tp
    if shape.num_kv_heads < tp and not shape.mla:  # replicated K/V heads: each GPU holds a whole head's k/v projections
        L, K, D = shape.num_layers, shape.hidden_size, shape.head_dim
        sharded_kv = L * 2 * K * shape.kv_dim / tp
        attention += L * 2 * K * per_gpu.num_kv_heads * D - sharded_kv
    embedding = p.embedding / tp
    if hf_tp_plan and tp > 1 and not shape.tie_word_embeddings and not hf_shards_input_embedding():
        embedding += shape.vocab_size * shape.hidden_size * (1 - 1 / tp)  # the input embedding whole on each rank
    return (embedding + attention + p.mlp / tp + p.router + p.norms) * WEIGHT_DTYPE_BYTES[weight_dtype]
