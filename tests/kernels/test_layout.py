"""The packed gate/up layout: exact inverse, documented row positions, shard-safe blocks."""

import pytest
import torch

from swiglu_patch import GATE_UP_BLOCK, pack_gate_up, unpack_gate_up
from swiglu_patch.kernels.layout import gate_up_rows


@pytest.mark.parametrize("intermediate", [1, 15, 16, 17, 72, 100, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unpack_inverts_pack_bit_for_bit(intermediate, dtype):
    gate = torch.randn(intermediate, 24).to(dtype)
    up = torch.randn(intermediate, 24).to(dtype)
    packed = pack_gate_up(gate, up)
    assert packed.shape == (2 * intermediate, 24) and packed.dtype == dtype
    g2, u2 = unpack_gate_up(packed)
    assert torch.equal(g2.view(torch.uint8), gate.view(torch.uint8))
    assert torch.equal(u2.view(torch.uint8), up.view(torch.uint8))


@pytest.mark.parametrize("intermediate", [5, 40])
def test_bias_packs_like_rows(intermediate):
    gate, up = torch.randn(intermediate, 8), torch.randn(intermediate, 8)
    packed_b = pack_gate_up(gate[:, 0].contiguous(), up[:, 0].contiguous())
    assert torch.equal(packed_b, pack_gate_up(gate, up)[:, 0])


def test_rows_follow_the_documented_formula():
    intermediate, g = 40, GATE_UP_BLOCK  # two full blocks and a partial one of 8
    gate = torch.arange(intermediate, dtype=torch.float32)[:, None]
    up = -1 - torch.arange(intermediate, dtype=torch.float32)[:, None]
    packed = pack_gate_up(gate, up)[:, 0]
    for i in range(intermediate):
        start = (i // g) * g
        width = min(g, intermediate - start)
        assert packed[2 * start + (i - start)] == i
        assert packed[2 * start + width + (i - start)] == -1 - i
    gate_rows, up_rows = gate_up_rows(intermediate)
    assert torch.equal(packed[gate_rows], gate[:, 0]) and torch.equal(packed[up_rows], up[:, 0])


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_column_shard_keeps_gate_beside_up(tp):
    """A contiguous 1/tp slice of the packed rows is the packed layout of that 1/tp of gate and up."""
    intermediate = GATE_UP_BLOCK * tp * 3
    gate, up = torch.randn(intermediate, 8), torch.randn(intermediate, 8)
    packed = pack_gate_up(gate, up)
    shard_rows, shard_i = 2 * intermediate // tp, intermediate // tp
    for r in range(tp):
        shard = packed[r * shard_rows : (r + 1) * shard_rows]
        sl = slice(r * shard_i, (r + 1) * shard_i)
        assert torch.equal(shard, pack_gate_up(gate[sl], up[sl]))


def test_non_contiguous_inputs_pack():
    gate, up = torch.randn(24, 48)[:, ::2], torch.randn(24, 48)[:, ::2]
    g2, u2 = unpack_gate_up(pack_gate_up(gate, up))
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="same shape"):
        pack_gate_up(torch.randn(4, 3), torch.randn(5, 3))
    with pytest.raises(TypeError, match="dtype"):
        pack_gate_up(torch.randn(4, 3), torch.randn(4, 3).half())
    with pytest.raises(ValueError, match=r"\[2\*I, K\]"):
        unpack_gate_up(torch.randn(5, 3))
