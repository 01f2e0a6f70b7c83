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
        dh_num_stages, wgrad_num_stages: the dH and the weight-gradient kernels' pipeline depth
            (None: num_stages).
        wgrad_rows: the rows of a block the weight-gradient kernels reduce per step (a divisor of
            block_m, a multiple of 16; None: block_m).
        smem_budget_kib: the shared memory (KiB) a kernel's pipelined operand tiles may take; a
            kernel's stages are cut to fit it (fp32 tiles take twice a 16-bit stage), and a
            weight-gradient tile whose one stage would not fit is halved along its longer side.
        dh_warp_specialized: on Hopper, run dH as the warp-specialized kernel (`experts_dh_ws.py`:
            its epilogue beside the next tile's MMAs) where it can take the call; its ring has
            dh_num_stages (or num_stages) stages and its own shared memory (not the budget).
        dh_ws_block_n, dh_ws_stages: that kernel's tile along I (None: block_n; up to 128 with
            one MMA warpgroup, or 256 with two side by side and G handed to the epilogue in dOut's
            dtype) and its ring's stages (None: dh_num_stages, or num_stages).
        dh_ws_registers: that kernel's registers a thread in its (loader, epilogue) warps.
        wgrad_warp_specialized: on Hopper, run the two weight gradients as the persistent
            warp-specialized kernel (`experts_wgrad_ws.py`: the next tile's loads and MMAs beside a
            tile's store) where it can take the call, with output tiles of wgrad_ws_tile; its ring
            has wgrad_num_stages (or num_stages) stages of wgrad_rows (or block_m) rows and its
            own shared memory.
        wgrad_ws_tile: that kernel's output tile (its own: wgrad_block_a x wgrad_block_b stay the
            tile of the calls it leaves to the one-program-per-tile kernel).
        wgrad_ws_registers: that kernel's registers a thread in its (loader, epilogue) warps.
        dx_warp_specialized: on Hopper, run dX as the warp-specialized kernel (`experts_dx_ws.py`:
            block_m x dx_ws_block_n tiles stepping dx_block_k over 2I, its store beside the next
            tile's MMAs) where it can take the call, with a ring of dx_ws_stages stages;
            dx_ws_registers: its registers a thread in its (loader, epilogue) warps.
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
    dh_num_stages: int | None = None
    wgrad_num_stages: int | None = None
    wgrad_rows: int | None = None
    smem_budget_kib: int = 160
    dh_warp_specialized: bool = False
    dh_ws_block_n: int | None = None
    dh_ws_stages: int | None = None
    dh_ws_registers: tuple[int, int] = (96, 192)
    wgrad_warp_specialized: bool = False
    wgrad_ws_tile: tuple[int, int] = (256, 128)
    wgrad_ws_registers: tuple[int, int] = (96, 64)
    dx_warp_specialized: bool = False
    dx_ws_block_n: int = 256
    dx_ws_stages: int = 3
    dx_ws_registers: tuple[int, int] = (96, 96)

    def __post_init__(self):
        rows = self.wgrad_rows
        if rows is not None and (rows < 16 or rows % 16 or self.block_m % rows):
            raise ValueError(f"ExpertsBackwardConfig: wgrad_rows must be a multiple of 16 that divides block_m "
                             f"({self.block_m}), got {rows}")

    def short(self) -> str:
        """e.g. "128: dH 128x64 s4, dX 128x64, dW 128x256 s2, g8 w8 s3, 224 KiB"."""
        dh_s = "" if self.dh_num_stages is None else f" s{self.dh_num_stages}"
        wg_s = ("" if self.wgrad_num_stages is None else f" s{self.wgrad_num_stages}") + (
            "" if self.wgrad_rows is None else f" r{self.wgrad_rows}")
        if self.dh_warp_specialized:
            dh_s += (" ws" + ("" if self.dh_ws_block_n is None else f" {self.dh_ws_block_n}")
                     + ("" if self.dh_ws_stages is None else f" s{self.dh_ws_stages}"))
        if self.wgrad_warp_specialized:
            wg_s += f" ws {self.wgrad_ws_tile[0]}x{self.wgrad_ws_tile[1]}"
        dx_s = f" ws {self.dx_ws_block_n} s{self.dx_ws_stages}" if self.dx_warp_specialized else ""
        return (f"{self.block_m}: dH {self.block_n}x{self.block_k}{dh_s}, dX {self.dx_block_n}x{self.dx_block_k}{dx_s}, "
                f"dW {self.wgrad_block_a}x{self.wgrad_block_b}{wg_s}, g{self.group_m} w{self.num_warps} "
                f"s{self.num_stages}, {self.smem_budget_kib} KiB")
