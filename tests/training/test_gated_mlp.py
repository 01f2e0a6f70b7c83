"""`gated_mlp`, the MLP through down_proj as one differentiable op: every gradient against float64.

The float64 reference is autograd through `helpers.epilogue64` on the *unpacked* gate and up
weights (no code shared with the op: no packing, no written-out derivative); the packed
weight's gradient is compared after packing the reference's gate and up gradients. Pass rule
(`helpers`' quack rule): within twice the error of HF-eager-style PyTorch in the same dtype
(two GEMMs, the epilogue's ops, the down GEMM, autograd through all of them) plus a per-dtype
epsilon. On CPU the Triton backend runs under the interpreter in fp32/fp16; on the GPU bf16 too.
"""

import pytest
import torch
from helpers import CUDA, EPS, KERNEL_DTYPES, epilogue64, packed_of, rel_err
from training.mlp_check import (ALL_EPILOGUES, BACKEND, EPILOGUES, NAMES, _describe, _strided, check_all, mlp_case,
                                reference64, run_ours, same_dtype)

from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.layout import PackedGateUp
from swiglu_patch.training import gated_epilogue_grad_reference, gated_mlp


@pytest.mark.parametrize("m", [1, 7, 199])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mode", ["store", "recompute"])
def test_every_gradient_matches_float64(m, dtype, bias, mode):
    """I = 37 and K = 50: no multiple of any block, a partial last gate/up block."""
    case = mlp_case(m, 50, 37, dtype, bias)
    check_all(run_ours(*case, "silu", mode, BACKEND), case, "silu")


@pytest.mark.parametrize("epilogue", EPILOGUES, ids=_describe)
@pytest.mark.parametrize("scale", [1.0, 30.0])
@pytest.mark.parametrize("mode", ["store", "recompute"])
def test_every_epilogue_every_gradient(epilogue, scale, mode):
    """Scales and clamps through the whole backward, at large input scale too (clamps bite)."""
    dtype = KERNEL_DTYPES[-1]
    case = mlp_case(7, 40, 24, dtype, bias=True, scale=scale)
    check_all(run_ours(*case, epilogue, mode, BACKEND), case, epilogue)


