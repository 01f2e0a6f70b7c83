"""The few numbers of a decoder config that memory depends on, and how each family lays out a layer.

A :class:`ModelShape` is read from a transformers config (``PretrainedConfig``) and holds only
what the activation model, the weight count and the KV-cache arithmetic need. Shape letters as
everywhere in swiglu-patch: K = hidden_size, I = intermediate_size (of the dense MLP layers),
H = attention heads, KV = key/value heads, D = head_dim. A mixture-of-experts model also has a
:class:`~swiglu_patch.memory.moe_shape.MoeShape` (its experts and which layers are sparse), and
DeepSeek's latent attention an :class:`~swiglu_patch.memory.moe_shape.MlaShape`.

The :data:`DECODER_LAYOUTS` table says, per ``config.model_type``, how Hugging Face's eager code
lays out one decoder layer: norm style, norms per layer, q/k norms, packed projections, embedding
scaling, which attention HF runs. The activation model walks a layer with this layout. (Which
MLPs the patch can fuse is another table: ``swiglu_patch.registry.KNOWN_MLP_CLASSES``.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from swiglu_patch.memory.moe_shape import MlaShape, MoeShape, mla_from_config, moe_from_config

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"  # a recurrent layer (Gated DeltaNet): a fixed state per sequence, no KV per token


@dataclass(frozen=True)
class LinearAttnShape:
    """The Gated DeltaNet layers of a hybrid model (Qwen3.5, Qwen3-Next): their sizes and state.

    Attributes:
        num_key_heads, num_value_heads: Hk and Hv (``linear_num_key_heads``, ``linear_num_value_heads``).
        key_head_dim, value_head_dim: Dk and Dv.
        conv_kernel: the causal convolution's width over q, k and v.
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q and k (Hk Dk each) and v (Hv Dv)."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    def state_bytes(self, conv_bytes: int, tp: int = 1) -> int:
        """One sequence's state in one layer on one GPU: the convolution's last kernel - 1 inputs
        [conv_dim, kernel - 1] at ``conv_bytes`` and the recurrent state [Hv, Dk, Dv] in fp32
        (Qwen3.5's ``mamba_ssm_dtype``; vLLM keeps both per sequence), the heads split tp ways."""
        recurrent = self.num_value_heads * self.key_head_dim * self.value_head_dim * 4
        return (self.conv_dim * (self.conv_kernel - 1) * conv_bytes + recurrent) // tp

    def params(self, hidden_size: int) -> tuple[int, int]:
        """(projection and convolution weights, norm weights) of one layer: in_proj_qkv [conv_dim, K], in_proj_z
        [Hv Dv, K], in_proj_b and in_proj_a [Hv, K], conv1d [conv_dim, 1, kernel], dt_bias and A_log [Hv],
        out_proj [K, Hv Dv]; norm [Dv]."""
        v = self.num_value_heads * self.value_head_dim
        weights = hidden_size * (self.conv_dim + v) + hidden_size * 2 * self.num_value_heads
        return weights + self.conv_dim * self.conv_kernel + 2 * self.num_value_heads + v * hidden_size, self.value_head_dim


