"""Tensor-level kernels of swiglu-patch (installed as ``swiglu_patch.kernels``).

Knows tensors, never models. The layout and the PyTorch reference import without Triton;
the Triton kernel is imported lazily by `swiglu_patch.functional`.
"""

from .activations import ACTIVATIONS
from .layout import GATE_UP_BLOCK, gate_up_rows, pack_gate_up, unpack_gate_up
from .reference import gated_linear_reference

__all__ = ["ACTIVATIONS", "GATE_UP_BLOCK", "gate_up_rows", "pack_gate_up", "unpack_gate_up", "gated_linear_reference"]
