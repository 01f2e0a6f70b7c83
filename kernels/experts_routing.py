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
"""

from __future__ import annotations

import torch


def capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Row slots for `num_pairs` pairs over `num_experts` experts in blocks of `block_m`."""
    rows = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return -(-rows // block_m) * block_m


def expert_blocks(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) for `top_k_index` [T, TOP_K] (any integer dtype); see the module docstring."""
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
