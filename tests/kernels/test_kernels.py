"""Every kernel, forced by name, against a float64 reference: odd shapes, biases, strides, epilogues.

On CPU the kernels run through TRITON_INTERPRET=1 in fp32/fp16 (Triton 3.9's interpreter
gets bf16 tl.dot wrong; the TMA kernels need 16-bit operands, so fp16 there); on the GPU the
same tests run the compiled kernels, bf16 included. Every output starts as NaN, so an
element a kernel does not write fails. Pass rule: `helpers.check`.
"""

import pytest
import torch
from helpers import ACTS, CUDA, DEVICE, KERNEL_DTYPES, check, make_case, packed_of

from swiglu_patch.kernels.configs import GatedGemmConfig as C
from swiglu_patch.kernels.dispatch import gated_gemm
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.rules import RULES

TMA_DTYPES = [torch.float16] + ([torch.bfloat16] if CUDA else [])
# Interpreter tiles are small (many tiles, several K steps); the GPU runs the rules' tiles.
SMALL = {"pointer": C(16, 16, 16, group_m=2), "gemv": C(1, 32, 32), "tma": C(32, 32, 32, group_m=2),
         "grid": C(16, 32, 32, group_m=2)}
EPILOGUES = [
    "silu", "gelu_tanh", "gelu",
    GatedEpilogue("silu", gate_scale=0.8839, out_scale=0.5859),  # Falcon-H1's mlp_multipliers
    GatedEpilogue("silu", limit=1.0, clamp="gate"),  # DeepSeek-V4 / GLM-5-next swiglu_limit
    GatedEpilogue("silu", limit=1.0, clamp="activation"),  # Step-3.7 swiglu_limits_shared
    GatedEpilogue("gelu_tanh", gate_scale=2.0, limit=2.5),
]


def _run(kernel, x, gate, up, bg, bu, epilogue, config=None, out=None):
    m, i = x.shape[0], gate.shape[0]
    if out is None:
        out = torch.full((m, i), float("nan"), dtype=x.dtype, device=x.device)  # poisoned
    config = config or (None if CUDA else SMALL[kernel])
    gated_gemm(x, packed_of(gate, up), epilogue, packed_of(bg, bu), out=out, config=config, kernel=kernel)
    return out


POINTER_SHAPES = [(1, 64, 48), (7, 50, 37), (199, 130, 100)] + ([(4096, 256, 200)] if CUDA else [])


@pytest.mark.parametrize("m,k,i", POINTER_SHAPES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("bias", [False, True])
def test_pointer_kernel_matches_float64(m, k, i, dtype, act, bias):
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias)
    out = torch.full((m, i), float("nan"), dtype=dtype, device=DEVICE)  # the rule's tile for this M
    gated_gemm(x, packed_of(gate, up), act, packed_of(bg, bu), out=out, kernel="pointer")
    check(out, x, gate, up, bg, bu, act)


