"""The PyTorch reference of a fused MoE experts block: the spec the experts kernels and tests share.

For T tokens x [T, K], each routed to TOP_K experts (top_k_index [T, TOP_K], expert ids in
[0, E); an id >= E is an expert-parallel sentinel, a slot this rank does not own, which
contributes nothing) with routing weights top_k_weights [T, TOP_K]:

    out[t] = sum_j  w[t, j] * ( h_{t,j} @ Wd[e]^T + bd[e] ),     e = top_k_index[t, j]
    h_{t,j} = epilogue(x[t] @ Wg[e]^T + bg[e],  x[t] @ Wu[e]^T + bu[e])

Layouts (`ExpertsLayout`), as transformers' `@use_experts_implementation` classes hold them:
- gate_up [E, 2I, K] (`transposed=False`) or [E, K, 2I] (`transposed=True`, gpt-oss); along
  the 2I axis gate and up are chunked, [gate; up] (`concatenated=True`: gate column i at i, up
  at I + i), or interleaved pairwise (`concatenated=False`: gate at 2i, up at 2i + 1);
- gate_up_bias [E, 2I] in the same order along 2I; down [E, K, I] or, transposed, [E, I, K];
  down_bias [E, K].

Numerics (the kernels do the same): the gate/up GEMM runs in x's dtype with fp32
accumulation, the epilogue in fp32, h is rounded once to x's dtype; the down GEMM accumulates
in fp32, the bias and the routing weight are applied in fp32, and the TOP_K partial rows are
summed in fp32 and rounded once to x's dtype. (transformers rounds each expert's down output
to x's dtype before weighting it: ours rounds less.)

LoRA on the experts (`ExpertsLowRank`), never materialized: an adapter on a projection W_e
[out, in] adds s * (v @ A_e^T) @ B_e^T to its output for input rows v, A [E, r, in],
B [E, out, r] (PEFT's `ParamWrapper` delta s * B_e @ A_e, in every layout): gate_up's before
the bias and the epilogue, down's before the bias and the routing weight. The projections'
v @ A_e^T * s are rounded to x's dtype, as the kernels' x_lr and h_lr are.

The reference loops over the experts that were hit, in plain torch ops: differentiable, no
cached tensors, one host synchronisation (the list of experts hit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .epilogue import GatedEpilogue


@dataclass(frozen=True)
class ExpertsLayout:
    """How an experts module stores its 3-D weights (see the module docstring).

    Attributes:
        transposed: gate_up is [E, K, 2I] and down [E, I, K] (else [E, 2I, K] and [E, K, I]).
        concatenated: gate and up chunked [gate; up] along 2I (else interleaved pairwise).
    """

    transposed: bool = False
    concatenated: bool = True

    def gate_up_strides(self, gate_up: torch.Tensor) -> tuple[int, int, int]:
        """gate_up's (expert, 2I-axis, K-axis) strides: a kernel indexing [e, n, k] reads either layout."""
        s = gate_up.stride()
        return (s[0], s[2], s[1]) if self.transposed else (s[0], s[1], s[2])

    def down_strides(self, down: torch.Tensor) -> tuple[int, int, int]:
        """down's (expert, K_out-axis, I-axis) strides: a kernel indexing [e, n, i] reads either layout."""
        s = down.stride()
        return (s[0], s[2], s[1]) if self.transposed else (s[0], s[1], s[2])

    def describe(self) -> str:
        shape = "[E, K, 2I]" if self.transposed else "[E, 2I, K]"
        return f"gate_up {shape} {'[gate; up]' if self.concatenated else 'interleaved pairs'}"


