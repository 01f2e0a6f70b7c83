"""The packed gate/up layout: exact inverse, documented row positions, shard-safe blocks, PackedGateUp."""

import pytest
import torch

from swiglu_patch import GATE_UP_BLOCK, PackedGateUp, pack_gate_up
from swiglu_patch.kernels.layout import deinterleave_gate_up, gate_up_rows, interleave_gate_up, split_interleaved


@pytest.mark.parametrize("intermediate", [1, 15, 16, 17, 72, 100, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unpack_inverts_pack_bit_for_bit(intermediate, dtype):
    gate = torch.randn(intermediate, 24).to(dtype)
    up = torch.randn(intermediate, 24).to(dtype)
    packed = interleave_gate_up(gate, up)
    assert packed.shape == (2 * intermediate, 24) and packed.dtype == dtype
    g2, u2 = deinterleave_gate_up(packed)
    assert torch.equal(g2.view(torch.uint8), gate.view(torch.uint8))
    assert torch.equal(u2.view(torch.uint8), up.view(torch.uint8))


@pytest.mark.parametrize("intermediate", [5, 40])
def test_bias_packs_like_rows(intermediate):
    gate, up = torch.randn(intermediate, 8), torch.randn(intermediate, 8)
    packed_b = interleave_gate_up(gate[:, 0].contiguous(), up[:, 0].contiguous())
    assert torch.equal(packed_b, interleave_gate_up(gate, up)[:, 0])


def test_rows_follow_the_documented_formula():
    intermediate, g = 40, GATE_UP_BLOCK  # two full blocks and a partial one of 8
    gate = torch.arange(intermediate, dtype=torch.float32)[:, None]
    up = -1 - torch.arange(intermediate, dtype=torch.float32)[:, None]
    packed = interleave_gate_up(gate, up)[:, 0]
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
    packed = interleave_gate_up(gate, up)
    shard_rows, shard_i = 2 * intermediate // tp, intermediate // tp
    for r in range(tp):
        shard = packed[r * shard_rows : (r + 1) * shard_rows]
        sl = slice(r * shard_i, (r + 1) * shard_i)
        assert torch.equal(shard, interleave_gate_up(gate[sl], up[sl]))


def test_non_contiguous_inputs_pack():
    gate, up = torch.randn(24, 48)[:, ::2], torch.randn(24, 48)[:, ::2]
    g2, u2 = deinterleave_gate_up(interleave_gate_up(gate, up))
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="same shape"):
        pack_gate_up(torch.randn(4, 3), torch.randn(5, 3))
    with pytest.raises(TypeError, match="dtype"):
        pack_gate_up(torch.randn(4, 3), torch.randn(4, 3).half())
    with pytest.raises(ValueError, match=r"\[2\*I, K\]"):
        deinterleave_gate_up(torch.randn(5, 3))
    with pytest.raises(ValueError, match="both gate_bias and up_bias"):
        pack_gate_up(torch.randn(4, 3), torch.randn(4, 3), torch.randn(4))
    with pytest.raises(ValueError, match=r"PackedGateUp: weight must be \[2\*I, K\]"):
        PackedGateUp.from_interleaved(torch.randn(5, 3))


@pytest.mark.parametrize("intermediate", [16, 40, 7])
def test_pack_gate_up_round_trips_weights_and_biases(intermediate):
    gate, up = torch.randn(intermediate, 8), torch.randn(intermediate, 8)
    bg, bu = torch.randn(intermediate), torch.randn(intermediate)
    packed = pack_gate_up(gate, up, bg, bu)
    assert isinstance(packed, PackedGateUp) and packed.intermediate_size == intermediate
    assert all(torch.equal(a, b) for a, b in zip(packed.unpack(), (gate, up, bg, bu)))
    assert pack_gate_up(gate, up).unpack()[2:] == (None, None)


@pytest.mark.parametrize("intermediate", [16, 40, 7])
def test_split_interleaved_on_the_last_dim_is_the_column_split(intermediate):
    """A [M, 2*I] pre-activation x @ packed^T splits into x @ gate^T and x @ up^T (small integers:
    every product exact, whatever order the GEMMs sum in)."""
    gate, up = torch.randint(-4, 5, (intermediate, 8)).double(), torch.randint(-4, 5, (intermediate, 8)).double()
    x = torch.randint(-4, 5, (5, 8)).double()
    g, u = split_interleaved(x @ interleave_gate_up(gate, up).T, -1)
    assert torch.equal(g, x @ gate.T) and torch.equal(u, x @ up.T)
