"""`gated_mlp_interleaved` with LoRA in its GEMMs: the low-rank segment (x_lr, b_lr) and h
returned for adapters on down_proj (its gradient joins dY @ Wd in the backward GEMM).

Every output and gradient (y, h, x, W, Wd, x_lr, b_lr) against float64 autograd of the formula
written out, by the quack rule (within twice PyTorch's own same-dtype error plus an epsilon).
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, EPS, KERNEL_DTYPES, rel_err

from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.layout import split_interleaved
from swiglu_patch.training import gated_mlp_interleaved

BACKEND = "triton"  # under the interpreter on CPU


def _formula(x, w, wd, x_lr, b_lr):
    """(y, h) of the gated MLP with the low-rank segment, in x's dtype, by plain torch ops."""
    gate, up = split_interleaved(x @ w.t() + x_lr @ b_lr.t(), -1)
    h = GatedEpilogue.of("silu").apply(gate, up)
    return h @ wd.t(), h


def _grads(fn, tensors, dy, dh_extra):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y, h = fn(*leaves)
    torch.autograd.backward((y, h), (dy, dh_extra))
    return [y.detach(), h.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("mode", ["store", "recompute"])
def test_low_rank_and_h_gradients_match_float64(m, dtype, mode):
    k, i, r = 50, 37, 5
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w = (torch.randn(2 * i, k, device=DEVICE) / k**0.5).to(dtype)
    wd = (torch.randn(k, i, device=DEVICE) / i**0.5).to(dtype)
    x_lr = (torch.randn(m, r, device=DEVICE) * 0.5).to(dtype)
    b_lr = (torch.randn(2 * i, r, device=DEVICE) / r**0.5).to(dtype)
    dy, dh_extra = torch.randn(m, k, device=DEVICE).to(dtype), torch.randn(m, i, device=DEVICE).to(dtype)
    tensors = (x, w, wd, x_lr, b_lr)

    def ours(x, w, wd, x_lr, b_lr):
        return gated_mlp_interleaved(x, w, None, wd, None, GatedEpilogue.of("silu"), mode, BACKEND, x_lr, b_lr,
                                     return_h=True)

    got = _grads(ours, tensors, dy, dh_extra)
    ref = _grads(_formula, [t.double() for t in tensors], dy.double(), dh_extra.double())
    same = _grads(_formula, tensors, dy, dh_extra)
    for name, o, s, f in zip(("y", "h", "dx", "dW", "dWd", "dx_lr", "db_lr"), got, same, ref):
        assert o is not None and o.dtype == dtype and torch.isfinite(o).all(), name
        bound = 2 * rel_err(s, f) + EPS[dtype]
        assert rel_err(o, f) <= bound, f"{name}: {rel_err(o, f):.3g} > {bound:.3g}"


def test_low_rank_operands_come_in_pairs_and_must_fit():
    x, w, wd = torch.randn(3, 32), torch.randn(32, 32), torch.randn(32, 16)
    epi = GatedEpilogue.of("silu")
    with pytest.raises(ValueError, match="come together"):
        gated_mlp_interleaved(x, w, None, wd, None, epi, x_lr=torch.randn(3, 4))
    with pytest.raises(ValueError, match="x_lr must be"):
        gated_mlp_interleaved(x, w, None, wd, None, epi, x_lr=torch.randn(2, 4), b_lr=torch.randn(32, 4))
    with pytest.raises(TypeError, match="b_lr must match"):
        gated_mlp_interleaved(x, w, None, wd, None, epi, x_lr=torch.randn(3, 4), b_lr=torch.randn(32, 4).double())


def test_return_h_keeps_leading_dims():
    x = torch.randn(2, 3, 32, device=DEVICE).to(KERNEL_DTYPES[-1])
    w = torch.randn(48, 32, device=DEVICE).to(x.dtype)
    wd = torch.randn(32, 24, device=DEVICE).to(x.dtype)
    y, h = gated_mlp_interleaved(x, w, None, wd, None, GatedEpilogue.of("silu"), backend=BACKEND, return_h=True)
    assert y.shape == (2, 3, 32) and h.shape == (2, 3, 24)
    assert rel_err(y, F.linear(h, wd)) < 1e-3
