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
from helpers import CUDA, DEVICE, check, make_case

DTYPES = [torch.float16] + ([torch.bfloat16] if CUDA else [])
# Tiles small enough for the interpreter; on the GPU the shipped rules' tiles.
TILES = [GatedGemmConfig(16, 32, 32, group_m=2), GatedGemmConfig(32, 16, 64, group_m=4, num_stages=2)] if not CUDA \
    else [rule.config for rule in gg._GRAPH_RULES]
assert TILES and all(rule.config.grid_boxes in (1, 2) for rule in gg._GRAPH_RULES)  # no test runs on an empty list
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
    small = min(TILES, key=lambda c: c.block_m * c.block_k + 2 * c.block_n * c.block_k)  # fits in fp32
    out = gated_gemm(x32, pack_gate_up(g32, u32), "silu", config=small)
    check(out, x32, g32, u32, None, None, "silu")


def _grid(bm, bn, bk, stages, boxes, group_m=4):
    return GatedGemmConfig(bm, bn, bk, group_m=group_m, num_warps=4, num_stages=stages, grid_boxes=boxes)


SHAPES_KI = {"qwen2.5-7b": (18944, 3584), "llama-3-8b": (14336, 4096), "gemma-2-9b": (14336, 3584),
             "llama-3-70b": (28672, 8192), "gemma-2-27b": (36864, 4608), "llama-3.2-1b": (8192, 2048)}
# What a captured call runs per (M, shape), written out from the sweeps the rules cite; a pair
# not listed runs what an eager call runs.
_Q16, _Q32, _N64, _A64, _N128 = (_grid(16, 64, 128, 2, 2), _grid(32, 64, 128, 2, 2), _grid(64, 64, 128, 2, 1),
                                 _grid(64, 64, 128, 3, 1), _grid(128, 64, 64, 4, 1, group_m=8))
GRAPH_PICKS = {
    "H100": {(1, "qwen2.5-7b"): _Q16, (16, "qwen2.5-7b"): _Q16, (32, "qwen2.5-7b"): _Q32,
             (64, "qwen2.5-7b"): _grid(32, 64, 128, 2, 1), (64, "llama-3-8b"): _N64, (64, "gemma-2-9b"): _N64,
             (64, "llama-3-70b"): _N64, (64, "gemma-2-27b"): _A64, (64, "llama-3.2-1b"): _A64,
             (128, "llama-3-8b"): _N128, (128, "gemma-2-9b"): _N128, (128, "llama-3.2-1b"): _N128},
    "H200": {(1, "qwen2.5-7b"): _Q16, (16, "qwen2.5-7b"): _Q16, (32, "qwen2.5-7b"): _Q32,
             (16, "llama-3-8b"): _grid(16, 128, 128, 3, 1), (16, "gemma-2-9b"): _grid(16, 128, 128, 3, 1),
             (1, "gemma-2-27b"): _grid(16, 64, 128, 2, 2), (16, "gemma-2-27b"): _grid(16, 64, 128, 2, 2),
             (32, "gemma-2-27b"): _grid(32, 64, 128, 2, 1), (32, "llama-3-8b"): _grid(32, 128, 128, 3, 2),
             (32, "gemma-2-9b"): _grid(32, 128, 128, 3, 2), (32, "llama-3-70b"): _grid(32, 128, 128, 3, 2),
             (64, "qwen2.5-7b"): _grid(64, 64, 64, 3, 1), (64, "gemma-2-27b"): _grid(64, 64, 64, 3, 1),
             (64, "llama-3-8b"): _N64, (64, "gemma-2-9b"): _N64, (64, "llama-3-70b"): _N64,
             (64, "llama-3.2-1b"): _A64, (128, "llama-3-8b"): _N128, (128, "gemma-2-9b"): _N128,
             (128, "llama-3.2-1b"): _N128},
}


@pytest.mark.parametrize("gpu", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_graph_rules_apply_only_to_captured_calls(monkeypatch, gpu):
    """`_GRAPH_RULES` (the grid kernel) are consulted only for a call being captured into a CUDA
    graph, and give each GPU the tiles its sweep picked; an eager call keeps `_SHAPE_RULES`
    (the GEMV at M = 1 on Llama-3-8B / Gemma-2-9B, captured or not); other GPUs have none."""
    pick = gg.default_config.__wrapped__  # uncached: the GPU name is patched below
    monkeypatch.setattr(gg, "_gpu_name", lambda index: gpu)
    want = GRAPH_PICKS[gpu.split()[1]]
    for m in (1, 16, 32, 64, 128, 256):
        for name, (i, k) in SHAPES_KI.items():
            eager = pick(m, torch.bfloat16, i, 0, k)
            assert eager.grid_boxes == 0, (m, name)
            assert pick(m, torch.bfloat16, i, 0, k, True) == want.get((m, name), eager), (m, name)
    assert pick(1, torch.bfloat16, 14336, 0, 4096, True).block_m == 1  # the GEMV
    table64 = gg._for_bucket(gg._DEFAULTS, 64)
    assert pick(64, torch.bfloat16, 3584, 0, 8192, True) == table64  # a 70B tensor-parallel shard: not measured
    assert {c for rule in gg._GRAPH_RULES for c in [rule.config]} == set(GRAPH_PICKS["H100"].values()) | set(
        GRAPH_PICKS["H200"].values())  # every rule is reached by a measured shape
    monkeypatch.setattr(gg, "_gpu_name", lambda index: "NVIDIA A100-SXM4-80GB")
    for m in (1, 32, 64, 128):
        assert pick(m, torch.bfloat16, 18944, 0, 3584, True) == pick(m, torch.bfloat16, 18944, 0, 3584)


@pytest.mark.skipif(not CUDA, reason="graph capture needs the GPU")
def test_captured_call_runs_the_grid_rule(monkeypatch):
    """kernel='auto' inside CUDA-graph capture runs the grid rule's tile on an H100 or H200 (and what
    `_SHAPE_RULES` picks elsewhere); the replayed output matches float64; an eager call of the
    same shape does not take the grid kernel."""
    m, k, i = 64, 1024, 16400  # the Qwen2.5-7B rule's range (I > 16384, K <= 4096), I no multiple of 128
    x, gate, up, bg, bu = make_case(m, k, i, torch.bfloat16, bias=True)
    packed, bias = pack_gate_up(gate, up), pack_gate_up(bg, bu)
    calls = []
    real = gg._grid().gated_gemm_tma_grid
    monkeypatch.setattr(gg._grid(), "gated_gemm_tma_grid", lambda *a, **kw: calls.append(a[-1]) or real(*a, **kw))
    eager = gated_gemm(x, packed, "silu", bias)
    check(eager, x, gate, up, bg, bu, "silu")
    assert calls == []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        gated_gemm(x, packed, "silu", bias, config=gg.default_config(64, x.dtype, i, 0, k, True))
    torch.cuda.current_stream().wait_stream(side)
    calls.clear()
    out = torch.full((m, i), float("nan"), dtype=x.dtype, device=DEVICE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gated_gemm(x, packed, "silu", bias, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(out, x, gate, up, bg, bu, "silu")
    hopper = any(g in torch.cuda.get_device_name(0) for g in ("H100", "H200"))  # the GPUs with graph rules
    assert calls == ([gg.default_config(64, x.dtype, i, 0, k, True)] if hopper else [])