@dataclass(frozen=True)
class ExpertsEpilogue:
    """The gated math of one expert: a `GatedEpilogue`, or gpt-oss's clamped SwiGLU.

    gpt-oss (`alpha` set): g = min(gate, limit), u = clip(up, -limit, limit),
    h = g * sigmoid(alpha * g) * (u + 1). Otherwise `gated` says what h is.
    """

    gated: GatedEpilogue
    alpha: float | None = None

    def apply(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """h from fp32 pre-activations (differentiable)."""
        if self.alpha is None:
            return self.gated.apply(gate, up)
        limit = self.gated.limit
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1.0)

    def constexprs(self) -> dict:
        """The experts kernels' compile-time epilogue arguments (`GatedEpilogue.constexprs` plus ALPHA)."""
        return dict(self.gated.constexprs(), ALPHA=0.0 if self.alpha is None else self.alpha)

    def describe(self) -> str:
        if self.alpha is None:
            return self.gated.describe()
        return f"gpt-oss swiglu, alpha {self.alpha:g}, clamp {self.gated.limit:g}, (up + 1)"


class ExpertsLowRank(NamedTuple):
    """LoRA adapters on the experts' projections (see the module docstring); a projection
    without one has None for its A and B.

    Attributes:
        gate_up_a: [E, r, K]; gate_up_b: [E, 2I, r], rows in the model's gate/up order.
        gate_up_scale: s of gate_up's adapter.
        down_a: [E, r', I]; down_b: [E, K_out, r'].
        down_scale: s of down's adapter.
    """

    gate_up_a: torch.Tensor | None
    gate_up_b: torch.Tensor | None
    gate_up_scale: float
    down_a: torch.Tensor | None
    down_b: torch.Tensor | None
    down_scale: float


def _low_rank(v: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None, scale: float, e: int, out_dtype):
    """s * (v @ a[e]^T) @ b[e]^T, the projection rounded to v's dtype; 0 without an adapter."""
    if a is None:
        return 0
    v_lr = ((v @ a[e].t()).to(out_dtype) * scale).to(v.dtype)
    return v_lr.to(out_dtype) @ b[e].t().to(out_dtype)


def split_gate_up(pre: torch.Tensor, layout: ExpertsLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up), each [..., I], from a pre-activation [..., 2I] in `layout`'s order."""
    if layout.concatenated:
        return pre.chunk(2, dim=-1)
    return pre[..., ::2], pre[..., 1::2]


def experts_reference(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    epilogue: ExpertsEpilogue,
    layout: ExpertsLayout = ExpertsLayout(),
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    low_rank: ExpertsLowRank | None = None,
) -> torch.Tensor:
    """The experts block of the module docstring, expert by expert.

    Args:
        x: [T, K] tokens, any strides.
        top_k_index: [T, TOP_K] integer expert ids (ids >= E are skipped).
        top_k_weights: [T, TOP_K] routing weights (any float dtype).
        gate_up, down, gate_up_bias, down_bias: the experts' weights in `layout` (x's dtype).
        epilogue: the gated math.
        low_rank: LoRA adapters on the projections (x's dtype), or None.

    Returns:
        [T, K] in x's dtype.
    """
    num_experts = gate_up.shape[0]
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(x.shape[0], down.shape[2] if layout.transposed else down.shape[1], dtype=acc, device=x.device)
    lr = low_rank or ExpertsLowRank(None, None, 1.0, None, None, 1.0)
    flat = top_k_index.reshape(-1)
    for e in torch.unique(flat[flat < num_experts]).tolist():
        token, slot = torch.nonzero(top_k_index == e, as_tuple=True)
        w_gu = gate_up[e] if layout.transposed else gate_up[e].t()
        pre = x[token] @ w_gu
        if lr.gate_up_a is not None:
            pre = (pre.to(acc) + _low_rank(x[token], lr.gate_up_a, lr.gate_up_b, lr.gate_up_scale, e, acc))
        if gate_up_bias is not None:
            pre = pre + gate_up_bias[e]
        gate, up = split_gate_up(pre, layout)
        h = epilogue.apply(gate.to(acc), up.to(acc)).to(x.dtype)
        w_d = down[e] if layout.transposed else down[e].t()
        y = (h @ w_d).to(acc) + _low_rank(h, lr.down_a, lr.down_b, lr.down_scale, e, acc)
        if down_bias is not None:
            y = y + down_bias[e].to(acc)
        out = out.index_add(0, token, y * top_k_weights[token, slot].to(acc)[:, None])
    return out.to(x.dtype)
