"""Training's kernels, forced by name, against float64: the forward that stores the
pre-activation (STORE_PREACT) and the backward GEMM dY @ Wd with the gated derivative fused.

On CPU the kernels run under TRITON_INTERPRET=1 in fp32/fp16 (the TMA kernels in fp16: they
need 16-bit operands); on the GPU bf16 too. Every output starts as NaN, so an element a kernel
does not write fails. Pass rule (`helpers`' quack rule): the error of ours against float64
is within twice that of PyTorch's own same-dtype computation plus a per-dtype epsilon. The
float64 derivatives come from autograd through `helpers.epilogue64`, which shares no code
with the kernels or with training.py's written-out formulas.
"""

import pytest
import torch
from helpers import CUDA, DEVICE, EPS, KERNEL_DTYPES, check, epilogue64, make_case, packed_of, rel_err
from training.mlp_check import ALL_EPILOGUES as EPILOGUES

from swiglu_patch.kernels.configs import GatedGemmConfig as C
from swiglu_patch.kernels.configs import m_bucket
from swiglu_patch.kernels.dispatch import explain, gated_backward, gated_gemm, gated_gemm_with_preact
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.layout import interleave_gate_up, split_interleaved
from swiglu_patch.kernels.rules import BACKWARD_KERNELS, BACKWARD_RULES

TMA_DTYPES = [torch.float16] + ([torch.bfloat16] if CUDA else [])
# Interpreter tiles: many tiles and K steps, masked tails; the GPU takes the rules' tiles.
SMALL_FWD = {"pointer": C(32, 32, 32, group_m=2), "tma": C(16, 16, 16, group_m=2)}
SMALL_BWD = {"backward_pointer": C(32, 32, 32, group_m=2), "backward_tma": C(16, 32, 16, group_m=2)}


def _describe(e):
    return GatedEpilogue.of(e).describe()


def _poisoned(shape, like):
    return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


# -- the forward with STORE_PREACT --------------------------------------------------------

FWD_CASES = [("pointer", 1, 64, 48), ("pointer", 7, 50, 37), ("pointer", 199, 130, 100),
             ("tma", 1, 64, 48), ("tma", 37, 72, 64), ("tma", 199, 96, 80)]


@pytest.mark.parametrize("kernel,m,k,i", FWD_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_forward_stores_the_interleaved_preactivation(kernel, m, k, i, bias):
    dtype = TMA_DTYPES[-1] if kernel == "tma" else KERNEL_DTYPES[-1]
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias)
    w, b = packed_of(gate, up), packed_of(bg, bu)
    out, preact = _poisoned((m, i), x), _poisoned((m, 2 * i), x)
    config = None if CUDA else SMALL_FWD[kernel]
    gated_gemm_with_preact(x, w, "silu", b, out=out, preact_out=preact, config=config, kernel=kernel)
    check(out, x, gate, up, bg, bu, "silu")
    p64 = x.double() @ w.double().T + (b.double() if bias else 0)
    same = torch.nn.functional.linear(x, w, b)  # PyTorch's own rounding of P
    assert torch.isfinite(preact).all()
    assert rel_err(preact, p64) <= 2 * rel_err(same, p64) + EPS[dtype]
    # storing P changes nothing else: h is the inference kernel's, bit for bit
    plain = gated_gemm(x, w, "silu", b, config=config, kernel=kernel)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("epilogue", EPILOGUES, ids=_describe)
def test_stored_preactivation_is_before_scales_and_clamps(epilogue):
    x, gate, up, bg, bu = make_case(37, 72, 64, TMA_DTYPES[-1], bias=True, scale=30.0)
    w, b = packed_of(gate, up), packed_of(bg, bu)
    for kernel in ("pointer", "tma"):
        out, preact = gated_gemm_with_preact(x, w, epilogue, b, config=None if CUDA else SMALL_FWD[kernel],
                                             kernel=kernel)
        check(out, x, gate, up, bg, bu, epilogue)
        ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
        assert rel_err(preact, ref) <= 2 * rel_err(torch.nn.functional.linear(x, w, b), ref) + EPS[x.dtype]


