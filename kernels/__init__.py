"""Tensor-level kernels of swiglu-patch (installed as ``swiglu_patch.kernels``): tensors, never models.

Modules, leaves first (each imports only modules above it in this list):
- `layout`: the interleaved gate/up layout, `PackedGateUp`, `pack_gate_up`;
- `epilogue`: the gated epilogue's math (`GatedEpilogue`, `ACTIVATIONS`);
- `reference`: the PyTorch reference of the fused gated linear (the spec; the CPU path);
- `configs`: `GatedGemmConfig`, `KernelCapability` (what a kernel file can run; the TMA
  constraint), `m_bucket`; `device`: device facts; `jit_common`: shared Triton code;
  `launcher`: `FastLaunch`, a compiled kernel's launch without Triton's per-call binding;
  `operands`: the entry points' checks on their tensors;
- one kernel, its launcher and its ``CAPABILITY`` per file: `gated_gemm_pointer`,
  `gated_gemm_tma`, `gated_gemm_tma_grid`, `gated_gemv` (forward), `gated_backward_pointer`,
  `gated_backward_tma`, `gated_backward_ws` (Gluon, Hopper), `gated_backward_split` (training:
  dY @ W_down with the gated derivative in the epilogue);
- `rules`: which kernel runs which call, one table per op family (`TABLES`); `dispatch`: the
  planner and every entry point (`gated_gemm`, `gated_gemm_with_preact`, `gated_gemm_low_rank`,
  `gated_backward`), with `explain` and `choose`.

Importing this package imports neither Triton nor any kernel: `swiglu_patch.functional`
(through `swiglu_patch.ops`) imports `dispatch` on first use.
"""

from .epilogue import ACTIVATIONS, GatedEpilogue
from .layout import GATE_UP_BLOCK, PackedGateUp, deinterleave_gate_up, interleave_gate_up, pack_gate_up
from .reference import gated_linear_reference

__all__ = [
    "ACTIVATIONS",
    "GATE_UP_BLOCK",
    "GatedEpilogue",
    "PackedGateUp",
    "deinterleave_gate_up",
    "gated_linear_reference",
    "interleave_gate_up",
    "pack_gate_up",
]
