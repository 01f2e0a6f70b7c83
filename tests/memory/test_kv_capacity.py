"""KV-cache capacity arithmetic against numbers worked by hand, presets against published sizes, bad input.

Two models are worked through: Llama 3.1 8B (GQA: 32 query heads, 8 KV heads) and Gemma 2 9B
(every other layer has a 4096-token sliding window, head_dim 256 explicit, 4 norms per layer).
"""

from __future__ import annotations

import argparse
import json
import re

import pytest

from swiglu_patch.memory.configs import config_from_dict, list_presets, load_preset_document, resolve_model
from swiglu_patch.memory.gpus import gpu_memory_gib
from swiglu_patch.memory.kv_capacity import (
    InsufficientMemoryError,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_capacity,
    smallest_tp,
)
from swiglu_patch.memory.shape import ModelShape
from swiglu_patch.memory.weights import count_params, weight_bytes_per_gpu

GIB = 1024**3


@pytest.fixture(scope="module")
def llama8b() -> ModelShape:
    return resolve_model("llama-3.1-8b").shape()


@pytest.fixture(scope="module")
def gemma2_9b() -> ModelShape:
    return resolve_model("gemma-2-9b").shape()


# -- presets ------------------------------------------------------------------------------------

def test_at_least_fifteen_presets_each_with_a_source():
    names = list_presets()
    assert len(names) >= 15
    for name in names:
        doc = load_preset_document(name)
        assert doc["source"].startswith("https://huggingface.co/") and doc["source"].count("config.json") == 1
        shape = resolve_model(name).shape()
        assert shape.num_heads % shape.num_kv_heads == 0
        if shape.moe is None:
            assert shape.intermediate_size > shape.hidden_size
        else:  # experts are narrower than dense MLPs, and there are more of them than are routed to
            assert 0 < shape.moe.top_k < shape.moe.num_experts and shape.moe.num_sparse_layers > 0


# Parameter counts published for these checkpoints (model cards / safetensors metadata): they check
# the preset numbers and the counting at once.
PUBLISHED_PARAMS = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "llama-3.2-1b": 1_235_814_400,
    "mistral-7b-v0.1": 7_241_732_096,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
    "phi-3-mini": 3_821_079_552,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_count_matches_published(name):
    assert count_params(resolve_model(name).shape()).total == PUBLISHED_PARAMS[name]


def test_shapes_read_from_configs(llama8b, gemma2_9b):
    assert (llama8b.num_heads, llama8b.num_kv_heads, llama8b.head_dim, llama8b.num_sliding_layers) == (32, 8, 128, 0)
    assert (gemma2_9b.head_dim, gemma2_9b.sliding_window, gemma2_9b.num_sliding_layers) == (256, 4096, 21)
    assert gemma2_9b.layer_types[:2] == ("sliding_attention", "full_attention")
    nemo = resolve_model("mistral-nemo-12b").shape()
    assert nemo.head_dim == 128 and nemo.q_dim == 4096 != nemo.hidden_size  # explicit head_dim honoured
    gemma3 = resolve_model("gemma-3-12b").shape()
    assert (gemma3.num_sliding_layers, gemma3.num_full_layers, gemma3.sliding_window) == (40, 8, 1024)


def test_multimodal_config_reads_its_text_config():
    doc = load_preset_document("gemma-3-4b")
    text = dict(doc["config"])
    text.pop("model_type")
    config = config_from_dict({"model_type": "gemma3", "text_config": text, "vision_config": {}})
    shape = ModelShape.from_config(config, name="gemma-3-4b-mm")
    assert (shape.model_type, shape.hidden_size, shape.num_layers) == ("gemma3_text", 2560, 34)


# -- KV bytes ------------------------------------------------------------------------------------

