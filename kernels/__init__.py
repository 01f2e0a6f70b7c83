"""Tensor-level kernels of swiglu-patch (installed as ``swiglu_patch.kernels``): tensors, never models.

Modules, leaves first (each imports only modules above it in this list):
- `layout`: the interleaved gate/up layout, `PackedGateUp`, `pack_gate_up`;
- `epilogue`: the gated epilogue's math (`GatedEpilogue`, `ACTIVATIONS`);
- `reference`: the PyTorch reference of the fused gated linear (the spec; the CPU path);
- `configs`: `GatedGemmConfig`, `m_bucket`; `device`: device facts; `jit_common`: shared Triton code;
  `launcher`: `FastLaunch`, a compiled kernel's launch without Triton's per-call binding;
- one kernel and its launcher per file: `gated_gemm_pointer`, `gated_gemm_tma`,
  `gated_gemm_tma_grid`, `gated_gemv` (forward), `gated_backward_pointer`, `gated_backward_tma`
  (training: dY @ W_down with the gated derivative in the epilogue);
- `rules`: which kernel runs which call, as a table; `dispatch`: `gated_gemm`, the one entry
  point, and `explain`; `dispatch_training`: training's entry points on the same rules (the
  forward that stores the pre-activation, the backward GEMM, the LoRA low-rank segment).

Importing this package imports neither Triton nor any kernel: `swiglu_patch.functional`
imports `dispatch` on first use.
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
