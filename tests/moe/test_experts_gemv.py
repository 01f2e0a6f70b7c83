"""The experts GEMV path (`kernels/experts_gemv.py`): what `test_experts_kernels.py` checks of every
experts kernel, plus what is its own: slot counts that are not powers of 2, sizes off its tiles,
a strided output, any T when forced, a CUDA graph of a one-token call replayed on fresh inputs, and
the planner giving it calls of one token, and of two on experts of I <= 1024, only.

On CPU the kernels run in Triton's interpreter (fp32, fp16); on a GPU compiled, bf16 too. Each
check draws fresh inputs, poisons the output and compares with float64 (`experts_forward_check.check_forward`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import rel_err
from moe.experts_forward_check import (DEVICE, DTYPES, EPILOGUES, EPS, LAYOUTS, check_forward, expert_weights,
                                      routing)
from moe.experts_ws_compile import CUOBJDUMP
from swiglu_patch.kernels import dispatch, launcher
from swiglu_patch.kernels.experts import experts_forward
from swiglu_patch.kernels.experts_reference import experts_reference

H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 3, 6, 8])
def test_slot_counts_and_sizes_off_the_tiles(dtype, top_k):
    """TOP_K rounded up to a power of 2 inside the down kernel: the padding slots add nothing; K,
    I and K_out off every tile (I = 37: 2I = 74 columns; K = K_out = 50)."""
    e, k, i = top_k + 3, 50, 37
    for t in (1, 2, 3):
        w = expert_weights(e, k, i, LAYOUTS[0], True, dtype)
        x = torch.randn(t, k).to(DEVICE, dtype)
        index, weights = routing(t, e, top_k)
        check_forward(x, index, weights, w, EPILOGUES["silu"], LAYOUTS[0], "experts_gemv", dtype)


def test_strided_output_and_large_t_when_forced():
    """A strided out is written element by element; the forced kernel runs any T (its own rule stops at 2)."""
    dtype = torch.float32
    w = expert_weights(6, 32, 24, LAYOUTS[3], False, dtype)
    x = torch.randn(70, 32).to(DEVICE, dtype)
    index, weights = routing(70, 6, 4)
    out = torch.full((32, 70), float("nan"), dtype=dtype, device=DEVICE).t()  # column stride 70
    experts_forward(x, index, weights, *w[:2], EPILOGUES["gelu"], LAYOUTS[3], kernel="experts_gemv", out=out)
    grouped = experts_forward(x, index, weights, *w[:2], EPILOGUES["gelu"], LAYOUTS[3], kernel="experts_grouped")
    assert not out.isnan().any()
    torch.testing.assert_close(out, grouped, rtol=1e-5, atol=1e-5)
    check_forward(x, index, weights, w, EPILOGUES["gelu"], LAYOUTS[3], "experts_gemv", dtype)


def test_an_eager_decode_call_launches_two_kernels(monkeypatch):
    """What the path is for: one token, auto, two launches (the grouped path: routing, gated, down, combine)."""
    launched = []
    call = launcher.FastLaunch.__call__

    def counting(self, grid, device_index, *args):
        launched.append(self.kernel.__name__)
        return call(self, grid, device_index, *args)

    monkeypatch.setattr(launcher.FastLaunch, "__call__", counting)
    dtype = torch.float16
    w = expert_weights(8, 32, 16, LAYOUTS[0], False, dtype)
    x = torch.randn(1, 32).to(DEVICE, dtype)
    index, weights = routing(1, 8, 2)
    experts_forward(x, index, weights, *w[:2], EPILOGUES["silu"])
    assert launched == ["_experts_gated_gemv_kernel", "_experts_down_combine_kernel"]
    launched.clear()
    experts_forward(x.repeat(3, 1), index.repeat(3, 1), weights.repeat(3, 1), *w[:2], EPILOGUES["silu"])
    assert len(launched) == 4 and "_experts_gated_gemv_kernel" not in launched


def test_weights_strided_along_their_rows_go_to_the_transposed_gemv(monkeypatch):
    """A transposed layout (gpt-oss) reads K and I with a stride: an eager one-token auto call runs
    the transposed GEMV's three kernels (`experts_gemv_transposed.py`), two tokens the grouped
    path; naming the GEMV is an error that says what it needs and the fix, and naming the
    transposed GEMV on untransposed weights is one too."""
    launched = []
    call = launcher.FastLaunch.__call__
    monkeypatch.setattr(launcher.FastLaunch, "__call__",
                        lambda self, *a: (launched.append(self.kernel.__name__), call(self, *a))[1])
    dtype = torch.float32
    layout = LAYOUTS[1]
    w = expert_weights(4, 32, 16, layout, True, dtype)
    x = torch.randn(1, 32).to(DEVICE, dtype)
    index, weights = routing(1, 4, 2)
    check_forward(x, index, weights, w, EPILOGUES["gpt_oss"], layout, "auto", dtype)
    assert launched == ["_experts_gated_gemv_t_kernel", "_experts_down_t_partial_kernel",
                        "_experts_down_t_combine_kernel"]
    launched.clear()
    x2, (index2, weights2) = torch.randn(2, 32).to(DEVICE, dtype), routing(2, 4, 2)
    check_forward(x2, index2, weights2, w, EPILOGUES["gpt_oss"], layout, "auto", dtype)
    assert len(launched) == 4 and not any("gemv" in name for name in launched)
    with pytest.raises(ValueError, match="unit stride along their reduction axis.*kernel='auto'"):
        experts_forward(x, index, weights, *w[:2], EPILOGUES["gpt_oss"], layout, *w[2:], kernel="experts_gemv")
    chunked = expert_weights(4, 32, 16, LAYOUTS[0], False, dtype)
    with pytest.raises(ValueError, match="unit stride along their output axis.*kernel='auto'"):
        experts_forward(x, index, weights, *chunked[:2], EPILOGUES["silu"], LAYOUTS[0],
                        kernel="experts_gemv_transposed")


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_a_captured_one_token_call_replays_right_on_fresh_inputs(monkeypatch):
    """The planner gives captured one-token calls to the GEMV: a CUDA graph of an auto call, replayed
    after fresh x, routing and weights are copied into its inputs and its output is poisoned, gives
    the float64 reference's output of the new inputs (h lives in the graph's pool)."""
    launched = []
    call = launcher.FastLaunch.__call__
    monkeypatch.setattr(launcher.FastLaunch, "__call__",
                        lambda self, *a: (launched.append(self.kernel.__name__), call(self, *a))[1])
    dtype, layout, epilogue = torch.bfloat16, LAYOUTS[0], EPILOGUES["silu"]
    e, k, i, top_k = 16, 256, 96, 4
    w = expert_weights(e, k, i, layout, False, dtype)
    x = torch.randn(1, k).to(DEVICE, dtype)
    index, weights = routing(1, e, top_k)
    out = torch.empty(1, k, dtype=dtype, device=DEVICE)
    experts_forward(x, index, weights, *w[:2], epilogue, layout, out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    launched.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        experts_forward(x, index, weights, *w[:2], epilogue, layout, out=out)
    assert launched == ["_experts_gated_gemv_kernel", "_experts_down_combine_kernel"]
    for _ in range(3):
        fresh_w = expert_weights(e, k, i, layout, False, dtype)
        fresh_index, fresh_weights = routing(1, e, top_k)
        for static, fresh in ((x, torch.randn(1, k).to(DEVICE, dtype)), (index, fresh_index),
                              (weights, fresh_weights), (w[0], fresh_w[0]), (w[1], fresh_w[1])):
            static.copy_(fresh)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = experts_reference(x.double(), index, weights.double(), w[0].double(), w[1].double(), epilogue, layout)
        torch_err = rel_err(experts_reference(x, index, weights, *w[:2], epilogue, layout), ref)
        assert not out.isnan().any()
        assert rel_err(out, ref) <= 2 * torch_err + EPS[dtype]


@pytest.mark.parametrize("gpu", [H100, "NVIDIA A100-SXM4-80GB", "cpu"])
def test_the_planner_gives_it_one_token_calls_and_two_token_calls_of_small_experts(gpu):
    """Every one-token call, captured or not, at any I, and two-token calls on experts of I <= 1024
    (less GPU time than the grouped kernels as well as less host time; on larger experts the
    grouped kernels take less GPU time at two tokens); never more tokens, a call storing P or one
    with LoRA."""
    dtype = torch.float16
    for m, i, captured, op, kernel in ((1, 768, False, "experts", "experts_gemv"),
                                       (1, 768, True, "experts", "experts_gemv"),
                                       (1, 14336, True, "experts", "experts_gemv"),
                                       (2, 1024, False, "experts", "experts_gemv"),
                                       (2, 1024, True, "experts", "experts_gemv"),
                                       (2, 1408, False, "experts", "experts_grouped"),  # GPU-bound: larger experts
                                       (3, 768, False, "experts", "experts_grouped"),
                                       (1, 768, False, "experts_preact", "experts_grouped"),
                                       (1, 768, False, "experts_low_rank", "experts_grouped"),
                                       (1, 768, False, "experts_low_rank_preact", "experts_grouped")):
        _, rule, _ = dispatch.choose(gpu, dtype, m, 2048, i, captured, op=op)
        assert rule.kernel == kernel, (m, i, captured, op)
    text = dispatch.explain(gpu, dtype, 2, 2048, 1408, captured=True, op="experts")
    assert "M = 2 is outside ..1" in text and "I = 1408" in text
    assert "experts_grouped" in text.split("CHOSEN")[0].splitlines()[-1]


COMPILED = [(layout, bias, config) for config in ("EXPERTS_GEMV_CONFIG", "EXPERTS_GEMV_T2_CONFIG")
            for layout, bias in (("chunked", "0"), ("interleaved", "1"))]
COMPILED += [("transposed", bias, "EXPERTS_GEMV_TRANSPOSED_CONFIG") for bias in ("0", "1")]


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton install has no NVIDIA backend")
@pytest.mark.parametrize("layout, has_bias, config", COMPILED)
def test_the_kernels_compile_for_hopper_as_a_launch_specializes_them(layout, has_bias, config, tmp_path):
    """The interpreter specializes no argument; the GPU turns ints equal to 1 (the interleaved layout's
    UP_SHIFT, unit strides, a single split of I) into constants, so only a compile shows the kernels
    take them. No spills, at each rule's tiles; the transposed GEMV's three kernels too."""
    script = Path(__file__).with_name("experts_gemv_compile.py")
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, str(script), "bfloat16", layout, has_bias, config, str(tmp_path)],
                         env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    names = ("gated", "down", "combine") if layout == "transposed" else ("gated", "down")
    assert sorted(p.stem for p in tmp_path.glob("*.cubin")) == sorted(names)
    for name in names:
        usage = subprocess.run([CUOBJDUMP, "-res-usage", str(tmp_path / f"{name}.cubin")], capture_output=True,
                               text=True, check=True).stdout
        assert " STACK:0 " in usage and " LOCAL:0 " in usage, (name, usage)
