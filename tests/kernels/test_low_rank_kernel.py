"""The kernels' LoRA paths against float64: the low-rank segment of the pointer, TMA and GEMV
kernels (`dispatch.gated_gemm_low_rank`) and the backward kernels' dh_in input.

The low-rank segment computes the gated GEMM over [x | x_lr] against [W | b_lr]; the check
is `helpers.check` on exactly those concatenated operands (gate rows [Wg | Bg], up rows
[Wu | Bu]). Outputs are poisoned with NaN before the run; shapes cover 1 token, I and r that are
not multiples of any block, and non-contiguous operands.
"""

import pytest
import torch
from helpers import CUDA, DEVICE, EPS, KERNEL_DTYPES, check, make_case, packed_of, rel_err

from swiglu_patch.kernels.configs import GatedGemmConfig as C
from swiglu_patch.kernels.dispatch import gated_backward, gated_gemm_low_rank
from swiglu_patch.kernels.layout import split_interleaved

# (m, k, i, r): 1 token; I not a multiple of 16; r of 1, below, at and past the segment's step of 16
SHAPES = [(1, 64, 48, 16), (7, 50, 37, 5), (37, 40, 24, 1), (130, 72, 100, 33)]
# the TMA kernel: I % 16 == 0, 16-byte rows (r % 8 == 0); r = 24 reads a zero-filled half step
TMA_SHAPES = [(1, 64, 48, 16), (37, 72, 64, 8), (130, 96, 80, 24)]
TMA_DTYPES = [torch.float16] + ([torch.bfloat16] if CUDA else [])
# small tiles for the interpreter; None on the GPU: the kernel's Hopper rule
TMA_CONFIG = None if CUDA else C(16, 16, 16, group_m=2)


def _nan(shape, like):
    return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


def _low_rank_case(m, k, i, r, dtype, bias, strided=False):
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias)
    x_lr = (torch.randn(m, 2 * r, device=DEVICE) * 0.5).to(dtype)
    b_g = (torch.randn(i, r, device=DEVICE) / r**0.5).to(dtype)
    b_u = (torch.randn(i, r, device=DEVICE) / r**0.5).to(dtype)
    b_lr = packed_of(b_g, b_u)
    if strided:  # every other column of x_lr, b_lr stored transposed
        x_lr, b_lr = x_lr[:, ::2], b_lr.t().contiguous().t()
    else:
        x_lr = x_lr[:, :r].contiguous()
    return x, gate, up, bg, bu, x_lr, b_g, b_u, b_lr


def _check_preact(preact, x, w, x_lr, b_lr, b):
    """P = x @ W^T + x_lr @ b_lr^T + b against float64, within 2x of PyTorch's own rounding."""
    ref = x.double() @ w.double().t() + x_lr.double() @ b_lr.double().t() + b.double()
    same = x @ w.t() + x_lr @ b_lr.t() + b
    assert rel_err(preact, ref) <= 2 * rel_err(same, ref) + EPS[x.dtype]


# (kernel, m, k, i, r, dtype): "auto" is the pointer kernel on CPU (and at these M on the GPU)
SEGMENT_CASES = ([("auto", *shape, dtype) for shape in SHAPES for dtype in KERNEL_DTYPES]
                 + [("tma", *shape, dtype) for shape in TMA_SHAPES for dtype in TMA_DTYPES])