@dataclass(frozen=True)
class DecoderLayout:
    """How one model family's HF eager decoder layer is laid out (what the activation model walks).

    Attributes:
        norm_style: "llama" (``w * x.float().normed.to(dtype)``), "gemma"
            (``(x.float().normed * (1 + w)).type_as(x)``) or "gpt_oss" (``(w * x.float().normed)
            .to(dtype)``, the normed fp32 copy still referenced during the cast); all keep two
            fp32 copies at their peak, gpt-oss's three bytes' worth more.
        norms_per_layer: 2 (pre-attention, pre-MLP) or 4 (Gemma 2/3 add post-attention, post-MLP).
        qk_norm: RMSNorm over head_dim on q and k (Qwen3, Gemma 3).
        qk_norm_before_transpose: Qwen3 norms q right after q_proj (before k_proj runs); Gemma 3
            norms q and k after all three projections.
        embed_scale: embeddings multiplied by sqrt(K) into a new tensor (Gemma).
        fused_qkv: one ``qkv_proj`` output [M, (H + 2 KV) D] that q, k, v are views of (Phi-3).
        fused_gate_up: one ``gate_up_proj`` output [M, 2I] (Phi-3), which stays alive through the MLP.
        qkv_bias: q/k/v projections carry a bias (Qwen2) unless the config says otherwise.
        hf_attention: "sdpa" or "eager": what HF runs by default for this family (Gemma 2's
            attention soft-capping is refused by HF's sdpa path, so it runs eager), "eager_sinks"
            (gpt-oss: eager with attention sinks, its own RoPE) or "unwalked" where HF's own
            attention code is not modelled (DeepSeek's latent attention): only
            ``attention="flash"`` predicts that.
        rotary_fraction: the share of head_dim RoPE rotates (GLM-4.5: 0.5; the rest passes).
        o_bias: o_proj carries a bias when the config's ``attention_bias`` is set (GLM-4.5's never does).
        unused_sliding_mask: HF builds a bool [T, T] sliding-window mask (sdpa) even where no layer
            slides, and keeps it for the whole forward (Qwen2-MoE).
        output_gate: q_proj also writes a per-head gate on the attention output (Qwen3.5's gated
            attention: q_proj [K, 2 H D]).
    """

    norm_style: str = "llama"
    norms_per_layer: int = 2
    qk_norm: bool = False
    qk_norm_before_transpose: bool = False
    embed_scale: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    qkv_bias: bool = False
    hf_attention: str = "sdpa"
    rotary_fraction: float = 1.0
    o_bias: bool = True
    unused_sliding_mask: bool = False
    output_gate: bool = False


DECODER_LAYOUTS: dict[str, DecoderLayout] = {
    "llama": DecoderLayout(),
    "mistral": DecoderLayout(),
    "qwen2": DecoderLayout(qkv_bias=True),
    "qwen3": DecoderLayout(qk_norm=True, qk_norm_before_transpose=True),
    "gemma": DecoderLayout(norm_style="gemma", embed_scale=True),
    "gemma2": DecoderLayout(norm_style="gemma", norms_per_layer=4, embed_scale=True, hf_attention="eager"),
    "gemma3_text": DecoderLayout(norm_style="gemma", norms_per_layer=4, qk_norm=True, embed_scale=True),
    "phi3": DecoderLayout(fused_qkv=True, fused_gate_up=True),
    # mixture-of-experts families (their experts: swiglu_patch.memory.moe_shape.MOE_LAYOUTS)
    "qwen3_moe": DecoderLayout(qk_norm=True, qk_norm_before_transpose=True),
    "qwen2_moe": DecoderLayout(qkv_bias=True, unused_sliding_mask=True),
    "mixtral": DecoderLayout(),
    "glm4_moe": DecoderLayout(rotary_fraction=0.5, o_bias=False),
    "gpt_oss": DecoderLayout(norm_style="gpt_oss", hf_attention="eager_sinks"),
    "deepseek_v3": DecoderLayout(hf_attention="unwalked"),
    # hybrid: 3 Gated DeltaNet layers to 1 gated-attention layer; neither is walked by HF's code here
    # (a server's fused kernels are: kv-capacity), its experts block is
    "qwen3_5_moe_text": DecoderLayout(norm_style="gemma", qk_norm=True, hf_attention="unwalked", output_gate=True),
}

# Config fields a gated-MLP decoder must state; everything else has a defensible default.
REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

_DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "bf16": "bfloat16"}


