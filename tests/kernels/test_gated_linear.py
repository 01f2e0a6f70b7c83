"""gated_linear and the Triton kernel against a float64 reference.

Pass rule (quack's): the relative error of ours against float64 is at most twice that of
PyTorch's own same-dtype computation (two GEMMs, act, mul, as HF eager does) plus a small
per-dtype epsilon. On CPU the kernel runs through TRITON_INTERPRET=1, fp16/fp32 only
(Triton 3.9's interpreter gets bf16 tl.dot wrong, FACTS.md); bf16 runs on the GPU.
"""

import os
import subprocess
import sys

import pytest
import torch
from helpers import ACTS, CUDA, DEVICE, KERNEL_DTYPES, check, make_case, reference64, rel_err

from swiglu_patch import gated_linear, pack_gate_up
from swiglu_patch.kernels.gated_gemm import GatedGemmConfig, gated_gemm

SHAPES = [(1, 64, 48), (7, 50, 37), (199, 130, 100)] + ([(4096, 256, 200)] if CUDA else [])


@pytest.mark.parametrize("m,k,i", SHAPES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_float64(m, k, i, dtype, act, bias):
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias)
    packed = pack_gate_up(gate, up)
    packed_b = pack_gate_up(bg, bu) if bias else None
    out = torch.full((m, i), float("nan"), dtype=dtype, device=DEVICE)  # poisoned: unwritten stays NaN
    gated_gemm(x, packed, act, packed_b, out=out)
    check(out, x, gate, up, bg, bu, act)


