"""`gated_linear`, the public functional API, against a float64 reference: both backends,
leading dims and strides, the PackedGateUp guard, gradients, errors and the registered op.

Kernel-level tests are in test_kernels.py; the pass rule is `helpers.check`.
"""

import os
import subprocess
import sys

import pytest
import torch
from helpers import ACTS, CUDA, DEVICE, KERNEL_DTYPES, check, make_case, packed_of, reference64, rel_err

from swiglu_patch import GatedEpilogue, PackedGateUp, gated_linear, pack_gate_up


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
    out = gated_linear(x, pack_gate_up(gate, up, bg, bu), act, backend="torch")
    check(out, x, gate, up, bg, bu, act)


def test_torch_reference_is_differentiable():
    x, gate, up, _, _ = make_case(3, 8, 20, torch.float64, bias=False, device="cpu")
    weight = packed_of(gate, up).requires_grad_()
    x.requires_grad_()
    for epilogue in ("silu", GatedEpilogue("gelu_tanh", gate_scale=0.7, out_scale=1.3, limit=0.5)):
        torch.autograd.gradcheck(
            lambda a, w: gated_linear(a, PackedGateUp.from_interleaved(w), epilogue, backend="torch"), (x, weight),
            fast_mode=True)


def test_triton_refuses_to_drop_gradients():
    x, gate, up, _, _ = make_case(4, 16, 16, torch.float32, bias=False)
    packed = PackedGateUp.from_interleaved(packed_of(gate, up).requires_grad_())
    with pytest.raises(NotImplementedError, match="for inference.*swiglu_patch.training.gated_mlp"):
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
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 16\]"):
        gated_linear(x[:, :15], packed)
    with pytest.raises(TypeError, match="match x's dtype"):
        gated_linear(x.half(), packed)
    with pytest.raises(NotImplementedError, match="supported: silu, gelu_tanh, gelu"):
        gated_linear(x, packed, "relu")
    with pytest.raises(ValueError, match="backend must be one of"):
        gated_linear(x, packed, backend="cuda")
    with pytest.raises(ValueError, match=r"bias must be \[32\]"):
        PackedGateUp.from_interleaved(packed.weight, torch.zeros(31, device=DEVICE))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        gated_linear(x.double(), PackedGateUp(packed.weight.double()), backend="triton")
    with pytest.raises(TypeError, match="floating-point"):
        gated_linear(x.int(), packed)
    with pytest.raises(ValueError, match="limit must be a positive number"):
        GatedEpilogue("silu", limit=-1.0)


def test_a_raw_tensor_is_refused_with_the_fix():
    """torch.cat([gate, up]) (Phi-3's chunked layout) would run and be wrong: the API takes only
    a PackedGateUp, and says how to make one."""
    x, gate, up, _, _ = make_case(3, 16, 16, torch.float32, bias=False)
    with pytest.raises(TypeError, match=r"PackedGateUp.*pack_gate_up\(gate_weight, up_weight\).*torch.cat"):
        gated_linear(x, torch.cat([gate, up]))


@pytest.mark.skipif(CUDA, reason="the interpreter's bf16 refusal; the GPU runs bf16")
def test_bf16_in_the_interpreter_is_refused():
    x, gate, up, _, _ = make_case(3, 16, 16, torch.bfloat16, bias=False)
    with pytest.raises(TypeError, match="interpreter computes bfloat16 matrix products wrongly.*float16/float32"):
        gated_linear(x, pack_gate_up(gate, up), backend="triton")