def test_forward_preact_takes_non_contiguous_x_and_preact():
    dtype = KERNEL_DTYPES[-1]
    x, gate, up, bg, bu = make_case(2 * 45, 70, 53, dtype, bias=True)
    x = x[::2]
    w, b = packed_of(gate, up), packed_of(bg, bu)
    big = _poisoned((45, 2 * 2 * 53), x)
    preact = big[:, ::2]  # column stride 2
    out, _ = gated_gemm_with_preact(x, w, "gelu", b, preact_out=preact)  # auto: the pointer kernel
    check(out, x, gate, up, bg, bu, "gelu")
    p64 = x.double() @ w.double().T + b.double()
    assert rel_err(preact, p64) <= 2 * rel_err(torch.nn.functional.linear(x, w, b), p64) + EPS[dtype]
    assert torch.isnan(big[:, 1::2]).all(), "wrote outside the view"


@pytest.mark.parametrize("m", [45, 300])
def test_forward_preact_tma_split_tail(m):
    """Split-tail programs store P through their narrower boxes too."""
    x, gate, up, bg, bu = make_case(m, 96, 128, TMA_DTYPES[-1], bias=False)
    w = packed_of(gate, up)
    config = C(64, 64, 32, group_m=2, split_tail=True) if CUDA else C(16, 64, 32, group_m=2, split_tail=True)
    out, preact = gated_gemm_with_preact(x, w, "silu", config=config, kernel="tma")
    check(out, x, gate, up, None, None, "silu")
    p64 = x.double() @ w.double().T
    assert rel_err(preact, p64) <= 2 * rel_err(torch.nn.functional.linear(x, w), p64) + EPS[x.dtype]


def test_forward_preact_errors():
    x, gate, up, _, _ = make_case(5, 32, 16, KERNEL_DTYPES[-1], bias=False)
    w = packed_of(gate, up)
    with pytest.raises(ValueError, match="preact_out must be"):
        gated_gemm_with_preact(x, w, preact_out=x.new_empty(5, 31))
    with pytest.raises(ValueError, match="kernel must be 'auto' or one of"):
        gated_gemm_with_preact(x, w, kernel="grid")
    with pytest.raises(ValueError, match="kernel='tma' needs"):
        gated_gemm_with_preact(x.float(), w.float(), kernel="tma")


# -- the backward GEMM ---------------------------------------------------------------------


def _backward_case(m, k, i, dtype, scale=1.0, device=DEVICE):
    """dY [M, K], Wd [K, I], P [M, 2*I]: fresh random values, P of magnitude `scale`."""
    dy = torch.randn(m, k, device=device).to(dtype)
    wd = (torch.randn(k, i, device=device) / i**0.5).to(dtype)
    preact = (torch.randn(m, 2 * i, device=device) * scale).to(dtype)
    return dy, wd, preact


def _backward64(dy, wd, preact, epilogue):
    """(dP, h) in float64, by autograd through helpers.epilogue64."""
    gate, up = (t.requires_grad_() for t in split_interleaved(preact.double(), -1))
    h = epilogue64(gate, up, epilogue)
    dgate, dup = torch.autograd.grad(h, (gate, up), dy.double() @ wd.double())
    return torch.cat([dgate, dup], -1), h.detach()


def _backward_same_dtype(dy, wd, preact, epilogue):
    """(dP, h) as eager PyTorch gets them in the tensors' dtype: dH rounded, the epilogue's
    ops and their autograd in that dtype."""
    gate, up = (t.requires_grad_() for t in split_interleaved(preact, -1))
    h = GatedEpilogue.of(epilogue).apply(gate, up)
    dgate, dup = torch.autograd.grad(h, (gate, up), dy @ wd)
    return torch.cat([dgate, dup], -1), h.detach()


def check_backward(dpreact, h, dy, wd, preact, epilogue):
    """dP (interleaved) and h against float64, by the quack rule."""
    ref_dp, ref_h = _backward64(dy, wd, preact, epilogue)
    same_dp, same_h = _backward_same_dtype(dy, wd, preact, epilogue)
    ours_dp = torch.cat(split_interleaved(dpreact, -1), -1)
    for name, ours, same, ref in (("dP", ours_dp, same_dp, ref_dp), ("h", h, same_h, ref_h)):
        assert ours.dtype == dy.dtype and torch.isfinite(ours).all(), f"{name}: non-finite or wrong dtype"
        bound = 2 * rel_err(same, ref) + EPS[dy.dtype]
        assert rel_err(ours, ref) <= bound, f"{name}: error {rel_err(ours, ref):.3g} > bound {bound:.3g}"


