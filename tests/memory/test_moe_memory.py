"""The memory model of mixture-of-experts layers: hand-worked experts blocks, HF's blocks on CPU, presets.

The live-tensor count (`memory/live_tensors.py`) runs tiny HF MoE models: HF's default
experts path (``grouped_mm``, which has a CPU kernel) is counted tensor by tensor against the walk
of `swiglu_patch.memory.moe_walk`. Weights and the input exist before the call: their storages are
left out (``transpose`` of an expert weight is a view the count would otherwise see as new).
"""

from __future__ import annotations

import gc

import pytest
import torch
from memory.live_tensors import cpu_measure

from swiglu_patch.memory import hf_releases
from swiglu_patch.memory.activation_model import predict_mlp_peak, predict_moe_peak, predict_prefill_peak
from swiglu_patch.memory.configs import resolve_model
from swiglu_patch.memory.shape import DECODER_LAYOUTS, ModelShape

transformers = pytest.importorskip("transformers")


_BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=500, max_position_embeddings=2048)

# model_type -> the experts fields of a tiny config (8 experts of I_e = 48, 2 per token)
TINY_MOE = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96,
                      norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96,
                      shared_expert_intermediate_size=80, sliding_window=None),
    "qwen3_5_moe_text": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                             shared_expert_intermediate_size=80, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=16,
                             layer_types=["linear_attention", "full_attention"]),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48),
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96,
                     n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, attention_bias=True,
                     partial_rotary_factor=0.5),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"]),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32,
                        kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        num_key_value_heads=4),
}


MOE_PRESETS = ("qwen3-30b-a3b", "qwen3.5-35b-a3b", "mixtral-8x7b", "gpt-oss-20b", "gpt-oss-120b", "glm-4.5-air",
               "deepseek-v3")


def _tiny(model_type: str, dtype=torch.bfloat16):
    config = transformers.AutoConfig.for_model(model_type, **(_BASE | TINY_MOE[model_type]))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)
    assert model.config._experts_implementation == "grouped_mm"
    return model


def _existing(model) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def test_every_moe_layout_is_checked_against_live_tensors():
    from swiglu_patch.memory.moe_shape import MOE_LAYOUTS
    from swiglu_patch.memory.shape import DECODER_LAYOUTS

    assert set(TINY_MOE) == set(MOE_LAYOUTS) and set(MOE_LAYOUTS) <= set(DECODER_LAYOUTS)


# -- HF's experts block, counted on CPU ---------------------------------------------------------

@pytest.mark.parametrize("model_type", sorted(TINY_MOE))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 100])
def test_experts_block_walk_matches_live_tensors(model_type, dtype, tokens):
    model = _tiny(model_type, dtype)
    shape = ModelShape.from_config(model.config)
    layer = shape.moe.sparse_layers.index(True)
    x = torch.randn(1, tokens, 64, dtype=dtype)
    with torch.inference_mode():
        measured = cpu_measure(lambda: model.model.layers[layer].mlp(x), x, *_existing(model))
    predicted = predict_moe_peak(shape, tokens, fused=False, dtype_bytes=dtype.itemsize)
    assert predicted.bytes == measured, predicted.where


@pytest.mark.parametrize("model_type", sorted(t for t in TINY_MOE if DECODER_LAYOUTS[t].hf_attention != "unwalked"))
@pytest.mark.parametrize("batch,seq_len", [(1, 192), (3, 64)])
def test_moe_prefill_walk_matches_live_tensors(model_type, batch, seq_len):
    model = _tiny(model_type)
    ids = torch.randint(0, 500, (batch, seq_len))
    with torch.inference_mode():
        measured = cpu_measure(lambda: model(input_ids=ids, logits_to_keep=1, use_cache=True), ids, *_existing(model))
    shape = ModelShape.from_config(model.config)
    predicted = predict_prefill_peak(shape, batch, seq_len, fused=False, logits_to_keep=1)
    lse = batch * shape.num_heads * seq_len * 4 if predicted.where.endswith("logsumexp") else 0  # inside SDPA
    assert abs(predicted.bytes - lse - measured) <= 8, predicted.where  # gpt-oss: one 0-d int64 tensor


def test_unmodelled_hf_attention_is_refused_and_flash_predicts():
    shape = ModelShape.from_config(_tiny("deepseek_v3").config)
    with pytest.raises(NotImplementedError, match="attention='flash'"):
        predict_prefill_peak(shape, 1, 64, fused=False)
    eager, fused = (predict_prefill_peak(shape, 1, 64, fused=f, attention="flash", server_kernels=True)
                    for f in (False, True))
    assert fused.bytes < eager.bytes and "mlp" in eager.where


