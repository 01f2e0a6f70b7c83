"""One launch configuration of a gated GEMM kernel, what a kernel file can run, and the M buckets.

- `GatedGemmConfig`: tile and launch parameters of one call; a config never implies a kernel.
- `KernelCapability`: what one kernel file declares it can run (its ``CAPABILITY``): the ops it
  serves, its dtypes, whether it reads and writes through TMA descriptors, its features.
- `TMA_DTYPES`, `TMA_NEEDS`, `tma_fits`: the TMA kernels' constraint on a call, stated here
  once (`device.tma_operands_ok` checks the tensors against it).

Which kernel runs and with which config is decided by `dispatch.py` from the table in `rules.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import GATE_UP_BLOCK

ALL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TMA_DTYPES = (torch.bfloat16, torch.float16)
TMA_NEEDS = ("bf16/fp16 tensors with unit inner strides, 16-byte-aligned rows and base pointers, "
             f"and I % {GATE_UP_BLOCK} == 0")

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
        max_registers: registers per thread the compiler may use (Triton's maxnreg), 0 for its
            own choice; kernels that read it say so.
        epilogue_subtiles: backward TMA and warp-specialized kernels: the epilogue runs in this
            many column slices of the tile (more slices, less shared memory and fewer registers).
        epilogue_warps, epilogue_registers: warp-specialized backward kernel: the warps of its
            epilogue group and their registers per thread.
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
    max_registers: int = 0
    epilogue_subtiles: int = 2
    epilogue_warps: int = 4
    epilogue_registers: int = 200

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
        if self.max_registers:
            extras.append(f"r{self.max_registers}")
        if self.epilogue_subtiles != 2:
            extras.append(f"epi/{self.epilogue_subtiles}")
        if (self.epilogue_warps, self.epilogue_registers) != (4, 200):
            extras.append(f"epi w{self.epilogue_warps} r{self.epilogue_registers}")
        return (f"{self.block_m}x(2*{self.block_n})x{self.block_k} g{self.group_m} w{self.num_warps} "
                f"s{self.num_stages}" + "".join(" " + e for e in extras))


def m_bucket(m: int) -> int:
    """The power of two >= m, capped at 8192: launch choices are made per bucket, not per M."""
    return min(1 << max(m - 1, 0).bit_length(), 8192)


def rows_bucket(m: int) -> int:
    """The least of 2^k and 3 * 2^(k-1) that is >= m (at least 1), capped at 8192: half an octave
    finer than `m_bucket`, for the experts ops' rows per expert (`dispatch.expert_rows`), where a
    tile's padding turns within one of `m_bucket`'s buckets (48 against 64 rows per expert)."""
    bucket = m_bucket(m)
    return max(1, bucket * 3 // 4 if m <= bucket * 3 // 4 else bucket)


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for ints (triton.cdiv is a jit function: slow to call from the host's hot path)."""
    return -(-a // b)


def tma_fits(dtype: torch.dtype, i: int) -> bool:
    """The TMA kernels' dtype and shape condition: 16-bit, whole gate/up blocks (the alignment of
    the tensors themselves is `device.tma_aligned`)."""
    return dtype in TMA_DTYPES and i % GATE_UP_BLOCK == 0


@dataclass(frozen=True)
class ExpertsConfig:
    """Tiles of the experts kernels (`experts_gemv.py`, `experts_gemm.py`).

    Attributes:
        block_m: pairs per block of the grouped kernels (a multiple of 16 for tl.dot); the GEMV ignores it.
        block_n, block_k: the gated kernel's tile along I and its step along K.
        down_block_n, down_block_k: the down kernel's tile along K_out and its step along I.
        group_m: blocks that walk the column tiles together (L2 reuse).
        num_warps, num_stages: Triton's launch parameters.
        down_num_warps: the GEMV's down kernel's warps (`experts_gemv.py`), where they differ from
            its gated kernel's num_warps (None: num_warps); the grouped kernels do not read it.
        down_split_i: rows of I each down program of the transposed GEMV sums
            (`experts_gemv_transposed.py`: partial sums over I, then a combine launch); None: all
            of I in one program. Only that kernel reads it.
        warp_specialized: on Hopper, run the gated GEMM of calls that store no P as the
            warp-specialized kernel (`experts_gated_ws.py`: the same block_m x (2 x block_n)
            tiles stepping block_k over K, h's stores beside the next tile's MMAs) where it can
            take the call, with a ring of ws_stages stages;
        warp_specialized_preact: the same for calls that also store P (training's store mode),
            with ws_preact_block_k steps at ws_preact_stages stages;
        ws_registers: that kernel's registers a thread in its (loader, epilogue) warps.
        down_warp_specialized: on Hopper, run the down GEMM as the warp-specialized kernel
            (`experts_down_ws.py`: block_m x down_ws_block_n tiles stepping down_ws_block_k over I,
            y's stores beside the next tile's MMAs) where it can take the call, with a ring of
            down_ws_stages stages; down_ws_registers: its registers a thread in its (loader,
            epilogue) warps.
    """

    block_m: int
    block_n: int
    block_k: int
    down_block_n: int
    down_block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    warp_specialized: bool = False
    warp_specialized_preact: bool = False
    ws_stages: int = 3
    ws_preact_block_k: int = 64
    ws_preact_stages: int = 3
    ws_registers: tuple[int, int] = (80, 64)
    down_warp_specialized: bool = False
    down_ws_block_n: int = 256
    down_ws_block_k: int = 64
    down_ws_stages: int = 3
    down_ws_registers: tuple[int, int] = (96, 96)
    down_num_warps: int | None = None
    down_split_i: int | None = None

    def short(self) -> str:
        """e.g. "64x(2*128)x64, down 128x64, g8 w8 s3" (" ws s3", " ws-preact 64s4", down's " ws 256x64s3" where
        warp-specialized)."""
        ws = f" ws s{self.ws_stages}" if self.warp_specialized else ""
        if self.warp_specialized_preact:
            ws += f" ws-preact {self.ws_preact_block_k}s{self.ws_preact_stages}"
        down_ws = (f" ws {self.down_ws_block_n}x{self.down_ws_block_k}s{self.down_ws_stages}"
                   if self.down_warp_specialized else "")
        down_w = ("" if self.down_num_warps is None else f" w{self.down_num_warps}") + (
            "" if self.down_split_i is None else f" split {self.down_split_i}")
        return (f"{self.block_m}x(2*{self.block_n})x{self.block_k}, down {self.down_block_n}x{self.down_block_k}"
                f"{down_w}{down_ws}, g{self.group_m} w{self.num_warps} s{self.num_stages}{ws}")


@dataclass(frozen=True)
class KernelCapability:
    """What one kernel file can run: the planner (`dispatch.py`) reads it, the kernel never does.

    Attributes:
        name: the kernel's name in the rules (`rules.py`).
        ops: the rule tables it serves: "forward" (the gated GEMM), "backward" (dY @ Wd with
            the gated derivative), "experts" (an MoE experts block).
        features: what it can add to a call of those ops: "store_preact" (writes P [M, 2*I]),
            "low_rank" (the LoRA segment x_lr @ b_lr^T), "dh_in" (a further gradient of h).
        dtypes: the dtypes of the tensors it takes.
        tma: reads and writes through TMA descriptors: the call must meet `TMA_NEEDS`.
        one_token: M == 1 only, with whole gate/up blocks (the GEMV).
        gpu_only: a Gluon kernel for Hopper (wgmma): CUDA tensors on a compute-capability 9.x GPU,
            never under the interpreter.
        unit_stride_rows: reads each weight row as one contiguous vector (the experts GEMV): the
            weights' reduction axis must have unit stride, which only `can_run` sees (a layout).
        unit_stride_columns: reads weight tiles contiguous along the output axis (the transposed
            experts GEMV): that axis must have unit stride, which only `can_run` sees.
    """

    name: str
    ops: tuple[str, ...]
    features: frozenset[str] = frozenset()
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES
    tma: bool = False
    one_token: bool = False
    gpu_only: bool = False
    unit_stride_rows: bool = False
    unit_stride_columns: bool = False

    @property
    def runs_every_call(self) -> bool:
        """Needs nothing of the tensors: the planner skips its `can_run`."""
        return (not (self.tma or self.one_token or self.gpu_only or self.unit_stride_rows or self.unit_stride_columns)
                and self.dtypes == ALL_DTYPES)

    def runs(self, dtype: torch.dtype, m: int, i: int, tma_aligned: bool = True, on_gpu: bool = True,
             transposed: bool = False) -> bool:
        """Whether it can run a call, decided without tensors (tma_aligned: whether they meet TMA's
        alignment; on_gpu: CUDA tensors outside the interpreter; transposed: experts' weights in the
        transposed layout, gpt-oss's, with unit-stride columns); `can_run` in its file decides the
        same on the tensors."""
        if dtype not in self.dtypes or (self.gpu_only and not on_gpu):
            return False
        if (self.unit_stride_rows and transposed) or (self.unit_stride_columns and not transposed):
            return False
        if self.one_token and (m != 1 or i % GATE_UP_BLOCK):
            return False
        return not self.tma or (tma_fits(dtype, i) and tma_aligned)

    def needs(self) -> str:
        """What a call must meet, as text for error messages."""
        if self.tma:
            return TMA_NEEDS + (" on a Hopper GPU (a Gluon kernel: not under the interpreter)" if self.gpu_only else "")
        if self.one_token:
            return f"M == 1 and I % {GATE_UP_BLOCK} == 0"
        if self.unit_stride_rows:
            return "weights with unit stride along their reduction axis (gate_up [E, 2I, K], down [E, K_out, I])"
        if self.unit_stride_columns:
            return "transposed weights with unit stride along their output axis (gate_up [E, K, 2I], down [E, I, K_out])"
        return "floating-point tensors in " + "/".join(str(d).replace("torch.", "") for d in self.dtypes)
