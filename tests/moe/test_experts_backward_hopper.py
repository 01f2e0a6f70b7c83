"""The experts backward's Hopper kernels on a Hopper GPU: the warp-specialized dH
(`experts_dh_ws.py`) and weight-gradient (`experts_wgrad_ws.py`) kernels in place of the
one-program-per-tile ones, and gpt-oss's experts on the Hopper rule, against float64 autograd of
`experts_reference` (`experts_grad_check.py`: fresh inputs, poisoned allocations, within twice
PyTorch's own error). Each case asserts which kernel ran. Their compilation for sm_90a is checked
without a GPU (`test_experts_dh_ws.py`, `test_experts_wgrad_ws.py`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe.experts_grad_check import (DEVICE, EPILOGUES, LAYOUTS, check_gradients, expert_weights, named_case,
                                    poisoned_allocations, recording, routing)
from swiglu_patch.kernels import dispatch
from swiglu_patch.kernels.rules import EXPERTS_BACKWARD_RULES

__all__ = ["poisoned_allocations"]  # the autouse fixture, imported to apply here

HOPPER_GPU = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
HOPPER_RULE = next(r.config for r in EXPERTS_BACKWARD_RULES if r.gpus)
WS_CONFIG = dataclasses.replace(HOPPER_RULE, dh_warp_specialized=True, wgrad_warp_specialized=False)
WGRAD_WS_CONFIG = dataclasses.replace(HOPPER_RULE, dh_warp_specialized=True, wgrad_warp_specialized=True)
# (tokens, experts, top-k, K, I, routing, dtype, store): tiles past one per program (the ring and the handoff
# wrap), K off the 128-wide tiles of the other kernels (a multiple of the 64-wide K step it takes) and I off its
# 128-column tile, one token, all first choices on one expert, an expert with none, sentinels, and
# inputs of scale 8 (bf16: fp16 autograd, the bound, overflows there)
WS_CASES = {
    "many_tiles": (1024, 8, 8, 1024, 640, "uniform", torch.bfloat16, True),
    "tails": (300, 6, 3, 192, 144, "uniform", torch.float16, False),
    "one_token": (1, 4, 2, 64, 32, "uniform", torch.bfloat16, True),
    "one_expert": (257, 4, 2, 128, 256, "one_expert", torch.bfloat16, True),
    "empty_expert": (257, 4, 2, 128, 176, "empty_expert", torch.float16, True),
    "sentinels": (130, 4, 2, 128, 64, "uniform", torch.bfloat16, False),
    "large": (200, 4, 2, 64, 48, "uniform", torch.bfloat16, True),
}


def _check_case(cases: dict, case: str, config) -> None:
    """`check_gradients` on one of `cases` (tokens, experts, top-k, K, I, routing, dtype, store; "large": inputs and
    weights of scale 8, "sentinels": every other token's second slot on an expert-parallel sentinel), SwiGLU
    experts in the [E, 2I, K] layout without biases, with `config`'s tiles."""
    *shape, dtype, store = cases[case]
    x, index, weights, w = named_case(case, *shape, dtype)
    check_gradients(x, index, weights, w, EPILOGUES["silu"], LAYOUTS[0], dtype, store,
                    kernel="experts_backward_grouped", config=config)


# the dH kernel's two MMA layouts and two handoffs: (tile along I, stages, (loader, epilogue) registers)
DH_TILES = {"128_s4": (128, 4, (96, 192)), "256_s3": (256, 3, (64, 96))}


@pytest.mark.skipif(not HOPPER_GPU, reason="the warp-specialized dH kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("tile", list(DH_TILES))
@pytest.mark.parametrize("case", list(WS_CASES))
def test_the_warp_specialized_dh_kernel(case, tile, monkeypatch):
    """`experts_dh_ws.py` in place of the one-program-per-tile dH kernel, against float64: it must be the
    kernel that ran (no fallback), and every gradient within twice torch's own error."""
    from swiglu_patch.kernels import experts_dh_ws

    ran = recording(monkeypatch, experts_dh_ws)
    width, stages, registers = DH_TILES[tile]
    _check_case(WS_CASES, case, dataclasses.replace(WS_CONFIG, dh_ws_block_n=width, dh_ws_stages=stages,
                                                     dh_ws_registers=registers))
    assert ran == [True]


@pytest.mark.skipif(not HOPPER_GPU, reason="the warp-specialized dH kernel runs on Hopper GPUs only")
def test_the_warp_specialized_dh_kernel_leaves_what_it_cannot_take_to_the_other(monkeypatch):
    """Biases, the transposed layout, K_out off a multiple of the 64-wide K step, and I off a multiple of 16 run
    the one-program-per-tile kernel."""
    from swiglu_patch.kernels import experts_dh_ws

    ran = recording(monkeypatch, experts_dh_ws)
    for layout, bias, k, i in ((LAYOUTS[0], True, 64, 32), (LAYOUTS[1], False, 64, 32), (LAYOUTS[0], False, 208, 32),
                               (LAYOUTS[0], False, 64, 120)):
        w = expert_weights(4, k, i, layout, bias, torch.bfloat16)
        x = torch.randn(40, k).to(DEVICE, torch.bfloat16)
        index, weights = routing(40, 4, 2)
        check_gradients(x, index, weights, w, EPILOGUES["silu"], layout, torch.bfloat16, kernel="experts_backward_grouped",
               config=WS_CONFIG)
    assert ran == [False] * 4


@pytest.mark.skipif(not HOPPER_GPU, reason="the Hopper rule's tiles run on Hopper GPUs")
@pytest.mark.parametrize("store", [True, False], ids=["store", "recompute"])
def test_gpt_oss_experts_on_the_hopper_rule(store):
    """gpt-oss's experts (transposed, interleaved, biased, its clamped SwiGLU) at T = 1024 in bf16, where the planner
    takes the Hopper rule: the case a bias sum inside the dH kernel's main loop got wrong, x's and gate_up's
    gradients 34-54% off float64 (docs/history.md, `experts_bias_dh`)."""
    layout = LAYOUTS[1]
    w = expert_weights(8, 256, 128, layout, True, torch.bfloat16)
    x = torch.randn(1024, 256).to(DEVICE, torch.bfloat16)
    index, weights = routing(1024, 8, 4)
    assert dispatch.choose(torch.cuda.get_device_name(), torch.bfloat16, 1024, 256, 128,
                           op="experts_backward")[1].gpus  # the Hopper rule
    check_gradients(x, index, weights, w, EPILOGUES["gpt_oss"], layout, torch.bfloat16, store)


@pytest.mark.skipif(not HOPPER_GPU, reason="the warp-specialized weight-gradient kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("block_a", [128, 256])
@pytest.mark.parametrize("case", list(WS_CASES))
def test_the_warp_specialized_weight_gradient_kernel(case, block_a, monkeypatch):
    """`experts_wgrad_ws.py` for both weight gradients, against float64, on the dH kernel's cases: tiles past one
    per program and 16 steps a tile (the ring and the handoff wrap), tails of every tile, one token, every first
    choice on one expert, an expert with no pairs (its gradient zeros), sentinels, scale-8 inputs. It must be the
    kernel that ran, for dW_down and for dW_gate_up; with 128x128 tiles (one MMA warpgroup, an fp32 handoff) and
    256x128 (two, a 16-bit handoff)."""
    from swiglu_patch.kernels import experts_wgrad_ws

    ran = recording(monkeypatch, experts_wgrad_ws)
    _check_case(WS_CASES, case, dataclasses.replace(WGRAD_WS_CONFIG, wgrad_ws_tile=(block_a, 128)))
    assert ran == [True, True]


@pytest.mark.skipif(not HOPPER_GPU, reason="the warp-specialized weight-gradient kernel runs on Hopper GPUs only")
def test_the_warp_specialized_weight_gradient_kernel_leaves_what_it_cannot_take_to_the_other(monkeypatch):
    """Biases and the transposed layout (out's B axis strided) run `_experts_wgrad_kernel` for both gradients; I off
    a multiple of 16 for dW_down (hw's columns), a strided x for dW_gate_up. Every gradient still checked."""
    from swiglu_patch.kernels import experts_wgrad_ws

    ran = recording(monkeypatch, experts_wgrad_ws)
    expected = []
    for layout, bias, i, strided_x, answers in ((LAYOUTS[0], True, 32, False, [False, False]),
                                                (LAYOUTS[1], False, 32, False, [False, False]),
                                                (LAYOUTS[0], False, 120, False, [False, True]),
                                                (LAYOUTS[0], False, 32, True, [True, False])):
        w = expert_weights(4, 64, i, layout, bias, torch.bfloat16)
        x = torch.randn(40, 128 if strided_x else 64).to(DEVICE, torch.bfloat16)
        x = x[:, ::2] if strided_x else x
        index, weights = routing(40, 4, 2)
        check_gradients(x, index, weights, w, EPILOGUES["silu"], layout, torch.bfloat16,
                        kernel="experts_backward_grouped", config=WGRAD_WS_CONFIG)
        expected += answers
    assert ran == expected


# WS_CASES with 2I a multiple of the 64-wide step over 2I that the dX kernel takes (K off its 128-column tile in
# "tails")
DX_CASES = dict(WS_CASES, tails=(300, 6, 3, 208, 160, "uniform", torch.float16, False),
                empty_expert=(257, 4, 2, 128, 96, "empty_expert", torch.float16, True),
                large=(200, 4, 2, 64, 32, "uniform", torch.bfloat16, True))
DX_WS_CONFIG = dataclasses.replace(WGRAD_WS_CONFIG, dx_warp_specialized=True)
# the (tile width, stages) of the kernel's two MMA layouts and two handoffs
DX_TILES = {"256_s3": (256, 3), "128_s4": (128, 4)}


@pytest.mark.skipif(not HOPPER_GPU, reason="the warp-specialized dX kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("tile", list(DX_TILES))
@pytest.mark.parametrize("case", list(DX_CASES))
def test_the_warp_specialized_dx_kernel(case, tile, monkeypatch):
    """`experts_dx_ws.py` in place of the one-program-per-tile dX kernel, against float64, on the dH kernel's cases:
    it must be the kernel that ran, and every gradient within twice torch's own error."""
    from swiglu_patch.kernels import experts_dx_ws

    ran = recording(monkeypatch, experts_dx_ws)
    width, stages = DX_TILES[tile]
    _check_case(DX_CASES, case, dataclasses.replace(DX_WS_CONFIG, dx_ws_block_n=width, dx_ws_stages=stages))
    assert ran == [True]


@pytest.mark.skipif(not HOPPER_GPU, reason="the warp-specialized dX kernel runs on Hopper GPUs only")
def test_the_warp_specialized_dx_kernel_leaves_what_it_cannot_take_to_the_other(monkeypatch):
    """The transposed layout (Wgu's K axis strided) and 2I off a multiple of the 64-wide step run `_experts_dx_kernel`;
    a bias does not stop it. Every gradient still checked."""
    from swiglu_patch.kernels import experts_dx_ws

    ran = recording(monkeypatch, experts_dx_ws)
    for layout, bias, i in ((LAYOUTS[1], False, 32), (LAYOUTS[0], False, 40), (LAYOUTS[0], True, 32)):
        w = expert_weights(4, 64, i, layout, bias, torch.bfloat16)
        x = torch.randn(40, 64).to(DEVICE, torch.bfloat16)
        index, weights = routing(40, 4, 2)
        check_gradients(x, index, weights, w, EPILOGUES["silu"], layout, torch.bfloat16,
                        kernel="experts_backward_grouped", config=DX_WS_CONFIG)
    assert ran == [False, False, True]