@pytest.mark.parametrize("triton_version, numpy_version, blocked", [
    ("3.6.0", "2.4.0", True), ("3.6.0", "2.5.2", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.0", False),
    ("3.9.0", "2.5.2", False), ("3.6.0", "2.4.0rc1", True), ("3.10.0", "3.0.0", False)])
def test_the_interpreter_blocker_names_triton_36_under_numpy_24(triton_version, numpy_version, blocked, monkeypatch):
    import numpy
    import triton

    from swiglu_patch.kernels import device

    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    device.interpreter_blocker.cache_clear()
    try:
        message = device.interpreter_blocker()
    finally:
        device.interpreter_blocker.cache_clear()
    assert (message is not None) == blocked
    if blocked:
        assert f"Triton {triton_version}" in message and f"NumPy {numpy_version}" in message
        assert "numpy<2.4" in message and "triton>=3.7" in message


@pytest.mark.skipif(CUDA, reason="checks the CPU error of an interpreter that cannot run the kernels")
def test_triton_on_cpu_with_a_blocked_interpreter_names_the_fix(monkeypatch):
    from swiglu_patch.kernels import dispatch

    monkeypatch.setattr(dispatch, "interpreter_blocker", lambda: "Triton 3.6.0's interpreter cannot run under NumPy 2.4.0")
    x, gate, up, _, _ = make_case(3, 16, 16, torch.float32, bias=False)
    with pytest.raises(RuntimeError, match=r"gated_linear: backend='triton' on cpu tensors: Triton 3.6.0.*backend='torch'"):
        gated_linear(x, pack_gate_up(gate, up), backend="triton")
    gated_linear(x, pack_gate_up(gate, up), backend="torch")  # the PyTorch path is not blocked


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_strided_bias_is_read_correctly(backend):
    x, gate, up, bg, bu = make_case(7, 32, 40, KERNEL_DTYPES[-1], bias=True)
    wide = torch.zeros(160, dtype=x.dtype, device=DEVICE)
    wide[::2] = packed_of(bg, bu)
    out = gated_linear(x, PackedGateUp.from_interleaved(packed_of(gate, up), wide[::2]), "silu", backend=backend)
    check(out, x, gate, up, bg, bu, "silu")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_one_token_and_large_inputs(backend):
    for m, scale in ((1, 1.0), (5, 50.0)):
        x, gate, up, bg, bu = make_case(m, 48, 40, KERNEL_DTYPES[-1], bias=True, scale=scale)
        epilogue = GatedEpilogue("silu", limit=7.0)
        check(gated_linear(x, pack_gate_up(gate, up, bg, bu), epilogue, backend=backend), x, gate, up, bg, bu,
              epilogue)


def test_the_reference_survives_inference_mode_then_trains():
    """No cache of index tensors: a forward under inference_mode must not poison a later backward."""
    x, gate, up, _, _ = make_case(5, 16, 40, torch.float32, bias=False, device="cpu")
    packed = pack_gate_up(gate, up)
    with torch.inference_mode():
        gated_linear(x, packed, backend="torch")
    w = packed.weight.clone().requires_grad_()
    gated_linear(x, PackedGateUp.from_interleaved(w), backend="torch").sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="checks the CPU error when Triton's interpreter is off")
def test_triton_on_cpu_without_interpreter_explains():
    code = (
        "import torch; from swiglu_patch import gated_linear, pack_gate_up\n"
        "try:\n gated_linear(torch.randn(2, 16), pack_gate_up(torch.randn(16, 16), torch.randn(16, 16)), "
        "backend='triton')\n"
        "except RuntimeError as e: print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr


def test_registered_op_matches_and_passes_opcheck():
    """The op torch.compile and CUDA graphs see: same result, and a fake impl that fits."""
    x, gate, up, bg, bu = make_case(9, 32, 48, torch.float32, bias=True)
    packed, packed_b = packed_of(gate, up), packed_of(bg, bu)
    epilogue = GatedEpilogue("gelu_tanh", gate_scale=0.5, limit=1.5, clamp="activation")
    out = torch.ops.swiglu_patch.gated_gemm(x, packed, packed_b, "gelu_tanh", 0.5, 1.0, 2, 1.5)
    check(out, x, gate, up, bg, bu, epilogue)
    torch.library.opcheck(torch.ops.swiglu_patch.gated_gemm.default, (x, packed, packed_b, "silu", 1.0, 1.0, 0, 0.0),
                          test_utils=("test_schema", "test_faketensor"))
