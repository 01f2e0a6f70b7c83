"""The ops a `tune` sweep times: each calls a public kernel entry point with `kernel=` and
`config=` into outputs filled with NaN, names the cuBLAS GEMM of the same shape, and checks its
outputs against float64 on sampled rows (`accuracy.py`).

- `forward`: `gated_gemm(x, W, act)` -> out [M, I] (W the packed [2I, K] weight); cuBLAS
  x @ [Wg; Wu]^T.
- `preact`: `gated_gemm_with_preact(x, W, act)` -> (out [M, I], P [M, 2I]), training's forward;
  cuBLAS as `forward`.
- `backward`: `gated_backward(dY, Wd, P, act)` -> (dP [M, 2I], h [M, I]), training's backward
  GEMM dH = dY @ Wd with the derivative fused; P from the shipped `preact` call, dY [M, K],
  Wd [K, I]; cuBLAS dY @ Wd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .accuracy import backward_f64, interleaved_preact_f64, rel_error

OPS = ("forward", "preact", "backward")


def entry_points():
    """The module with the public kernel entry points (`gated_gemm`, `gated_gemm_with_preact`,
    `gated_backward`, `gated_gemm_low_rank`): `swiglu_patch.kernels.dispatch` where it has them
    all, else training's three from `dispatch_training` beside it."""
    from swiglu_patch.kernels import dispatch

    if hasattr(dispatch, "gated_backward"):
        return dispatch
    from swiglu_patch.kernels import dispatch_training

    return dispatch_training


@dataclass
class SweepOp:
    """One op of one (shape, M).

    Attributes:
        name: one of OPS.
        make: (kernel, config) -> (fn, outs): fn() runs the call into outs and returns outs[0].
        cublas: the cuBLAS GEMM of the same shape, the ratio's denominator.
        error: outs -> the largest relative error of the outputs' sampled rows against float64.
    """

    name: str
    make: Callable[[str, object], tuple[Callable[[], torch.Tensor], tuple[torch.Tensor, ...]]]
    cublas: Callable[[], torch.Tensor]
    error: Callable[[tuple[torch.Tensor, ...]], float]


def _nan(*shape, like: torch.Tensor) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


def _err(out: torch.Tensor, idx: torch.Tensor, want: torch.Tensor) -> float:
    rows = out.index_select(0, idx)
    return rel_error(rows, want) if not rows.isnan().any().item() else math.inf


def build_op(name: str, x: torch.Tensor, packed_weight: torch.Tensor, stacked: torch.Tensor, activation: str,
             gated_ref: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor, gen: torch.Generator) -> SweepOp:
    """The SweepOp `name` on x [M, K] and the packed weight [2I, K] (`stacked` [2I, K] is the same
    gate and up rows stacked, for cuBLAS); `gated_ref(x_rows)` is the float64 act(gate) * up.

    Raises:
        ValueError: an unknown op name.
    """
    from swiglu_patch.kernels import dispatch

    ops = entry_points()
    m, k = x.shape
    i = packed_weight.shape[0] // 2
    want_h = gated_ref(x.index_select(0, idx))
    if name == "forward":
        def make(kernel, config):
            out = _nan(m, i, like=x)
            return lambda: dispatch.gated_gemm(x, packed_weight, activation, out=out, config=config, kernel=kernel), (out,)

        return SweepOp(name, make, lambda: x @ stacked.T, lambda outs: _err(outs[0], idx, want_h))
    if name == "preact":
        want_p = interleaved_preact_f64(x.index_select(0, idx), packed_weight)

        def make(kernel, config):
            out, preact = _nan(m, i, like=x), _nan(m, 2 * i, like=x)
            return (lambda: ops.gated_gemm_with_preact(x, packed_weight, activation, out=out, preact_out=preact,
                                                       config=config, kernel=kernel)[0]), (out, preact)

        return SweepOp(name, make, lambda: x @ stacked.T,
                       lambda outs: max(_err(outs[0], idx, want_h), _err(outs[1], idx, want_p)))
    if name == "backward":
        down = (torch.randn(k, i, generator=gen, device=x.device) * i**-0.5).to(x.dtype)
        dy = torch.randn(m, k, generator=gen, device=x.device).to(x.dtype)
        _, preact = ops.gated_gemm_with_preact(x, packed_weight, activation)
        want_dp, want_hb = backward_f64(dy.index_select(0, idx), down, preact.index_select(0, idx), activation)

        def make(kernel, config):
            dp, h = _nan(m, 2 * i, like=x), _nan(m, i, like=x)
            return (lambda: ops.gated_backward(dy, down, preact, activation, dpreact_out=dp, h_out=h, config=config,
                                               kernel=kernel)[0]), (dp, h)

        return SweepOp(name, make, lambda: dy @ down,
                       lambda outs: max(_err(outs[0], idx, want_dp), _err(outs[1], idx, want_hb)))
    raise ValueError(f"build_op: unknown op {name!r}; known: {', '.join(OPS)}")