@pytest.mark.parametrize("config", [C(16, 16, 16, group_m=2), C(32, 32, 32, group_m=1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pointer_kernel_many_tiles_and_k_steps(config, dtype):
    """Small pinned tiles: many output tiles, grouped ordering, several K steps, masked tails."""
    x, gate, up, bg, bu = make_case(45, 70, 53, dtype, bias=True)
    check(_run("pointer", x, gate, up, bg, bu, "silu", config=config), x, gate, up, bg, bu, "silu")


# (kernel, m, k, i): shapes each kernel takes (TMA kernels: I % 16 == 0, 16-byte rows)
EPILOGUE_CASES = [("pointer", 7, 50, 37), ("gemv", 1, 72, 48), ("tma", 37, 72, 64), ("grid", 5, 96, 80)]


@pytest.mark.parametrize("kernel,m,k,i", EPILOGUE_CASES)
@pytest.mark.parametrize("epilogue", EPILOGUES, ids=lambda e: GatedEpilogue.of(e).describe())
@pytest.mark.parametrize("scale", [1.0, 30.0])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES if CUDA else [None])
def test_every_kernel_computes_every_epilogue(kernel, m, k, i, epilogue, scale, dtype):
    """Scales and clamps on every kernel, at ordinary and at large input scale (a dropped clamp
    only shows where pre-activations pass the limit; at 30x most do); on the GPU in bf16, fp16
    and fp32 (the TMA kernels take 16-bit dtypes only), in the interpreter in one dtype."""
    if dtype is None:
        dtype = TMA_DTYPES[-1] if kernel in ("tma", "grid") else KERNEL_DTYPES[-1]
    if kernel in ("tma", "grid") and dtype not in TMA_DTYPES:
        pytest.skip("the TMA kernels take bf16/fp16 only")
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias=True, scale=scale)
    out = _run(kernel, x, gate, up, bg, bu, epilogue)
    check(out, x, gate, up, bg, bu, epilogue)
    if GatedEpilogue.of(epilogue).limit is not None and scale > 1:  # the case exercises the clamp
        plain = _run(kernel, x, gate, up, bg, bu, GatedEpilogue.of(epilogue).activation)
        assert not torch.allclose(out, plain, rtol=0.1, atol=0.1)


@pytest.mark.parametrize("kernel,m,k,i", EPILOGUE_CASES)
def test_every_kernel_reads_a_strided_bias(kernel, m, k, i):
    """A bias with stride 2 (a view of a wider tensor): read as the values it holds."""
    dtype = TMA_DTYPES[-1] if kernel in ("tma", "grid") else KERNEL_DTYPES[-1]
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias=True)
    wide = torch.zeros(4 * i, dtype=dtype, device=DEVICE)
    wide[::2] = packed_of(bg, bu)
    bias = wide[::2]
    assert bias.stride(0) == 2
    out = torch.full((m, i), float("nan"), dtype=dtype, device=DEVICE)
    gated_gemm(x, packed_of(gate, up), "silu", bias, out=out, config=None if CUDA else SMALL[kernel], kernel=kernel)
    check(out, x, gate, up, bg, bu, "silu")


# -- the one-token GEMV --

GEMV_CASES = [(72, 48, 32, 32), (100, 96, 64, 64), (64, 16, 32, 16), (130, 80, 16, 128)]


@pytest.mark.parametrize("k,i,block_n,block_k", GEMV_CASES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_float64(k, i, block_n, block_k, dtype, act, bias):
    """K no multiple of block_k, I no multiple of block_n, a single block."""
    x, gate, up, bg, bu = make_case(1, k, i, dtype, bias)
    out = _run("gemv", x, gate, up, bg, bu, act, config=C(1, block_n, block_k, num_warps=4, num_stages=1))
    check(out, x, gate, up, bg, bu, act)


def test_gemv_strided_input_weight_and_output():
    dtype = torch.float16
    x_full, gate, up, _, _ = make_case(1, 2 * 96, 64, dtype, bias=False)
    x = x_full[:, ::2]  # [1, 96], stride 2 along K
    packed_full = torch.cat([packed_of(gate[:, ::2], up[:, ::2])] * 2, dim=1)  # [128, 192]
    packed = packed_full[:, :96]  # row stride 192
    out_full = torch.full((1, 2 * 64), float("nan"), dtype=dtype, device=DEVICE)
    out = out_full[:, ::2]
    assert not (x.is_contiguous() or packed.is_contiguous() or out.is_contiguous())
    gated_gemm(x, packed, "silu", out=out, config=C(1, 32, 32, num_warps=4), kernel="gemv")
    check(out, x, gate[:, ::2].contiguous(), up[:, ::2].contiguous(), None, None, "silu")
    assert out_full[:, 1::2].isnan().all()  # nothing written between the output's columns


def test_forced_kernels_refuse_what_they_cannot_run():
    x, gate, up, _, _ = make_case(2, 32, 32, torch.float32, bias=False)
    with pytest.raises(ValueError, match="kernel='gemv' needs M == 1.*kernel='auto'"):
        gated_gemm(x, packed_of(gate, up), kernel="gemv")
    x, gate, up, _, _ = make_case(1, 32, 40, torch.float32, bias=False)
    with pytest.raises(ValueError, match="I % 16 == 0"):
        gated_gemm(x, packed_of(gate, up), kernel="gemv")
    x, gate, up, _, _ = make_case(1, 32, 32, torch.float32, bias=False)
    with pytest.raises(ValueError, match="block_n 24 is not a multiple of 16"):
        gated_gemm(x, packed_of(gate, up), config=C(1, 24, 32), kernel="gemv")
    x, gate, up, _, _ = make_case(3, 64, 40, torch.float16, bias=False)  # I = 40: not whole 16-row blocks
    for kernel in ("grid", "tma"):
        with pytest.raises(ValueError, match=f"kernel='{kernel}' needs .* I % 16 == 0.*kernel='auto'"):
            gated_gemm(x, packed_of(gate, up), "silu", kernel=kernel)
    x, gate, up, _, _ = make_case(8, 60, 48, torch.float16, bias=False)  # K * 2 bytes: no multiple of 16
    with pytest.raises(ValueError, match="16-byte-aligned rows"):
        gated_gemm(x, packed_of(gate, up), "silu", kernel="tma")
    with pytest.raises(ValueError, match="kernel must be 'auto' or one of"):
        gated_gemm(x, packed_of(gate, up), "silu", kernel="cublas")
    with pytest.raises(ValueError, match="a config needs the kernel it is for"):
        gated_gemm(x, packed_of(gate, up), "silu", config=C(16, 16, 16))


# -- the persistent TMA kernel --

TMA_SHAPES = [(1, 64, 48), (37, 72, 64), (300, 136, 96)] + ([(4096, 512, 384)] if CUDA else [])


@pytest.mark.parametrize("m,k,i", TMA_SHAPES)
@pytest.mark.parametrize("dtype", TMA_DTYPES)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("bias", [False, True])
def test_tma_kernel_matches_float64(m, k, i, dtype, act, bias):
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias)
    check(_run("tma", x, gate, up, bg, bu, act), x, gate, up, bg, bu, act)


