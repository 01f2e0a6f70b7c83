"""The backward GEMM's split kernel (`gated_backward_split.py`), the warp-specialized kernel
(`gated_backward_ws.py`, on a Hopper GPU only) and the TMA kernel's epilogue in four slices against
float64: dP and h within twice eager's same-dtype error, in place or not, edge tiles, every
epilogue at input scales 1 and 30, dh_in. On CPU they run under TRITON_INTERPRET=1 in fp32 and
fp16 (the TMA kernel in fp16 only)."""

from __future__ import annotations

import pytest
import torch
from helpers import CUDA, DEVICE, EPS, epilogue64, rel_err

from swiglu_patch.kernels.configs import GatedGemmConfig as C
from swiglu_patch.kernels.dispatch import MODULES, gated_backward
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.layout import split_interleaved
from swiglu_patch.kernels.rules import WS_256_CONFIG

HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9
SMALL = {"backward_split": C(16, 32, 16, num_warps=4), **({"backward_ws": None} if HOPPER else {})}
DTYPES = {"backward_split": [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else []),
          "backward_ws": [torch.bfloat16, torch.float16]}
EPILOGUES = [GatedEpilogue("silu"), GatedEpilogue("silu", gate_scale=0.8839, out_scale=0.5859),
             GatedEpilogue("silu", limit=1.0, clamp="gate"), GatedEpilogue("gelu_tanh", gate_scale=2.0, limit=2.5),
             GatedEpilogue("gelu", out_scale=1.5, limit=0.8, clamp="activation")]


def _case(m, k, i, dtype, scale=1.0):
    dy = torch.randn(m, k, device=DEVICE).to(dtype)
    wd = (torch.randn(k, i, device=DEVICE) / i**0.5).to(dtype)
    preact = (scale * torch.randn(m, 2 * i, device=DEVICE)).to(dtype)
    return dy, wd, preact


def _check(dpreact, h, dy, wd, preact, epilogue, dh_in=None):
    """dP (interleaved) and h within 2x eager's same-dtype error against float64 (+ EPS)."""
    dh64 = dy.double() @ wd.double() + (0 if dh_in is None else dh_in.double())
    gate, up = (t.requires_grad_() for t in split_interleaved(preact.double(), -1))
    h64 = epilogue64(gate, up, epilogue)
    ref = torch.cat(torch.autograd.grad(h64, (gate, up), dh64), -1)
    gate_s, up_s = (t.requires_grad_() for t in split_interleaved(preact, -1))
    h_same = GatedEpilogue.of(epilogue).apply(gate_s, up_s)
    dh_same = dy @ wd + (0 if dh_in is None else dh_in)
    same = torch.cat(torch.autograd.grad(h_same, (gate_s, up_s), dh_same), -1)
    ours = torch.cat(split_interleaved(dpreact, -1), -1)
    for name, o, s, r in (("dP", ours, same, ref), ("h", h, h_same.detach(), h64.detach())):
        assert torch.isfinite(o).all(), f"{name}: non-finite"
        bound = 2 * rel_err(s, r) + EPS[dy.dtype]
        assert rel_err(o, r) <= bound, f"{name}: error {rel_err(o, r):.3g} > bound {bound:.3g}"


def _run(kernel, dy, wd, preact, epilogue, in_place, dh_in=None):
    m, i = preact.shape[0], wd.shape[1]
    saved = preact.clone()
    dpreact = preact if in_place else torch.full((m, 2 * i), float("nan"), dtype=dy.dtype, device=DEVICE)
    h = torch.full((m, i), float("nan"), dtype=dy.dtype, device=DEVICE)
    gated_backward(dy, wd, preact, epilogue, dpreact_out=dpreact, h_out=h, config=None if CUDA else SMALL[kernel],
                   kernel=kernel, dh_in=dh_in)
    if not in_place:
        assert torch.equal(preact, saved), "P was written"
    return dpreact, h, saved


# (kernel, m, k, i): edge tiles in M and I, I not a multiple of 16, K past one step
SHAPES = [("backward_split", 1, 64, 48), ("backward_split", 7, 50, 37), ("backward_split", 37, 72, 80),
          ("backward_split", 199, 130, 100)]
if HOPPER:  # TMA needs K % 8 == 0 and I % 16 == 0; 128-row tiles, 64-deep K steps: tails in M, I and K
    SHAPES += [("backward_ws", 1, 64, 48), ("backward_ws", 7, 40, 128), ("backward_ws", 199, 136, 80),
               ("backward_ws", 300, 1032, 400), ("backward_ws", 1000, 512, 2064)]


@pytest.mark.parametrize("kernel,m,k,i", SHAPES)
@pytest.mark.parametrize("in_place", [False, True])
def test_backward_variant_matches_float64(kernel, m, k, i, in_place):
    for dtype in DTYPES[kernel]:
        dy, wd, preact = _case(m, k, i, dtype)
        dpreact, h, saved = _run(kernel, dy, wd, preact, "silu", in_place)
        _check(dpreact, h, dy, wd, saved, "silu")


