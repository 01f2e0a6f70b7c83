"""Routing prep for the grouped experts GEMMs: the (token, slot) pairs sorted by expert, in blocks.

Pairs: p = t * TOP_K + j for token t and slot j, S = T * TOP_K of them, with expert
top_k_index[t, j]. `expert_blocks` lays them out for `experts_gemm`: each expert's pairs,
in pair order, padded to a whole number of BLOCK_M-row blocks, experts one after another.

    sorted_pairs [capacity] int64:  the pair id in each row slot; S marks a padding slot
    block_expert [capacity / BLOCK_M] int64:  the expert of each block; E marks an unused block

`capacity` = S + min(S, E) * (BLOCK_M - 1), rounded up to BLOCK_M: the most rows any routing
can need, known on the host from the shapes alone. So the prep is plain torch ops with no
host synchronisation (no `.item()`), capturable in a CUDA graph, and the GEMMs launch one
program per block of the capacity; unused blocks exit at once. Expert-parallel sentinels
(ids >= E) get no row: nothing is computed for them.

Two ways to the same layout: up to `KERNEL_PAIRS` pairs and `KERNEL_EXPERTS` experts, one
program of `_expert_blocks_kernel` (a histogram, a bitonic sort of expert * 2^b + pair, two
prefix sums, scattered stores: one launch, a few microseconds of host time); past that,
`expert_blocks_torch` (a sort and a dozen small torch ops, whose host time a large call's GPU
time hides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import FastLaunch

KERNEL_PAIRS = 4096
KERNEL_EXPERTS = 1023


def capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Row slots for `num_pairs` pairs over `num_experts` experts in blocks of `block_m`."""
    rows = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return -(-rows // block_m) * block_m


@triton.jit
def _expert_blocks_kernel(
    idx_ptr, pairs_ptr, blocks_ptr, scratch_ptr,
    NUM_PAIRS, NUM_EXPERTS, CAPACITY, NUM_BLOCKS,
    BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, MAX_BLOCKS: tl.constexpr,
    FILL: tl.constexpr,
):
    # -- every slot padding, every block unused --
    for start in range(0, CAPACITY, FILL):
        offs = start + tl.arange(0, FILL)
        tl.store(pairs_ptr + offs, tl.full((FILL,), 0, tl.int64) + NUM_PAIRS, mask=offs < CAPACITY)
    for start in range(0, NUM_BLOCKS, FILL):
        offs = start + tl.arange(0, FILL)
        tl.store(blocks_ptr + offs, tl.full((FILL,), 0, tl.int64) + NUM_EXPERTS, mask=offs < NUM_BLOCKS)
    # -- per expert: pairs, padded rows, first row, first pair in sorted order --
    pair = tl.arange(0, BLOCK_S)
    expert = tl.load(idx_ptr + pair, mask=pair < NUM_PAIRS, other=NUM_EXPERTS).to(tl.int32)
    expert = tl.minimum(expert, NUM_EXPERTS)  # sentinels and padding -> E
    counts = tl.histogram(expert, BLOCK_E)  # [BLOCK_E]; bin E and above: sentinels and padding
    e = tl.arange(0, BLOCK_E)
    counts = tl.where(e < NUM_EXPERTS, counts, 0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    first_row = padded_end - padded
    first_pair = tl.cumsum(counts, 0) - counts
    tl.store(scratch_ptr + e, first_row)
    tl.store(scratch_ptr + BLOCK_E + e, first_pair)
    tl.debug_barrier()  # the fills and the scratch before the scattered stores
    # -- the pairs sorted by (expert, pair), each stored at its expert's rows --
    key = tl.sort(expert * BLOCK_S + pair)
    sorted_expert = key // BLOCK_S
    sorted_pair = key % BLOCK_S
    real = sorted_expert < NUM_EXPERTS
    base = tl.load(scratch_ptr + sorted_expert, mask=real, other=0)
    rank = pair - tl.load(scratch_ptr + BLOCK_E + sorted_expert, mask=real, other=0)
    tl.store(pairs_ptr + base + rank, sorted_pair.to(tl.int64), mask=real)
    # -- each expert's blocks --
    for j in range(MAX_BLOCKS):
        tl.store(blocks_ptr + first_row // BLOCK_M + j, e.to(tl.int64), mask=(e < NUM_EXPERTS) & (j * BLOCK_M < padded))


_ROUTING: dict[tuple, FastLaunch] = {}  # (BLOCK_S, BLOCK_E, block_m) -> its launcher (no tensors)


def expert_blocks(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) for `top_k_index` [T, TOP_K] (any integer dtype); see the module docstring."""
    num_pairs = top_k_index.numel()
    if num_pairs > KERNEL_PAIRS or num_experts > KERNEL_EXPERTS or num_pairs == 0:
        return expert_blocks_torch(top_k_index, num_experts, block_m)
    block_s = triton.next_power_of_2(num_pairs)
    block_e = triton.next_power_of_2(num_experts + 1)
    rows = capacity(num_pairs, num_experts, block_m)
    sorted_pairs = top_k_index.new_empty(rows, dtype=torch.int64)
    block_expert = top_k_index.new_empty(rows // block_m, dtype=torch.int64)
    scratch = top_k_index.new_empty(2 * block_e, dtype=torch.int32)
    launch = _ROUTING.get((block_s, block_e, block_m))
    if launch is None:
        launch = _ROUTING[(block_s, block_e, block_m)] = FastLaunch(_expert_blocks_kernel, dict(
            BLOCK_S=block_s, BLOCK_E=block_e, BLOCK_M=block_m, MAX_BLOCKS=triton.cdiv(block_s, block_m),
            FILL=1024, num_warps=4))
    flat = top_k_index.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    launch(1, top_k_index.get_device(), flat, sorted_pairs, block_expert, scratch, num_pairs, num_experts, rows,
           rows // block_m)
    return sorted_pairs, block_expert


def expert_blocks_torch(top_k_index: torch.Tensor, num_experts: int,
                        block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`expert_blocks` in torch ops, for any number of pairs and experts."""
    flat = top_k_index.reshape(-1).to(torch.int64).clamp(max=num_experts)  # sentinels -> E
    num_pairs = flat.numel()
    rows = capacity(num_pairs, num_experts, block_m)
    sorted_ids, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:num_experts] + (block_m - 1)) // block_m * block_m
    padded_end = padded.cumsum(0)
    # the slot of each sorted pair: its expert's first padded row + its rank among that expert's pairs
    first = torch.cat((padded_end - padded, padded_end.new_full((1,), rows)))  # sentinels -> the spare slot
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[sorted_ids]
    slot = torch.where(sorted_ids < num_experts, first[sorted_ids] + rank, rows)
    sorted_pairs = flat.new_full((rows + 1,), num_pairs)
    sorted_pairs.scatter_(0, slot, order)
    block_starts = torch.arange(0, rows, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    return sorted_pairs[:rows], block_expert