def test_tma_kernel_strided_rows():
    x_full, gate, up, _, _ = make_case(90, 64, 32, torch.float16, bias=False)
    x = x_full[::3]  # row stride 3*K: still TMA-aligned
    check(_run("tma", x, gate, up, None, None, "silu"), x, gate, up, None, None, "silu")


def test_tail_split_on_an_h100():
    from swiglu_patch.kernels.gated_gemm_tma import tail_split

    split = C(128, 128, 64, split_tail=True)
    # Llama-3-8B (I = 14336): 112 column tiles, on 132 SMs
    assert tail_split(128, 14336, split, 132) == (112, 1)  # one wave: nothing to split
    assert tail_split(384, 14336, split, 132) == (336, 1)  # last wave 72 of 132: 45% idle, whole tiles
    assert tail_split(512, 14336, split, 132) == (396, 2)  # 448 tiles, a last wave of 52 -> 104 half tiles
    assert tail_split(512, 18944, split, 132) == (528, 2)  # Qwen2.5-7B: 64 -> 128
    assert tail_split(2432, 14336, split, 132) == (2112, 4)  # a tail of 16 -> 64 quarter tiles
    assert tail_split(2432, 14336, C(128, 128, 64), 132) == (2128, 1)  # split_tail off
    # 128x(2*64) tiles: a tail of 32; 64 / 4 columns is below SPLIT_TAIL_MIN_N, so halves
    assert tail_split(2432, 14336, C(128, 64, 64, split_tail=True), 132) == (4224, 2)
    assert tail_split(2432, 14336, C(128, 32, 64, split_tail=True), 132) == (8512, 1)  # too narrow


# (m, k, i, config): last waves that leave half the programs or more idle, on the interpreter's
# 4 programs or the GPU's SMs; tails of 2 and 4 narrower tiles, partial row and column tiles.
SPLIT_CASES = [
    (37, 72, 96, C(16, 64, 16, group_m=2, split_tail=True)),  # 6 tiles: a tail of 2 -> 4
    (70, 40, 96, C(16, 128, 32, group_m=2, split_tail=True)),  # 4 + 1 tiles: 1 -> 4, past I
    (40, 64, 176, C(16, 64, 16, group_m=1, split_tail=True)),  # 8 + 1: partial rows and columns
] if not CUDA else [
    (300, 512, 1120, C(64, 128, 64, num_warps=4, num_stages=3, split_tail=True)),
    (512, 1024, 14336, C(128, 128, 64, num_warps=8, num_stages=4, warp_specialize=True, split_tail=True)),
    (2432, 256, 14336, C(128, 128, 64, num_warps=8, num_stages=4, split_tail=True)),
    (129, 512, 14336 + 48, C(64, 64, 128, num_warps=4, num_stages=4, split_tail=True)),
]


