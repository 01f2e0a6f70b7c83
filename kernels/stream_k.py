"""Stream-K bookkeeping for the persistent kernels (today `gated_gemm_tma`'s mostly idle last wave).

Stream-K splits a range of (tile, K-iteration) pairs evenly over P persistent programs:
with S iterations, program p runs the contiguous run [first(p), first(p + 1)) where the
first S % P programs take S // P + 1 iterations and the rest S // P. A tile whose K
iterations fall in more than one program's run is computed in pieces: each piece's fp32
accumulator goes to a workspace slot (2p for the piece at the start of program p's run,
2p + 1 for the one at its end; a run holds at most those two partial pieces), the piece
whose arrival completes the tile's int32 count sums every piece in program order (the same
sum whichever arrived last: deterministic results) and runs the epilogue, then resets the
count to zero. Nothing waits on another program, so this also runs in Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def sk_first_iter(p, q, r):
    """First stream-K iteration of program p when the iterations are split q (+1 for p < r) each."""
    return p * q + tl.minimum(p, r)


@triton.jit
def sk_owner(it, q, r):
    """The program whose stream-K range holds iteration `it`."""
    return tl.where(it < r * (q + 1), it // (q + 1), r + (it - r * (q + 1)) // tl.maximum(q, 1))


@triton.jit
def sk_piece_slot(p, tile_begin, q, r):
    """Workspace slot of program p's piece of the tile whose first iteration is tile_begin:
    its end piece (2p + 1) if p's run began before the tile, else its start piece (2p)."""
    return 2 * p + (sk_first_iter(p, q, r) < tile_begin).to(tl.int32)


# Per (device, stream): int32 arrival counts of the stream-K tiles, zero between calls (each
# tile's last piece resets its count). Calls on one stream run in order, so they can share
# one buffer; two streams never do. A buffer that grows is replaced, never freed: a CUDA graph
# captured with it keeps its address.
_counts: dict[tuple[int, int], torch.Tensor] = {}
_replaced: list[torch.Tensor] = []


def stream_k_counts(device: torch.device, n: int) -> torch.Tensor:
    """An int32 buffer of at least n zeros for this device's current stream."""
    key = (device.index or 0, torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else (-1, 0)
    cnt = _counts.get(key)
    if cnt is None or cnt.numel() < n:
        if cnt is not None:
            _replaced.append(cnt)
        cnt = _counts[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return cnt


def all_counts_zero() -> bool:
    """Whether every count buffer is back to zeros (tests: each call resets what it used)."""
    return all(not c.any() for c in _counts.values())
