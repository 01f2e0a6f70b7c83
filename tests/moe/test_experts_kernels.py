"""The experts kernels (`EXPERTS_KERNELS`; the grouped one at every rule's tile) against float64, and
the routing prep.

On CPU they run in Triton's interpreter (fp32 and fp16: the interpreter's bf16 dot is wrong);
on a GPU the compiled kernels, bf16 included. Every check is `experts_forward_check.check_forward`'s.
"""

from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from moe.experts_forward_check import (DEVICE, DTYPES, EPILOGUES, EPS, LAYOUTS, check_forward, expert_weights,
                                       routing)
from swiglu_patch.kernels.experts import EXPERTS_KERNELS, experts_forward
from swiglu_patch.kernels.experts_reference import experts_reference
from swiglu_patch.kernels.experts_routing import capacity, expert_blocks, expert_blocks_torch
from swiglu_patch.kernels.rules import EXPERTS_RULES




def takes(kernel: str, layout) -> bool:
    """Whether the kernel reads this layout: the GEMV reads weight rows along a unit stride (not
    transposed ones), the transposed GEMV tiles contiguous along the output axis (transposed only)."""
    return {"experts_gemv": not layout.transposed, "experts_gemv_transposed": layout.transposed}.get(kernel, True)


def plain_layout(kernel: str):
    """The first of LAYOUTS the kernel takes: chunked [E, 2I, K], or gpt-oss's for the transposed GEMV."""
    return next(layout for layout in LAYOUTS if takes(kernel, layout))


KERNEL_LAYOUTS = [(k, layout) for k in EXPERTS_KERNELS for layout in LAYOUTS if takes(k, layout)]


@pytest.mark.parametrize("kernel, layout", KERNEL_LAYOUTS, ids=lambda v: v if isinstance(v, str) else v.describe())
@pytest.mark.parametrize("dtype", DTYPES)
def test_layouts_and_bias_against_float64(kernel, dtype, layout):
    e, k, i, top_k = 5, 40, 24, 2  # K and I off every block size
    for t, bias in ((1, False), (7, True)):
        w = expert_weights(e, k, i, layout, bias, dtype)
        x = torch.randn(t, k).to(DEVICE, dtype)
        index, weights = routing(t, e, top_k)
        check_forward(x, index, weights, w, EPILOGUES["silu"], layout, kernel, dtype)


@pytest.mark.parametrize("kernel", EXPERTS_KERNELS)
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_every_epilogue_at_large_magnitudes(kernel, name):
    """Inputs of scale 6 cross the clamps; gpt-oss on its own interleaved, transposed layout (untransposed
    for the GEMV)."""
    layout = (LAYOUTS[3] if kernel == "experts_gemv" else LAYOUTS[1]) if name == "gpt_oss" else plain_layout(kernel)
    dtype = torch.float32
    w = expert_weights(6, 48, 32, layout, name == "gpt_oss", dtype)
    x = (torch.randn(9, 48) * 6.0).to(DEVICE, dtype)
    index, weights = routing(9, 6, 3)
    check_forward(x, index, weights, w, EPILOGUES[name], layout, kernel, dtype)


@pytest.mark.parametrize("kernel", EXPERTS_KERNELS)
@pytest.mark.parametrize("skew", ["one_expert", "empty_expert"])
def test_all_tokens_on_one_expert_and_an_expert_with_none(kernel, skew):
    dtype, layout = torch.float16, plain_layout(kernel)
    w = expert_weights(4, 32, 16, layout, True, dtype)
    x = torch.randn(37, 32).to(DEVICE, dtype)
    index, weights = routing(37, 4, 2, skew)
    check_forward(x, index, weights, w, EPILOGUES["silu"], layout, kernel, dtype)


@pytest.mark.parametrize("kernel", EXPERTS_KERNELS)
def test_non_contiguous_inputs(kernel):
    dtype = torch.float32
    layout = plain_layout(kernel)
    gate_up, down, gb, db = expert_weights(4, 32, 16, layout, True, dtype)
    padded = torch.zeros(*down.shape[:2], down.shape[2] + 8, dtype=dtype, device=DEVICE)
    down = padded[..., :down.shape[2]].copy_(down)  # rows 8 elements apart from their neighbours' ends
    if kernel == "experts_grouped":
        gate_up = gate_up.transpose(1, 2).contiguous().transpose(1, 2)  # same values, K strided
    elif kernel == "experts_gemv_transposed":  # columns along a unit stride, rows of gate_up padded too
        gate_up = torch.zeros(4, 32, 2 * 16 + 8, dtype=dtype, device=DEVICE)[..., :2 * 16].copy_(gate_up)
    x = torch.randn(22, 64).to(DEVICE, dtype)[::2, ::2]
    index, weights = routing(11, 4, 2)
    index = torch.cat([index, index], dim=1)[:, ::2]
    weights = torch.cat([weights, weights], dim=1)[:, ::2]
    check_forward(x, index, weights, (gate_up, down, gb, db), EPILOGUES["silu"], layout, kernel, dtype)


