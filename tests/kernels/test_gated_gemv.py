"""The one-token GEMV (`kernels/gated_gemv.py`) against float64: Triton's interpreter on CPU,
the real kernel on a GPU. Outputs start as NaN, so an unwritten column fails."""

from __future__ import annotations

import pytest
import torch

from swiglu_patch import pack_gate_up
from swiglu_patch.kernels.gated_gemm import GatedGemmConfig, gated_gemm
from helpers import DEVICE, KERNEL_DTYPES, check, make_case

# (K, I, block_n, block_k): K no multiple of block_k, I no multiple of block_n, one block only
CASES = [(72, 48, 32, 32), (100, 96, 64, 64), (64, 16, 32, 16), (130, 80, 16, 128)]


@pytest.mark.parametrize("k,i,block_n,block_k", CASES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_float64(k, i, block_n, block_k, dtype, act, bias):
    x, gate, up, bg, bu = make_case(1, k, i, dtype, bias)
    out = torch.full((1, i), float("nan"), dtype=dtype, device=DEVICE)
    cfg = GatedGemmConfig(1, block_n, block_k, num_warps=4, num_stages=1)
    gated_gemm(x, pack_gate_up(gate, up), act, pack_gate_up(bg, bu) if bias else None, out=out, config=cfg,
               kernel="gemv")
    check(out, x, gate, up, bg, bu, act)


def test_gemv_strided_input_weight_and_output():
    dtype = torch.float16
    x_full, gate, up, _, _ = make_case(1, 2 * 96, 64, dtype, bias=False)
    x = x_full[:, ::2]  # [1, 96], stride 2 along K
    packed_full = torch.cat([pack_gate_up(gate[:, ::2], up[:, ::2])] * 2, dim=1)  # [128, 192]
    packed = packed_full[:, :96]  # row stride 192
    out_full = torch.full((1, 2 * 64), float("nan"), dtype=dtype, device=DEVICE)
    out = out_full[:, ::2]
    assert not (x.is_contiguous() or packed.is_contiguous() or out.is_contiguous())
    gated_gemm(x, packed, "silu", out=out, config=GatedGemmConfig(1, 32, 32, num_warps=4), kernel="gemv")
    check(out, x, gate[:, ::2].contiguous(), up[:, ::2].contiguous(), None, None, "silu")
    assert out_full[:, 1::2].isnan().all()  # nothing written between the output's columns


def test_gemv_refuses_what_it_cannot_run():
    x, gate, up, _, _ = make_case(2, 32, 32, torch.float32, bias=False)
    with pytest.raises(ValueError, match="M == 1.*kernel='auto'"):
        gated_gemm(x, pack_gate_up(gate, up), kernel="gemv")
    x, gate, up, _, _ = make_case(1, 32, 40, torch.float32, bias=False)
    with pytest.raises(ValueError, match="I % 16 == 0"):
        gated_gemm(x, pack_gate_up(gate, up), kernel="gemv")
    x, gate, up, _, _ = make_case(1, 32, 32, torch.float32, bias=False)
    with pytest.raises(ValueError, match="block_n 24 is not a multiple of 16"):
        gated_gemm(x, pack_gate_up(gate, up), config=GatedGemmConfig(1, 24, 32), kernel="gemv")


def test_a_gemv_config_routes_one_token_to_the_gemv_and_more_to_the_pointer_kernel(monkeypatch):
    """kernel='auto' with a block_m == 1 config (what the M = 1 shape rule returns): M = 1 with
    whole blocks runs the GEMV; more tokens, or a partial block, fall back to the pointer
    kernel's table config; kernel='pointer' refuses it."""
    from swiglu_patch.kernels import gated_gemm as gg

    cfg = GatedGemmConfig(1, 32, 32, num_warps=4, num_stages=1)
    ran = []
    real = gg._gemv().gated_gemv
    monkeypatch.setattr(gg._gemv(), "gated_gemv", lambda *a: ran.append(1) or real(*a))
    for m, i, via_gemv in [(1, 48, True), (3, 48, False), (1, 40, False)]:
        x, gate, up, _, _ = make_case(m, 64, i, torch.float16, bias=False)
        out = gated_gemm(x, pack_gate_up(gate, up), "silu", config=cfg)
        check(out, x, gate, up, None, None, "silu")
        assert bool(ran) == via_gemv, (m, i)
        ran.clear()
    with pytest.raises(ValueError, match="block_m=1 is the one-token GEMV's"):
        gated_gemm(x, pack_gate_up(gate, up), "silu", config=cfg, kernel="pointer")
