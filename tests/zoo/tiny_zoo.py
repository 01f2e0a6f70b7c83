"""Tiny random models of every model type that the installed transformers can build for text
generation (its causal-LM and image-text-to-text mappings), for the zoo test.

`build(model_type)` starts from the type's default config (a real model's size), shrinks every
size it knows (hidden 64, intermediate 72, 2 layers, 4 heads of 16, 4 experts, a vocabulary of
128 with special token ids moved under it) in the config and in each of its sub-configs, applies
the type's entry in `OVERRIDES` (what the generic shrink gets wrong) and builds the model in fp32
on CPU with a fixed seed. `VARIANTS` adds config settings that real checkpoints use and the tiny
defaults miss (a clamp, a multiplier, activation sparsity, MoE).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 72, 2, 4, 2, 16
EXPERTS, EXPERTS_PER_TOKEN, EXPERT_INTERMEDIATE = 4, 2, 40
VOCAB = 128

# key -> value for every config and sub-config that has the key
_SIZES = {
    "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN, "embed_dim": HIDDEN, "out_hidden_size": HIDDEN,
    "text_hidden_size": HIDDEN, "embedding_dim": HIDDEN,
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": HEAD_DIM, "projector_hidden_size": HIDDEN, "projection_dim": HIDDEN,
    "intermediate_size": INTERMEDIATE, "ffn_dim": INTERMEDIATE, "d_ff": INTERMEDIATE, "encoder_ffn_dim": INTERMEDIATE,
    "decoder_ffn_dim": INTERMEDIATE, "n_inner": INTERMEDIATE, "intermediate_size_mlp": INTERMEDIATE,
    "moe_intermediate_size": EXPERT_INTERMEDIATE, "shared_expert_intermediate_size": EXPERT_INTERMEDIATE,
    "shared_intermediate_size": EXPERT_INTERMEDIATE, "moe_shared_expert_intermediate_size": EXPERT_INTERMEDIATE,
    "shared_experts_intermediate_size": EXPERT_INTERMEDIATE, "expert_ffn_hidden_size": EXPERT_INTERMEDIATE,
    "moe_hidden_size": EXPERT_INTERMEDIATE, "dense_intermediate_size": INTERMEDIATE, "share_expert_dim": EXPERT_INTERMEDIATE,
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "num_layers": LAYERS, "n_layers": LAYERS, "depth": LAYERS,
    "encoder_layers": LAYERS, "decoder_layers": LAYERS,
    "num_attention_heads": HEADS, "n_head": HEADS, "num_heads": HEADS, "n_heads": HEADS,
    "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
    "num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": EXPERTS_PER_TOKEN, "num_experts_per_token": EXPERTS_PER_TOKEN, "moe_topk": EXPERTS_PER_TOKEN,
    "moe_k": EXPERTS_PER_TOKEN,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    # multi-head latent attention (DeepSeek-V2/V3 and kin): head_dim is the rope part
    "qk_rope_head_dim": HEAD_DIM, "qk_nope_head_dim": HEAD_DIM, "v_head_dim": HEAD_DIM, "qk_head_dim": 2 * HEAD_DIM,
    "kv_lora_rank": 32, "q_lora_rank": 32, "index_head_dim": 2 * HEAD_DIM, "index_n_heads": HEADS,
    # linear attention (Kimi delta attention, gated DeltaNet)
    "linear_key_head_dim": HEAD_DIM, "linear_value_head_dim": HEAD_DIM, "linear_num_key_heads": KV_HEADS,
    "linear_num_value_heads": HEADS, "linear_head_dim": HEAD_DIM, "linear_num_heads": HEADS,
    # state-space layers
    "mamba_d_state": 16, "ssm_state_size": 16, "mamba_chunk_size": 16, "mamba_dt_rank": 8, "time_step_rank": 8,
}
# key -> value where the default config leaves it None and the model cannot be built with None
_FILL_NONE = {
    "head_dim": HEAD_DIM, "n_routed_experts": EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN, "n_shared_experts": 1,
    "top_k_experts": EXPERTS_PER_TOKEN,
}
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
_TOKEN_ID = ("token_id", "token_index", "_token_id")


@dataclass
class Built:
    """A tiny model and what built it."""

    model_type: str
    variant: str
    model: torch.nn.Module
    config: object
    auto_class: type
    notes: list[str] = field(default_factory=list)


class CannotBuild(Exception):
    """The model type cannot be built small here; the message is the recorded reason."""


# The transformers release the zoo's records were made with: docs/coverage.md's (CANNOT_BUILD, the issue
# cases and the table are regenerated together). An older one (the GPU image's 5.17, say) lacks some types
# and builds others differently: there a type that cannot be built small is skipped with its reason, and
# every type that builds is still examined. On that release or a newer one the records hold strictly.
COVERAGE_TABLE = Path(__file__).resolve().parents[2] / "docs" / "coverage.md"


def recorded_with() -> str:
    """The transformers version docs/coverage.md was generated with, e.g. "5.24.0"."""
    return re.search(r"every model type of transformers (\S+)", COVERAGE_TABLE.read_text(encoding="utf-8")).group(1)


def older_transformers() -> bool:
    """Whether the installed transformers predates `recorded_with()` (by major and minor version)."""
    def minor(version: str) -> tuple[int, int]:
        return tuple(int(p) for p in version.split(".")[:2])
    return minor(transformers.__version__) < minor(recorded_with())


def skip_if_older(model_type: str, reason: str) -> None:
    """On an older transformers, skip a test of a type that cannot be built small there."""
    if older_transformers():
        pytest.skip(f"{model_type} cannot be built small under transformers {transformers.__version__} "
                    f"(the zoo's records are {recorded_with()}'s): {reason}")


def build_or_skip(model_type: str, variant: str = "default") -> "Built":
    """`build`, with `skip_if_older` where it cannot build the type."""
    try:
        return build(model_type, variant)
    except CannotBuild as e:
        skip_if_older(model_type, str(e))
        raise


def model_types() -> list[str]:
    """Every model type of the causal-LM and image-text-to-text mappings, sorted."""
    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))


def auto_class(model_type: str):
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def _layers_to_keep(d: dict, n_before: int) -> list[int]:
    """Indices of the layers to keep: the first layer of each kind the per-layer string lists name
    (sliding/full attention, dense/sparse MLP, ...), up to 4, then the first ones, LAYERS at least."""
    kinds = [v for v in d.values() if isinstance(v, list) and len(v) == n_before and v and all(isinstance(x, str) for x in v)]
    keep, seen = [], set()
    for i in range(n_before):
        kind = tuple(v[i] for v in kinds)
        if kind not in seen and len(keep) < 4:
            seen.add(kind)
            keep.append(i)
    keep += [i for i in range(n_before) if i not in keep][: max(0, LAYERS - len(keep))]
    return sorted(keep)


def _rescale_mrope(rope: dict, head_dim: int) -> dict:
    """`rope` with its mrope_section rescaled to sum to head_dim // 2."""
    section = rope.get("mrope_section")
    if not (isinstance(section, list) and section and sum(section) != head_dim // 2):
        return rope
    total, half = sum(section), head_dim // 2
    new = [max(1, s * half // total) for s in section]
    new[0] += half - sum(new)
    return rope | {"mrope_section": new}


def _shrink(d: dict) -> dict:
    """The config dict `d` with every known size made tiny and its layers cut to a few of each kind."""
    n_before = next((d[k] for k in _LAYER_COUNT_KEYS if isinstance(d.get(k), int) and not isinstance(d[k], bool)), None)
    keep = _layers_to_keep(d, n_before) if n_before and n_before > LAYERS else None
    out = {}
    for key, value in d.items():
        key_s = str(key)
        if value is None and key_s in _FILL_NONE and "num_attention_heads" in d:
            out[key] = _FILL_NONE[key_s]
        elif isinstance(value, dict) and not key_s.startswith("rope") and "id2label" not in key_s and key_s != "label2id":
            if keep and value and all(str(k).isdigit() for k in value):  # {layer index: setting}
                out[key] = {type(k)(keep.index(int(k))): v for k, v in value.items() if int(k) in keep}
            else:
                out[key] = _shrink(value)
        elif key in _SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = _SIZES[key] if value > _SIZES[key] else value
        elif keep and isinstance(value, list) and len(value) == n_before:
            out[key] = [value[i] for i in keep]
        else:
            out[key] = value
    if d.get("num_key_value_heads") in (None, d.get("num_attention_heads")) and "num_key_value_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]  # no GQA in the real model, none here
    if keep:
        for k in _LAYER_COUNT_KEYS:
            if isinstance(out.get(k), int):
                out[k] = len(keep)
    head_dim = out.get("head_dim") or (out.get("hidden_size", 0) // max(out.get("num_attention_heads", 1) or 1, 1))
    for key, value in out.items():
        if str(key).startswith("rope") and isinstance(value, dict) and head_dim:
            out[key] = _rescale_mrope(value, head_dim)
            for sub, rope in value.items():  # per layer type
                if isinstance(rope, dict):
                    out[key][sub] = _rescale_mrope(rope, head_dim)
    return out


def _is_token_id(key, value) -> bool:
    return (isinstance(key, str) and key.endswith(_TOKEN_ID) and isinstance(value, int)
            and not isinstance(value, bool) and value >= 0)


def _remap_token_ids(d: dict, mapping: dict[int, int]) -> dict:
    """`d` with every token id of VOCAB or more moved to a distinct id just under VOCAB, and
    every vocab_size at most VOCAB: a 128-token vocabulary whatever ids the real model uses."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not str(k).startswith("rope"):
            out[k] = _remap_token_ids(v, mapping)
        elif _is_token_id(k, v) and v >= VOCAB:
            out[k] = mapping.setdefault(v, VOCAB - 1 - len(mapping))
        elif isinstance(k, str) and k.endswith("token_ids") and isinstance(v, list):
            out[k] = [mapping.setdefault(i, VOCAB - 1 - len(mapping)) if isinstance(i, int) and i >= VOCAB else i
                      for i in v]
        elif k == "vocab_size" and isinstance(v, int):
            out[k] = min(v, VOCAB)
        else:
            out[k] = v
    return out


def tiny_config(model_type: str, **overrides):
    """The shrunk default config of `model_type`, with `overrides` (nested dicts merge)."""
    default = AutoConfig.for_model(model_type).to_dict()
    d = _remap_token_ids(_shrink(default), {})
    d["initializer_range"] = 0.2
    d = _merge(d, OVERRIDES.get(model_type, {}))
    d = _merge(d, overrides)
    d.pop("model_type", None)
    d.pop("transformers_version", None)
    return AutoConfig.for_model(model_type, **d)


def _merge(d: dict, over: dict) -> dict:
    out = dict(d)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@contextlib.contextmanager
def quiet():
    """Silence transformers' and Python's warnings while building."""
    level = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.getLogger("transformers").setLevel(level)


def build(model_type: str, variant: str = "default", seed: int = 0) -> Built:
    """A tiny fp32 random model of `model_type` (and `variant`) in eval mode.

    Raises:
        CannotBuild: with the reason, where the type cannot be built small.
    """
    overrides = VARIANTS[(model_type, variant)] if variant != "default" else {}
    cls = auto_class(model_type)
    with quiet():
        try:
            config = tiny_config(model_type, **overrides)
            torch.manual_seed(seed)
            try:
                model = cls.from_config(config, dtype=torch.float32)
            except ValueError as e:  # in a mapping whose auto class does not take its config
                if "Unrecognized configuration class" not in str(e):
                    raise
                cls = AutoModelForCausalLM
                model = cls.from_config(config, dtype=torch.float32)
        except Exception as e:  # noqa: BLE001 - any failure is recorded as the reason
            raise CannotBuild(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from e
    return Built(model_type, variant, model.eval(), config, cls)


_MROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}

# per model type: config keys the generic shrink gets wrong
OVERRIDES: dict[str, dict] = {
    "reformer": dict(is_decoder=True, attn_layers=["local", "lsh"], axial_pos_shape=[8, 16], axial_pos_embds_dim=[32, 32]),
    "xlnet": dict(d_head=16),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    "dots3_note": dict(text_config=dict(swa_head_dim=2 * HEAD_DIM)),
    "dots3_note_text": dict(swa_head_dim=2 * HEAD_DIM),
    "mamba2": dict(head_dim=32, expand=2),
    "bamba": dict(mamba_n_heads=8, mamba_d_head=16, mamba_expand=2),
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=16, mamba_expand=2),
    "molmo2": dict(adapter_config=dict(vision_feature_layer=[-1, -2])),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "hrm_text": dict(num_layers_per_stack=1),
    "step3p7": dict(sliding_window=16),
    "xlstm": dict(num_blocks=LAYERS),
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"]),
    **{t: dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM, indexer_budget=16,
               indexer_compress_ratio=4) for t in ("qwen4_exp_text",)},
    "qwen4_exp": dict(text_config=dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM,
                                       indexer_budget=16, indexer_compress_ratio=4)),
    "gemma3n_text": dict(num_kv_shared_layers=0),
    "gemma4_unified_assistant": dict(num_kv_shared_layers=0),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "deepseek_ocr2": dict(text_config=dict(mlp_layer_types=["dense", "sparse"])),
    # layer counts in (attention, mlp) pairs; input + recurrent + output layers = num_hidden_layers
    "dory": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, n_input_layers=1,
                 n_recurrent_layers=2, n_output_layers=1),
    # image and audio token ranges inside the tiny vocabulary; the audio codebook as wide as its hidden size
    "apertus1p5": dict(image_token_offset=64, audio_token_offset=80, vision_config=dict(codebook_size=16),
                       audio_config=dict(codebook_size=16, codebook_dim=64)),
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),
    "diffusion_gemma": dict(canvas_length=8, text_config=dict(num_experts=EXPERTS, top_k_experts=EXPERTS_PER_TOKEN,
                                             moe_intermediate_size=EXPERT_INTERMEDIATE)),
    **{t: dict(text_config=_MROPE) for t in ("qwen2_vl", "qwen2_5_vl", "paddleocr_vl", "glm4v", "glm46v", "glmga",
                                               "glm_ocr", "glm4v_moe", "qwen2_5_omni_thinker")},
}

# (model_type, variant) -> config overrides for settings real checkpoints use and tiny defaults miss
VARIANTS: dict[tuple[str, str], dict] = {
    # Gemma 3n: a row-wise Gaussian top-k on the gate in the first 10 layers of the real models
    ("gemma3n_text", "activation_sparsity"): dict(activation_sparsity_pattern=[0.95, 0.0]),
    # Falcon-H1 checkpoints' mlp_multipliers (gate, down)
    ("falcon_h1", "mlp_multipliers"): dict(mlp_multipliers=[0.8839, 0.5859]),
    ("falcon_h1", "mlp_multipliers_bias"): dict(mlp_multipliers=[0.8839, 0.5859], mlp_bias=True),
    # SwiGLU clamps; a limit of 1 clamps at ordinary input scale too
    ("deepseek_v4", "swiglu_limit"): dict(swiglu_limit=1.0),
    ("glm5_next", "swiglu_limit"): dict(text_config=dict(swiglu_limit=1.0), vision_config=dict(swiglu_limit=1.0)),
    ("step3p7", "swiglu_limits_shared"): dict(text_config=dict(swiglu_limits_shared=[0.0, 1.0])),
    # Doge's cross-domain MoE (shared MLP plus routed experts in one module)
    ("doge", "is_moe"): dict(is_moe=True, num_experts=16, num_experts_per_tok=2),
    # BitNet with a gated activation: still its ffn_sub_norm between the product and down
    ("bitnet", "silu"): dict(hidden_act="silu"),
    # biases on every projection (Llama's mlp_bias)
    ("llama", "mlp_bias"): dict(mlp_bias=True),
    # GEGLU with the exact (erf) GELU
    ("gemma", "gelu"): dict(hidden_act="gelu", hidden_activation="gelu"),
}

_TIMM = ("ImportError", "its vision tower comes from timm, which is not installed")
# model type -> (how building fails: the start of the error, why): no tiny model of these is built here
CANNOT_BUILD: dict[str, tuple[str, str]] = {
    "chameleon": ("AttributeError", "needs the image tokenizer's vocabulary_map, which the default config leaves empty"),
    "emu3": ("AttributeError", "needs the image tokenizer's vocabulary_map, which the default config leaves empty"),
    "cohere_compass": ("KeyError: 'full_attention'", "its default rope_parameters lack a layer type the model builds"),
    "cohere_compass_text": ("KeyError: 'full_attention'", "its default rope_parameters lack a layer type the model builds"),
    "dots3_note": ("StrictDataclassClassValidationError", "per-layer head sizes that the generic shrink breaks"),
    "dots3_note_text": ("StrictDataclassClassValidationError", "per-layer head sizes that the generic shrink breaks"),
    "ernie4_5_vl_moe": ("RuntimeError", "its vision rotary embedding does not fit the tiny head size"),
    "evolla": ("ValueError: Unrecognized configuration class",
               "listed for image-text-to-text, but neither that auto class nor the causal-LM one takes its config"),
    "fast_vlm": _TIMM,
    "gemma3n": _TIMM,
    "perception_lm": _TIMM,
    "gemma4_assistant": ("StrictDataclassClassValidationError", "a draft model whose config holds only next to its target"),
    "gemma4_unified_assistant": ("ValueError: The set of layer types producing a cache",
                                 "a draft model whose config holds only next to its target"),
    "granite4_vision": ("TypeError", "its default config leaves deepstack_layer_map empty, which the model needs"),
    "musicgen": ("AttributeError", "an audio model whose default config lacks decoder settings the causal-LM class reads"),
    "musicgen_melody": ("AttributeError", "an audio model whose default config lacks decoder settings the causal-LM class reads"),
}
