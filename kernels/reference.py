"""The PyTorch reference of the fused gated linear: the spec every test and the CPU path use.

    out[M, I] = act(x @ Wg^T + bg) * (x @ Wu^T + bu)

with Wg, Wu (and bg, bu) read out of the packed [2*I, K] weight (layout: `layout.py`).
The GEMM runs in x's dtype (as nn.Linear would), the activation and product in fp32 on the
upcast pre-activations, and the result is rounded once to x's dtype, as the kernel does.

Tokens are processed in chunks of `chunk_rows`, so the extra memory is a [chunk_rows, 2*I]
pre-activation plus its fp32 halves, next to the [M, I] output the fused kernel also
writes: peak memory stays near the kernel's for any M. Differentiable (plain torch ops).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .activations import ACTIVATIONS, check_activation
from .layout import gate_up_rows

DEFAULT_CHUNK_ROWS = 256


@lru_cache(maxsize=64)
def _rows(intermediate: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return gate_up_rows(intermediate, device=device)


def gated_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    activation: str = "silu",
    bias: torch.Tensor | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """act(x @ Wg^T + bg) * (x @ Wu^T + bu) on the packed weight, in chunks of tokens.

    Args:
        x: [M, K] input, any strides.
        packed: [2*I, K] interleaved gate/up weight, x's dtype.
        activation: one of `ACTIVATIONS`.
        bias: optional [2*I] interleaved gate/up bias.
        chunk_rows: tokens per chunk.

    Returns:
        [M, I] tensor in x's dtype.
    """
    check_activation("gated_linear_reference", activation)
    act = ACTIVATIONS[activation]
    gate_rows, up_rows = _rows(packed.shape[0] // 2, packed.device)
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 epilogue, as the kernel's
    out = x.new_empty((x.shape[0], packed.shape[0] // 2))
    for start in range(0, x.shape[0], chunk_rows):
        pre = torch.nn.functional.linear(x[start : start + chunk_rows], packed, bias)  # [m, 2I]
        gate = pre.index_select(1, gate_rows).to(acc)
        up = pre.index_select(1, up_rows).to(acc)
        out[start : start + chunk_rows] = act(gate) * up
    return out