def _run_backward(kernel, dy, wd, preact, epilogue, in_place=False, config=None):
    m, i = preact.shape[0], wd.shape[1]
    saved = preact.clone()
    dpreact = preact if in_place else _poisoned((m, 2 * i), preact)
    h = _poisoned((m, i), preact)
    config = config or (None if CUDA else SMALL_BWD[kernel])
    gated_backward(dy, wd, preact, epilogue, dpreact_out=dpreact, h_out=h, config=config, kernel=kernel)
    if not in_place:
        assert torch.equal(preact, saved), "P was written"
    return dpreact, h, saved


# (kernel, m, k, i): the TMA kernel needs I % 16 == 0 and 16-byte rows
BACKWARD_SHAPES = [("backward_pointer", 1, 64, 48), ("backward_pointer", 7, 50, 37),
                   ("backward_pointer", 199, 130, 100), ("backward_tma", 1, 64, 48),
                   ("backward_tma", 7, 40, 96), ("backward_tma", 199, 96, 80)]


@pytest.mark.parametrize("kernel,m,k,i", BACKWARD_SHAPES)
@pytest.mark.parametrize("in_place", [False, True])
def test_backward_kernel_matches_float64(kernel, m, k, i, in_place):
    dtype = TMA_DTYPES[-1] if kernel == "backward_tma" else KERNEL_DTYPES[-1]
    dy, wd, preact = _backward_case(m, k, i, dtype)
    dpreact, h, saved = _run_backward(kernel, dy, wd, preact, "silu", in_place=in_place)
    check_backward(dpreact, h, dy, wd, saved, "silu")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_backward_pointer_kernel_dtypes(dtype):
    dy, wd, preact = _backward_case(45, 70, 53, dtype)
    dpreact, h, saved = _run_backward("backward_pointer", dy, wd, preact, "gelu_tanh")
    check_backward(dpreact, h, dy, wd, saved, "gelu_tanh")


@pytest.mark.parametrize("kernel,m,k,i", [("backward_pointer", 7, 50, 37), ("backward_tma", 37, 72, 64)])
@pytest.mark.parametrize("epilogue", EPILOGUES, ids=_describe)
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_backward_kernel_computes_every_epilogue(kernel, m, k, i, epilogue, scale):
    """Scales and clamps, at ordinary and at large pre-activations (at 30x most clip: a clamp
    whose zero derivative were dropped, or applied where it does not clip, shows)."""
    dtype = TMA_DTYPES[-1] if kernel == "backward_tma" else KERNEL_DTYPES[-1]
    dy, wd, preact = _backward_case(m, k, i, dtype, scale=scale)
    dpreact, h, saved = _run_backward(kernel, dy, wd, preact, epilogue, in_place=True)
    check_backward(dpreact, h, dy, wd, saved, epilogue)
    e = GatedEpilogue.of(epilogue)
    if e.limit is not None and scale > 1:  # the case exercises the clamp
        plain, _, _ = _run_backward(kernel, dy, wd, saved.clone(), e.activation)
        assert not torch.allclose(dpreact, plain, rtol=0.1, atol=0.1)


@pytest.mark.parametrize("kernel", ["backward_pointer", "backward_tma", "backward_split"])
def test_a_clamp_on_its_bound_passes_the_gradient_as_torch_does(kernel):
    """P planted on the clamp's bounds (a quarter of gate at the limit, a quarter of up at each of
    +-limit): dP against float64 autograd through torch.clamp, which passes the gradient there up to
    torch 2.13 and not from 2.14 (tests/kernels/test_clamp_at_bound.py has the helpers' own case)."""
    epilogue = GatedEpilogue("silu", limit=2.0, clamp="gate")
    dtype = KERNEL_DTYPES[-1] if kernel == "backward_pointer" else TMA_DTYPES[-1]
    dy, wd, preact = _backward_case(37, 72, 64, dtype, scale=2.0)
    gate, up = (t.clone() for t in split_interleaved(preact, -1))
    gate[:, 0::4], up[:, 1::4], up[:, 2::4] = 2.0, 2.0, -2.0
    preact = interleave_gate_up(gate.T, up.T).T.contiguous()
    config = C(16, 32, 16, num_warps=4) if kernel == "backward_split" and not CUDA else None
    dpreact, h, saved = _run_backward(kernel, dy, wd, preact, epilogue, config=config)
    check_backward(dpreact, h, dy, wd, saved, epilogue)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_backward_large_magnitude_preactivations_stay_finite(activation):
    """|P| near 1e30 in fp32: act' is 0 or 1 out there, and g^3 overflowing must not give 0 * inf."""
    dy, wd, _ = _backward_case(7, 50, 37, torch.float32)
    preact = torch.randn(7, 74, device=DEVICE) * 1e30
    dpreact, _, saved = _run_backward("backward_pointer", dy, wd, preact, activation)
    dgate = split_interleaved(dpreact, -1)[0]
    assert torch.isfinite(dgate).all()
    ref_dgate = _backward64(dy, wd, saved, activation)[0][:, :37]
    assert rel_err(dgate, ref_dgate) < 1e-5