# -- hand-worked experts blocks -------------------------------------------------------------------



@pytest.mark.usefixtures("newest_transformers")
def test_qwen3_30b_a3b_block_hand_worked():
    shape = resolve_model("qwen3-30b-a3b").shape()
    T, k, E, K, I, e = 512, 8, 128, 2048, 768, 2
    S = T * k
    router = T * E * e + T * k * e + T * k * 8  # logits, top-k weights (bf16), top-k ids (int64), kept by the block
    index = 2 * S * 8 + S * e + S * 4 + 2 * E * 4  # sorted ids, perm, sorted weights, histc input, counts, offsets
    # peak at the un-permute: x_g, down, weighted, weighted in token order (4 S K), the inverse permutation
    eager = router + index + 4 * S * K * e + S * 8
    assert eager > router + index + S * K * e + 4 * S * I * e  # the gate ([S, 2I] + act + product) is lower
    # fused: out [T, K] first, the pairs in 64-row expert blocks (T = 512's rule: S + 128 x 63 slots, int64,
    # the one-program routing kernel up to 4,096 pairs) and each block's expert, then h [S, I] and y [S, K]
    rows = -(-(S + E * 63) // 64) * 64
    fused = router + T * K * e + rows * 8 + rows // 64 * 8 + S * I * e + S * K * e
    assert predict_moe_peak(shape, T, fused=False).bytes == eager == 67_404_800
    # the H100 measured 67,408,896 and 25,436,672 (benchmarks/results/h100/memory_moe/)
    assert predict_moe_peak(shape, T, fused=True).bytes == fused == 25_436_656


@pytest.mark.usefixtures("newest_transformers")
def test_mixtral_block_peaks_at_the_gate_with_fp32_routing():
    shape = resolve_model("mixtral-8x7b").shape()
    T, k, E, K, I, e = 512, 2, 8, 4096, 14336, 2
    S = T * k
    router = T * E * e + T * k * 4 + T * k * 8  # the top-k weights stay fp32
    index = 2 * S * 8 + S * 4 + S * 4 + 2 * E * 4
    eager = predict_moe_peak(shape, T, fused=False)
    assert eager.bytes == router + index + S * K * e + 4 * S * I * e and eager.where.endswith("act(gate) * up")
    fused = predict_moe_peak(shape, T, fused=True)
    rows = -(-(S + E * 63) // 64) * 64  # T = 512's rule: 64-row blocks; the routing kernel (1,024 pairs)
    assert fused.bytes == router + T * K * e + rows * 8 + rows // 64 * 8 + S * I * e + S * K * e


@pytest.mark.usefixtures("newest_transformers")
def test_gpt_oss_clamped_gate_and_biases():
    shape = resolve_model("gpt-oss-20b").shape()
    T, k, E, K, I, e = 256, 4, 32, 2880, 2880, 2
    S = T * k
    router = T * E * e + T * k * e + T * k * 8
    index = 2 * S * 8 + S * e + S * 4 + 2 * E * 4
    # gate_up bias per pair [S, 2I], gate_up [S, 2I], then clamp(gate), clamp(up), glu, up + 1, product
    eager = router + index + S * K * e + 2 * S * I * e + 2 * S * I * e + 5 * S * I * e
    assert predict_moe_peak(shape, T, fused=False).bytes == eager


@pytest.mark.usefixtures("newest_transformers")
def test_deepseek_v3_tp8_hand_worked():
    shape = resolve_model("deepseek-v3").shape().sharded(8)
    T, k, E, K, I, e = 64, 8, 256, 7168, 2048 // 8, 2
    S = T * k
    assert (shape.moe.intermediate_size, shape.moe.shared_intermediate_size) == (I, I)
    assert predict_mlp_peak(shape, T, fused=True, layer=0).bytes == T * (18432 // 8) * e + T * K * e  # dense layer
    router = T * E * 4 + T * k * 4 + T * k * 8  # fp32 logits and weights, int64 ids
    peak = predict_moe_peak(shape, T, fused=True)
    # out [T, K] is allocated first and h and y live until the call returns: T = 64 takes 16-row blocks
    rows = -(-(S + min(S, E) * 15) // 16) * 16
    assert peak.bytes == router + T * K * e + rows * 8 + rows // 16 * 8 + S * I * e + S * K * e
    assert peak.where.endswith("fused experts grouped down * routing weight")


def test_fused_experts_shrink_every_moe_preset():
    for name in MOE_PRESETS:
        shape = resolve_model(name).shape()
        eager, fused = (predict_moe_peak(shape, 512, fused=f).bytes for f in (False, True))
        assert 0 < fused < eager / 2, name


def test_dense_model_has_no_experts_block():
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        predict_moe_peak(resolve_model("llama-3.1-8b").shape(), 16, fused=False)
    with pytest.raises(ValueError, match="layer must be in"):
        predict_mlp_peak(resolve_model("llama-3.1-8b").shape(), 16, fused=False, layer=32)


# -- presets: published sizes, KV bytes, weights --------------------------------------------------

def test_moe_preset_parameter_counts_match_published():
    from swiglu_patch.memory.weights import count_params

    total = {name: count_params(resolve_model(name).shape()).total for name in
             MOE_PRESETS}
    assert total["mixtral-8x7b"] == 46_702_792_704  # the checkpoint's safetensors total
    assert round(total["qwen3-30b-a3b"] / 1e9, 1) == 30.5  # model card: 30.5B in total
    assert round(total["gpt-oss-20b"] / 1e9, 2) == 20.91  # model card: 20.91B total
    assert round(total["gpt-oss-120b"] / 1e9, 2) == 116.83  # model card: 116.83B total
    # "35B total" (the card counts the vision tower and the MTP layer, which this text model leaves out)
    assert 34.5e9 < total["qwen3.5-35b-a3b"] < 35e9
    assert round(total["deepseek-v3"] / 1e9) == 671  # report: 671B total (without the MTP module)
    # "106B total parameters": our count (no MTP layer, which transformers does not load) is 106.85B
    assert 106e9 < total["glm-4.5-air"] < 107e9


def test_moe_config_keys_per_family():
    shapes = {n: resolve_model(n).shape() for n in ("qwen3-30b-a3b", "gpt-oss-20b", "glm-4.5-air", "deepseek-v3")}
    m = {n: s.moe for n, s in shapes.items()}
    assert (m["qwen3-30b-a3b"].num_experts, m["qwen3-30b-a3b"].top_k, m["qwen3-30b-a3b"].intermediate_size) == (
        128, 8, 768)  # num_experts, moe_intermediate_size
    assert (m["gpt-oss-20b"].num_experts, m["gpt-oss-20b"].intermediate_size) == (32, 2880)  # intermediate_size
    assert m["glm-4.5-air"].sparse_layers == (False,) + (True,) * 45  # first_k_dense_replace 1
    assert m["deepseek-v3"].sparse_layers[:4] == (False, False, False, True) and m["deepseek-v3"].num_sparse_layers == 58
    assert (m["deepseek-v3"].num_experts, m["deepseek-v3"].shared_intermediate_size) == (256, 2048)  # n_shared x I_e
    assert shapes["deepseek-v3"].mla.latent_dim == 576
    qwen = transformers.AutoConfig.for_model("qwen3_moe", **(_BASE | TINY_MOE["qwen3_moe"]),
                                             decoder_sparse_step=2, mlp_only_layers=[3])
    qwen.num_hidden_layers = 6
    assert ModelShape.from_config(qwen).moe.sparse_layers == (False, True, False, False, False, True)


def test_kv_bytes_of_moe_presets():
    from swiglu_patch.memory.kv_capacity import kv_bytes_per_sequence, kv_bytes_per_token

    deepseek = resolve_model("deepseek-v3").shape()
    # latent attention: 61 layers x (512 + 64) values x 2 bytes, the same on every GPU
    assert kv_bytes_per_token(deepseek) == kv_bytes_per_token(deepseek, tp=8) == 61 * 576 * 2
    gpt = resolve_model("gpt-oss-20b").shape()
    assert kv_bytes_per_token(gpt) == 24 * 2 * 8 * 64 * 2
    # 12 full layers keep 8192 tokens, 12 sliding layers 128
    assert kv_bytes_per_sequence(gpt, 8192) == 2 * 8 * 64 * 2 * (12 * 8192 + 12 * 128)


@pytest.mark.usefixtures("newest_transformers")
def test_moe_weights_count_every_expert_and_replicate_the_router():
    from swiglu_patch.memory.weights import weight_bytes_per_gpu

    shape = resolve_model("qwen3-30b-a3b").shape()
    K, V, L, E, I = 2048, 151936, 48, 128, 768
    embedding, attention = 2 * V * K, L * (2 * K * 4096 + 2 * K * 512)
    experts, router, norms = L * E * 3 * K * I, L * E * K, L * (2 * K + 2 * 128) + K
    assert weight_bytes_per_gpu(shape, "bf16", tp=2) == 2 * ((embedding + attention + experts) / 2 + router + norms)
    assert shape.sharded(2).moe.intermediate_size == 384
    with pytest.raises(ValueError, match="does not divide .*expert intermediate size 768"):
        shape.sharded(5)


def test_kv_capacity_answers_for_moe_presets(capsys):
    from swiglu_patch.memory.kv_capacity import smallest_tp

    tps = {n: smallest_tp(resolve_model(n).shape(), gpu_mem_gib=79.1) for n in
           ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "gpt-oss-120b", "glm-4.5-air")}
    # bf16 weights: 56.9, 87.0, 39.0, 217.6 and 199.0 GiB against 71.2 GiB usable per H100
    assert tps == {"qwen3-30b-a3b": 1, "mixtral-8x7b": 2, "gpt-oss-20b": 1, "gpt-oss-120b": 4, "glm-4.5-air": 4}
    from memory.test_kv_capacity import _run_cli

    code, out, _ = _run_cli(["--model", "qwen3-30b-a3b", "--gpu", "H100"], capsys)
    assert code == 0 and "fused experts" in out and "experts grouped_mm" in out
    row = next(line for line in out.splitlines() if line.startswith("| KV tokens (full count) |"))
    eager, fused = (int(c.replace(",", "")) for c in row.split("|")[2:4])
    assert fused > eager > 0


@pytest.mark.parametrize("model_type", sorted(TINY_MOE))
def test_parameter_count_of_every_moe_family_is_the_models(model_type):
    """count_params against the tiny HF model's own parameters (Qwen3.5: DeltaNet and gated-attention layers)."""
    from swiglu_patch.memory.weights import count_params

    model = _tiny(model_type)
    assert count_params(ModelShape.from_config(model.config)).total == sum(p.numel() for p in model.parameters())


def test_qwen3_5_hybrid_layers_and_state_hand_worked():
    from swiglu_patch.memory.kv_capacity import kv_bytes_per_sequence, kv_bytes_per_token

    shape = resolve_model("qwen3.5-35b-a3b").shape()
    assert (shape.num_full_layers, shape.num_linear_layers, shape.num_sliding_layers) == (10, 30, 0)
    assert shape.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    m = shape.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.shared_intermediate_size) == (256, 8, 512, 512)
    assert m.sparse_layers == (True,) * 40 and shape.intermediate_size == 512  # no dense I: every layer sparse
    # 10 attention layers x K and V x 2 KV heads x 256 x 2 bytes; 30 DeltaNet layers keep their state per sequence:
    # conv [2 x 16 x 128 + 32 x 128 = 8192 channels, kernel - 1 = 3] bf16 + recurrent [32, 128, 128] fp32
    state = 8192 * 3 * 2 + 32 * 128 * 128 * 4
    assert kv_bytes_per_token(shape) == 10 * 2 * 2 * 256 * 2 == 20480
    assert kv_bytes_per_sequence(shape, 8192) == 20480 * 8192 + 30 * state
    assert kv_bytes_per_sequence(shape, 8192, tp=2) == 10 * 2 * 1 * 256 * 2 * 8192 + 30 * state // 2
    with pytest.raises(ValueError, match="16 / 32 linear-attention key / value heads"):
        shape.sharded(32)


def test_a_config_without_dense_intermediate_size_needs_every_layer_sparse():
    config = transformers.AutoConfig.for_model("qwen3_5_moe_text", **(_BASE | TINY_MOE["qwen3_5_moe_text"]))
    assert ModelShape.from_config(config).intermediate_size == 48  # no dense layer: I unused, the experts' size
    config = transformers.AutoConfig.for_model("qwen3_5_moe_text", **(_BASE | TINY_MOE["qwen3_5_moe_text"]),
                                               mlp_only_layers=[0])
    with pytest.raises(ValueError, match="lacks intermediate_size, which its dense MLP layers need"):
        ModelShape.from_config(config)


def test_memory_and_kv_capacity_answer_for_every_moe_preset(capsys):
    """`swiglu-patch memory` (the experts block; the prefill too where HF's attention is walked) and
    `swiglu-patch kv-capacity` give numbers for every MoE preset."""
    import argparse

    from memory.test_kv_capacity import _run_cli

    from swiglu_patch.memory import profile_cli

    for name in MOE_PRESETS:
        parser = argparse.ArgumentParser()
        profile_cli.add_arguments(parser)
        assert profile_cli.main(parser.parse_args(["--model", name, "--tokens", "512", "--batch-sizes", "1"])) == 0, name
        out = capsys.readouterr().out
        assert f"| {name} | mlp | 1 | 512 |" in out, out
        walked = DECODER_LAYOUTS[resolve_model(name).shape().family].hf_attention != "unwalked"
        assert (f"| {name} | prefill | 1 | 512 |" in out) == walked, name
        # bf16 weights of DeepSeek-V3 (1.25 TiB) fit no H100 tensor-parallel group: its own fp8 weights do at tp 16
        extra = ["--weight-dtype", "fp8"] if name == "deepseek-v3" else []
        code, out, err = _run_cli(["--model", name, "--gpu", "H100", *extra], capsys)
        assert code == 0, (name, err)
        row = next(line for line in out.splitlines() if line.startswith("| KV tokens (full count) |"))
        eager, fused = (int(c.replace(",", "")) for c in row.split("|")[2:4])
        assert fused > eager > 0, name


def _collect_garbage(*_) -> None:
    gc.collect()  # a forward hook: returns None, so the module's output stands


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU count of the fused path runs Triton's interpreter")
@pytest.mark.parametrize("model_type", sorted(TINY_MOE))
def test_fused_experts_walk_matches_live_tensors_under_the_interpreter(model_type):
    """The fused path's tensors (out, the routing blocks, h, y) counted on CPU: the Triton kernels under
    TRITON_INTERPRET=1 allocate through torch as on the GPU. The differences: the routing kernel's int32
    scratch [2 x next_pow2(E + 1)], which the interpreter's launch still holds at the peak (on the H100 it
    is freed before h: measured within 16 bytes of the prediction, benchmarks/results/h100/memory_moe/), and
    what the interpreter leaves to the garbage collector (below)."""
    from swiglu_patch import apply_fused_mlp

    model = _tiny(model_type, torch.float32)
    shape = ModelShape.from_config(model.config)
    apply_fused_mlp(model, backend="triton", strict=False)
    layer = shape.moe.sparse_layers.index(True)
    scratch = 2 * 16 * 4  # 8 experts: next_pow2(9) = 16
    # The interpreter's launches leave tensors in reference cycles, which no GPU launch makes: after one qwen2_moe
    # experts call at 7 tokens the garbage collector frees 3,584 bytes (Triton 3.9) or 7,496 (3.8), which would
    # stay counted through a shared expert's forward. They are collected as the experts call returns.
    model.model.layers[layer].mlp.experts.register_forward_hook(_collect_garbage)
    for tokens in (7, 100):
        x = torch.randn(1, tokens, 64)
        with torch.inference_mode():
            measured = cpu_measure(lambda: model.model.layers[layer].mlp(x), x, *_existing(model))
        predicted = predict_moe_peak(shape, tokens, fused=True, dtype_bytes=4)
        assert predicted.bytes + scratch == measured, (tokens, predicted.where)


@pytest.mark.parametrize("name, tokens", [("mixtral-8x7b", 512), ("qwen3-30b-a3b", 512), ("deepseek-v3", 1)])
def test_transformers_up_to_5_17_allocate_more(name, tokens, monkeypatch):
    """What the walk adds for the GPU image's transformers 5.17 (measured against it to the byte by the
    live-tensor tests above when it is installed): the bool sentinel mask [S] beside peaks that the two
    masked_fill copies do not raise, and, for DeepSeek's router, its weight cast to fp32 beside x's fp32
    copy and the logits, which sets a one-token block's peak."""
    shape = resolve_model(name).shape()
    monkeypatch.setattr(hf_releases, "installed_transformers", lambda: None)
    newest = predict_moe_peak(shape, tokens, fused=False).bytes
    monkeypatch.setattr(hf_releases, "installed_transformers", lambda: (5, 17))
    older = predict_moe_peak(shape, tokens, fused=False)
    E, K, S = shape.moe.num_experts, shape.hidden_size, tokens * shape.moe.top_k
    if name == "deepseek-v3":
        assert older.bytes == tokens * K * 4 + E * K * 4 + tokens * E * 4 and "router" in older.where
    else:
        assert older.bytes == newest + S
