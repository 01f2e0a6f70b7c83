"""What memory depends on in a mixture-of-experts config, and how each MoE family routes.

Shape letters as everywhere: K = hidden_size, E = routed experts, k = experts per token,
I_e = one expert's intermediate size, T = tokens into the block, S = T * k (token, expert) pairs.

A :class:`MoeShape` is read from a transformers config (``moe_from_config``). Config keys differ
per family and transformers' config classes map most of them (``num_experts`` ->
``num_local_experts``, ``n_routed_experts`` -> ``num_local_experts``); the rest are read here:

- experts: ``num_local_experts`` / ``num_experts`` / ``n_routed_experts``
- top-k: ``num_experts_per_tok`` / ``experts_per_token``
- expert size: ``moe_intermediate_size``, else ``intermediate_size`` (Mixtral, gpt-oss)
- shared experts: ``shared_expert_intermediate_size`` (Qwen2-MoE), or ``n_shared_experts`` x
  ``moe_intermediate_size`` (DeepSeek, GLM)
- dense layers: ``first_k_dense_replace`` (DeepSeek, GLM), ``decoder_sparse_step`` and
  ``mlp_only_layers`` (Qwen MoE)

:data:`MOE_LAYOUTS` says, per ``config.model_type``, how HF's code routes and gates (what the
activation walk in :mod:`swiglu_patch.memory.moe_walk` allocates). :class:`MlaShape` holds
DeepSeek's multi-head latent attention sizes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoeLayout:
    """How one MoE family's HF block routes, gates and combines.

    Attributes:
        router: "softmax_topk" (softmax over E in fp32, then top-k: Qwen, Mixtral), "topk_softmax"
            (top-k of the logits, softmax over k: gpt-oss) or "sigmoid_group" (fp32 logits,
            sigmoid, grouped top-k with a correction bias: DeepSeek-V3, GLM-4.5).
        routing_fp32: the top-k weights stay fp32 (Mixtral, DeepSeek, GLM), which makes HF's
            weighted expert outputs [S, K] fp32; Qwen casts them to the activation dtype.
        gate: "chunk" (``act(gate) * up`` on the halves of [S, 2 I_e]) or "clamp" (gpt-oss:
            clamped interleaved halves, ``(up + 1) * gate * sigmoid(alpha * gate)``).
        expert_bias: per-expert biases on gate_up and down (gpt-oss), gathered per pair by HF.
        shared_first: the shared expert runs before the router (Qwen2-MoE) instead of after the
            routed experts (DeepSeek, GLM).
        shared_gate: the shared expert's output is scaled by ``sigmoid(Linear(K, 1))`` (Qwen2-MoE).
        router_bias: the router linear has a bias (gpt-oss).
    """

    router: str = "softmax_topk"
    routing_fp32: bool = False
    gate: str = "chunk"
    expert_bias: bool = False
    shared_first: bool = False
    shared_gate: bool = False
    router_bias: bool = False


MOE_LAYOUTS: dict[str, MoeLayout] = {
    "qwen3_moe": MoeLayout(),
    "qwen2_moe": MoeLayout(shared_first=True, shared_gate=True),
    "qwen3_5_moe_text": MoeLayout(shared_first=True, shared_gate=True),  # Qwen3.5: Qwen3-Next's block
    "mixtral": MoeLayout(routing_fp32=True),
    "gpt_oss": MoeLayout(router="topk_softmax", gate="clamp", expert_bias=True, router_bias=True),
    "glm4_moe": MoeLayout(router="sigmoid_group", routing_fp32=True),
    "deepseek_v3": MoeLayout(router="sigmoid_group", routing_fp32=True),
}


@dataclass(frozen=True)
class MoeShape:
    """The experts of one model (all layers; one GPU's share once sharded).

    Attributes:
        family: key into :data:`MOE_LAYOUTS`.
        num_experts: E routed experts per MoE layer.
        top_k: k experts per token.
        intermediate_size: I_e of one routed expert.
        shared_intermediate_size: I of the shared expert MLP (0: none).
        sparse_layers: per decoder layer, True where the MLP is the experts block.
    """

    family: str
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    sparse_layers: tuple[bool, ...]

    @property
    def layout(self) -> MoeLayout:
        return MOE_LAYOUTS[self.family]

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    def truncated(self, num_layers: int) -> MoeShape:
        return dataclasses.replace(self, sparse_layers=self.sparse_layers[:num_layers])


@dataclass(frozen=True)
class MlaShape:
    """DeepSeek's multi-head latent attention (per head unless named).

    Attributes:
        q_lora_rank: width of the compressed query (0: q_proj straight from K).
        kv_lora_rank: width of the compressed key/value latent.
        qk_nope_head_dim, qk_rope_head_dim: the query/key head's parts without and with RoPE.
        v_head_dim: the value head.
    """

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What a server caches per token and layer: the latent plus the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _first(config: Any, *keys: str) -> Any:
    for key in keys:
        value = getattr(config, key, None)
        if value is not None:
            return value
    return None


def _int(key: str, value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: {key} must be a non-negative integer, got {value!r}; fix the config.json")
    return value


def moe_from_config(config: Any, model_type: str, num_layers: int, *, where: str = "config") -> MoeShape | None:
    """The experts of ``config``, or None for a dense model (no MoE layout, or no experts).

    Raises:
        ValueError: a MoE family whose config lacks the experts' count, top-k or size, or states
            one that is not a positive integer.
    """
    if model_type not in MOE_LAYOUTS:
        return None
    experts = _first(config, "num_local_experts", "num_experts", "n_routed_experts")
    if experts == 0:
        return None
    top_k = _first(config, "num_experts_per_tok", "experts_per_token")
    size = _first(config, "moe_intermediate_size", "intermediate_size")
    for key, value in (("num_experts", experts), ("num_experts_per_tok", top_k), ("moe_intermediate_size", size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: a {model_type} config needs {key} as a positive integer, got {value!r}; fix the config.json")
    if top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok {top_k} exceeds the {experts} experts; fix the config.json")
    shared = getattr(config, "shared_expert_intermediate_size", None)
    if shared is None:
        n_shared = getattr(config, "n_shared_experts", None) or 0
        shared = _int("n_shared_experts", n_shared, where) * size
    shared = _int("shared_expert_intermediate_size", shared, where)
    return MoeShape(family=model_type, num_experts=experts, top_k=top_k, intermediate_size=size,
                    shared_intermediate_size=shared, sparse_layers=_sparse_layers(config, num_layers))


def _sparse_layers(config: Any, num_layers: int) -> tuple[bool, ...]:
    """Per layer, whether HF builds the experts block there (each family's decoder-layer rule)."""
    first_dense = getattr(config, "first_k_dense_replace", None) or 0
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense_only = set(getattr(config, "mlp_only_layers", None) or ())
    return tuple(i >= first_dense and (i + 1) % step == 0 and i not in dense_only for i in range(num_layers))


def mla_from_config(config: Any) -> MlaShape | None:
    """DeepSeek's latent attention sizes, or None when the config has no ``kv_lora_rank``."""
    if getattr(config, "kv_lora_rank", None) is None:
        return None
    return MlaShape(q_lora_rank=int(getattr(config, "q_lora_rank", None) or 0),
                    kv_lora_rank=int(config.kv_lora_rank), qk_nope_head_dim=int(config.qk_nope_head_dim),
                    qk_rope_head_dim=int(config.qk_rope_head_dim), v_head_dim=int(config.v_head_dim))