@pytest.mark.parametrize("m,k,i,cfg", SPLIT_CASES)
@pytest.mark.parametrize("dtype", TMA_DTYPES)
def test_tma_split_tail_matches_float64(m, k, i, cfg, dtype):
    from swiglu_patch.kernels.device import num_sms
    from swiglu_patch.kernels.gated_gemm_tma import tail_split

    assert tail_split(m, i, cfg, num_sms(0) if CUDA else 4)[1] > 1  # the case has a split tail
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias=True)
    check(_run("tma", x, gate, up, bg, bu, "silu", config=cfg), x, gate, up, bg, bu, "silu")


# Two persistent programs per SM (8 on the interpreter's 4 "SMs"): a partial last wave, with and
# without a split tail.
PAIRED_CASES = [
    (37, 72, 96, C(16, 32, 16, group_m=2, programs_per_sm=2)),  # 9 tiles on 8 programs
    (37, 72, 64, C(16, 64, 16, group_m=2, programs_per_sm=2, split_tail=True)),  # 3 tiles -> 3 x 2
] if not CUDA else [
    (2432, 256, 14336, C(128, 64, 64, num_warps=4, num_stages=3, programs_per_sm=2, split_tail=True)),
    (300, 512, 1120 + 16, C(64, 64, 128, num_warps=4, num_stages=2, programs_per_sm=2)),
]


@pytest.mark.parametrize("m,k,i,cfg", PAIRED_CASES)
@pytest.mark.parametrize("dtype", TMA_DTYPES)
def test_tma_two_programs_per_sm_matches_float64(m, k, i, cfg, dtype):
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias=True)
    check(_run("tma", x, gate, up, bg, bu, "gelu_tanh", config=cfg), x, gate, up, bg, bu, "gelu_tanh")


# -- the one-program-per-tile TMA kernel --

GRID_TILES = [C(16, 32, 32, group_m=2), C(32, 16, 64, group_m=4, num_stages=2)] if not CUDA \
    else sorted({r.config for r in RULES if r.kernel == "grid"}, key=str)
GRID_SHAPES = [(1, 64, 48), (37, 200, 80), (5, 96, 208)] if not CUDA else [(1, 1000, 1040), (37, 4104, 1040),
                                                                            (100, 1000, 2064)]


@pytest.mark.parametrize("m,k,i", GRID_SHAPES)
@pytest.mark.parametrize("boxes", [1, 2])
@pytest.mark.parametrize("dtype", TMA_DTYPES)
def test_grid_kernel_matches_float64(m, k, i, boxes, dtype):
    """Both weight-box layouts, with bias, both tanh activations, every tile."""
    from dataclasses import replace

    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias=True)
    for cfg in GRID_TILES:
        for act in ("silu", "gelu_tanh"):
            out = _run("grid", x, gate, up, bg, bu, act, config=replace(cfg, weight_boxes=boxes))
            check(out, x, gate, up, bg, bu, act)


@pytest.mark.parametrize("kernel", ["grid", "tma"])
def test_tma_kernels_on_strided_rows(kernel):
    """x, out and the weight are row slices of wider tensors (unit inner stride, 16-byte-aligned
    rows: what TMA needs); nothing is written past the output's columns."""
    m, k, i = (37, 200, 80) if not CUDA else (37, 1000, 1040)
    dtype = TMA_DTYPES[-1]
    x_wide, gate, up, _, _ = make_case(m, k + 24, i, dtype, bias=False)
    x, gate, up = x_wide[:, :k], gate[:, :k], up[:, :k]
    packed_wide = torch.zeros(2 * i, k + 40, dtype=dtype, device=DEVICE)
    packed_wide[:, :k] = packed_of(gate, up)
    packed = packed_wide[:, :k]
    out_wide = torch.full((m, i + 8), float("nan"), dtype=dtype, device=DEVICE)
    out = out_wide[:, :i]
    assert not x.is_contiguous() and not packed.is_contiguous() and not out.is_contiguous()
    gated_gemm(x, packed, "silu", out=out, config=None if CUDA else SMALL[kernel], kernel=kernel)
    check(out, x, gate.contiguous(), up.contiguous(), None, None, "silu")
    assert out_wide[:, i:].isnan().all(), "wrote past the output's columns"