@pytest.mark.parametrize("kernel,m,k,i,r,dtype", SEGMENT_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_low_rank_segment_matches_float64(kernel, m, k, i, r, dtype, bias):
    """out and the stored P of the segment, against float64."""
    x, gate, up, bg, bu, x_lr, b_g, b_u, b_lr = _low_rank_case(m, k, i, r, dtype, bias)
    w, b = packed_of(gate, up), packed_of(bg, bu)
    out, preact = _nan((m, i), x), _nan((m, 2 * i), x)
    gated_gemm_low_rank(x, w, x_lr, b_lr, "silu", b, store_preact=True, out=out, preact_out=preact,
                        config=TMA_CONFIG if kernel == "tma" else None, kernel=kernel)
    check(out, torch.cat([x, x_lr], 1), torch.cat([gate, b_g], 1), torch.cat([up, b_u], 1), bg, bu)
    _check_preact(preact, x, w, x_lr, b_lr, b if bias else torch.zeros_like(w[:, 0]))


@pytest.mark.parametrize("m", [45, 300])
def test_tma_low_rank_segment_in_the_split_tail(m):
    """Split-tail programs add the low-rank segment through their narrower b_lr boxes too."""
    dtype = TMA_DTYPES[-1]
    x, gate, up, bg, bu, x_lr, b_g, b_u, b_lr = _low_rank_case(m, 96, 128, 16, dtype, False)
    config = C(64, 64, 32, group_m=2, split_tail=True) if CUDA else C(16, 64, 32, group_m=2, split_tail=True)
    out, _ = gated_gemm_low_rank(x, packed_of(gate, up), x_lr, b_lr, "silu", config=config, kernel="tma")
    check(out, torch.cat([x, x_lr], 1), torch.cat([gate, b_g], 1), torch.cat([up, b_u], 1), None, None)


# the GEMV: one token, whole blocks; r of 1, at and past its step of 16; K not a multiple of its block
GEMV_SHAPES = [(1, 64, 48, 16), (1, 50, 32, 1), (1, 300, 64, 37)]
GEMV_CONFIG = C(1, 32, 64, num_warps=4, num_stages=1)  # two gate/up blocks per program, K in 64 steps


@pytest.mark.parametrize("m,k,i,r", GEMV_SHAPES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_gemv_low_rank_segment_matches_float64(m, k, i, r, dtype, bias, strided):
    """The GEMV's segment (inference at M = 1) against float64, out poisoned first."""
    x, gate, up, bg, bu, x_lr, b_g, b_u, b_lr = _low_rank_case(m, k, i, r, dtype, bias, strided)
    out = _nan((m, i), x)
    got, preact = gated_gemm_low_rank(x, packed_of(gate, up), x_lr, b_lr, "silu", packed_of(bg, bu), out=out,
                                      config=GEMV_CONFIG, kernel="gemv")
    assert got is out and preact is None
    check(out, torch.cat([x, x_lr], 1), torch.cat([gate, b_g], 1), torch.cat([up, b_u], 1), bg, bu)


def test_gemv_low_rank_refuses_what_it_cannot_run():
    """Two tokens, or a stored pre-activation: named, with the fix."""
    x, gate, up, _, _, x_lr, _, _, b_lr = _low_rank_case(2, 64, 48, 4, KERNEL_DTYPES[-1], False)
    with pytest.raises(ValueError, match="kernel='gemv' needs M == 1.*use kernel='auto'"):
        gated_gemm_low_rank(x, packed_of(gate, up), x_lr, b_lr, kernel="gemv")
    with pytest.raises(ValueError, match="kernel must be 'auto' or one of \\('pointer', 'tma'\\)"):
        gated_gemm_low_rank(x[:1], packed_of(gate, up), x_lr[:1], b_lr, store_preact=True, kernel="gemv")


def test_tma_low_rank_segment_refuses_unaligned_adapters():
    """r = 5 gives 10-byte rows, which TMA cannot address: named, with the fix."""
    x, gate, up, _, _, x_lr, _, _, b_lr = _low_rank_case(8, 64, 48, 5, TMA_DTYPES[-1], False)
    with pytest.raises(ValueError, match="kernel='tma' needs.*use kernel='auto'"):
        gated_gemm_low_rank(x, packed_of(gate, up), x_lr, b_lr, kernel="tma")


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
def test_low_rank_segment_strided_operands_and_stored_preact(act):
    """Non-contiguous x_lr and b_lr; with store_preact, P = x @ W^T + x_lr @ b_lr^T + b in the
    packed interleaved columns, against float64."""
    dtype = KERNEL_DTYPES[-1]
    m, k, i, r = 19, 48, 40, 7
    x, gate, up, bg, bu, x_lr, b_g, b_u, b_lr = _low_rank_case(m, k, i, r, dtype, True, strided=True)
    assert not x_lr.is_contiguous() and not b_lr.is_contiguous()
    w, b = packed_of(gate, up), packed_of(bg, bu)
    out, preact = _nan((m, i), x), _nan((m, 2 * i), x)
    gated_gemm_low_rank(x, w, x_lr, b_lr, act, b, store_preact=True, out=out, preact_out=preact)
    check(out, torch.cat([x, x_lr], 1), torch.cat([gate, b_g], 1), torch.cat([up, b_u], 1), bg, bu, act)
    _check_preact(preact, x, w, x_lr, b_lr, b)


def test_low_rank_segment_large_magnitude_inputs_stay_finite():
    dtype = KERNEL_DTYPES[-1]
    x, gate, up, bg, bu, x_lr, b_g, b_u, b_lr = _low_rank_case(9, 32, 24, 4, dtype, False)
    x_lr = x_lr * 40  # pre-activations of order 50-100: h stays below fp16's largest value
    out = _nan((9, 24), x)
    gated_gemm_low_rank(x * 30, packed_of(gate, up), x_lr, b_lr, "silu", out=out)
    check(out, torch.cat([x * 30, x_lr], 1), torch.cat([gate, b_g], 1), torch.cat([up, b_u], 1), None, None)


def test_low_rank_operands_that_do_not_fit_are_refused():
    dtype = KERNEL_DTYPES[-1]
    x, gate, up, _, _, x_lr, _, _, b_lr = _low_rank_case(5, 32, 16, 4, dtype, False)
    w = packed_of(gate, up)
    with pytest.raises(ValueError, match="x_lr must be"):
        gated_gemm_low_rank(x, w, x_lr[:4], b_lr)
    with pytest.raises(ValueError, match="b_lr must be"):
        gated_gemm_low_rank(x, w, x_lr, b_lr[:, :3])
    with pytest.raises(TypeError, match="b_lr must match"):
        gated_gemm_low_rank(x, w, x_lr, b_lr.double())


# (kernel, m, k, i): the TMA kernel needs I % 16 == 0 and 16-byte rows
DH_IN_CASES = [("backward_pointer", 1, 64, 48), ("backward_pointer", 7, 50, 37), ("backward_pointer", 130, 96, 80),
               ("backward_tma", 1, 64, 48), ("backward_tma", 7, 40, 96), ("backward_tma", 130, 96, 80)]
SMALL_BWD = {"backward_pointer": C(32, 32, 32, group_m=2), "backward_tma": C(16, 32, 16, group_m=2)}


@pytest.mark.parametrize("kernel,m,k,i,dtype", [
    (*case, dtype) for case in DH_IN_CASES
    for dtype in (TMA_DTYPES if case[0] == "backward_tma" else KERNEL_DTYPES)])
def test_backward_dh_in_joins_dh_before_the_derivative(kernel, m, k, i, dtype):
    """dP = d/dP of sum((dY @ Wd + dh_in) * h): the gradient a LoRA adapter on down_proj sends back
    through h, against float64 autograd; dh_in non-contiguous."""
    dy = torch.randn(m, k, device=DEVICE).to(dtype)
    wd = (torch.randn(k, i, device=DEVICE) / i**0.5).to(dtype)
    preact = torch.randn(m, 2 * i, device=DEVICE).to(dtype)
    dh_in = torch.randn(i, m, device=DEVICE).to(dtype).t()
    dpreact, h = _nan((m, 2 * i), dy), _nan((m, i), dy)
    gated_backward(dy, wd, preact, "silu", dpreact_out=dpreact, h_out=h, dh_in=dh_in,
                   config=None if CUDA else SMALL_BWD[kernel], kernel=kernel)
    gate, up = (t.requires_grad_() for t in split_interleaved(preact.double(), -1))
    h64 = torch.nn.functional.silu(gate) * up
    dh64 = dy.double() @ wd.double() + dh_in.double()
    dgate, dup = torch.autograd.grad(h64, (gate, up), dh64)
    ours = torch.cat(split_interleaved(dpreact, -1), -1)
    g16, u16 = (t.detach().requires_grad_() for t in split_interleaved(preact, -1))
    same = torch.autograd.grad(torch.nn.functional.silu(g16) * u16, (g16, u16), dy @ wd + dh_in)
    ref = torch.cat([dgate, dup], -1)
    bound = 2 * rel_err(torch.cat(same, -1), ref) + EPS[dtype]
    assert torch.isfinite(ours).all() and rel_err(ours, ref) <= bound, (rel_err(ours, ref), bound)
    assert rel_err(h, h64) <= 2 * rel_err(torch.nn.functional.silu(g16) * u16, h64) + EPS[dtype]


def test_backward_dh_in_of_the_wrong_shape_is_refused():
    dtype = KERNEL_DTYPES[-1]
    dy, wd = torch.randn(4, 32, device=DEVICE).to(dtype), torch.randn(32, 16, device=DEVICE).to(dtype)
    preact, dh_in = torch.randn(4, 32, device=DEVICE).to(dtype), torch.randn(4, 16, device=DEVICE).to(dtype)
    with pytest.raises(ValueError, match="dh_in must be"):
        gated_backward(dy, wd, preact, dh_in=dh_in[:3])


@pytest.mark.skipif(not CUDA, reason="bf16 through the kernels needs the GPU (the interpreter's bf16 dot is wrong)")
@pytest.mark.parametrize("r", [64, 5])
def test_low_rank_segment_bf16_on_the_gpu_matches_float64(r):
    """Prefill through the rules: r = 64 takes the TMA kernel, r = 5 (unaligned rows) the pointer kernel."""
    x, gate, up, bg, bu, x_lr, b_g, b_u, b_lr = _low_rank_case(4096, 4096, 1024, r, torch.bfloat16, False)
    out = _nan((4096, 1024), x)
    gated_gemm_low_rank(x, packed_of(gate, up), x_lr, b_lr, "silu", out=out)
    check(out, torch.cat([x, x_lr], 1), torch.cat([gate, b_g], 1), torch.cat([up, b_u], 1), None, None)


@pytest.mark.skipif(not CUDA, reason="bf16 through the kernels needs the GPU (the interpreter's bf16 dot is wrong)")
def test_backward_dh_in_bf16_on_the_gpu_through_the_rules():
    """Prefill through the rules (the TMA backward at M = 4096), against float64 autograd."""
    m, k, i = 4096, 1024, 2048
    dy = torch.randn(m, k, device=DEVICE).bfloat16()
    wd = (torch.randn(k, i, device=DEVICE) / i**0.5).bfloat16()
    preact, dh_in = torch.randn(m, 2 * i, device=DEVICE).bfloat16(), torch.randn(m, i, device=DEVICE).bfloat16()
    dpreact, _ = gated_backward(dy, wd, preact, "silu", dh_in=dh_in)
    gate, up = (t.requires_grad_() for t in split_interleaved(preact.double(), -1))
    ref = torch.cat(torch.autograd.grad(torch.nn.functional.silu(gate) * up, (gate, up),
                                        dy.double() @ wd.double() + dh_in.double()), -1)
    g16, u16 = (t.detach().requires_grad_() for t in split_interleaved(preact, -1))
    same = torch.cat(torch.autograd.grad(torch.nn.functional.silu(g16) * u16, (g16, u16), dy @ wd + dh_in), -1)
    assert rel_err(torch.cat(split_interleaved(dpreact, -1), -1), ref) <= 2 * rel_err(same, ref) + EPS[torch.bfloat16]
