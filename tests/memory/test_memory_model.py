"""The activation-memory model against hand-worked numbers and against tensors actually allocated.

On CPU there is no allocator peak to read, so `LiveTensors` (live_tensors.py) counts what the CUDA caching
allocator would: every storage an aten op creates, until it dies (TorchDispatchMode plus a weakref
finalizer per storage). Running real HF models (tiny configs, every family) under it and comparing
with `predict_prefill_peak` checks the model's walk of HF's code tensor by tensor; what it cannot
see are allocations inside one op (SDPA's log-sum-exp and mask conversion, cuBLAS workspaces),
which the GPU run of `swiglu-patch memory` checks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import tiny_model
from memory.live_tensors import cpu_measure

from swiglu_patch.memory.activation_model import predict_mlp_peak, predict_prefill_peak
from swiglu_patch.memory.configs import resolve_model
from swiglu_patch.memory.live_set import LiveSet
from swiglu_patch.memory.shape import DECODER_LAYOUTS, ModelShape

transformers = pytest.importorskip("transformers")


# -- hand-worked numbers ------------------------------------------------------------------------

def test_mlp_peak_llama_8b_hand_worked():
    shape = resolve_model("llama-3.1-8b").shape()
    m, k, i = 8192, 4096, 14336
    # eager: act(gate), up and their product live together: 3 x M x I bf16 (672 MiB)
    assert predict_mlp_peak(shape, m, fused=False).bytes == 3 * m * i * 2 == 704_643_072
    # fused: the [M, I] kernel output and the [M, K] down_proj output (288 MiB)
    assert predict_mlp_peak(shape, m, fused=True).bytes == (m * i + m * k) * 2 == 301_989_888


def test_mlp_peak_phi3_keeps_packed_gate_up_alive():
    shape = resolve_model("phi-3-mini").shape()
    m, k, i = 1000, 3072, 8192
    # gate_up [M, 2I] stays referenced by `gate` while act(gate) and the product exist: 4 x M x I
    assert predict_mlp_peak(shape, m, fused=False).bytes == 4 * m * i * 2
    assert predict_mlp_peak(shape, m, fused=True).bytes == (m * i + m * k) * 2


def test_prefill_peak_llama_8b_two_layers_hand_worked():
    shape = resolve_model("llama-3.1-8b").shape().truncated(2)
    M, K, I, KVD, D, e = 8192, 4096, 14336, 1024, 128, 2
    common = (
        2 * 2 * M * KVD * e  # DynamicCache: K and V of both layers
        + 8 * M  # position_ids, int64 [1, T]
        + 2 * M * D * e  # rotary cos and sin [1, T, D]
    )
    # eager peak in the last layer's MLP: embeddings, layer input, residual, normed input + 3 x M x I
    eager = 4 * M * K * e + 3 * M * I * e + common
    # fused: the same four [M, K] plus the kernel's [M, I] output and down_proj's [M, K] output
    fused = 5 * M * K * e + M * I * e + common
    assert eager == 1_044_447_232 and fused == 641_794_048
    assert predict_prefill_peak(shape, 1, M, fused=False).bytes == eager
    assert predict_prefill_peak(shape, 1, M, fused=True).bytes == fused
    assert predict_prefill_peak(shape, 2, M // 2, fused=False).bytes == eager - M // 2 * (8 + 2 * D * e)


def test_prefill_peak_moves_out_of_the_mlp_when_fused_makes_it_small():
    # Gemma 3 12B: q has 16 x 256 = 4096 > K = 3840 columns, normed in fp32: once the MLP is fused,
    # the q-norm of attention is the larger peak, so the saving is less than 2 x M x I.
    shape = resolve_model("gemma-3-12b").shape()
    eager = predict_prefill_peak(shape, 1, 512, fused=False, use_cache=False, attention="flash")
    fused = predict_prefill_peak(shape, 1, 512, fused=True, use_cache=False, attention="flash")
    assert "mlp" in eager.where and "mlp" not in fused.where
    assert 0 < eager.bytes - fused.bytes < 2 * 512 * 15360 * 2


def test_live_set_bookkeeping():
    ls = LiveSet()
    ls.alloc("a", 10, "x")
    ls.alloc("b", 5, "y")
    ls.free("a")
    ls.alloc("c", 7, "x")
    assert (ls.total, ls.peak.bytes, ls.peak.where, ls.peak.breakdown) == (12, 15, "b", {"x": 10, "y": 5})
    with pytest.raises(ValueError, match="live already"):
        ls.alloc("b", 1, "y")
    with pytest.raises(ValueError, match="negative"):
        ls.alloc("d", -1, "y")


def test_bad_sizes_are_refused():
    shape = resolve_model("llama-3.2-1b").shape()
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        predict_prefill_peak(shape, 1, 0, fused=False)
    with pytest.raises(ValueError, match="attention must be one of"):
        predict_prefill_peak(shape, 1, 8, fused=False, attention="paged")


# -- the walk against real HF forwards on CPU --------------------------------------------------

# tests/helpers.py's tiny models, widened: a larger I and V so the MLP and the logits are
# distinct phases of the walk; 3 layers so a model mixes sliding and full attention.
_TINY = dict(intermediate_size=224, num_hidden_layers=3, head_dim=32, vocab_size=500, max_position_embeddings=2048)

# model_type -> (config overrides, the attention implementation HF runs by default for it)
_LAYOUTS = {
    "llama": ({}, "sdpa"),
    "mistral": ({"sliding_window": None}, "sdpa"),
    "qwen2": ({}, "sdpa"),
    "qwen3": ({}, "sdpa"),
    "phi3": ({"num_key_value_heads": 4, "head_dim": None, "sliding_window": None}, "sdpa"),
    "gemma3_text": ({"sliding_window": 512, "layer_types": ["sliding_attention", "sliding_attention",
                                                            "full_attention"]}, "sdpa"),
    "gemma": ({}, "sdpa"),
    "gemma2": ({"sliding_window": 64}, "eager"),
}


def _tiny_model(model_type: str, dtype=torch.bfloat16, **overrides):
    extra, attn = _LAYOUTS[model_type]
    fields = {**_TINY, **extra, **overrides}
    fields = {k: v for k, v in fields.items() if v is not None or k == "sliding_window"}  # None: the config's default
    model = tiny_model(model_type, dtype=dtype, attn_implementation=attn, **fields)
    assert model.config._attn_implementation == attn
    return model.requires_grad_(False)


def test_every_decoder_layout_is_checked_against_live_tensors():
    from swiglu_patch.memory.moe_shape import MOE_LAYOUTS

    # mixture-of-experts families: test_moe_memory.py (TINY_MOE covers every key of MOE_LAYOUTS)
    assert set(_LAYOUTS) == set(DECODER_LAYOUTS) - set(MOE_LAYOUTS)


@pytest.mark.parametrize("model_type", sorted(_LAYOUTS))
@pytest.mark.parametrize("batch,seq_len", [(1, 192), (3, 64)])
def test_prefill_walk_matches_live_tensors(model_type, batch, seq_len):
    model = _tiny_model(model_type)
    ids = torch.randint(0, 500, (batch, seq_len))
    with torch.inference_mode():
        measured = cpu_measure(lambda: model(input_ids=ids, logits_to_keep=1, use_cache=True))
    shape = ModelShape.from_config(model.config)
    predicted = predict_prefill_peak(shape, batch, seq_len, fused=False, logits_to_keep=1)
    # What the CPU count misses is SDPA's fp32 log-sum-exp [B, H, T] (modelled for CUDA's flash kernel)
    lse = batch * shape.num_heads * seq_len * 4 if predicted.where.endswith("logsumexp") else 0
    assert predicted.bytes - lse == pytest.approx(measured, rel=0.002), predicted.where


@pytest.mark.parametrize("model_type", ["llama", "phi3", "gemma3_text"])
def test_mlp_walk_matches_live_tensors(model_type):
    model = _tiny_model(model_type)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 100, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        measured = cpu_measure(lambda: mlp(x))
    predicted = predict_mlp_peak(ModelShape.from_config(model.config), 200, fused=False)
    assert predicted.bytes == measured


def test_fp32_model_norms_without_upcast_copies():
    model = _tiny_model("llama", dtype=torch.float32)
    ids = torch.randint(0, 500, (1, 128))
    with torch.inference_mode():
        measured = cpu_measure(lambda: model(input_ids=ids, logits_to_keep=1))
    predicted = predict_prefill_peak(ModelShape.from_config(model.config), 1, 128, fused=False, dtype_bytes=4)
    assert predicted.bytes == pytest.approx(measured, rel=0.002)


def test_sliding_window_mask_is_counted():
    # T >= window: HF materializes a bool [T, T] mask and SDPA (on CUDA) an additive [B, 1, T, T] copy;
    # the CPU count sees the first, not the second (made inside the SDPA op).
    model = _tiny_model("mistral", sliding_window=64)
    ids = torch.randint(0, 500, (1, 256))
    with torch.inference_mode():
        measured = cpu_measure(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1))
    shape = ModelShape.from_config(model.config)
    assert shape.sliding_window == 64
    without_mask = predict_prefill_peak(dataclasses.replace(shape, sliding_window=None), 1, 256,
                                        fused=False)
    with_mask = predict_prefill_peak(shape, 1, 256, fused=False)
    assert with_mask.bytes > without_mask.bytes
    assert measured > without_mask.bytes - 1 * 4 * 256 * 4  # the mask is really there
    assert with_mask.bytes == pytest.approx(measured, rel=0.05)


# -- the profiler's pipeline --------------------------------------------------------------------

def _tiny_resolved():
    from swiglu_patch.memory.configs import ResolvedModel, config_from_dict

    fields = dict(model_type="llama", hidden_size=64, intermediate_size=224, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=500)
    return ResolvedModel("tiny-llama", "tiny llama", "test", config_from_dict(fields))


def test_profile_pipeline_on_cpu_measures_eager_as_predicted(capsys):
    pytest.importorskip("swiglu_patch.patch")
    from swiglu_patch.memory.profiler import profile_model

    rows, info = profile_model(_tiny_resolved(), layers=2, whats=["mlp", "prefill"], batches=[1, 2],
                               seq_lens=[64, 160], dtype="bf16", backend="torch", device="cpu", measure=cpu_measure)
    err = capsys.readouterr().err  # a progress bar per path over its 8 points
    assert "tiny-llama eager" in err and "tiny-llama fused" in err and "8/8" in err
    assert info["layers"] == 2 and "patched 2" in info["patch_report"]
    assert len(rows) == 2 * 2 * 2 * 2 and all(r.measured_bytes for r in rows)
    for r in rows:
        if r.path == "eager":  # the fused rows run the chunked CPU reference, not the kernel: no claim
            lse = r.batch * 4 * r.seq_len * 4 if r.predicted_where.endswith("logsumexp") else 0
            assert r.predicted_bytes - lse == pytest.approx(r.measured_bytes, rel=0.002), (r.what, r.tokens)


def test_memory_cli_without_cuda_shows_prediction_only(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the command measures instead")
    import argparse

    from swiglu_patch.memory import profile_cli

    parser = argparse.ArgumentParser()
    profile_cli.add_arguments(parser)
    args = parser.parse_args(["--model", "llama-3.1-8b", "qwen3-8b", "--tokens", "512,8192", "--batch-sizes", "1",
                              "--out-dir", str(tmp_path)])
    assert profile_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "CUDA is not available" in out and "PREDICTION ONLY" in out
    assert "672.0 MiB" in out  # llama-3.1-8b one MLP at 8192 tokens: 3 x 8192 x 14336 x 2 bytes
    import json

    payload = json.loads((tmp_path / "memory_profile.json").read_text())
    assert payload["measured"] is False and len(payload["rows"]) == 2 * 2 * 2 * 2
    assert all(r["measured_bytes"] is None for r in payload["rows"])
    assert (tmp_path / "memory_profile.png").stat().st_size > 10_000


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (measures with the caching allocator)")
def test_profile_on_cuda_within_ten_percent():
    from swiglu_patch.memory.profiler import profile_model

    rows, _ = profile_model(resolve_model("llama-3.2-1b"), layers=2, whats=["mlp", "prefill"], batches=[1],
                            seq_lens=[512, 4096], dtype="bf16")
    for r in rows:
        assert abs(r.ratio - 1) <= 0.10, (r.what, r.path, r.tokens, r.measured_bytes, r.predicted_bytes)


def test_server_kernels_drop_norm_and_rope_temporaries_only():
    shape = resolve_model("llama-3.1-70b").shape().sharded(4)  # I/4 = 7168 < K = 8192: norms matter
    kw = dict(use_cache=False, attention="flash")
    M, K, I = 512, 8192, 7168
    small = 8 * M + 2 * M * 128 * 2
    hf = {f: predict_prefill_peak(shape, 1, M, fused=f, **kw) for f in (False, True)}
    server = {f: predict_prefill_peak(shape, 1, M, fused=f, server_kernels=True, **kw) for f in (False, True)}
    # HF: the pre-MLP RMSNorm (embeddings, layer input, residual + two fp32 [M, K]) beats both MLPs
    assert hf[False].bytes == hf[True].bytes == 3 * M * K * 2 + 2 * M * K * 4 + small
    # server kernels: the MLP phases set the peak, and fusing saves 2 x M x I - M x K
    assert server[False].bytes == 4 * M * K * 2 + 3 * M * I * 2 + small
    assert server[True].bytes == 5 * M * K * 2 + M * I * 2 + small


def test_memory_cli_rerenders_a_gpu_run_and_flags_misses(tmp_path, capsys):
    import argparse
    import json

    from swiglu_patch.memory import profile_cli
    from swiglu_patch.memory.profiler import predict_rows

    shape = resolve_model("llama-3.2-1b").shape().truncated(2)
    rows = [r.to_dict() for r in predict_rows(shape, ["mlp"], [1], [512, 4096], 2, 16384)]
    for r, factor in zip(rows, (1.05, 0.80, 1.0, 1.0)):  # eager 512: predicted 5% high; eager 4096: 20% low
        r["measured_bytes"] = int(r["predicted_bytes"] / factor)
    src = tmp_path / "run.json"
    src.write_text(json.dumps({"environment": {"gpu": "NVIDIA H100 80GB HBM3"}, "rows": rows}))
    parser = argparse.ArgumentParser()
    profile_cli.add_arguments(parser)
    args = parser.parse_args(["--from-json", str(src), "--out-dir", str(tmp_path)])
    assert profile_cli.main(args) == 0
    out = capsys.readouterr().out
    lines = {int(line.split("|")[4]): line for line in out.splitlines() if line.startswith("| llama-3.2-1b")}
    assert "+5.0%" in lines[512] and lines[512].rstrip(" |").endswith("ok")
    assert "-20.0%" in lines[4096] and lines[4096].rstrip(" |").endswith("MISS")
    assert "3/4 measured points within 10%" in out
    assert (tmp_path / "memory_profile.md").exists() and (tmp_path / "memory_profile.png").exists()


# -- the plot -----------------------------------------------------------------------------------

LONG_TITLE = ("Peak memory above weights on NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, transformers 5.17.0, "
              "commit 93f9813); HF eager vs swiglu-patch fused; prefill with logits_to_keep=1 and use_cache=True")


@pytest.mark.parametrize("models", [["llama-3.2-1b"], ["llama-3.2-1b", "qwen3-8b", "gemma-3-4b"]])
def test_profile_plot_tells_batches_apart_and_fits_its_title(models):
    pytest.importorskip("matplotlib")
    from swiglu_patch.memory.plotting import profile_figure
    from swiglu_patch.memory.profiler import predict_rows

    rows = []
    for name in models:
        shape = resolve_model(name).shape().truncated(2)
        rows += [r.to_dict() for r in predict_rows(shape, ["mlp", "prefill"], [1, 2], [512, 2048], 2, 16384)]
    for r in rows:
        r["measured_bytes"] = r["predicted_bytes"]
    fig = profile_figure(rows, title=LONG_TITLE)
    try:
        fig.canvas.draw()
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert {"eager B=1", "eager B=2", "fused B=1", "fused B=2"} <= set(labels)
        # every (path, batch) series has its own colour and marker, in every panel
        for ax in fig.axes:
            measured = [line for line in ax.get_lines() if line.get_linestyle() == "None"]
            assert len(measured) == 4 and len({(line.get_color(), line.get_marker()) for line in measured}) == 4
        box = fig.bbox
        for artist in (fig._suptitle, fig.legends[0]):  # inside the figure: nothing clipped
            ext = artist.get_window_extent()
            assert box.x0 <= ext.x0 and ext.x1 <= box.x1 and box.y0 <= ext.y0 and ext.y1 <= box.y1, (artist, ext, box)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
