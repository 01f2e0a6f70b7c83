"""A clamp's derivative where its input sits exactly on the bound, as the installed torch takes it.

torch.clamp's backward passed the gradient at the bound up to torch 2.13 and passes none from 2.14.
The kernels' derivative (`jit_common.gated_epilogue_grad`, `experts_jit.experts_epilogue_grad`, which
every backward kernel calls) and the PyTorch spec (`ops.gated_epilogue_grad_reference`) follow the
torch they run beside (`epilogue.CLIP_GRAD_AT_BOUND`, `MIN_GRAD_AT_BOUND`). Here gate and up hold
values on the bounds, planted, beside values inside and outside them, and each derivative is held
against float64 autograd through `torch.clamp` itself (`ExpertsEpilogue.apply`), under whichever torch
runs the test. The activation clamp's bound, act(g) = limit, is a computed value that cannot be planted
exactly; its comparison is the same `min_passes` as the gate clamp's."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from swiglu_patch.kernels.epilogue import CLIP_GRAD_AT_BOUND, MIN_GRAD_AT_BOUND, GatedEpilogue
from swiglu_patch.kernels.experts_jit import experts_epilogue_grad
from swiglu_patch.kernels.experts_reference import ExpertsEpilogue
from swiglu_patch.ops import gated_epilogue_grad_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = 64  # elements, one program

EPILOGUES = {
    "clamp(gate) 1.5": ExpertsEpilogue(GatedEpilogue("silu", limit=1.5, clamp="gate")),
    "gelu_tanh, gate x 2, clamp(gate) 2.5": ExpertsEpilogue(GatedEpilogue("gelu_tanh", gate_scale=2.0, limit=2.5)),
    "gpt-oss, clamp 7": ExpertsEpilogue(GatedEpilogue("silu", limit=7.0), alpha=1.702),
}


@triton.jit
def _epilogue_grad_kernel(gate_ptr, up_ptr, dh_ptr, h_ptr, dgate_ptr, dup_ptr, N: tl.constexpr,
                          ACTIVATION: tl.constexpr, GATE_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr,
                          CLAMP: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    offs = tl.arange(0, N)
    gate, up, dh = tl.load(gate_ptr + offs), tl.load(up_ptr + offs), tl.load(dh_ptr + offs)
    h, dgate, dup = experts_epilogue_grad(gate, up, dh, ACTIVATION, False, GATE_SCALE, OUT_SCALE, CLAMP, LIMIT, ALPHA)
    tl.store(h_ptr + offs, h)
    tl.store(dgate_ptr + offs, dgate)
    tl.store(dup_ptr + offs, dup)


def _planted(epilogue: ExpertsEpilogue):
    """fp32 gate, up and dh [N]: a quarter of gate on its bound (limit / gate_scale), a quarter of
    up on +limit and one on -limit (their gates inside the bound, where act(g) is far from 0), the
    rest drawn inside and past the bounds; dh never zero."""
    limit, scale = epilogue.gated.limit, epilogue.gated.gate_scale
    gate = torch.randn(N) * 2 * limit / scale
    up = torch.randn(N) * 2 * limit
    gate[0::4] = limit / scale
    up[1::4], up[2::4] = limit, -limit
    for first in (1, 2):
        gate[first::4] = (torch.rand(N // 4) * 0.8 + 0.1) * limit / scale
    dh = torch.randn(N).abs() + 0.5
    assert (gate * scale == limit).sum() >= N // 4 and (up.abs() == limit).sum() >= N // 2
    return gate, up, dh


def _float64_grads(epilogue, gate, up, dh):
    g, u = (t.double().requires_grad_() for t in (gate, up))
    h = epilogue.apply(g, u)
    dg, du = torch.autograd.grad(h, (g, u), dh.double())
    return h.detach(), dg, du


@pytest.mark.parametrize("name", list(EPILOGUES))
def test_the_kernels_derivative_at_the_bound_is_torch_clamps(name):
    epilogue = EPILOGUES[name]
    gate, up, dh = _planted(epilogue)
    h, dgate, dup = (torch.full((N,), float("nan"), device=DEVICE) for _ in range(3))
    _epilogue_grad_kernel[(1,)](gate.to(DEVICE), up.to(DEVICE), dh.to(DEVICE), h, dgate, dup, N,
                                **{k: v for k, v in epilogue.constexprs().items()})
    ref_h, ref_dgate, ref_dup = _float64_grads(epilogue, gate, up, dh)
    h, dgate, dup = (t.cpu().double() for t in (h, dgate, dup))
    limit = epilogue.gated.limit
    up_on_bound, gate_on_bound = up.abs() == limit, gate * epilogue.gated.gate_scale == limit
    for what, ours, ref, on_bound in (("dgate", dgate, ref_dgate, gate_on_bound), ("dup", dup, ref_dup, up_on_bound)):
        assert torch.equal(ours[on_bound] == 0, ref[on_bound] == 0), f"{what} on the bound: {ours[on_bound]}"
    for what, ours, ref in (("h", h, ref_h), ("dgate", dgate, ref_dgate), ("dup", dup, ref_dup)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
    # the planted values decide the case: torch passes the gradient at every bound, or at none
    assert bool((ref_dup[up_on_bound] != 0).all()) == CLIP_GRAD_AT_BOUND
    assert bool((ref_dgate[gate_on_bound] != 0).all()) == MIN_GRAD_AT_BOUND


@pytest.mark.parametrize("name", [n for n, e in EPILOGUES.items() if e.alpha is None])
def test_the_pytorch_spec_of_the_derivative_at_the_bound_is_torch_clamps(name):
    epilogue = EPILOGUES[name]
    gate, up, dh = (t.double() for t in _planted(epilogue))
    h, dgate, dup = gated_epilogue_grad_reference(gate, up, dh, epilogue.gated)
    ref_h, ref_dgate, ref_dup = _float64_grads(epilogue, gate, up, dh)
    for what, ours, ref in (("h", h, ref_h), ("dgate", dgate, ref_dgate), ("dup", dup, ref_dup)):
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: {m}")
