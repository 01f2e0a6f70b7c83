"""swiglu-patch: fused gated-MLP (SwiGLU/GeGLU) GEMM for Hugging Face transformers models.

    report = apply_fused_mlp(model)   # every gated MLP's gate/up GEMMs + act + mul -> one Triton GEMM
    unpatch(model)                    # the original modules back, weights bit for bit
"""

from .functional import gated_linear
from .kernels.epilogue import GatedEpilogue
from .kernels.layout import GATE_UP_BLOCK, PackedGateUp, pack_gate_up
from .module import FusedGatedMLP
from .patch import PatchError, PatchReport, apply_fused_mlp, is_patched, unpatch

__version__ = "0.1.0"

__all__ = [
    "GATE_UP_BLOCK",
    "FusedGatedMLP",
    "GatedEpilogue",
    "PackedGateUp",
    "PatchError",
    "PatchReport",
    "apply_fused_mlp",
    "gated_linear",
    "is_patched",
    "pack_gate_up",
    "unpatch",
]