@pytest.mark.parametrize("kernel,m,k,i", [("pointer", 7, 50, 37), ("gemv", 1, 72, 48), ("tma", 300, 72, 64)])
def test_repeated_calls_through_the_fast_launch(kernel, m, k, i):
    """Later calls skip Triton's binding (`launcher.FastLaunch`): each must still write every
    element right, also when a call's pointers lose the 16-byte alignment the first call had
    (a new specialization), and when the output has other strides."""
    from swiglu_patch.kernels.dispatch import MODULES

    dtype = TMA_DTYPES[-1] if kernel == "tma" else KERNEL_DTYPES[-1]
    x, gate, up, bg, bu = make_case(m + 1, k + 8, i, dtype, bias=True)
    packed, bias = packed_of(gate, up), packed_of(bg, bu)
    launch = MODULES[kernel].make_launcher(
        SMALL[kernel] if not CUDA else C(64, 64, 64, num_warps=4, num_stages=3) if kernel != "gemv" else C(1, 32, 64),
        dict(GatedEpilogue("silu").constexprs(), APPROX_TANH=False), True, dtype)
    cases = [(x[:m, :k], packed[:, :k]), (x[:m, :k], packed[:, :k])]
    if kernel != "tma":  # TMA needs 16-byte alignment: the others take an x that starts one element in
        cases.append((x[1:m + 1, 1:k + 1], packed[:, :k]))
    for xs, ws in cases:
        out = torch.full((m, i), float("nan"), dtype=dtype, device=DEVICE)
        launch(xs, ws, bias, out)
        check(out, xs, gate[:, :k], up[:, :k], bg, bu, "silu")


def test_fast_launch_specialization_keys():
    """The key tells apart what Triton specializes on: alignment, 1, multiples of 16, int32 range."""
    from swiglu_patch.kernels.launcher import _spec

    t = torch.zeros(64, dtype=torch.float16)
    assert _spec((t,)) != _spec((t[1:],))  # 2-byte offset: not 16-byte aligned
    assert _spec((t,)) != _spec((t.float(),))
    assert len({_spec((v,)) for v in (1, 2, 16, 17, 2**31, -(2**31) - 1)}) == 5  # 2 and 17 alike
    assert _spec((2,)) == _spec((17,)) and _spec((32,)) == _spec((16,))


@pytest.mark.skipif(not CUDA, reason="the int-keyed launch path runs only on CUDA (the interpreter takes Triton's)")
def test_fast_launch_int_keyed_path_relaunches_only_what_it_compiled():
    """Repeated calls with the same ints, aligned tensors and dtypes take the int-keyed entry (and,
    on Triton 3.6, its C launch function); a call that differs in any of these must not reuse it."""
    import triton
    import triton.language as tl

    from swiglu_patch.kernels.launcher import FastLaunch

    @triton.jit
    def scale_copy(src, dst, n, stride, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs * stride, mask=offs < n) * 2, mask=offs < n)

    fast = FastLaunch(scale_copy, dict(BLOCK=128))
    base = torch.randn(4096, device=DEVICE)

    def run(src, n, stride, dtype=torch.float32):
        src = src.to(dtype)
        dst = torch.full((n,), float("nan"), device=DEVICE, dtype=dtype)
        fast(triton.cdiv(n, 128), 0, src, dst, n, stride)
        torch.testing.assert_close(dst, src[: n * stride: stride][:n] * 2, rtol=0, atol=0)

    for _ in range(3):
        run(base, 1000, 1)
    assert len(fast._by_ints) == 1
    run(base[1:], 1000, 1)  # 4-byte offset: unaligned, not the aligned entry
    run(base, 999, 1)
    run(base, 500, 2)
    run(base, 1000, 1, torch.float16)
    run(base, 1000, 1, torch.float16)
    run(base, 1000, 1, torch.float16)
    run(base, 1, 1)  # n == 1: Triton specializes on it
    run(base, 1, 1)
    run(base, 1, 1)
    assert len(fast._by_ints) >= 3