def test_kv_bytes_per_token_gqa(llama8b):
    # 32 layers x 2 (K, V) x 8 KV heads x 128 x 2 bytes
    assert kv_bytes_per_token(llama8b, "bf16") == 32 * 2 * 8 * 128 * 2 == 131_072
    assert kv_bytes_per_token(llama8b, "fp8") == 65_536
    assert kv_bytes_per_token(llama8b, "bf16", tp=2) == 32 * 2 * 4 * 128 * 2
    # tp=16 > 8 KV heads: each GPU keeps one (replicated) head
    assert kv_bytes_per_token(llama8b, "bf16", tp=16) == 32 * 2 * 1 * 128 * 2


def test_kv_bytes_sliding_window(gemma2_9b):
    per_layer_token = 2 * 8 * 256 * 2  # K and V, 8 KV heads, head_dim 256, bf16
    assert kv_bytes_per_token(gemma2_9b) == 42 * per_layer_token == 344_064
    # 8192-token sequence: 21 full layers keep 8192 tokens, 21 sliding layers keep 4096
    assert kv_bytes_per_sequence(gemma2_9b, 8192) == per_layer_token * (21 * 8192 + 21 * 4096) == 2_113_929_216
    assert kv_bytes_per_sequence(gemma2_9b, 8192, capped=False) == 344_064 * 8192
    # shorter than the window: capping changes nothing
    assert kv_bytes_per_sequence(gemma2_9b, 2048) == kv_bytes_per_sequence(gemma2_9b, 2048, capped=False)


# -- capacity ------------------------------------------------------------------------------------

def test_capacity_llama_8b_hand_worked(llama8b):
    usable = 77_309_411_328  # 0.9 x 80 GiB
    weights = 8_030_261_248 * 2
    M, K, I, D = 512, 4096, 14336, 128
    small = 8 * M + 2 * M * D * 2  # position ids + rotary cos/sin
    # eager: embeddings, layer input, residual, normed input, and gate/act/up/product of 3 x M x I
    act_eager = 4 * M * K * 2 + 3 * M * I * 2 + small
    # fused: the same four [M, K], the kernel's [M, I] and down_proj's [M, K]
    act_fused = 5 * M * K * 2 + M * I * 2 + small
    assert (act_eager, act_fused) == (61_083_648, 35_917_824)
    r = kv_capacity(llama8b, gpu_mem_gib=80, chunk_tokens=512, mem_fraction=0.9, seq_len=8192)
    assert (r.usable_bytes, r.weights_per_gpu, r.act_eager, r.act_fused) == (usable, weights, act_eager, act_fused)
    assert r.tokens_eager_full == (usable - weights - act_eager) // 131_072 == 466_825
    assert r.tokens_fused_full == (usable - weights - act_fused) // 131_072 == 467_017
    assert r.extra_tokens_full == 192 == (act_eager - act_fused) // 131_072  # 24 MiB / 128 KiB
    assert r.extra_pct == pytest.approx(100 * 192 / 466_825)
    assert r.seqs_eager == (usable - weights - act_eager) // (131_072 * 8192) == 56
    assert r.tokens_eager_capped == r.tokens_eager_full  # no sliding layers


def test_capacity_gemma2_9b_hand_worked(gemma2_9b):
    usable = 77_309_411_328
    weights = 9_241_705_984 * 2
    M, K, I, D = 512, 3584, 14336, 256
    small = 8 * M + 2 * M * D * 2
    act_eager = 4 * M * K * 2 + 3 * M * I * 2 + small
    act_fused = 5 * M * K * 2 + M * I * 2 + small
    assert (act_eager, act_fused) == (59_248_640, 33_558_528)
    r = kv_capacity(gemma2_9b, gpu_mem_gib=80, chunk_tokens=512, seq_len=8192)
    assert (r.act_eager, r.act_fused) == (act_eager, act_fused)
    assert r.tokens_eager_full == (usable - weights - act_eager) // 344_064 == 170_801
    assert r.tokens_fused_full == (usable - weights - act_fused) // 344_064 == 170_876
    # window-capped: an 8192-token sequence costs 2_113_929_216 bytes, i.e. 258_048 bytes a token
    assert r.seqs_eager == (usable - weights - act_eager) // 2_113_929_216 == 27
    assert r.tokens_eager_capped == (usable - weights - act_eager) * 8192 // 2_113_929_216 == 227_735


