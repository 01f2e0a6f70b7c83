"""The experts GEMV path (`kernels/experts_gemv.py`): what `test_experts_kernels.py` checks of every
experts kernel, plus what is its own: slot counts that are not powers of 2, sizes off its tiles,
a strided output, any T when forced, and the planner giving it eager decode calls only.

On CPU the kernels run in Triton's interpreter (fp32, fp16); on a GPU compiled, bf16 too. Each
check draws fresh inputs, poisons the output and compares with float64 (`experts_forward_check.check_forward`).
"""

from __future__ import annotations

import pytest
import torch

from swiglu_patch.kernels import dispatch, launcher
from swiglu_patch.kernels.experts import experts_forward
from moe.experts_forward_check import DEVICE, DTYPES, EPILOGUES, LAYOUTS, check_forward, expert_weights, routing

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


@pytest.mark.parametrize("gpu", [H100, "NVIDIA A100-SXM4-80GB", "cpu"])
def test_the_planner_gives_it_eager_decode_calls_only(gpu):
    """Eager calls of 1-2 tokens; never a captured call (a CUDA graph pays no host time, and the
    grouped kernels are the ones timed there), more tokens, a call storing P or one with LoRA."""
    dtype = torch.float16
    for m, captured, op, kernel in ((1, False, "experts", "experts_gemv"), (2, False, "experts", "experts_gemv"),
                                    (3, False, "experts", "experts_grouped"),
                                    (1, True, "experts", "experts_grouped"),
                                    (1, False, "experts_preact", "experts_grouped"),
                                    (1, False, "experts_low_rank", "experts_grouped"),
                                    (1, False, "experts_low_rank_preact", "experts_grouped")):
        _, rule, _ = dispatch.choose(gpu, dtype, m, 2048, 768, captured, op=op)
        assert rule.kernel == kernel, (m, captured, op)
    text = dispatch.explain(gpu, dtype, 1, 2048, 768, captured=True, op="experts")
    assert "experts_gemv" in text and "only for" not in text.split("CHOSEN")[1]
