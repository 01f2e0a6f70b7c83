"""The activation's `tanh.approx.f32` path: when it is on, and that it stays within the float64 bound.

`dispatch.gated_gemm` evaluates silu and gelu_tanh as g/2 + g/2 * tanh(.) with one MUFU op for
bf16/fp16 inputs on the GPU (`default_approx_tanh`); fp32 and the CPU interpreter keep
exp and a reciprocal. The GPU tests run both paths on the pointer, TMA and GEMV kernels and
hold each to the same float64 bound as every other kernel test.
"""

import pytest
import torch

from helpers import CUDA, DEVICE, check, make_case, packed_of

from swiglu_patch.kernels.device import interpreting
from swiglu_patch.kernels.dispatch import default_approx_tanh, gated_gemm


def test_default_is_exact_for_fp32_and_on_cpu():
    assert not default_approx_tanh(torch.ones(2, 2, dtype=torch.float32, device=DEVICE))
    assert not default_approx_tanh(torch.ones(2, 2, dtype=torch.bfloat16))  # CPU tensor
    if CUDA and not interpreting():
        assert default_approx_tanh(torch.ones(2, 2, dtype=torch.bfloat16, device="cuda"))
        assert default_approx_tanh(torch.ones(2, 2, dtype=torch.float16, device="cuda"))


@pytest.mark.skipif(not interpreting(), reason="the interpreter's refusal; the GPU runs the PTX")
def test_interpreter_refuses_approx_tanh_by_name():
    x, gate, up, _, _ = make_case(3, 32, 32, torch.float16, bias=False)
    with pytest.raises(ValueError, match="approx_tanh=True needs the GPU"):
        gated_gemm(x, packed_of(gate, up), "silu", approx_tanh=True)


# (m, k, i, kernel): the one-token GEMV, the pointer kernel (decode and odd sizes), the TMA kernel
GPU_CASES = [(1, 512, 256, "gemv"), (5, 136, 100, "pointer"), (300, 256, 200, "pointer"), (1000, 512, 384, "tma")]


@pytest.mark.skipif(not CUDA or interpreting(), reason="tanh.approx.f32 is inline PTX: GPU only")
@pytest.mark.parametrize("m,k,i,kernel", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [False, True])
def test_approx_and_exact_both_match_float64(m, k, i, kernel, dtype, act, bias):
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias)
    packed, packed_b = packed_of(gate, up), packed_of(bg, bu)
    outs = {}
    for approx in (True, False):
        out = torch.full((m, i), float("nan"), dtype=dtype, device="cuda")  # poisoned
        gated_gemm(x, packed, act, packed_b, out=out, kernel=kernel, approx_tanh=approx)
        check(out, x, gate, up, bg, bu, act)
        outs[approx] = out.float()
    # the two differ by the last bit of some outputs, not more: 2^-11 of tanh is below a 16-bit ulp
    ulp = torch.finfo(dtype).eps * outs[False].abs().clamp_min(1.0)
    assert ((outs[True] - outs[False]).abs() <= 2 * ulp).all()