@pytest.mark.usefixtures("newest_transformers")
def test_tensor_parallel_shares(llama8b):
    r1 = kv_capacity(llama8b, gpu_mem_gib=80, tp=1)
    r2 = kv_capacity(llama8b, gpu_mem_gib=80, tp=2)
    assert r2.weights_per_gpu == pytest.approx(r1.weights_per_gpu / 2, rel=1e-4)  # norms replicated
    assert r2.kv_per_token_full == r1.kv_per_token_full // 2
    M, K, I2 = 512, 4096, 14336 // 2
    small = 8 * M + 2 * M * 128 * 2
    assert r2.act_eager == 4 * M * K * 2 + 3 * M * I2 * 2 + small == 39_063_552
    assert r2.act_fused == 5 * M * K * 2 + M * I2 * 2 + small == 28_577_792
    # With HF's own RMSNorm (two fp32 copies of [M, K]) the fused MLP phase is no longer the peak:
    # the pre-MLP norm is (embeddings, layer input, residual + 2 fp32 [M, K]), and the saving shrinks.
    hf = kv_capacity(llama8b, gpu_mem_gib=80, tp=2, runtime="hf")
    assert hf.act_eager == r2.act_eager
    assert hf.act_fused == 3 * M * K * 2 + 2 * M * K * 4 + small == 29_626_368
    assert "pre_mlp_norm" in hf.act_fused_where and "mlp: down_proj" in r2.act_fused_where


def test_saving_grows_with_the_chunk(llama8b):
    extra = [kv_capacity(llama8b, gpu_mem_gib=80, chunk_tokens=c).extra_tokens_full for c in (512, 2048, 8192)]
    assert extra[0] * 3.9 < extra[1] and extra[1] * 3.9 < extra[2]


def test_smallest_tp_picks_the_first_that_fits():
    s70 = resolve_model("llama-3.1-70b").shape()
    assert smallest_tp(s70, gpu_mem_gib=80) == 2
    assert smallest_tp(s70, gpu_mem_gib=80, weight_dtype="fp8") == 1


# -- bad input -------------------------------------------------------------------------------------

def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError) as info:
        resolve_model("llama-9")
    message = str(info.value)
    assert "Unknown preset 'llama-9'" in message
    assert all(name in message for name in ("llama-3.1-8b", "gemma-2-9b", "qwen3-32b", "phi-3-mini"))