def test_backward_kernels_take_non_contiguous_dy_and_outputs():
    dtype = KERNEL_DTYPES[-1]
    dy, wd, preact = _backward_case(2 * 45, 2 * 70, 53, dtype)
    dy = dy[::2, ::2]  # both strides != natural
    wd = wd.t().contiguous().t()[::2]  # column-major Wd rows 0, 2, ..: [70, 53]
    preact = preact[::2]
    big = _poisoned((45, 2 * 2 * 53), preact)
    dpreact = big[:, ::2]
    h = _poisoned((53, 45), preact).t()
    gated_backward(dy, wd, preact, "silu", dpreact_out=dpreact, h_out=h)  # auto: the pointer kernel
    check_backward(dpreact, h, dy, wd, preact, "silu")
    assert torch.isnan(big[:, 1::2]).all(), "wrote outside the view"


def test_backward_rule_bounds_sit_on_bucket_edges():
    """Backward plans are cached per M bucket too."""
    for n, rule in enumerate(BACKWARD_RULES):
        assert rule.kernel in BACKWARD_KERNELS and rule.why, n
        low, high = rule.m
        for m in range(1, 20000):
            by_m = (low is None or m >= low) and (high is None or m <= high)
            by_bucket = (low is None or m_bucket(m) >= low) and (high is None or m_bucket(m) <= high)
            assert by_m == by_bucket, f"rule {n}: M bound {rule.m} cuts bucket {m_bucket(m)} at M = {m}"


@pytest.mark.parametrize("gpu", ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "cpu"])
def test_every_backward_call_gets_a_rule_its_kernel_can_run(gpu):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        if gpu == "cpu" and dtype == torch.bfloat16:
            continue  # refused before any rule (tests/kernels/test_dispatch.py)
        for m in (1, 16, 17, 65, 129, 4096, 100000):
            for i, aligned in ((14336, True), (14336, False), (37, True)):
                text = explain(gpu, dtype, m, 4096, i, tma_aligned=aligned, op="backward")
                chosen = next(line for line in text.splitlines() if "CHOSEN" in line)
                if "backward_tma" in chosen:
                    assert "H100" in gpu and dtype != torch.float32 and i % 16 == 0 and aligned and m >= 65, text
                if "backward_ws" in chosen:
                    assert "H100" in gpu and dtype != torch.float32 and i % 16 == 0 and aligned and m > 512, text
    for m, kernel in ((4096, "backward_ws"), (513, "backward_ws"), (512, "backward_split"), (129, "backward_split")):
        text = explain("NVIDIA H100 80GB HBM3", torch.bfloat16, m, 4096, 14336, op="backward")
        assert kernel in next(line for line in text.splitlines() if "CHOSEN" in line), text


def test_backward_errors():
    dy, wd, preact = _backward_case(5, 32, 16, KERNEL_DTYPES[-1])
    with pytest.raises(ValueError, match=r"preact must be \[M, 2\*I\]"):
        gated_backward(dy, wd, preact[:, :31])
    with pytest.raises(ValueError, match="dy must be"):
        gated_backward(dy[:, :31], wd, preact)
    with pytest.raises(TypeError, match="must match dy's dtype"):
        gated_backward(dy, wd.double(), preact)
    with pytest.raises(ValueError, match="h_out must be"):
        gated_backward(dy, wd, preact, h_out=dy.new_empty(5, 15))
    with pytest.raises(ValueError, match="kernel must be 'auto' or one of"):
        gated_backward(dy, wd, preact, kernel="tma")
    with pytest.raises(ValueError, match="kernel='backward_tma' needs"):
        gated_backward(dy.float(), wd.float(), preact.float(), kernel="backward_tma")


@pytest.mark.skipif(CUDA, reason="the interpreter's bf16 refusal")
def test_backward_refuses_bf16_in_the_interpreter():
    dy, wd, preact = _backward_case(5, 32, 16, torch.bfloat16)
    with pytest.raises(TypeError, match="interpreter computes bfloat16"):
        gated_backward(dy, wd, preact)
