"""The PyTorch reference of the fused gated linear: the spec every test and the CPU path use.

    out[M, I] = epilogue(x @ Wg^T + bg, x @ Wu^T + bu)      (plain: act(gate) * up)

with Wg, Wu (and bg, bu) read out of the packed [2*I, K] weight (layout: `layout.py`; the
epilogue: `epilogue.py`). The GEMM runs in x's dtype (as nn.Linear would), the epilogue in
fp32 on the upcast pre-activations, and the result is rounded once to x's dtype, as the
kernels do.

Tokens are processed in chunks of `chunk_rows`, so the extra memory is a [chunk_rows, 2*I]
pre-activation plus its fp32 halves, next to the [M, I] output the fused kernel also
writes: peak memory stays near the kernel's for any M. Plain torch ops, no cached tensors:
differentiable, and safe under inference mode, torch.compile and CUDA graphs.
"""

from __future__ import annotations

import torch

from .epilogue import GatedEpilogue
from .layout import split_interleaved

DEFAULT_CHUNK_ROWS = 256


def gated_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    epilogue: GatedEpilogue | str = "silu",
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """epilogue(x @ Wg^T + bg, x @ Wu^T + bu) on the packed weight, in chunks of tokens.

    Args:
        x: [M, K] input, any strides.
        weight: [2*I, K] interleaved gate/up weight, x's dtype.
        bias: optional [2*I] interleaved gate/up bias.
        epilogue: a `GatedEpilogue` or an activation name.
        chunk_rows: tokens per chunk.

    Returns:
        [M, I] tensor in x's dtype.
    """
    epilogue = GatedEpilogue.of(epilogue)
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 epilogue, as the kernels'
    if x.shape[0] <= chunk_rows:  # one chunk: no output buffer to fill (keeps autograd simple)
        gate, up = split_interleaved(torch.nn.functional.linear(x, weight, bias), -1)
        return epilogue.apply(gate.to(acc), up.to(acc)).to(x.dtype)
    out = x.new_empty((x.shape[0], weight.shape[0] // 2))
    for start in range(0, x.shape[0], chunk_rows):
        gate, up = split_interleaved(torch.nn.functional.linear(x[start : start + chunk_rows], weight, bias), -1)
        out[start : start + chunk_rows] = epilogue.apply(gate.to(acc), up.to(acc))
    return out