@pytest.mark.parametrize(
    "config", [GatedGemmConfig(16, 16, 16, group_m=2), GatedGemmConfig(32, 32, 32, group_m=1)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_many_tiles_and_k_steps(config, dtype):
    """Small pinned tiles: many output tiles, grouped ordering, several K steps, masked tails."""
    x, gate, up, bg, bu = make_case(45, 70, 53, dtype, bias=True)
    out = torch.full((45, 53), float("nan"), dtype=dtype, device=DEVICE)
    gated_gemm(x, pack_gate_up(gate, up), "silu", pack_gate_up(bg, bu), out=out, config=config)
    check(out, x, gate, up, bg, bu, "silu")


@pytest.mark.parametrize("m", [1, 5, 16, 27])
def test_every_shipped_shape_rule_config_matches_float64(m):
    """The bucket's table config and every per-GPU, per-shape config (`_SHAPE_RULES`), whichever
    GPU runs the test (bf16 there, fp16 in the interpreter), on a shape whose I and K are no
    multiple of any block."""
    from swiglu_patch.kernels import gated_gemm as gg

    dtype = torch.bfloat16 if CUDA else torch.float16
    x, gate, up, bg, bu = make_case(m, 1000, 600, dtype, bias=True)
    for config in [gg.default_config(m, dtype), *(rule.config for rule in gg._SHAPE_RULES)]:
        out = torch.full((m, 600), float("nan"), dtype=dtype, device=DEVICE)
        gated_gemm(x, pack_gate_up(gate, up), "silu", pack_gate_up(bg, bu), out=out, config=config)
        check(out, x, gate, up, bg, bu, "silu")


def test_config_per_gpu_and_shape(monkeypatch):
    from swiglu_patch.kernels import gated_gemm as gg

    pick = gg.default_config.__wrapped__  # uncached: the GPU name is patched below
    table, table32 = gg._for_bucket(gg._DEFAULTS, 1), gg._for_bucket(gg._DEFAULTS, 32)
    short_k, gemv_narrow_i, narrow_i, mid_wide_i, mid_wide_i_h200, tma_70b = (rule.config for rule in gg._SHAPE_RULES)
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        monkeypatch.setattr(gg, "_gpu_name", lambda index, name=name: name)
        assert pick(1, torch.bfloat16, 8192, 0, 2048) == pick(16, torch.bfloat16, 18944, 0, 1536) == short_k
        assert pick(2, torch.bfloat16, 14336, 0, 4096) == pick(16, torch.bfloat16, 14336, 0, 3584) == narrow_i
        assert pick(1, torch.bfloat16, 18944, 0, 3584) == table  # Qwen2.5-7B: wider I than the rule covers
        assert pick(1, torch.bfloat16, 28672, 0, 8192) == table  # Llama-3-70B
        assert pick(1, torch.bfloat16, 7168, 0, 8192) == narrow_i  # Llama-3-70B, 1 of 4 GPUs
        assert pick(1, torch.bfloat16, 3584, 0, 8192) == table  # 1 of 8 GPUs: below the rule's I
        assert pick(32, torch.bfloat16, 14336, 0, 4096) == table32  # Llama-3-8B at M = 32: the table
        assert pick(32, torch.bfloat16, 36864, 0, 4608) == table32  # Gemma-2-27B: K above the rule's
        assert pick(64, torch.bfloat16, 18944, 0, 3584) == gg._for_bucket(gg._DEFAULTS, 64)
        assert pick(1, torch.bfloat16, 14336, None, 4096) == table  # no CUDA device: the bucket table
        assert pick(2, torch.float32, 14336, 0, 4096).block_k == narrow_i.block_k // 2
        # the GEMV at M = 1 on Llama-3-8B and Gemma-2-9B, not at M = 2 nor on a 70B tensor-parallel shard
        assert pick(1, torch.bfloat16, 14336, 0, 4096) == pick(1, torch.bfloat16, 14336, 0, 3584) == gemv_narrow_i
        assert gemv_narrow_i.block_m == 1 and pick(2, torch.bfloat16, 14336, 0, 4096) == narrow_i
    # Qwen2.5-7B at 17 <= M <= 32: a tile per GPU (the H200 is patched in last)
    assert pick(32, torch.bfloat16, 18944, 0, 3584) == pick(24, torch.bfloat16, 18944, 0, 3584) == mid_wide_i_h200
    monkeypatch.setattr(gg, "_gpu_name", lambda index: "NVIDIA H100 80GB HBM3")
    assert pick(32, torch.bfloat16, 18944, 0, 3584) == pick(24, torch.bfloat16, 18944, 0, 3584) == mid_wide_i
    assert mid_wide_i != mid_wide_i_h200
    # Llama-3-70B at 33 <= M <= 64 on the H100: the TMA tile with two programs per SM
    table64 = gg._for_bucket(gg._DEFAULTS, 64)
    assert pick(64, torch.bfloat16, 28672, 0, 8192) == pick(33, torch.bfloat16, 28672, 0, 8192) == tma_70b
    assert tma_70b.programs_per_sm == 2
    assert pick(32, torch.bfloat16, 28672, 0, 8192) != tma_70b  # bucket 32: not measured
    assert pick(64, torch.bfloat16, 36864, 0, 4608) == table64  # Gemma-2-27B: K below the rule's
    assert pick(64, torch.bfloat16, 18944, 0, 3584) == table64  # Qwen2.5-7B: the tile lost there
    monkeypatch.setattr(gg, "_gpu_name", lambda index: "NVIDIA H200")
    assert pick(64, torch.bfloat16, 28672, 0, 8192) == table64  # not measured on the H200
    monkeypatch.setattr(gg, "_gpu_name", lambda index: "NVIDIA A100-SXM4-80GB")
    assert pick(1, torch.bfloat16, 14336, 0, 4096) == table  # no rule measured there


@pytest.mark.skipif(not CUDA, reason="shape rules apply on a CUDA device; the interpreter takes the bucket table")
def test_auto_runs_the_kernel_a_shape_rule_names(monkeypatch):
    """kernel='auto' without a config runs what `_SHAPE_RULES` picks for this GPU and shape (the TMA
    kernel for a programs_per_sm > 1 tile, the GEMV for block_m == 1, else the pointer kernel);
    kernel='pointer' without a config runs the bucket's pointer tile instead of raising."""
    from swiglu_patch.kernels import gated_gemm as gg

    m, k, i = 64, 8192, 16400  # Llama-3-70B's K; I just past the rule's lower bound, no multiple of 128
    x, gate, up, _, _ = make_case(m, k, i, torch.bfloat16, bias=False)
    packed = pack_gate_up(gate, up)
    rule = gg.default_config(gg.m_bucket(m), x.dtype, i, 0, k)
    calls = []
    real_tma = gg._tma().gated_gemm_tma
    monkeypatch.setattr(gg._tma(), "gated_gemm_tma", lambda *a, **kw: calls.append(a[-1]) or real_tma(*a, **kw))
    for kernel in ("auto", "pointer"):
        out = torch.full((m, i), float("nan"), dtype=x.dtype, device=DEVICE)
        gated_gemm(x, packed, "silu", out=out, kernel=kernel)
        check(out, x, gate, up, None, None, "silu")
    tma_route = rule.programs_per_sm > 1 and gg._use_tma(x, packed, out, min_m=1)
    assert calls == ([rule] if tma_route else [])
    if "H100" in torch.cuda.get_device_name(0):
        assert tma_route  # the 70B rule (H100)
    x1 = x[:1]
    out1 = torch.full((1, i), float("nan"), dtype=x.dtype, device=DEVICE)
    gated_gemm(x1, packed, "silu", out=out1, kernel="pointer")  # whatever rule covers M = 1
    check(out1, x1, gate, up, None, None, "silu")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_non_contiguous_and_leading_dims(backend, dtype):
    x_full, gate, up, _, _ = make_case(2 * 3 * 5, 48, 40, dtype, bias=False)
    x = x_full.view(6, 5, 48)[::2]  # [3, 5, 48], non-contiguous
    assert not x.is_contiguous()
    out = gated_linear(x, pack_gate_up(gate, up), "gelu_tanh", backend=backend)
    assert out.shape == (3, 5, 40)
    check(out.reshape(-1, 40), x.reshape(-1, 48), gate, up, None, None, "gelu_tanh")
    # a column-strided x: every other feature of a wider tensor
    xs = torch.randn(9, 96, device=DEVICE).to(dtype)[:, ::2]
    check(gated_linear(xs, pack_gate_up(gate, up), "silu", backend=backend), xs, gate, up, None, None, "silu")


@pytest.mark.parametrize("m", [1, 7, 600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", list(ACTS))
def test_torch_reference_matches_float64(m, dtype, act):
    x, gate, up, bg, bu = make_case(m, 40, 33, dtype, bias=True, device="cpu")
    out = gated_linear(x, pack_gate_up(gate, up), act, pack_gate_up(bg, bu), backend="torch")
    check(out, x, gate, up, bg, bu, act)


def test_torch_reference_is_differentiable():
    x, gate, up, _, _ = make_case(5, 16, 20, torch.float64, bias=False, device="cpu")
    packed = pack_gate_up(gate, up).requires_grad_()
    x.requires_grad_()
    torch.autograd.gradcheck(lambda a, w: gated_linear(a, w, "silu", backend="torch"), (x, packed))


def test_triton_refuses_to_drop_gradients():
    x, gate, up, _, _ = make_case(4, 16, 16, torch.float32, bias=False)
    packed = pack_gate_up(gate, up).requires_grad_()
    with pytest.raises(NotImplementedError, match="no backward"):
        gated_linear(x, packed, backend="triton")
    with torch.no_grad():
        gated_linear(x, packed, backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA: tf32 only exists on the GPU")
def test_fp32_respects_allow_tf32():
    x, gate, up, _, _ = make_case(256, 1024, 512, torch.float32, bias=False)
    packed = pack_gate_up(gate, up)
    ref = reference64(x, gate, up, None, None, "silu")
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert rel_err(gated_linear(x, packed), ref) < 1e-5  # tf32 would give ~1e-4..1e-3
        torch.backends.cuda.matmul.allow_tf32 = True
        assert rel_err(gated_linear(x, packed), ref) > 1e-5
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_bad_arguments_name_the_problem():
    x, gate, up, _, _ = make_case(3, 16, 16, torch.float32, bias=False)
    packed = pack_gate_up(gate, up)
    with pytest.raises(ValueError, match="last dim 16"):
        gated_linear(x[:, :15], packed)
    with pytest.raises(TypeError, match="match x's dtype"):
        gated_linear(x.half(), packed)
    with pytest.raises(NotImplementedError, match="supported: silu, gelu_tanh, gelu"):
        gated_linear(x, packed, activation="relu")
    with pytest.raises(ValueError, match="backend must be one of"):
        gated_linear(x, packed, backend="cuda")
    with pytest.raises(ValueError, match=r"bias must be \[32\]"):
        gated_linear(x, packed, bias=torch.zeros(31, device=DEVICE))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        gated_linear(x.double(), packed.double(), backend="triton")
    with pytest.raises(TypeError, match="floating-point"):
        gated_linear(x.int(), packed.int())


@pytest.mark.skipif(CUDA, reason="checks the CPU error when Triton's interpreter is off")
def test_triton_on_cpu_without_interpreter_explains():
    code = (
        "import torch; from swiglu_patch import gated_linear\n"
        "try:\n gated_linear(torch.randn(2, 16), torch.randn(32, 16), backend='triton')\n"
        "except RuntimeError as e: print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr


TMA_DTYPES = [torch.float16] + ([torch.bfloat16] if CUDA else [])
TMA_CONFIG = None if CUDA else GatedGemmConfig(16, 16, 16, group_m=2)  # small tiles: many in the interpreter


@pytest.mark.parametrize("m,k,i", [(1, 64, 48), (37, 72, 64), (300, 136, 96)] + ([(4096, 512, 384)] if CUDA else []))
@pytest.mark.parametrize("dtype", TMA_DTYPES)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("bias", [False, True])
def test_tma_kernel_matches_float64(m, k, i, dtype, act, bias):
    from swiglu_patch.kernels.gated_gemm_tma import tma_supported

    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias)
    packed = pack_gate_up(gate, up)
    out = torch.full((m, i), float("nan"), dtype=dtype, device=DEVICE)
    assert tma_supported(x, packed, out)
    gated_gemm(x, packed, act, pack_gate_up(bg, bu) if bias else None, out=out, config=TMA_CONFIG, kernel="tma")
    check(out, x, gate, up, bg, bu, act)


def test_tma_kernel_strided_rows():
    x_full, gate, up, _, _ = make_case(90, 64, 32, torch.float16, bias=False)
    x = x_full[::3]  # row stride 3*K: still TMA-aligned
    out = torch.full((30, 32), float("nan"), dtype=torch.float16, device=DEVICE)
    gated_gemm(x, pack_gate_up(gate, up), "silu", out=out, config=TMA_CONFIG, kernel="tma")
    check(out, x, gate, up, None, None, "silu")


def test_tma_refuses_partial_blocks_and_misaligned_rows():
    from swiglu_patch.kernels.gated_gemm_tma import tma_supported

    x, gate, up, _, _ = make_case(8, 64, 40, torch.float16, bias=False)  # I = 40: a partial block
    assert not tma_supported(x, pack_gate_up(gate, up), None)
    x, gate, up, _, _ = make_case(8, 60, 48, torch.float16, bias=False)  # K*2 bytes not a multiple of 16
    assert not tma_supported(x, pack_gate_up(gate, up), None)


@pytest.mark.parametrize("device_descriptors", [True, False])
def test_tma_host_and_device_descriptors(device_descriptors):
    from swiglu_patch.kernels.activations import ACTIVATION_CODES
    from swiglu_patch.kernels.gated_gemm import _TMA_DEFAULTS
    from swiglu_patch.kernels.gated_gemm_tma import gated_gemm_tma

    x, gate, up, bg, bu = make_case(70, 64, 48, torch.float16, bias=True)
    out = torch.full((70, 48), float("nan"), dtype=torch.float16, device=DEVICE)
    cfg = TMA_CONFIG or _TMA_DEFAULTS[max(_TMA_DEFAULTS)]
    gated_gemm_tma(x, pack_gate_up(gate, up), ACTIVATION_CODES["gelu"], CUDA, pack_gate_up(bg, bu), out, cfg,
                   device_descriptors=device_descriptors)
    check(out, x, gate, up, bg, bu, "gelu")


# Stream-K: (m, k, i) whose last wave is partial, on the interpreter's 4 programs with 16x(2*16)
# tiles, or the GPU's SMs with 64x(2*32) tiles: tiles split across 2-5 programs, all tiles
# stream-K (fewer tiles than programs), whole tiles inside one program's run, K below one block.
SK_CONFIG = GatedGemmConfig(16, 16, 16, group_m=2, stream_k=True) if not CUDA else \
    GatedGemmConfig(64, 32, 64, group_m=8, num_warps=4, num_stages=3, stream_k=True)
SK_CASES = [(37, 72, 48), (16, 72, 32), (5, 200, 48), (16, 8, 48), (70, 136, 96)] + \
    ([(300, 512, 96), (4100, 640, 1120), (1000, 4096, 16)] if CUDA else [])


@pytest.mark.parametrize("m,k,i", SK_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_tma_stream_k_matches_float64_and_is_deterministic(m, k, i, bias):
    import triton

    from swiglu_patch.kernels import gated_gemm_tma as tma
    from swiglu_patch.kernels.activations import ACTIVATION_CODES
    from swiglu_patch.kernels.stream_k import all_counts_zero

    x, gate, up, bg, bu = make_case(m, k, i, torch.float16, bias)
    packed, packed_b = pack_gate_up(gate, up), (pack_gate_up(bg, bu) if bias else None)
    programs = tma._num_sms(0) if CUDA else 4
    tiles = triton.cdiv(m, SK_CONFIG.block_m) * triton.cdiv(i, SK_CONFIG.block_n)
    plan = tma.plan_tail(m, i, SK_CONFIG, programs, min_idle=0.0)
    assert plan.stream_k and plan.dp_tiles < tiles  # the case has stream-K tiles
    outs = []
    for _ in range(2):
        out = torch.full((m, i), float("nan"), dtype=torch.float16, device=DEVICE)
        tma.gated_gemm_tma(x, packed, ACTIVATION_CODES["gelu_tanh"], CUDA, packed_b, out, SK_CONFIG,
                           stream_k_min_idle=0.0)
        outs.append(out)
    check(outs[0], x, gate, up, bg, bu, "gelu_tanh")
    assert torch.equal(outs[0], outs[1])  # pieces are summed in program order, whoever arrives last
    assert all_counts_zero()  # every count reset for the next call


def test_tail_plan_on_an_h100():
    from swiglu_patch.kernels.gated_gemm_tma import STREAM_K_MIN_IDLE, TailPlan, plan_tail

    cfg = GatedGemmConfig(128, 128, 64, stream_k=True)
    both = GatedGemmConfig(128, 128, 64, stream_k=True, split_tail=True)
    # Llama-3-8B (I = 14336): 112 column tiles; on 132 SMs
    assert STREAM_K_MIN_IDLE == 0.8
    assert plan_tail(128, 14336, cfg, 132) == TailPlan(112)  # one wave, 15% idle: all data-parallel
    assert plan_tail(384, 14336, both, 132) == TailPlan(336)  # last wave 72 of 132 (45% idle): whole tiles
    assert plan_tail(1280, 14336, cfg, 132) == TailPlan(1120)  # last wave 64 of 132 (52% idle): data-parallel
    assert plan_tail(1280, 14336, cfg, 132, min_idle=0.4) == TailPlan(1056, stream_k=True)  # a lower bar
    assert plan_tail(2432, 14336, cfg, 132) == TailPlan(2112, stream_k=True)  # tail of 16: 88% idle
    assert plan_tail(2432, 14336, GatedGemmConfig(128, 128, 64), 132) == TailPlan(2128)  # neither on
    # split tail: M = 512 has 448 tiles, a last wave of 52 (61% idle) -> 104 half-width tiles
    assert plan_tail(512, 14336, both, 132) == TailPlan(396, split=2)
    assert plan_tail(512, 18944, both, 132) == TailPlan(528, split=2)  # Qwen2.5-7B: 64 -> 128
    assert plan_tail(1280, 14336, both, 132) == TailPlan(1056, split=2)
    # 88% idle: stream-K first if on, else quarter-width tiles
    assert plan_tail(2432, 14336, both, 132) == TailPlan(2112, stream_k=True)
    quarter = GatedGemmConfig(128, 128, 64, split_tail=True)
    assert plan_tail(2432, 14336, quarter, 132) == TailPlan(2112, split=4)
    # 128x(2*64) tiles: 4256, a tail of 32; 64 / 4 columns is below SPLIT_TAIL_MIN_N, so halves
    assert plan_tail(2432, 14336, GatedGemmConfig(128, 64, 64, split_tail=True), 132) == TailPlan(4224, split=2)
    assert plan_tail(2432, 14336, GatedGemmConfig(128, 32, 64, split_tail=True), 132) == TailPlan(8512)  # too narrow


# Split tail: (m, k, i, config) whose last wave leaves half the programs or more idle, on the
# interpreter's 4 programs or the GPU's SMs; tails of 2 and 4 narrower tiles each, a partial
# column tile (I not a multiple of block_n) and a partial row tile in the tail.
SPLIT_CASES = [
    (37, 72, 96, GatedGemmConfig(16, 64, 16, group_m=2, split_tail=True)),  # 6 tiles: a tail of 2 -> 4
    (70, 40, 96, GatedGemmConfig(16, 128, 32, group_m=2, split_tail=True)),  # 4 + 1 tiles: 1 -> 4, past I
    (40, 64, 176, GatedGemmConfig(16, 64, 16, group_m=1, split_tail=True)),  # 8 + 1: partial rows and columns
] if not CUDA else [
    (300, 512, 1120, GatedGemmConfig(64, 128, 64, num_warps=4, num_stages=3, split_tail=True)),  # all 45 split
    (512, 1024, 14336, GatedGemmConfig(128, 128, 64, num_warps=8, num_stages=4, warp_specialize=True,
                                      stream_k=True, split_tail=True)),
    (2432, 256, 14336, GatedGemmConfig(128, 128, 64, num_warps=8, num_stages=4, split_tail=True)),
    (129, 512, 14336 + 48, GatedGemmConfig(64, 64, 128, num_warps=4, num_stages=4, split_tail=True)),
]


@pytest.mark.parametrize("m,k,i,cfg", SPLIT_CASES)
@pytest.mark.parametrize("device_descriptors", [True, False])
@pytest.mark.parametrize("dtype", TMA_DTYPES)
def test_tma_split_tail_matches_float64(m, k, i, cfg, device_descriptors, dtype):
    from swiglu_patch.kernels import gated_gemm_tma as tma
    from swiglu_patch.kernels.activations import ACTIVATION_CODES

    programs = tma._num_sms(0) if CUDA else 4
    assert tma.plan_tail(m, i, cfg, programs).split > 1  # the case has a split tail
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias=True)
    out = torch.full((m, i), float("nan"), dtype=dtype, device=DEVICE)
    tma.gated_gemm_tma(x, pack_gate_up(gate, up), ACTIVATION_CODES["silu"], CUDA, pack_gate_up(bg, bu), out, cfg,
                       device_descriptors=device_descriptors)
    check(out, x, gate, up, bg, bu, "silu")


# Two persistent programs per SM (8 on the interpreter's 4 "SMs"): tiles strided by twice the
# SM count, a partial last wave, with and without a split tail.
PAIRED_CASES = [
    (37, 72, 96, GatedGemmConfig(16, 32, 16, group_m=2, programs_per_sm=2)),  # 9 tiles on 8 programs
    (37, 72, 64, GatedGemmConfig(16, 64, 16, group_m=2, programs_per_sm=2, split_tail=True)),  # 3 tiles -> 3 x 2
] if not CUDA else [
    (2432, 256, 14336, GatedGemmConfig(128, 64, 64, num_warps=4, num_stages=3, programs_per_sm=2, split_tail=True)),
    (300, 512, 1120 + 16, GatedGemmConfig(64, 64, 128, num_warps=4, num_stages=2, programs_per_sm=2)),
]


@pytest.mark.parametrize("m,k,i,cfg", PAIRED_CASES)
@pytest.mark.parametrize("dtype", TMA_DTYPES)
def test_tma_two_programs_per_sm_matches_float64(m, k, i, cfg, dtype):
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias=True)
    out = torch.full((m, i), float("nan"), dtype=dtype, device=DEVICE)
    gated_gemm(x, pack_gate_up(gate, up), "gelu_tanh", pack_gate_up(bg, bu), out=out, config=cfg, kernel="tma")
    check(out, x, gate, up, bg, bu, "gelu_tanh")


def test_registered_op_matches_and_passes_opcheck():
    """The op torch.compile and CUDA graphs see: same result, and a fake impl that fits."""
    x, gate, up, bg, bu = make_case(9, 32, 48, torch.float32, bias=True)
    packed, packed_b = pack_gate_up(gate, up), pack_gate_up(bg, bu)
    out = torch.ops.swiglu_patch.gated_gemm(x, packed, packed_b, "gelu_tanh")
    check(out, x, gate, up, bg, bu, "gelu_tanh")
    torch.library.opcheck(torch.ops.swiglu_patch.gated_gemm.default, (x, packed, packed_b, "silu"),
                          test_utils=("test_schema", "test_faketensor"))
