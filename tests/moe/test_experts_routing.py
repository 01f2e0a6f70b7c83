"""The routing prep's three ways (`kernels/experts_routing.py`) give one layout, element for element.

The one-program kernel (up to KERNEL_PAIRS pairs), the chunked kernels (past it) and the torch
ops are compared exactly, on routings that break things: an expert nobody picks, every token on
one expert, expert-parallel sentinels (ids >= E), one token, chunks that do not divide the pairs,
and a block size over the padding step. On CPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from swiglu_patch.kernels import experts_routing
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.experts import experts_forward
from swiglu_patch.kernels.experts_reference import ExpertsEpilogue, experts_reference
from swiglu_patch.kernels.experts_routing import expert_blocks, expert_blocks_chunked, expert_blocks_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _index(t: int, e: int, top_k: int, skew: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(t * 131 + e * 7 + top_k)
    logits = torch.randn(t, e, generator=gen)
    if skew == "one_expert":
        logits[:, 0] = 100.0
    if skew == "empty_expert":
        logits[:, -1] = -100.0
    index = torch.topk(logits, top_k, dim=-1).indices
    if skew == "sentinels":
        index[0, 0], index[-1, -1] = e, e + 5
    return index.to(DEVICE)


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(a[0], b[0]), "sorted_pairs differ"
    assert torch.equal(a[1], b[1]), "block_expert differs"


@pytest.mark.parametrize("skew", ["uniform", "one_expert", "empty_expert", "sentinels"])
@pytest.mark.parametrize("t, e, top_k, block_m, chunk", [
    (53, 9, 8, 64, 32),  # 424 pairs in 14 chunks, the last one short
    (200, 128, 8, 64, 128),  # Qwen3-30B-A3B's experts and top-k
    (300, 5, 1, 32, 64),  # experts with hundreds of pairs each
    (1, 3, 1, 16, 16),  # one pair
    (70, 60, 4, 128, 256),  # BLOCK_M past the padding step, one chunk
])
def test_chunked_kernels_give_the_torch_layout(t, e, top_k, block_m, chunk, skew):
    index = _index(t, e, top_k, skew)
    _same(expert_blocks_chunked(index, e, block_m, chunk=chunk), expert_blocks_torch(index, e, block_m))


@pytest.mark.parametrize("skew", ["uniform", "sentinels"])
def test_the_one_program_kernel_gives_the_torch_layout(skew):
    index = _index(53, 9, 8, skew)
    _same(expert_blocks(index, 9, 64), expert_blocks_torch(index, 9, 64))
    index = _index(75, 128, 8, skew)  # 600 pairs, past KERNEL_PAIRS: what bench_routing times it at
    _same(experts_routing.expert_blocks_one_program(index, 128, 64), expert_blocks_torch(index, 128, 64))


def test_past_kernel_pairs_the_chunked_kernels_run(monkeypatch):
    calls = []
    chunked = experts_routing.expert_blocks_chunked
    monkeypatch.setattr(experts_routing, "KERNEL_PAIRS", 32)
    monkeypatch.setattr(experts_routing, "expert_blocks_chunked",
                        lambda *a, **k: calls.append(a[0].numel()) or chunked(*a, chunk=16, **k))
    index = _index(45, 6, 2, "empty_expert")
    _same(expert_blocks(index, 6, 16), expert_blocks_torch(index, 6, 16))
    assert calls == [90]
    # and the experts GEMMs on those blocks: fp32 against float64
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(45, 24, generator=gen).to(DEVICE)
    gate_up = (torch.randn(6, 40, 24, generator=gen) * 24 ** -0.5).to(DEVICE)
    down = (torch.randn(6, 24, 20, generator=gen) * 20 ** -0.5).to(DEVICE)
    weights = torch.rand(45, 2, generator=gen).to(DEVICE)
    epilogue = ExpertsEpilogue(GatedEpilogue("silu"))
    out = experts_forward(x, index, weights, gate_up, down, epilogue)
    ref = experts_reference(x.double(), index, weights.double(), gate_up.double(), down.double(), epilogue)
    assert calls == [90, 90]
    assert (out.double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_chunk_pairs_aims_at_64_chunks_of_128_to_1024_pairs():
    chunk_pairs = experts_routing.chunk_pairs
    assert [chunk_pairs(s) for s in (513, 1024, 6144, 8192, 12288, 32768, 131072, 10 ** 7)] == \
        [128, 128, 128, 128, 256, 512, 1024, 1024]


def test_from_513_pairs_the_chunked_kernels_run_on_the_chosen_chunk(monkeypatch):
    chunks = []
    chunked = experts_routing.expert_blocks_chunked

    def spy(index, *args, **kwargs):
        chunks.append(kwargs.get("chunk"))
        return chunked(index, *args, **kwargs)

    monkeypatch.setattr(experts_routing, "expert_blocks_chunked", spy)
    small = _index(64, 128, 8, "uniform")  # 512 pairs: the one-program kernel
    _same(expert_blocks(small, 128, 64), expert_blocks_torch(small, 128, 64))
    assert chunks == []
    index = _index(100, 128, 8, "empty_expert")  # 800 pairs: 7 chunks of 128, the last one short
    _same(expert_blocks(index, 128, 64), expert_blocks_torch(index, 128, 64))
    assert chunks == [None]  # None: chunk_pairs(800) = 128


def test_chunked_refuses_what_it_cannot_hold():
    index = _index(4, 3, 1, "uniform")
    with pytest.raises(ValueError, match="power-of-2 chunk"):
        expert_blocks_chunked(index, 3, 16, chunk=48)
    with pytest.raises(ValueError, match="use expert_blocks_torch"):
        expert_blocks_chunked(index, experts_routing.KERNEL_EXPERTS + 1, 16)
