"""The experts forward's warp-specialized gated kernel (`experts_gated_ws.py`) on a Hopper GPU, in place of
the one-program-per-tile one: the block's output, and in store mode the pre-activation P it saves for
the backward, against float64 (fresh inputs, outputs and allocations poisoned, within twice PyTorch's
own error in the dtype). Each case asserts which kernel ran. Its compilation for sm_90a is checked
without a GPU (`test_experts_gated_ws.py`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import rel_err
from moe.experts_grad_check import (DEVICE, EPILOGUES, LAYOUTS, expert_weights, named_case, poisoned_allocations,
                                    recording, routing)
from swiglu_patch.kernels import experts_gated_ws
from swiglu_patch.kernels.experts import experts_forward
from swiglu_patch.kernels.experts_backward import experts_forward_with_preact
from swiglu_patch.kernels.experts_reference import experts_reference
from swiglu_patch.kernels.rules import EXPERTS_RULES

__all__ = ["poisoned_allocations"]  # the autouse fixture, imported to apply here

HOPPER_GPU = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
HOPPER_RULE = next(r.config for r in EXPERTS_RULES if r.gpus and r.config.warp_specialized)
WS_RULE = dataclasses.replace(HOPPER_RULE, warp_specialized_preact=True)  # store mode's calls too
EPS = {torch.float16: 1e-3, torch.bfloat16: 5e-3}
# (tokens, experts, top-k, K, I, routing, dtype): tiles past one per program (the ring and the handoff wrap),
# I off the 128-column tile (a last tile's boxes reach past the expert's gate and up rows), one token, all
# first choices on one expert, an expert with none, sentinels, inputs of scale 8
CASES = {
    "many_tiles": (2048, 8, 8, 1024, 640, "uniform", torch.bfloat16),
    "tails": (300, 6, 3, 192, 144, "uniform", torch.float16),
    "one_token": (1, 4, 2, 64, 32, "uniform", torch.bfloat16),
    "one_expert": (257, 4, 2, 128, 256, "one_expert", torch.bfloat16),
    "empty_expert": (257, 4, 2, 128, 176, "empty_expert", torch.float16),
    "sentinels": (130, 4, 2, 128, 64, "uniform", torch.bfloat16),
    "large": (200, 4, 2, 64, 48, "uniform", torch.bfloat16),
}
pytestmark = pytest.mark.skipif(not HOPPER_GPU, reason="needs a Hopper GPU (wgmma)")


def _case(case: str, cases: dict = CASES):
    *shape, dtype = cases[case]
    return (*named_case(case, *shape, dtype), dtype)


def _reference(x, index, weights, w, epilogue):
    """(float64 output, PyTorch's own error in x's dtype against it)."""
    ref = experts_reference(x.double(), index, weights.double(), w[0].double(), w[1].double(), epilogue, LAYOUTS[0])
    return ref, rel_err(experts_reference(x, index, weights, w[0], w[1], epilogue, LAYOUTS[0]), ref)


@pytest.mark.parametrize("case, epilogue", [(c, "silu") for c in CASES] + [
    (c, e) for c in ("tails", "large") for e in ("gelu_tanh", "scaled", "clamp_gate", "clamp_activation")])
def test_the_forward_against_float64(case, epilogue, monkeypatch):
    x, index, weights, w, dtype = _case(case)
    ref, torch_err = _reference(x, index, weights, w, EPILOGUES[epilogue])
    ran = recording(monkeypatch, experts_gated_ws)
    out = torch.full_like(ref, float("nan"), dtype=dtype)
    experts_forward(x, index, weights, w[0], w[1], EPILOGUES[epilogue], kernel="experts_grouped", config=WS_RULE,
                    out=out)
    assert ran == [True], ran
    assert not out.isnan().any(), "an output element was not written"
    assert rel_err(out, ref) <= 2 * torch_err + EPS[dtype], (rel_err(out, ref), torch_err)


@pytest.mark.parametrize("case", list(CASES))
def test_store_mode_saves_the_pre_activation(case, monkeypatch):
    """P [S, 2I] in the model's column order (gate then up), each pair's row: x[t] @ W[e]^T rounded once."""
    x, index, weights, w, dtype = _case(case)
    ref, torch_err = _reference(x, index, weights, w, EPILOGUES["silu"])
    ran = recording(monkeypatch, experts_gated_ws)
    out, preact = experts_forward_with_preact(x, index, weights, w[0], w[1], EPILOGUES["silu"],
                                              kernel="experts_grouped", config=WS_RULE)
    assert ran == [True], ran
    assert rel_err(out, ref) <= 2 * torch_err + EPS[dtype]
    for e in range(w[0].shape[0]):  # sentinels' rows are not written
        pairs = (index.flatten() == e).nonzero().squeeze(1)
        if pairs.numel():
            tokens = pairs // index.shape[1]
            p64 = x.double()[tokens] @ w[0][e].double().t()
            p_torch = (x[tokens].float() @ w[0][e].float().t()).to(dtype)  # fp32 sums, one rounding
            assert rel_err(preact[pairs], p64) <= 2 * rel_err(p_torch, p64) + EPS[dtype], e


def test_what_it_cannot_take_runs_the_other_kernel(monkeypatch):
    """x with a column stride (cp.async copies 16-byte rows) and a K off the 64-wide step: the one-program-per-tile
    kernel, as right."""
    ran = recording(monkeypatch, experts_gated_ws)
    for t, k, strided in ((600, 128, True), (600, 96, False)):
        w = expert_weights(4, k, 64, LAYOUTS[0], False, torch.bfloat16)
        x = torch.randn(t, 2 * k if strided else k).to(DEVICE, torch.bfloat16)
        x = x[:, ::2] if strided else x
        index, weights = routing(t, 4, 2)
        ref, torch_err = _reference(x, index, weights, w, EPILOGUES["silu"])
        out = experts_forward(x, index, weights, w[0], w[1], EPILOGUES["silu"], kernel="experts_grouped",
                              config=WS_RULE)
        assert rel_err(out, ref) <= 2 * torch_err + EPS[torch.bfloat16]
    assert ran == [False, False], ran


def test_the_planner_runs_it_for_prefill_with_rows_of_any_stride(monkeypatch):
    """T >= 4096 on Hopper takes the warp-specialized rule, in both modes' forward; x a slice of wider rows (a
    16-multiple stride) runs it."""
    ran = recording(monkeypatch, experts_gated_ws)
    w = expert_weights(8, 256, 128, LAYOUTS[0], False, torch.bfloat16)
    x = torch.randn(4096, 256 + 64).to(DEVICE, torch.bfloat16)[:, 64:]
    index, weights = routing(4096, 8, 4)
    ref, torch_err = _reference(x, index, weights, w, EPILOGUES["silu"])
    out = experts_forward(x, index, weights, w[0], w[1], EPILOGUES["silu"])
    assert ran == [True], ran
    assert rel_err(out, ref) <= 2 * torch_err + EPS[torch.bfloat16]
    out, _ = experts_forward_with_preact(x, index, weights, w[0], w[1], EPILOGUES["silu"])
    assert ran == [True, True], ran  # store mode's forward too (the rule's warp_specialized_preact)
    assert rel_err(out, ref) <= 2 * torch_err + EPS[torch.bfloat16]


def test_a_ring_wider_than_the_rule(monkeypatch):
    """4 stages of 64-wide steps (the most that fits beside h's handoff), and 5 of 32 with P stored."""
    ran = recording(monkeypatch, experts_gated_ws)
    x, index, weights, w, dtype = _case("many_tiles")
    ref, torch_err = _reference(x, index, weights, w, EPILOGUES["silu"])
    config = dataclasses.replace(WS_RULE, ws_stages=4, ws_preact_block_k=32, ws_preact_stages=5)
    out = experts_forward(x, index, weights, w[0], w[1], EPILOGUES["silu"], kernel="experts_grouped", config=config)
    out_p, _ = experts_forward_with_preact(x, index, weights, w[0], w[1], EPILOGUES["silu"], kernel="experts_grouped",
                                           config=config)
    assert ran == [True, True], ran
    assert max(rel_err(out, ref), rel_err(out_p, ref)) <= 2 * torch_err + EPS[dtype]


# the down kernel's cases: I a multiple of its 64-wide step, K_out (= K here) off its 256- and 128-column tiles
DOWN_CASES = dict(CASES, tails=(300, 6, 3, 192, 128, "uniform", torch.float16),
                  one_token=(1, 4, 2, 64, 64, "uniform", torch.bfloat16),
                  empty_expert=(257, 4, 2, 128, 192, "empty_expert", torch.float16),
                  large=(200, 4, 2, 80, 64, "uniform", torch.bfloat16))
# (tile along K_out, stages): the two MMA layouts and the two handoffs
DOWN_TILES = {"256_s3": (256, 3), "128_s4": (128, 4)}


@pytest.mark.parametrize("tile", list(DOWN_TILES))
@pytest.mark.parametrize("case", list(DOWN_CASES))
def test_the_down_kernel_against_float64(case, tile, monkeypatch):
    """`experts_down_ws.py` in place of the one-program-per-tile down GEMM, in both modes' forward: it must be the
    kernel that ran, and the block's output within twice torch's own error."""
    from swiglu_patch.kernels import experts_down_ws

    x, index, weights, w, dtype = _case(case, DOWN_CASES)
    ref, torch_err = _reference(x, index, weights, w, EPILOGUES["silu"])
    ran = recording(monkeypatch, experts_down_ws)
    width, stages = DOWN_TILES[tile]
    config = dataclasses.replace(HOPPER_RULE, down_warp_specialized=True, down_ws_block_n=width, down_ws_stages=stages)
    out = torch.full_like(ref, float("nan"), dtype=dtype)
    experts_forward(x, index, weights, w[0], w[1], EPILOGUES["silu"], kernel="experts_grouped", config=config, out=out)
    out_p, _ = experts_forward_with_preact(x, index, weights, w[0], w[1], EPILOGUES["silu"], kernel="experts_grouped",
                                           config=config)
    assert ran == [True, True], ran
    assert not out.isnan().any(), "an output element was not written"
    assert max(rel_err(out, ref), rel_err(out_p, ref)) <= 2 * torch_err + EPS[dtype], (rel_err(out, ref), torch_err)


def test_what_the_down_kernel_cannot_take_runs_the_other(monkeypatch):
    """I off the 64-wide step, and a bias: the one-program-per-tile down GEMM, as right."""
    from swiglu_patch.kernels import experts_down_ws

    ran = recording(monkeypatch, experts_down_ws)
    config = dataclasses.replace(HOPPER_RULE, down_warp_specialized=True)
    for i, bias in ((96, False), (64, True)):
        w = expert_weights(4, 128, i, LAYOUTS[0], bias, torch.bfloat16)
        x = torch.randn(600, 128).to(DEVICE, torch.bfloat16)
        index, weights = routing(600, 4, 2)
        w64 = [None if t is None else t.double() for t in w]
        ref = experts_reference(x.double(), index, weights.double(), w64[0], w64[1], EPILOGUES["silu"], LAYOUTS[0],
                                *w64[2:])
        torch_err = rel_err(experts_reference(x, index, weights, w[0], w[1], EPILOGUES["silu"], LAYOUTS[0], *w[2:]),
                            ref)
        out = experts_forward(x, index, weights, w[0], w[1], EPILOGUES["silu"], LAYOUTS[0], *w[2:],
                              kernel="experts_grouped", config=config)
        assert rel_err(out, ref) <= 2 * torch_err + EPS[torch.bfloat16]
    assert ran == [False], ran  # a bias: the launcher holds no warp-specialized down kernel, nothing asked
