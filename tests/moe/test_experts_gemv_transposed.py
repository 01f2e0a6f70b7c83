"""The transposed experts GEMV (`kernels/experts_gemv_transposed.py`, gpt-oss's layout): what
`test_experts_kernels.py` checks of every experts kernel, plus what is its own: the down GEMV's
splits of I (one, several, more than a combine load takes, a last one short), slot counts that
are not powers of 2, sizes off its tiles, and the planner giving it eager one-token calls only.

On CPU the kernels run in Triton's interpreter (fp32, fp16); on a GPU compiled, bf16 too. Each
check draws fresh inputs, poisons the output and compares with float64 (`experts_forward_check.check_forward`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe.experts_forward_check import DEVICE, DTYPES, EPILOGUES, LAYOUTS, check_forward, expert_weights, routing
from swiglu_patch.kernels import dispatch
from swiglu_patch.kernels.experts_gemv_transposed import COMBINE_SPLITS
from swiglu_patch.kernels.rules import EXPERTS_GEMV_TRANSPOSED_CONFIG

TRANSPOSED = [layout for layout in LAYOUTS if layout.transposed]
SMALL = dataclasses.replace(EXPERTS_GEMV_TRANSPOSED_CONFIG, block_n=16, block_k=16, down_block_n=32, down_block_k=8)


@pytest.mark.parametrize("layout", TRANSPOSED, ids=lambda layout: layout.describe())
@pytest.mark.parametrize("split_i", [None, 24, 8])
def test_splits_of_i_against_float64(layout, split_i):
    """I = 200 in rows of 24 (9 splits, the last of 8 rows: past one combine load of COMBINE_SPLITS)
    or 8 (25 splits), or all of I in one program; K = K_out = 50 off every tile; gpt-oss's epilogue
    and biases."""
    assert 200 // 8 > COMBINE_SPLITS and 200 % 24
    config = dataclasses.replace(SMALL, down_split_i=split_i)
    for dtype in DTYPES:
        w = expert_weights(6, 50, 200, layout, True, dtype)
        for t in (1, 3):
            x = torch.randn(t, 50).to(DEVICE, dtype)
            index, weights = routing(t, 6, 3)
            check_forward(x, index, weights, w, EPILOGUES["gpt_oss"], layout, "experts_gemv_transposed", dtype,
                          config)


@pytest.mark.parametrize("top_k", [1, 3, 6, 8])
def test_slot_counts_and_sizes_off_the_tiles(top_k):
    """TOP_K rounded up to a power of 2 inside the down kernels: the padding slots add nothing; I = 37
    (2I = 74 columns), K = K_out = 50, at the rule's tiles and at small ones."""
    e, dtype = top_k + 3, DTYPES[-1]
    for config in (None, SMALL):
        w = expert_weights(e, 50, 37, TRANSPOSED[0], True, dtype)
        x = torch.randn(2, 50).to(DEVICE, dtype)
        index, weights = routing(2, e, top_k)
        check_forward(x, index, weights, w, EPILOGUES["silu"], TRANSPOSED[0], "experts_gemv_transposed", dtype,
                      config)


@pytest.mark.parametrize("gpu", ["NVIDIA H100 80GB HBM3", "cpu"])
def test_the_planner_gives_it_eager_one_token_calls_on_transposed_weights_only(gpu):
    """Its rule matches one token, eager, transposed weights; a captured call (the grouped kernels
    take less GPU time), two tokens or untransposed weights go elsewhere. `choose` decides without
    tensors what the kernels' `can_run` decides on them, and `explain` says why."""
    dtype = torch.float16
    for m, captured, transposed, kernel in ((1, False, True, "experts_gemv_transposed"),
                                            (1, True, True, "experts_grouped"),
                                            (2, False, True, "experts_grouped"),
                                            (1, False, False, "experts_gemv")):
        _, rule, _ = dispatch.choose(gpu, dtype, m, 2880, 2880, captured, op="experts", transposed=transposed)
        assert rule.kernel == kernel, (m, captured, transposed)
    text = dispatch.explain(gpu, dtype, 1, 2880, 2880, op="experts", transposed=True)
    assert "transposed weights" in text.splitlines()[0]
    assert "experts_gemv kernel cannot run these tensors (needs weights with unit stride along their reduction" in text
    assert "experts_gemv_transposed" in text.split("CHOSEN")[0].splitlines()[-1]


def test_capability_records_agree_with_can_run_on_each_layout():
    """The GEMVs' tensor-free `runs(..., transposed=)` says what their files' `can_run` says on the
    weights of every layout."""
    for layout in LAYOUTS:
        gate_up, down, _, _ = expert_weights(4, 32, 16, layout, False, torch.float32)
        x = torch.randn(1, 32, device=DEVICE)
        for name in ("experts_gemv", "experts_gemv_transposed"):
            module = dispatch.MODULES[name]
            runs = module.CAPABILITY.runs(torch.float32, 1, 16, on_gpu=False, transposed=layout.transposed)
            assert module.can_run(x, gate_up, down, layout) == runs, (name, layout)
