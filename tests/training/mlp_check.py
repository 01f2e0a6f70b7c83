"""`gated_mlp`'s gradient check, shared by `test_gated_mlp.py` and `test_preact_split.py`.

The float64 reference is autograd through `helpers.epilogue64` on the *unpacked* gate and up
weights (no code shared with the op: no packing, no written-out derivative); the packed
weight's gradient is compared after packing the reference's gate and up gradients. Pass rule
(`helpers`' quack rule): within twice the error of HF-eager-style PyTorch in the same dtype
(two GEMMs, the epilogue's ops, the down GEMM, autograd through all of them) plus a per-dtype
epsilon.
"""

import torch
import torch.nn.functional as F
from helpers import DEVICE, EPS, epilogue64, make_case, packed_of, rel_err

from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.layout import PackedGateUp
from swiglu_patch.training import gated_mlp

EPILOGUES = [
    "silu", "gelu_tanh", "gelu",
    GatedEpilogue("silu", gate_scale=0.8839, out_scale=0.5859),
    GatedEpilogue("silu", limit=1.0, clamp="gate"),
    GatedEpilogue("silu", limit=1.0, clamp="activation"),
    GatedEpilogue("gelu_tanh", gate_scale=2.0, limit=2.5),
]
ALL_EPILOGUES = EPILOGUES + [GatedEpilogue("gelu", out_scale=1.5, limit=0.8, clamp="activation")]
NAMES = ("y", "dx", "dW_gate_up", "db_gate_up", "dW_down", "db_down")


def _describe(e):
    return GatedEpilogue.of(e).describe()


def mlp_case(m, k, i, dtype, bias, scale=1.0, device=DEVICE):
    """Fresh random x, gate, up, their biases, Wd [K, I], bd [K] and dY [M, K]."""
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias, device=device, scale=scale)
    wd = (torch.randn(k, i, device=device) / i**0.5).to(dtype)
    bd = torch.randn(k, device=device).to(dtype) if bias else None
    dy = torch.randn(m, k, device=device).to(dtype)
    return x, gate, up, bg, bu, wd, bd, dy


def reference64(x, gate, up, bg, bu, wd, bd, dy, epilogue):
    """(y, dx, dW packed, db packed or None, dWd, dbd or None) in float64, by autograd."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, gate, up, bg, bu, wd, bd)]
    x, gate, up, bg, bu, wd, bd = leaves
    g, u = x @ gate.T, x @ up.T
    if bg is not None:
        g, u = g + bg, u + bu
    y = epilogue64(g, u, epilogue) @ wd.T
    if bd is not None:
        y = y + bd
    y.backward(dy.double())
    return (y.detach(), x.grad, packed_of(gate.grad, up.grad), packed_of(bg.grad, bu.grad) if bg is not None else None,
            wd.grad, bd.grad if bd is not None else None)


def same_dtype(x, gate, up, bg, bu, wd, bd, dy, epilogue):
    """The same outputs from HF-eager-style PyTorch in the inputs' dtype."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, gate, up, bg, bu, wd, bd)]
    x, gate, up, bg, bu, wd, bd = leaves
    h = GatedEpilogue.of(epilogue).apply(F.linear(x, gate, bg), F.linear(x, up, bu))
    y = F.linear(h, wd, bd)
    y.backward(dy)
    return (y.detach(), x.grad, packed_of(gate.grad, up.grad), packed_of(bg.grad, bu.grad) if bg is not None else None,
            wd.grad, bd.grad if bd is not None else None)


def run_ours(x, gate, up, bg, bu, wd, bd, dy, epilogue, mode, backend):
    """(y, dx, dW, db, dWd, dbd) from gated_mlp, leaves poisoned-free (fresh .grad)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None
              for t in (x, packed_of(gate, up), packed_of(bg, bu), wd, bd)]
    x_, w, b, wd_, bd_ = leaves
    y = gated_mlp(x_, PackedGateUp(w, b), wd_, bd_, epilogue, mode, backend)
    y.backward(dy)
    return (y.detach(), x_.grad, w.grad, b.grad if b is not None else None, wd_.grad,
            bd_.grad if bd_ is not None else None)


def check_all(ours, case, epilogue):
    ref = reference64(*case, epilogue)
    same = same_dtype(*case, epilogue)
    dtype = case[0].dtype
    for name, o, s, r in zip(NAMES, ours, same, ref):
        if r is None:
            assert o is None, f"{name}: a gradient for an absent bias"
            continue
        assert o.shape == r.shape and o.dtype == dtype, f"{name}: {o.shape} {o.dtype}"
        assert torch.isfinite(o).all(), f"{name}: non-finite"
        bound = 2 * rel_err(s, r) + EPS[dtype]
        assert rel_err(o, r) <= bound, f"{name}: error {rel_err(o, r):.3g} > bound {bound:.3g}"


BACKEND = "triton"  # under the interpreter on CPU (tests/conftest.py sets it)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view with neither stride natural (rows 3 apart, columns 2 apart)."""
    big = torch.full((3 * t.shape[0], 2 * t.shape[1]), float("nan"), dtype=t.dtype, device=t.device)
    big[::3, ::2] = t
    return big[::3, ::2]
