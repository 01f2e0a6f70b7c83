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

Three ways to the same layout, each a few microseconds of host time up to `KERNEL_EXPERTS`
experts:

- up to `KERNEL_PAIRS` pairs, one program of `_expert_blocks_kernel`: a histogram, a bitonic sort
  of expert * 2^b + pair, two prefix sums, scattered stores (one launch). One program sorts what
  the chunked kernels sort in parallel, so past a few hundred pairs their programs win;
- past that, chunks of `chunk_pairs(S)` pairs (`expert_blocks_chunked`, two launches, one program
  per chunk): `_chunk_counts_kernel` stores each chunk's histogram [chunks, BLOCK_E] int32;
  `_chunk_scatter_kernel` sums those into every expert's padded rows and the pairs of earlier
  chunks, sorts its chunk like the one-program kernel and stores each pair at its expert's first
  row + the expert's pairs in earlier chunks + its rank in the chunk; each program also writes
  a share of the padding slots and of block_expert;
- `expert_blocks_torch`: the same in torch ops (a sort and some twenty small ops, each a launch
  on the GPU), for more experts than the kernels' histogram holds, and the tests' reference.

The chunk trades the sort (longer chunks, fewer programs) against every program summing every
chunk's histogram (more chunks): about `CHUNKS` chunks of 128 to 1024 pairs. On one H200 at
a239b8f (`python -m benchmarks.bench_routing --out A --commit a239b8f`, CUDA graphs, L2 flushed;
cut at its 280 s limit in the Mixtral-8x7B rows, before the script wrote its JSON row by row, so
these are its printed lines), µs a call, Qwen3-30B-A3B (128 experts, top 8) and in brackets
Qwen3.5-35B-A3B (256 experts):

    pairs     one program    chunks of 1024    chosen (chunk)      best
    512       9.8 (11.4)     21.7 (25.9)       9.8 (11.4) (one)    9.8 (11.4)
    1024      16.0 (19.5)    23.6 (36.5)       12.1 (19.4) (128)   12.0 (18.5)
    2048      47.2 (53.2)    24.5 (44.5)       12.0 (18.5) (128)   12.0 (18.4)
    6144      -              23.7 (38.4)       13.5 (19.6) (128)   12.7 (19.4)
    12288     -              24.4 (37.6)       15.2 (19.7) (256)   15.2 (19.7)
    32768     -              24.2 (42.8)       17.0 (28.7) (512)   17.0 (28.7)
    131072    -              27.1 (46.0)       26.9 (45.8) (1024)  26.9 (45.8)

Before, the one program ran to 1024 pairs and chunks were 1024 pairs: the choice now takes
0.42-1.00x that time (0.57x and 0.51x at 6144 pairs), within 1.07x the best way timed on every row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import ceil_div
from .launcher import FastLaunch

KERNEL_PAIRS = 512
KERNEL_EXPERTS = 1023
CHUNKS = 64  # chunks the chunked kernels aim at
CHUNK_PAIRS = (128, 1024)  # the least and the most pairs of a chunk
_FILL = 1024  # padding slots one program writes per step
_PAD = 16  # padding slots per expert written per step (an expert has fewer than BLOCK_M)
_BLOCKS = 32  # block_expert entries one program writes per step


def _pow2(n: int) -> int:
    """The least power of 2 >= n (n >= 1), in plain Python: triton.next_power_of_2 is a
    constexpr function, some microseconds per call on the host's hot path."""
    return 1 << (n - 1).bit_length()


def chunk_pairs(num_pairs: int) -> int:
    """Pairs per chunk of `expert_blocks_chunked` for `num_pairs` pairs: the power of 2 that makes
    about `CHUNKS` chunks, within `CHUNK_PAIRS`."""
    return min(CHUNK_PAIRS[1], max(CHUNK_PAIRS[0], _pow2(ceil_div(num_pairs, CHUNKS))))


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


@triton.jit
def _chunk_counts_kernel(idx_ptr, hist_ptr, NUM_PAIRS, NUM_EXPERTS, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    chunk = tl.program_id(0)
    pair = chunk * CHUNK + tl.arange(0, CHUNK)
    expert = tl.load(idx_ptr + pair, mask=pair < NUM_PAIRS, other=NUM_EXPERTS)
    expert = tl.minimum(expert, NUM_EXPERTS).to(tl.int32)  # sentinels and padding -> E
    tl.store(hist_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), tl.histogram(expert, BLOCK_E))