@pytest.mark.skipif(not CUDA, reason="the TMA kernels run on the GPU (their interpreter runs are in test_backward_kernels)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["store", "recompute"])
def test_gpu_rule_tiles(dtype, mode):
    """M = 1024 at an aligned I: the rules take the TMA forward and the TMA backward."""
    case = mlp_case(1024, 512, 384, dtype, bias=False)
    check_all(run_ours(*case, "silu", mode, "triton"), case, "silu")


@pytest.mark.parametrize("mode", ["store", "recompute"])
def test_non_contiguous_x_and_dy(mode):
    case = mlp_case(45, 40, 24, KERNEL_DTYPES[-1], bias=True)
    x, gate, up, bg, bu, wd, bd, dy = case
    xs = _strided(x).requires_grad_()
    w, b, wd_, bd_ = (t.clone().requires_grad_() for t in (packed_of(gate, up), packed_of(bg, bu), wd, bd))
    y = gated_mlp(xs, PackedGateUp(w, b), wd_, bd_, "gelu", mode, BACKEND)
    y.backward(_strided(dy))
    check_all((y.detach(), xs.grad, w.grad, b.grad, wd_.grad, bd_.grad), case, "gelu")


def test_leading_dims():
    case = mlp_case(10, 40, 24, KERNEL_DTYPES[-1], bias=False)
    x, gate, up, _, _, wd, _, dy = case
    x3 = x.view(2, 5, 40).clone().requires_grad_()
    w, wd_ = packed_of(gate, up).requires_grad_(), wd.clone().requires_grad_()
    y = gated_mlp(x3, PackedGateUp(w), wd_, None, "silu", "store", BACKEND)
    assert y.shape == (2, 5, 40)
    y.backward(dy.view(2, 5, 40))
    check_all((y.detach().view(10, 40), x3.grad.view(10, 40), w.grad, None, wd_.grad, None), case, "silu")


def test_frozen_weights_get_no_gradient_and_x_still_does():
    """What LoRA on a frozen base needs: dx only (the weight GEMMs are skipped)."""
    dtype = KERNEL_DTYPES[-1]
    x, gate, up, bg, bu, wd, bd, dy = mlp_case(7, 40, 24, dtype, bias=True)
    xg = x.clone().requires_grad_()
    w, b = packed_of(gate, up), packed_of(bg, bu)
    y = gated_mlp(xg, PackedGateUp(w, b), wd, bd, "silu", "store", BACKEND)
    y.backward(dy)
    assert w.grad is None and b.grad is None and wd.grad is None and bd.grad is None
    ref = reference64(x, gate, up, bg, bu, wd, bd, dy, "silu")[1]
    same = same_dtype(x, gate, up, bg, bu, wd, bd, dy, "silu")[1]
    assert rel_err(xg.grad, ref) <= 2 * rel_err(same, ref) + EPS[dtype]


def test_only_down_trainable():
    dtype = KERNEL_DTYPES[-1]
    x, gate, up, _, _, wd, _, dy = mlp_case(7, 40, 24, dtype, bias=False)
    wdg = wd.clone().requires_grad_()
    y = gated_mlp(x, PackedGateUp(packed_of(gate, up)), wdg, None, "gelu_tanh", "recompute", BACKEND)
    y.backward(dy)
    ref = reference64(x, gate, up, None, None, wd, None, dy, "gelu_tanh")[4]
    same = same_dtype(x, gate, up, None, None, wd, None, dy, "gelu_tanh")[4]
    assert rel_err(wdg.grad, ref) <= 2 * rel_err(same, ref) + EPS[dtype]


@pytest.mark.parametrize("mode", ["store", "recompute"])
def test_triton_and_torch_backends_agree(mode):
    case = mlp_case(9, 40, 24, torch.float32, bias=True)
    triton = run_ours(*case, "gelu_tanh", mode, "triton")
    torch_ = run_ours(*case, "gelu_tanh", mode, "torch")
    for name, a, b in zip(NAMES, triton, torch_):
        assert rel_err(a, b) < 1e-5, name


# -- the written-out backward formulas, by gradcheck in float64 ----------------------------




@pytest.mark.parametrize("epilogue", ALL_EPILOGUES, ids=_describe)
def test_gradcheck_torch_backend(epilogue):
    """The op's autograd formula (the written-out derivatives, the packed layout, both biases)
    against finite differences, through the torch backend in float64. gradcheck backpropagates
    one graph many times, which store mode refuses (its backward writes dP over the saved P),
    so recompute mode here; store mode's formula is the same after P, checked next."""
    x, gate, up, bg, bu, wd, bd, _ = mlp_case(3, 5, 20, torch.float64, bias=True, device="cpu", scale=2.0)
    inputs = [t.requires_grad_() for t in (x, packed_of(gate, up), packed_of(bg, bu), wd, bd)]

    def f(x, w, b, wd, bd):
        return gated_mlp(x, PackedGateUp(w, b), wd, bd, epilogue, "recompute", "torch")

    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)


@pytest.mark.parametrize("epilogue", ALL_EPILOGUES, ids=_describe)
@pytest.mark.parametrize("mode", ["store", "recompute"])
def test_torch_backend_in_float64_is_autograd_to_rounding(epilogue, mode):
    case = mlp_case(9, 40, 24, torch.float64, bias=True, device="cpu", scale=3.0)
    ours = run_ours(*case, epilogue, mode, "torch")
    for name, o, r in zip(NAMES, ours, reference64(*case, epilogue)):
        assert rel_err(o, r) < 1e-13, name


def test_store_mode_backpropagates_a_graph_once():
    """A second backward through a store-mode graph raises (P holds dP by then); recompute's runs."""
    x, gate, up, _, _, wd, _, dy = mlp_case(5, 40, 24, KERNEL_DTYPES[-1], bias=False)
    w = packed_of(gate, up).requires_grad_()
    for mode in ("store", "recompute"):
        y = gated_mlp(x, PackedGateUp(w), wd, None, "silu", mode, BACKEND)
        first = torch.autograd.grad(y, w, dy, retain_graph=True)[0]
        if mode == "store":
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                torch.autograd.grad(y, w, dy)
        else:
            assert torch.equal(torch.autograd.grad(y, w, dy)[0], first)


@pytest.mark.parametrize("epilogue", EPILOGUES, ids=_describe)
def test_written_out_epilogue_derivative_is_autograds(epilogue):
    g, u, dh = (torch.randn(64, 16, dtype=torch.float64) * 3 for _ in range(3))
    h, dg, du = gated_epilogue_grad_reference(g, u, dh, GatedEpilogue.of(epilogue))
    g_, u_ = g.clone().requires_grad_(), u.clone().requires_grad_()
    h_ = epilogue64(g_, u_, epilogue)
    ref_g, ref_u = torch.autograd.grad(h_, (g_, u_), dh)
    assert torch.allclose(h, h_.detach(), rtol=1e-12, atol=1e-12)
    assert torch.allclose(dg, ref_g, rtol=1e-12, atol=1e-12) and torch.allclose(du, ref_u, rtol=1e-12, atol=1e-12)