def test_config_without_needed_fields(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                                "num_attention_heads": 32, "vocab_size": 32000}))
    with pytest.raises(ValueError, match="lacks intermediate_size"):
        resolve_model(str(path))
    path.write_text(json.dumps({"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "vocab_size": 10}))
    with pytest.raises(ValueError, match="no model_type"):
        resolve_model(str(path))


def test_unknown_family_is_refused_unless_named(tmp_path):
    path = tmp_path / "config.json"
    fields = {"model_type": "olmo2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 100}
    path.write_text(json.dumps(fields))
    resolved = resolve_model(str(path))
    with pytest.raises(ValueError, match="Unknown model_type 'olmo2'.*Supported: .*llama"):
        resolved.shape()
    assert resolved.shape(family="llama").intermediate_size == 128


def test_memory_too_small_for_weights_is_an_error_not_negative_tokens():
    s70 = resolve_model("llama-3.1-70b").shape()
    with pytest.raises(InsufficientMemoryError, match=r"131\.4 GiB of bf16 weights .* do not fit .*--tp"):
        kv_capacity(s70, gpu_mem_gib=80, tp=1)


def test_bad_numbers_are_refused(llama8b):
    with pytest.raises(ValueError, match="mem_fraction"):
        kv_capacity(llama8b, gpu_mem_gib=80, mem_fraction=1.5)
    with pytest.raises(ValueError, match="KV-cache dtype"):
        kv_bytes_per_token(llama8b, "int3")
    with pytest.raises(ValueError, match="weight dtype"):
        weight_bytes_per_gpu(llama8b, "bf17")
    with pytest.raises(ValueError, match="does not divide 28 attention heads"):
        resolve_model("qwen2.5-7b").shape().sharded(8)
    with pytest.raises(ValueError, match="Unknown GPU 'K80'.*H100"):
        gpu_memory_gib("K80")


# -- the command ---------------------------------------------------------------------------------

def _run_cli(argv, capsys):
    from swiglu_patch.memory import kv_cli

    parser = argparse.ArgumentParser()
    kv_cli.add_arguments(parser)
    code = kv_cli.main(parser.parse_args(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_single_model_table(capsys):
    code, out, _ = _run_cli(["--model", "llama-3.1-8b", "--gpu-mem-gib", "80", "--tp", "1"], capsys)
    assert code == 0
    assert "| KV tokens (full count) | 466,825 | 467,017 | +192 (0.04%) |" in out
    assert "Assumptions:" in out and "logits for the last token" in out


def test_cli_too_small_gpu_is_a_clear_message(capsys):
    code, out, err = _run_cli(["--model", "llama-3.1-70b", "--gpu", "L4", "--tp", "1"], capsys)
    assert code == 2 and out == ""
    assert "do not fit" in err and "131.4 GiB of bf16 weights" in err
    assert re.search(r"\s-\d", err) is None  # no negative numbers


def test_cli_all_presets_writes_json_markdown_and_plot(tmp_path, capsys):
    plot = tmp_path / "kv.png"
    code, out, _ = _run_cli(["--model", "all", "--gpu", "H100", "--chunk", "512", "--out-dir", str(tmp_path),
                             "--name", "kv", "--plot", str(plot)], capsys)
    assert code == 0
    payload = json.loads((tmp_path / "kv.json").read_text())
    # DeepSeek-V3 in bf16 is 1.25 TiB: 16 H100s hold 78 GiB of it each, more than 90% of 79.1 GiB
    assert [s["model"] for s in payload["skipped"]] == ["deepseek-v3"]
    assert "no tensor-parallel degree" in payload["skipped"][0]["reason"]
    assert len(payload["results"]) == len(list_presets()) - 1
    by_model = {r["model"]: r for r in payload["results"]}
    assert by_model["llama-3.1-405b"]["tp"] == 16 and by_model["llama-3.1-8b"]["tp"] == 1
    assert all(r["tokens_fused_full"] >= r["tokens_eager_full"] > 0 for r in payload["results"])
    assert (tmp_path / "kv.md").read_text().count("\n| ") == len(list_presets())
    assert plot.stat().st_size > 10_000


def test_transformers_up_to_5_20_keeps_an_untied_input_embedding_whole(llama8b, monkeypatch):
    """Measured on CPU under 5.17 and 5.20 (`tp_plan="auto"`, 2 ranks; 5.21 shards it): loaded by
    transformers' own tp_plan, an untied input embedding stays whole on every rank, so each rank holds
    (1 - 1/tp) V K more; a tied one is sharded with the head either way, tp = 1 shards nothing, and a
    serving engine's count (the default) is unchanged."""
    from swiglu_patch.memory import hf_releases

    llama1b = resolve_model("llama-3.2-1b").shape()  # tied
    monkeypatch.setattr(hf_releases, "installed_transformers", lambda: None)
    newest = {(s.name, tp): weight_bytes_per_gpu(s, "bf16", tp, hf_tp_plan=True) for s in (llama8b, llama1b)
              for tp in (1, 4)}
    monkeypatch.setattr(hf_releases, "installed_transformers", lambda: (5, 20))
    assert weight_bytes_per_gpu(llama8b, "bf16", 4, hf_tp_plan=True) == newest[llama8b.name, 4] + 128256 * 4096 * 3 / 4 * 2
    assert weight_bytes_per_gpu(llama8b, "bf16", 4) == newest[llama8b.name, 4]  # a serving engine shards it
    for key in ((llama8b.name, 1), (llama1b.name, 1), (llama1b.name, 4)):
        shape = llama8b if key[0] == llama8b.name else llama1b
        assert weight_bytes_per_gpu(shape, "bf16", key[1], hf_tp_plan=True) == newest[key]
