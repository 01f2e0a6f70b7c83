"""One launch configuration of a gated GEMM kernel, and the M buckets configs are chosen by.

Which kernel runs and with which config is decided by `dispatch.py` from the table in
`rules.py`; a config never implies a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

# The low-rank (LoRA) segment's step along R, in the pointer and TMA kernels: tl.dot's least K.
LOW_RANK_BLOCK = 16


@dataclass(frozen=True)
class GatedGemmConfig:
    """Tile and launch parameters of one kernel call.

    Attributes:
        block_m: rows of x per tile (tokens). The GEMV ignores it.
        block_n: output columns (of I) per tile: the tile reads 2 * block_n packed rows.
        block_k: K per step of the main loop.
        group_m: row tiles that walk the column tiles together (L2 reuse).
        num_warps, num_stages: Triton's launch parameters (the GEMV runs one stage).
        warp_specialize: persistent TMA kernel: loads and MMAs in separate warp groups where
            Triton partitions the loop.
        split_tail: persistent TMA kernel: a last wave of whole tiles that would leave at
            least half the programs idle runs as narrower tiles instead.
        programs_per_sm: persistent TMA kernel: programs per SM (2: two share an SM).
        weight_boxes: grid TMA kernel: the weight read per K step as one [2*block_n, block_k]
            box (1) or as separate gate and up boxes (2).
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    warp_specialize: bool = False
    split_tail: bool = False
    programs_per_sm: int = 1
    weight_boxes: int = 1

    def meta(self) -> dict:
        """The kernels' tile meta-parameters."""
        return dict(
            BLOCK_SIZE_M=self.block_m, BLOCK_SIZE_N=self.block_n, BLOCK_SIZE_K=self.block_k,
            GROUP_SIZE_M=self.group_m,
        )

    def short(self) -> str:
        """e.g. "128x(2*128)x64 g8 w8 s4 split_tail"."""
        extras = [name for name in ("warp_specialize", "split_tail") if getattr(self, name)]
        if self.programs_per_sm != 1:
            extras.append(f"{self.programs_per_sm}/SM")
        if self.weight_boxes != 1:
            extras.append(f"{self.weight_boxes} boxes")
        return (f"{self.block_m}x(2*{self.block_n})x{self.block_k} g{self.group_m} w{self.num_warps} "
                f"s{self.num_stages}" + "".join(" " + e for e in extras))


def m_bucket(m: int) -> int:
    """The power of two >= m, capped at 8192: launch choices are made per bucket, not per M."""
    return min(1 << max(m - 1, 0).bit_length(), 8192)


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for ints (triton.cdiv is a jit function: slow to call from the host's hot path)."""
    return -(-a // b)
