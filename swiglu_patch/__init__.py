"""swiglu-patch: fused gated-MLP (SwiGLU/GeGLU) GEMM for Hugging Face transformers models.

    report = apply_fused_mlp(model)   # every gated MLP's gate/up GEMMs + act + mul -> one Triton GEMM
    unpatch(model)                    # the original modules back, weights bit for bit

The public names load on first use (PEP 562), so ``import swiglu_patch`` and the command
line's ``--help`` cost no torch, triton or transformers import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "gated_linear": ".functional",
    "gated_mlp": ".training",
    "GatedEpilogue": ".kernels.epilogue",
    "GATE_UP_BLOCK": ".kernels.layout",
    "PackedGateUp": ".kernels.layout",
    "pack_gate_up": ".kernels.layout",
    "FusedGatedMLP": ".module",
    "PatchError": ".patch",
    "PatchReport": ".patch",
    "apply_fused_mlp": ".patch",
    "is_patched": ".patch",
    "unpatch": ".patch",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from .functional import gated_linear
    from .training import gated_mlp
    from .kernels.epilogue import GatedEpilogue
    from .kernels.layout import GATE_UP_BLOCK, PackedGateUp, pack_gate_up
    from .module import FusedGatedMLP
    from .patch import PatchError, PatchReport, apply_fused_mlp, is_patched, unpatch


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'swiglu_patch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