def decoder_layout(model_type: str, override: str | None = None) -> DecoderLayout:
    """The :class:`DecoderLayout` of ``model_type``, or of ``override`` when given.

    Raises:
        ValueError: unknown model_type (the message lists the supported ones and the override).
    """
    key = override or model_type
    if key not in DECODER_LAYOUTS:
        raise ValueError(
            f"Unknown model_type {key!r} for the activation model. Supported: {', '.join(sorted(DECODER_LAYOUTS))}. "
            "If its decoder layer is laid out like Llama's, pass family='llama' (CLI: --family llama)."
        )
    return DECODER_LAYOUTS[key]


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a decoder config (one model, all layers, one GPU unless sharded).

    Attributes:
        name: a label (preset name or path).
        model_type: ``config.model_type`` (text model, e.g. "gemma3_text").
        family: key into :data:`DECODER_LAYOUTS` (the model_type, or the family it is treated as).
        hidden_size: K.
        intermediate_size: I.
        num_layers: decoder layers.
        num_heads: H.
        num_kv_heads: KV (GQA when KV < H).
        head_dim: D (explicit ``head_dim`` when the config has one, else K // H).
        vocab_size: V.
        tie_word_embeddings: lm_head shares the embedding matrix.
        activation: MLP activation name ("silu", "gelu_pytorch_tanh", ...).
        torch_dtype: the checkpoint's dtype name.
        sliding_window: window in tokens of the sliding layers, or None.
        layer_types: per layer, "full_attention", "sliding_attention" or "linear_attention".
        qkv_bias, o_bias, mlp_bias: biases on those projections.
        final_logit_softcapping: Gemma 2's logit soft-cap (extra temporaries on the logits), or None.
        source: where the config came from.
        moe: the experts (mixture-of-experts models), or None.
        mla: DeepSeek's latent-attention sizes, or None.
        attention_sinks: one learned sink logit per head (gpt-oss).
        linear: the linear-attention layers' sizes (hybrid models), or None.
    """

    name: str
    model_type: str
    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    activation: str
    torch_dtype: str
    sliding_window: int | None
    layer_types: tuple[str, ...]
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    final_logit_softcapping: float | None = None
    source: str = ""
    moe: MoeShape | None = None
    mla: MlaShape | None = None
    attention_sinks: bool = False
    linear: LinearAttnShape | None = None

    @property
    def layout(self) -> DecoderLayout:
        """How this model's HF decoder layer is laid out."""
        return DECODER_LAYOUTS[self.family]

    @property
    def q_dim(self) -> int:
        """H * D: width of the query (and of the attention output)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """KV * D: width of the key (and of the value)."""
        return self.num_kv_heads * self.head_dim

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the experts block."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    @property
    def num_sliding_layers(self) -> int:
        return sum(t == SLIDING for t in self.layer_types)

    @property
    def num_linear_layers(self) -> int:
        return sum(t == LINEAR for t in self.layer_types)

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers - self.num_linear_layers

    def truncated(self, num_layers: int) -> ModelShape:
        """The same shape with only the first ``num_layers`` layers (as the profiler builds it)."""
        if not 1 <= num_layers:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        n = min(num_layers, self.num_layers)
        moe = self.moe.truncated(n) if self.moe else None
        return dataclasses.replace(self, num_layers=n, layer_types=self.layer_types[:n], moe=moe)

    def sharded(self, tp: int) -> ModelShape:
        """What one GPU holds under tensor parallelism of degree ``tp`` (vLLM's rules).

        Heads and the MLP's I split ``tp`` ways; key/value heads split when KV >= tp and are
        replicated (one per GPU) when KV < tp; K and the vocabulary's activations stay whole.
        Experts split like dense MLPs (vLLM's tensor-parallel MoE without expert parallelism):
        every GPU holds all E experts with I_e / tp columns each, and the shared expert's I / tp.

        Raises:
            ValueError: H, I, I_e or the shared I not divisible by tp, or KV and tp not dividing
                one another.
        """
        if tp < 1:
            raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}")
        if tp == 1:
            return self
        problems = []
        if self.num_heads % tp:
            problems.append(f"{self.num_heads} attention heads")
        dense = self.moe is None or not all(self.moe.sparse_layers)
        if dense and self.intermediate_size % tp:
            problems.append(f"intermediate_size {self.intermediate_size}")
        if self.moe and self.moe.intermediate_size % tp:
            problems.append(f"expert intermediate size {self.moe.intermediate_size}")
        if self.moe and self.moe.shared_intermediate_size % tp:
            problems.append(f"shared expert intermediate size {self.moe.shared_intermediate_size}")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            problems.append(f"{self.num_kv_heads} key/value heads")
        if self.linear and (self.linear.num_key_heads % tp or self.linear.num_value_heads % tp):
            problems.append(f"{self.linear.num_key_heads} / {self.linear.num_value_heads} linear-attention key / value heads")
        if problems:
            raise ValueError(
                f"{self.name}: tensor-parallel degree {tp} does not divide {' and '.join(problems)}; "
                "pick a tp that divides them (CLI: --tp auto picks the smallest that fits)."
            )
        moe = self.moe and dataclasses.replace(self.moe, intermediate_size=self.moe.intermediate_size // tp,
                                               shared_intermediate_size=self.moe.shared_intermediate_size // tp)
        return dataclasses.replace(
            self,
            num_heads=self.num_heads // tp,
            num_kv_heads=max(1, self.num_kv_heads // tp),
            intermediate_size=self.intermediate_size // tp,
            moe=moe,
        )

    @classmethod
    def from_config(cls, config: Any, *, name: str = "", source: str = "", family: str | None = None) -> ModelShape:
        """Read a transformers config (multimodal ones through their text config).

        Args:
            config: a ``PretrainedConfig`` (or anything with its attributes).
            name: label for tables.
            source: where the config came from.
            family: treat the model as this family (a key of :data:`DECODER_LAYOUTS`) instead of its model_type.

        Raises:
            ValueError: a required field is missing, or the model_type is unknown and no family is given.
        """
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        required = REQUIRED_FIELDS
        if getattr(config, "intermediate_size", None) is None and getattr(config, "moe_intermediate_size", None):
            required = tuple(f for f in REQUIRED_FIELDS if f != "intermediate_size")  # every layer sparse (Qwen3.5)
        missing = [f for f in required if getattr(config, f, None) is None]
        if missing:
            raise ValueError(
                f"config for {name or '?'} lacks {', '.join(missing)}: a gated-MLP decoder config needs "
                f"{', '.join(REQUIRED_FIELDS)}. Pass the model's full config.json."
            )
        for key in required:
            value = getattr(config, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config for {name or '?'}: {key} must be a positive integer, got {value!r}; "
                                 "fix the config.json.")
        model_type = getattr(config, "model_type", "") or ""
        layout = decoder_layout(model_type, family)  # raises on unknown
        k, h = int(config.hidden_size), int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", None) or h)
        head_dim = int(getattr(config, "head_dim", None) or k // h)
        layers = int(config.num_hidden_layers)
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types is None:  # Mistral / Phi-3: one window for every layer when set
            types = [SLIDING if window else FULL] * layers
        types = tuple(t if t in (SLIDING, LINEAR) else FULL for t in types[:layers])
        if window is None:
            types = tuple(LINEAR if t == LINEAR else FULL for t in types)
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"
        dtype = getattr(config, "dtype", None) or vars(config).get("torch_dtype") or "bfloat16"
        dtype = str(dtype).replace("torch.", "")
        attention_bias = bool(getattr(config, "attention_bias", False))
        where = f"config for {name or model_type}"
        moe = moe_from_config(config, family or model_type, layers, where=where)
        dense_i = getattr(config, "intermediate_size", None)
        if dense_i is None and (moe is None or moe.num_sparse_layers < layers):
            raise ValueError(f"{where}: lacks intermediate_size, which its dense MLP layers need; fix the config.json.")
        return cls(
            name=name or getattr(config, "name_or_path", "") or model_type,
            model_type=model_type,
            family=family or model_type,
            hidden_size=k,
            intermediate_size=int(dense_i or moe.intermediate_size),
            num_layers=layers,
            num_heads=h,
            num_kv_heads=kv,
            head_dim=head_dim,
            vocab_size=int(config.vocab_size),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            activation=str(activation),
            torch_dtype=_DTYPE_NAMES.get(dtype, dtype),
            sliding_window=int(window) if window else None,
            layer_types=types,
            qkv_bias=bool(getattr(config, "qkv_bias", layout.qkv_bias)) or attention_bias,
            o_bias=attention_bias and layout.o_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
            source=source,
            moe=moe,
            mla=mla_from_config(config),
            attention_sinks=(family or model_type) == "gpt_oss",
            linear=_linear_from_config(config) if LINEAR in types else None,
        )


def _linear_from_config(config: Any) -> LinearAttnShape:
    """The linear-attention sizes of a hybrid config (Qwen3.5's ``linear_*`` keys).

    Raises:
        ValueError: one of them missing or not a positive integer.
    """
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim")
    values = [getattr(config, k, None) for k in keys]
    for key, value in zip(keys, values):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config: its layer_types name linear_attention layers, so {key} must be a positive "
                             f"integer, got {value!r}; fix the config.json")
    return LinearAttnShape(*values)
