"""Why tensor parallelism needs I/tp to be a multiple of 16, and the message that says so (no processes)."""

from __future__ import annotations

import pytest
import torch

from swiglu_patch import GATE_UP_BLOCK, pack_gate_up
from swiglu_patch.tensor_parallel import degree_error, working_degrees


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("blocks_per_rank", [1, 3])
def test_packing_local_shards_gives_the_column_shard_of_the_global_packed_weight(tp, blocks_per_rank):
    intermediate, k = GATE_UP_BLOCK * blocks_per_rank * tp, 40
    gate, up = torch.randn(intermediate, k), torch.randn(intermediate, k)
    global_shards = pack_gate_up(gate, up).weight.chunk(tp)  # what a colwise Shard(0) of the packed weight gives rank r
    for r in range(tp):
        assert torch.equal(pack_gate_up(gate.chunk(tp)[r], up.chunk(tp)[r]).weight, global_shards[r])


@pytest.mark.parametrize(("intermediate", "tp"), [(72, 2), (96, 4), (40, 2)])
def test_without_whole_blocks_per_rank_the_two_differ(intermediate, tp):
    """The case patching refuses: rank r's own packing is not its rows of the global packed weight."""
    gate, up = torch.randn(intermediate, 8), torch.randn(intermediate, 8)
    global_shards = pack_gate_up(gate, up).weight.chunk(tp)
    local = [pack_gate_up(gate.chunk(tp)[r], up.chunk(tp)[r]).weight for r in range(tp)]
    assert any(not torch.equal(local[r], global_shards[r]) for r in range(tp))


def test_working_degrees():
    assert working_degrees(256, 16) == [2, 4, 8, 16]
    assert working_degrees(96, 8) == [2, 3, 6]
    assert working_degrees(29568, 8) == [2, 3, 4, 6, 7, 8]  # Qwen2.5-72B: I = 16 * 1848
    assert working_degrees(72, 8) == []


def test_degree_error_is_none_when_every_rank_holds_whole_blocks():
    assert degree_error(14336, 8) is None  # Llama-3-8B
    assert degree_error(72, 1) is None  # not sharded


def test_degree_error_names_the_rows_per_rank_and_the_nearest_degrees():
    msg = degree_error(96, 4)
    for part in ("I=96", "tp=4", "24 gate/up rows per rank", "multiple of 16", "nearest degrees that work for I=96: 3 "
                 "and 6", "--nproc-per-node"):
        assert part in msg, f"{part!r} not in {msg!r}"
    assert "nearest degrees that work for I=96: 6;" in degree_error(96, 16)  # only a lower one is left
    assert "(uneven)" in degree_error(100, 3)


def test_degree_error_when_no_degree_works():
    msg = degree_error(72, 2)
    assert "36 gate/up rows per rank" in msg and "No tp > 1 works" in msg and "without tp_plan" in msg