@triton.jit
def _chunk_scatter_kernel(
    idx_ptr, hist_ptr, scratch_ptr, pairs_ptr, blocks_ptr,
    NUM_PAIRS, NUM_EXPERTS, NUM_CHUNKS, CAPACITY, NUM_BLOCKS, FILL_STRIDE, BLOCKS_STRIDE,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
    FILL: tl.constexpr, PAD: tl.constexpr, BLOCKS: tl.constexpr,
):
    chunk = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    # -- per expert: its pairs in every chunk and in the chunks before this one --
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    before = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for r0 in range(0, NUM_CHUNKS, ROWS):
        r = r0 + tl.arange(0, ROWS)
        h = tl.load(hist_ptr + r[:, None] * BLOCK_E + e[None, :], mask=(r < NUM_CHUNKS)[:, None], other=0)
        counts += tl.sum(h, 0)  # h: [ROWS, BLOCK_E]
        before += tl.sum(tl.where((r < chunk)[:, None], h, 0), 0)
    counts = tl.where(e < NUM_EXPERTS, counts, 0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    first_row = padded_end - padded
    total = tl.sum(padded, 0)
    own = tl.load(hist_ptr + chunk * BLOCK_E + e)
    own = tl.where(e < NUM_EXPERTS, own, 0)
    scratch = scratch_ptr + chunk * 2 * BLOCK_E
    tl.store(scratch + e, first_row + before)
    tl.store(scratch + BLOCK_E + e, tl.cumsum(own, 0) - own)  # each expert's first place in the sorted chunk
    tl.debug_barrier()  # the scratch before the gathers from it
    # -- this chunk's pairs sorted by (expert, pair), each stored at its expert's rows --
    local = tl.arange(0, CHUNK)
    pair = chunk * CHUNK + local
    expert = tl.load(idx_ptr + pair, mask=pair < NUM_PAIRS, other=NUM_EXPERTS)
    expert = tl.minimum(expert, NUM_EXPERTS).to(tl.int32)
    key = tl.sort(expert * CHUNK + local)
    sorted_expert = key // CHUNK
    real = sorted_expert < NUM_EXPERTS
    base = tl.load(scratch + sorted_expert, mask=real, other=0)
    rank = local - tl.load(scratch + BLOCK_E + sorted_expert, mask=real, other=0)
    tl.store(pairs_ptr + base + rank, (chunk * CHUNK + key % CHUNK).to(tl.int64), mask=real)
    # -- padding slots: after the pairs of this program's experts (e % NUM_CHUNKS == chunk), and after all --
    mine = (e < NUM_EXPERTS) & (e % NUM_CHUNKS == chunk)
    pad_start, pad_len = first_row + counts, padded - counts
    pad_value = tl.full((BLOCK_E, PAD), 0, tl.int64) + NUM_PAIRS
    for j0 in range(0, BLOCK_M, PAD):
        j = j0 + tl.arange(0, PAD)
        tl.store(pairs_ptr + pad_start[:, None] + j[None, :], pad_value,
                 mask=mine[:, None] & (j[None, :] < pad_len[:, None]))  # [BLOCK_E, PAD]
    for start in range(0, CAPACITY, FILL_STRIDE):
        offs = start + chunk * FILL + tl.arange(0, FILL)
        tl.store(pairs_ptr + offs, tl.full((FILL,), 0, tl.int64) + NUM_PAIRS, mask=(offs >= total) & (offs < CAPACITY))
    # -- the expert of each block: how many experts' rows end at or before its first row --
    for start in range(0, NUM_BLOCKS, BLOCKS_STRIDE):
        b = start + chunk * BLOCKS + tl.arange(0, BLOCKS)
        row = b * BLOCK_M
        owner = tl.sum((padded_end[None, :] <= row[:, None]).to(tl.int32), 1)  # [BLOCKS, BLOCK_E] summed
        owner = tl.where(row < total, owner, NUM_EXPERTS)
        tl.store(blocks_ptr + b, owner.to(tl.int64), mask=b < NUM_BLOCKS)


_ROUTING: dict[tuple, FastLaunch] = {}  # (kernel, BLOCK_S or CHUNK, BLOCK_E, block_m) -> its launcher (no tensors)


def _launcher(key: tuple, kernel, constexprs: dict) -> FastLaunch:
    launch = _ROUTING.get(key)
    if launch is None:
        launch = _ROUTING[key] = FastLaunch(kernel, constexprs)
    return launch


def _flat(top_k_index: torch.Tensor) -> torch.Tensor:
    flat = top_k_index.reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def expert_blocks(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) for `top_k_index` [T, TOP_K] (any integer dtype); see the module docstring."""
    num_pairs = top_k_index.numel()
    if num_experts > KERNEL_EXPERTS or num_pairs == 0:
        return expert_blocks_torch(top_k_index, num_experts, block_m)
    if num_pairs > KERNEL_PAIRS:
        return expert_blocks_chunked(top_k_index, num_experts, block_m)
    return expert_blocks_one_program(top_k_index, num_experts, block_m)


def expert_blocks_one_program(top_k_index: torch.Tensor, num_experts: int,
                              block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`expert_blocks` as one program of `_expert_blocks_kernel` (one launch), for 1 to a few thousand
    pairs (its sort holds them all) and at most `KERNEL_EXPERTS` experts."""
    num_pairs = top_k_index.numel()
    block_s = _pow2(num_pairs)
    block_e = _pow2(num_experts + 1)
    rows = capacity(num_pairs, num_experts, block_m)
    sorted_pairs = top_k_index.new_empty(rows, dtype=torch.int64)
    block_expert = top_k_index.new_empty(rows // block_m, dtype=torch.int64)
    scratch = top_k_index.new_empty(2 * block_e, dtype=torch.int32)
    launch = _launcher(("one", block_s, block_e, block_m), _expert_blocks_kernel, dict(
        BLOCK_S=block_s, BLOCK_E=block_e, BLOCK_M=block_m, MAX_BLOCKS=ceil_div(block_s, block_m), FILL=1024,
        num_warps=4))
    launch(1, top_k_index.get_device(), _flat(top_k_index), sorted_pairs, block_expert, scratch, num_pairs,
           num_experts, rows, rows // block_m)
    return sorted_pairs, block_expert


def expert_blocks_chunked(top_k_index: torch.Tensor, num_experts: int, block_m: int,
                          chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`expert_blocks` in chunks of `chunk` pairs (a power of 2; None: `chunk_pairs`), two launches
    for any number of pairs; at most `KERNEL_EXPERTS` experts."""
    num_pairs = top_k_index.numel()
    chunk = chunk_pairs(num_pairs) if chunk is None else chunk
    if num_experts > KERNEL_EXPERTS or chunk & (chunk - 1):
        raise ValueError(f"expert_blocks_chunked: at most {KERNEL_EXPERTS} experts and a power-of-2 chunk, got "
                         f"{num_experts} experts and chunk {chunk}; use expert_blocks_torch")
    block_e = _pow2(num_experts + 1)
    chunks = max(1, ceil_div(num_pairs, chunk))
    rows = capacity(num_pairs, num_experts, block_m)
    num_blocks = rows // block_m
    sorted_pairs = top_k_index.new_empty(rows, dtype=torch.int64)
    block_expert = top_k_index.new_empty(num_blocks, dtype=torch.int64)
    work = top_k_index.new_empty(3 * chunks * block_e, dtype=torch.int32)  # histograms, then 2 rows per chunk
    hist, scratch = work[:chunks * block_e], work[chunks * block_e:]
    flat, device = _flat(top_k_index), top_k_index.get_device()
    warps = 4 if chunk <= 1024 else 8
    _launcher(("counts", chunk, block_e, 0), _chunk_counts_kernel, dict(CHUNK=chunk, BLOCK_E=block_e,
                                                                         num_warps=warps))(
        chunks, device, flat, hist, num_pairs, num_experts)
    _launcher(("scatter", chunk, block_e, block_m), _chunk_scatter_kernel, dict(
        CHUNK=chunk, BLOCK_E=block_e, BLOCK_M=block_m, ROWS=max(1, min(32, 8192 // block_e)), FILL=_FILL, PAD=_PAD,
        BLOCKS=_BLOCKS, num_warps=warps))(
        chunks, device, flat, hist, scratch, sorted_pairs, block_expert, num_pairs, num_experts, chunks, rows,
        num_blocks, chunks * _FILL, chunks * _BLOCKS)
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
