"""`ExpertsBackwardConfig`: the tiles of the experts backward kernels (`experts_backward_gemm.py`).

A leaf: the planner's rules (`rules.EXPERTS_BACKWARD_RULES`) hold one per rule.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertsBackwardConfig:
    """Tiles of the four grouped kernels of the experts backward.

    Attributes:
        block_m: pairs per block (the routing's blocks; a multiple of 16: the weight-gradient
            kernels reduce over a block's rows with tl.dot).
        block_n, block_k: the dH kernel's tile along I and its step along K_out.
        dx_block_n, dx_block_k: the dX kernel's tile along K and its step along 2I.
        wgrad_block_a, wgrad_block_b: the weight-gradient kernels' output tile (dW_down:
            K_out x I; dW_gate_up: 2I x K).
        group_m: blocks that walk the column tiles together (L2 reuse).
        num_warps, num_stages: Triton's launch parameters.
    """

    block_m: int
    block_n: int
    block_k: int
    dx_block_n: int
    dx_block_k: int
    wgrad_block_a: int
    wgrad_block_b: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def short(self) -> str:
        """e.g. "128: dH 128x64, dX 128x64, dW 128x128, g8 w8 s3"."""
        return (f"{self.block_m}: dH {self.block_n}x{self.block_k}, dX {self.dx_block_n}x{self.dx_block_k}, "
                f"dW {self.wgrad_block_a}x{self.wgrad_block_b}, g{self.group_m} w{self.num_warps} s{self.num_stages}")