@pytest.mark.parametrize("kernel", list(SMALL))
@pytest.mark.parametrize("epilogue", EPILOGUES, ids=lambda e: repr(e)[:60])
@pytest.mark.parametrize("scale", [1.0, 30.0])  # 30: clamps clip
def test_backward_variant_computes_every_epilogue(kernel, epilogue, scale):
    dy, wd, preact = _case(37, 72, 64, DTYPES[kernel][0], scale)
    dpreact, h, saved = _run(kernel, dy, wd, preact, epilogue, in_place=True)
    _check(dpreact, h, dy, wd, saved, epilogue)


@pytest.mark.parametrize("kernel", list(SMALL))
def test_backward_variant_adds_dh_in(kernel):
    dy, wd, preact = _case(19, 40, 48, DTYPES[kernel][0])
    dh_in = torch.randn(48, 19, device=DEVICE).to(dy.dtype).T  # non-contiguous
    dpreact, h, saved = _run(kernel, dy, wd, preact, "silu", in_place=False, dh_in=dh_in)
    _check(dpreact, h, dy, wd, saved, "silu", dh_in=dh_in)


@pytest.mark.skipif(not HOPPER, reason="the warp-specialized kernel runs on Hopper GPUs only (CPU: its compile test)")
@pytest.mark.parametrize("m,k,i", [(1, 64, 48), (300, 1032, 400), (1000, 512, 2064)])
@pytest.mark.parametrize("epilogue", EPILOGUES[::2], ids=lambda e: repr(e)[:60])
def test_ws_kernel_256_row_tile_matches_float64(m, k, i, epilogue):
    """The 256x128 tile (8 MMA warps, a 16-bit handoff, the epilogue in 64-row slices) forced at every M:
    the rules run it for M 2049-4096 only."""
    for dtype, in_place, scale in ((torch.bfloat16, True, 1.0), (torch.float16, False, 30.0)):
        dy, wd, preact = _case(m, k, i, dtype, scale)
        dh_in = torch.randn(i, m, device=DEVICE).to(dtype).T if m > 1 else None  # non-contiguous
        saved = preact.clone()
        dpreact = preact if in_place else torch.full_like(preact, float("nan"))
        h = torch.full((m, i), float("nan"), dtype=dtype, device=DEVICE)
        gated_backward(dy, wd, preact, epilogue, dpreact_out=dpreact, h_out=h, config=WS_256_CONFIG, kernel="backward_ws",
                       dh_in=dh_in)
        _check(dpreact, h, dy, wd, saved, epilogue, dh_in=dh_in)


@pytest.mark.parametrize("m,k,i", [(7, 40, 128), (37, 72, 80)])
def test_tma_kernel_epilogue_in_four_slices(m, k, i):
    dy, wd, preact = _case(m, k, i, torch.float16)
    config = C(16, 64, 16, group_m=2, epilogue_subtiles=4)
    for in_place in (False, True):
        p_in = preact.clone()
        dpreact = p_in if in_place else torch.full_like(preact, float("nan"))
        h = torch.full((m, i), float("nan"), dtype=dy.dtype, device=DEVICE)
        gated_backward(dy, wd, p_in, "gelu_tanh", dpreact_out=dpreact, h_out=h, config=config, kernel="backward_tma")
        _check(dpreact, h, dy, wd, preact, "gelu_tanh")


def test_tma_kernel_refuses_epilogue_slices_it_cannot_cut():
    epilogue = dict(GatedEpilogue.of("silu").constexprs(), APPROX_TANH=False)
    with pytest.raises(ValueError, match="epilogue_subtiles must be 2 or 4"):
        MODULES["backward_tma"].make_launcher(C(128, 128, 64, epilogue_subtiles=3), epilogue, torch.float16)
    with pytest.raises(ValueError, match="multiple of 64 with 4 epilogue slices"):
        MODULES["backward_tma"].make_launcher(C(128, 32, 64, epilogue_subtiles=4), epilogue, torch.float16)


def test_split_kernel_takes_non_contiguous_dy_and_outputs():
    dy, wd, preact = _case(2 * 45, 2 * 70, 53, torch.float32)
    dy = dy[::2, ::2]  # both strides != natural
    wd = wd.t().contiguous().t()[::2]  # column-major Wd rows 0, 2, ..: [70, 53]
    preact = preact[::2]
    big = torch.full((45, 2 * 2 * 53), float("nan"), device=DEVICE)
    dpreact = big[:, ::2]
    h = torch.full((53, 45), float("nan"), device=DEVICE).t()
    gated_backward(dy, wd, preact, "silu", dpreact_out=dpreact, h_out=h, config=SMALL["backward_split"],
                   kernel="backward_split")
    _check(dpreact, h, dy, wd, preact, "silu")
    assert torch.isnan(big[:, 1::2]).all(), "wrote outside the view"
