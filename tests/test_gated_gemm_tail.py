"""The pointer kernel's decode tail split (`GatedGemmConfig.tail_split`) against a float64 reference.

With one row tile (M <= block_m), the tiles after the last whole wave run as tail_split
programs of block_n // tail_split columns each. On CPU through TRITON_INTERPRET=1 (fp16: the
interpreter gets bf16 tl.dot wrong; it counts 4 SMs), on the GPU in bf16 and fp16 with the
decode tiles. Every output starts as NaN, so a column no program writes fails.
"""

import dataclasses

import pytest
import torch

from swiglu_patch import pack_gate_up
from swiglu_patch.kernels import gated_gemm as gg
from swiglu_patch.kernels.gated_gemm import GatedGemmConfig, gated_gemm
from tests.test_gated_linear import CUDA, DEVICE, check, make_case

DTYPES = [torch.float16] + ([torch.bfloat16] if CUDA else [])
TILES = [GatedGemmConfig(16, 32, 32, num_stages=2), GatedGemmConfig(16, 64, 64, num_stages=2)] if not CUDA \
    else [GatedGemmConfig(16, 64, 256, num_stages=3), GatedGemmConfig(16, 32, 256, num_stages=4)]
# (M, K, I): one token and a full row tile; K no multiple of the K block; I with a partial
# gate/up block (328 = 20 x 16 + 8) or whole blocks of no wider tile; every tile leaves a tail
# after whole waves (4 SMs on CPU, 132 on an H100 or H200).
SHAPES = [(1, 80, 328), (16, 48, 336), (3, 64, 432)] if not CUDA else [(1, 1000, 14344), (16, 2056, 9200),
                                                                       (5, 4096, 14336)]


@pytest.mark.parametrize("m,k,i", SHAPES)
@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tail_split_matches_float64(m, k, i, split, dtype):
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias=True)
    packed, bias = pack_gate_up(gate, up), pack_gate_up(bg, bu)
    for tile in TILES:
        if tile.block_n // split < 16:
            continue  # too narrow for tl.dot: `_tail_split` refuses it (test below)
        cfg = dataclasses.replace(tile, tail_split=split)
        tiles = -(-i // cfg.block_n)
        whole, programs = gg._tail_split(cfg, m, tiles, x)
        assert whole < tiles and programs == whole + (tiles - whole) * split  # a tail is split
        for act in ("silu", "gelu_tanh"):
            out = torch.full((m, i), float("nan"), dtype=dtype, device=DEVICE)
            gated_gemm(x, packed, act, bias, out=out, config=cfg, kernel="pointer")
            check(out, x, gate, up, bg, bu, act)


def test_tail_split_program_count():
    """The arithmetic of `_tail_split` on the interpreter's 4 SMs, and where it does not apply."""
    x = torch.zeros(1, 8)
    cfg = GatedGemmConfig(16, 64, 64, tail_split=4)
    assert gg._tail_split(cfg, 1, 7, x) == (4, 4 + 3 * 4)  # 1 whole wave, 3 tiles as 12 of 16 columns
    assert gg._tail_split(cfg, 16, 3, x) == (0, 12)  # fewer tiles than SMs: all split
    assert gg._tail_split(cfg, 1, 8, x) == (8, 8)  # whole waves only
    assert gg._tail_split(cfg, 17, 7, x) == (7, 7)  # two row tiles: no split
    assert gg._tail_split(dataclasses.replace(cfg, tail_split=1), 1, 7, x) == (7, 7)
    with pytest.raises(ValueError, match="tail_split 8 must divide block_n 64 into tiles of >= 16"):
        gg._tail_split(dataclasses.replace(cfg, tail_split=8), 1, 7, x)


def test_tail_split_with_two_row_tiles_runs_whole_tiles():
    """M > block_m: the config's tail_split is ignored and the grouped grid runs; still right."""
    m, k, i = (40, 48, 208) if not CUDA else (40, 1000, 14336)
    dtype = DTYPES[-1]
    x, gate, up, _, _ = make_case(m, k, i, dtype, bias=False)
    out = torch.full((m, i), float("nan"), dtype=dtype, device=DEVICE)
    gated_gemm(x, pack_gate_up(gate, up), "silu", out=out, config=dataclasses.replace(TILES[0], tail_split=2),
               kernel="pointer")
    check(out, x, gate, up, None, None, "silu")
