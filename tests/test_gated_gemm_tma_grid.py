"""The one-program-per-tile TMA kernel (`gated_gemm_tma_grid`) against a float64 reference.

On CPU it runs through TRITON_INTERPRET=1 (fp16; the interpreter gets bf16 tl.dot wrong and
TMA needs 16-bit operands), on the GPU in bf16 and fp16. Pass rule as in test_gated_linear.py:
at most twice the relative error of PyTorch's same-dtype computation plus a per-dtype epsilon.
Every output starts as NaN, so an element the kernel does not write fails.
"""

import pytest
import torch

from swiglu_patch import pack_gate_up
from swiglu_patch.kernels import gated_gemm as gg
from swiglu_patch.kernels.activations import ACTIVATION_CODES
from swiglu_patch.kernels.gated_gemm import GatedGemmConfig, gated_gemm
from swiglu_patch.kernels.gated_gemm_tma_grid import gated_gemm_tma_grid
from tests.test_gated_linear import CUDA, DEVICE, check, make_case

DTYPES = [torch.float16] + ([torch.bfloat16] if CUDA else [])
# Tiles small enough for the interpreter; on the GPU the shipped rules' tiles.
TILES = [GatedGemmConfig(16, 32, 32, group_m=2), GatedGemmConfig(32, 16, 64, group_m=4, num_stages=2)] if not CUDA \
    else [rule.config for rule in gg._SHAPE_RULES if rule.config.grid_boxes]
# (M, K, I): one token; M and K no multiple of any block; I a multiple of 16 but of no wider block
SHAPES = [(1, 64, 48), (37, 200, 80), (5, 96, 208)] if not CUDA else [(1, 1000, 1040), (37, 4104, 1040),
                                                                       (100, 1000, 2064)]


def _run(x, packed, act, bias, out, cfg, two_dots, device_descriptors):
    return gated_gemm_tma_grid(x, packed, ACTIVATION_CODES[act], CUDA, bias, out, cfg, two_dots, device_descriptors)


@pytest.mark.parametrize("m,k,i", SHAPES)
@pytest.mark.parametrize("two_dots", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grid_kernel_matches_float64(m, k, i, two_dots, dtype):
    """Both weight-box layouts, with bias, both activations, every tile."""
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias=True)
    packed, bias = pack_gate_up(gate, up), pack_gate_up(bg, bu)
    for cfg in TILES:
        for act in ("silu", "gelu_tanh"):
            out = torch.full((m, i), float("nan"), dtype=dtype, device=DEVICE)
            _run(x, packed, act, bias, out, cfg, two_dots, device_descriptors=False)
            check(out, x, gate, up, bg, bu, act)


@pytest.mark.parametrize("two_dots", [False, True])
def test_device_descriptors_and_strided_rows(two_dots):
    """Descriptors built by the programs; x, out and the weight are row slices of wider tensors
    (unit inner stride, 16-byte-aligned row strides: what TMA needs)."""
    m, k, i = (37, 200, 80) if not CUDA else (37, 1000, 1040)
    dtype = DTYPES[-1]
    x_wide, gate, up, bg, bu = make_case(m, k + 24, i, dtype, bias=False)
    x = x_wide[:, :k]
    gate, up = gate[:, :k], up[:, :k]
    packed_wide = torch.zeros(2 * i, k + 40, dtype=dtype, device=DEVICE)
    packed_wide[:, :k] = pack_gate_up(gate, up)
    packed = packed_wide[:, :k]
    out_wide = torch.full((m, i + 8), float("nan"), dtype=dtype, device=DEVICE)
    out = out_wide[:, :i]
    assert not x.is_contiguous() and not packed.is_contiguous() and not out.is_contiguous()
    _run(x, packed, "silu", None, out, TILES[0], two_dots, device_descriptors=True)
    check(out, x, gate, up, None, None, "silu")
    assert out_wide[:, i:].isnan().all(), "wrote past the output's columns"


def test_kernel_grid_needs_what_tma_needs():
    """kernel='grid' where the call cannot run it: an error that names the requirement and the fix."""
    x, gate, up, _, _ = make_case(3, 64, 40, torch.float16, bias=False)  # I = 40: not whole 16-row blocks
    with pytest.raises(ValueError, match="kernel='grid' needs .* I % 16 == 0; use kernel='auto'"):
        gated_gemm(x, pack_gate_up(gate, up), "silu", kernel="grid")


@pytest.mark.skipif(not CUDA, reason="the grid kernel runs through gated_gemm on a Hopper GPU only")
@pytest.mark.parametrize("m", [1, 8, 32, 64, 100])
def test_gated_gemm_routes_grid_configs(m):
    """gated_gemm with a grid config (kernel='auto' or 'grid') runs it; fp32 takes the pointer kernel."""
    x, gate, up, bg, bu = make_case(m, 1000, 1040, torch.bfloat16, bias=True)
    packed, bias = pack_gate_up(gate, up), pack_gate_up(bg, bu)
    for kernel in ("auto", "grid"):
        for cfg in TILES:
            out = torch.full((m, 1040), float("nan"), dtype=x.dtype, device=DEVICE)
            gated_gemm(x, packed, "gelu_tanh", bias, out=out, config=cfg, kernel=kernel)
            check(out, x, gate, up, bg, bu, "gelu_tanh")
    x32, g32, u32 = x.float(), gate.float(), up.float()
    out = gated_gemm(x32, pack_gate_up(g32, u32), "silu", config=TILES[0])
    check(out, x32, g32, u32, None, None, "silu")