@pytest.mark.parametrize("kernel", EXPERTS_KERNELS)
def test_expert_parallel_sentinels_add_nothing(kernel):
    """Ids >= E (transformers' EP: slots another rank owns) contribute nothing, as in grouped_mm."""
    dtype, layout = torch.float32, plain_layout(kernel)
    w = expert_weights(4, 32, 16, layout, True, dtype)
    x = torch.randn(9, 32).to(DEVICE, dtype)
    index, weights = routing(9, 4, 2)
    index[::2, 1] = 4  # the sentinel
    index[3, :] = 7  # a token with no local expert at all
    out = torch.full((9, 32), float("nan"), dtype=dtype, device=DEVICE)
    experts_forward(x, index, weights, *w[:2], EPILOGUES["silu"], layout, *w[2:], kernel=kernel, out=out)
    kept = index < 4
    ref = experts_reference(x.double(), torch.where(kept, index, 4), weights.double(), *(t.double() for t in w[:2]),
                            EPILOGUES["silu"], layout, *(t.double() for t in w[2:]))
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("prep", [expert_blocks, expert_blocks_torch], ids=["kernel", "torch"])
@pytest.mark.parametrize("top_k, block_m", [(1, 16), (2, 16), (8, 64)])
def test_expert_blocks_lay_every_pair_out_once_per_expert(prep, top_k, block_m):
    e, t = top_k + 5, 53
    index, _ = routing(t, e, top_k, "empty_expert")
    index[0, 0] = e  # a sentinel gets no row
    sorted_pairs, block_expert = prep(index, e, block_m)
    s = t * top_k
    assert sorted_pairs.numel() == capacity(s, e, block_m) == block_expert.numel() * block_m
    pairs = sorted_pairs.view(-1, block_m).cpu()
    flat = index.reshape(-1).cpu()
    seen = []
    for b, expert in enumerate(block_expert.tolist()):
        rows = [p for p in pairs[b].tolist() if p < s]
        if expert == e:
            assert rows == [], "an unused block holds pairs"
            continue
        assert all(flat[p] == expert for p in rows) and rows == sorted(rows)
        seen += rows
    assert sorted(seen) == [p for p in range(s) if flat[p] < e]


def test_bad_operands_name_the_fix():
    w = expert_weights(4, 32, 16, LAYOUTS[0], False, torch.float32)
    x = torch.randn(3, 32, device=DEVICE)
    index, weights = routing(3, 4, 2)
    with pytest.raises(ValueError, match=r"x must be \[T, 32\]"):
        experts_forward(x[:, :31], index, weights, *w[:2], EPILOGUES["silu"])
    with pytest.raises(ValueError, match="top_k_index must be an integer"):
        experts_forward(x, index.float(), weights, *w[:2], EPILOGUES["silu"])
    with pytest.raises(TypeError, match="must match x's dtype"):
        experts_forward(x, index, weights, w[0].half(), w[1], EPILOGUES["silu"])
    with pytest.raises(ValueError, match="kernel must be 'auto' or one of"):
        experts_forward(x, index, weights, *w[:2], EPILOGUES["silu"], kernel="nope")
    if DEVICE == "cpu":
        with pytest.raises(TypeError, match="interpreter computes bfloat16"):
            experts_forward(x.bfloat16(), index, weights, w[0].bfloat16(), w[1].bfloat16(), EPILOGUES["silu"])


@pytest.mark.parametrize("rule", EXPERTS_RULES, ids=lambda r: r.config.short())
def test_every_rules_tile_against_float64(rule):
    """Each rule's config, whatever T the planner gives it, on a call whose experts get 0 to 40 rows."""
    dtype = torch.float16
    for layout in [layout for layout in LAYOUTS if takes(rule.kernel, layout)][:2]:
        w = expert_weights(6, 72, 40, layout, True, dtype)
        x = torch.randn(45, 72).to(DEVICE, dtype)
        index, weights = routing(45, 6, 2, "empty_expert")
        gate_up, down, gb, db = w
        f64 = lambda t: t.double()  # noqa: E731
        ref = experts_reference(x.double(), index, weights.double(), f64(gate_up), f64(down), EPILOGUES["silu"],
                                layout, f64(gb), f64(db))
        torch_err = rel_err(experts_reference(x, index, weights, gate_up, down, EPILOGUES["silu"], layout, gb, db), ref)
        out = experts_forward(x, index, weights, gate_up, down, EPILOGUES["silu"], layout, gb, db,
                              kernel=rule.kernel, config=rule.config)
        assert rel_err(out, ref) <= 2 * torch_err + EPS[dtype]
