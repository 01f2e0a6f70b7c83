"""Checks every way against a float64 reference before it is timed.

The reference is computed on a few rows of x, in float64, on the benchmark's device, from
the *unpacked* gate and up weights (the [I, K] tensors the packed weight was built from), with
the activation written out here from its formula, so it shares no code with the product:

    gated  = act(x64 @ Wg64^T) * (x64 @ Wu64^T)          -> [rows, I]
    preact = [x64 @ Wg64^T, x64 @ Wu64^T]                 -> [rows, 2I]  (for gemm_only)

The error is relative in the Frobenius norm over the checked rows:
||out - ref|| / ||ref||. A way whose error exceeds the bound of its dtype is flagged as
failed and not timed.

Bounds, and why: every way computes in fp32 from inputs exact in its dtype, then rounds.
Rounding the output alone costs about u/sqrt(3) in this norm (u = unit roundoff: 2^-8 bf16,
2^-11 fp16); HF eager also rounds both pre-activations, so its error is about twice that. On
N(0, 1) pre-activations the CPU dry run measures 2e-3 to 5e-3 in bf16 and 2e-4 to 5e-4 in
fp16 (ours lowest, eager highest). The bounds are 4u (bf16 1.6e-2, fp16 2.0e-3): 3x or more
above every correct way and far below what a wrong layout, a wrong activation or a dropped
K-tile gives (errors of order 1). fp32 allows TF32 (u = 2^-11) in case a run turns it
on; torch and the kernel default to IEEE fp32 and measure about 1e-6.
"""

from __future__ import annotations

import math

import torch

REL_ERR_BOUNDS: dict[torch.dtype, float] = {
    torch.bfloat16: 4 * 2.0**-8,  # 1.6e-2
    torch.float16: 4 * 2.0**-11,  # 2.0e-3
    torch.float32: 4 * 2.0**-11,  # 2.0e-3, TF32's unit roundoff
}


def activation_f64(g: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation from its formula, in float64.

    Raises:
        ValueError: an activation this reference does not know.
    """
    if activation == "silu":
        return g / (1.0 + torch.exp(-g))
    if activation == "gelu_tanh":
        return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
    if activation == "gelu":
        return 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0)))
    raise ValueError(f"activation_f64: unknown activation {activation!r}; known: silu, gelu_tanh, gelu")


def check_rows(m: int, count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Row indices to check: the first and last row and random ones, at most `count`, sorted.

    Returns:
        int64 CPU tensor of unique indices in [0, m).
    """
    if m <= count:
        return torch.arange(m)
    picks = torch.randperm(m - 2, generator=generator)[: count - 2] + 1
    return torch.cat([torch.tensor([0, m - 1]), picks]).unique()  # unique() sorts


class Reference:
    """float64 gate/up weights of one shape, kept while its token counts are run.

    Args:
        gate: [I, K] gate weight, any float dtype.
        up: [I, K] up weight.
        activation: the gate's activation.
    """

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, activation: str):
        self.gate = gate.to(torch.float64)
        self.up = up.to(torch.float64)
        self.activation = activation

    def preact(self, x_rows: torch.Tensor) -> torch.Tensor:
        """[rows, 2I] float64: x @ [Wg; Wu]^T, gate columns first (the stacked weight's order)."""
        x64 = x_rows.to(torch.float64)
        return torch.cat([x64 @ self.gate.T, x64 @ self.up.T], dim=1)

    def gated(self, x_rows: torch.Tensor) -> torch.Tensor:
        """[rows, I] float64: act(x @ Wg^T) * (x @ Wu^T)."""
        x64 = x_rows.to(torch.float64)
        return activation_f64(x64 @ self.gate.T, self.activation) * (x64 @ self.up.T)


def gate_up_columns(i: int, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate columns, up columns) of the interleaved [.., 2I] layout, each [I] int64: blocks of
    `block` gate rows then `block` up rows, the last, partial block its rest gate rows, then its
    rest up rows (the layout `swiglu_patch.kernels.layout` documents, written out here)."""
    idx = torch.arange(i)
    start = idx - idx % block
    width = torch.clamp(i - start, max=block)
    return 2 * start + idx % block, 2 * start + width + idx % block


def interleaved_preact_f64(x_rows: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
    """[rows, 2I] float64: P = x @ W^T on the packed [2I, K] weight, in its interleaved order."""
    return x_rows.to(torch.float64) @ packed_weight.to(torch.float64).T


def backward_f64(dy_rows: torch.Tensor, down_weight: torch.Tensor, preact_rows: torch.Tensor,
                 activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dP [rows, 2I], h [rows, I]) in float64 for y = h @ Wd^T, h = act(gate) * up, the gate and
    up columns of the interleaved P [rows, 2I]; dH = dY @ Wd [K, I] by autograd on the formula."""
    gate_cols, up_cols = gate_up_columns(down_weight.shape[1])
    p64 = preact_rows.to(torch.float64)
    gate = p64[:, gate_cols.to(p64.device)].requires_grad_()
    up = p64[:, up_cols.to(p64.device)].requires_grad_()
    with torch.enable_grad():
        h = activation_f64(gate, activation) * up
        h.backward(dy_rows.to(torch.float64) @ down_weight.to(torch.float64))
    dp = torch.empty_like(p64)
    dp[:, gate_cols.to(p64.device)], dp[:, up_cols.to(p64.device)] = gate.grad, up.grad
    return dp, h.detach()


def rel_error(out_rows: torch.Tensor, ref_rows: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in float64; inf if shapes differ or out is not finite.

    Raises:
        ValueError: the reference is all zeros (the relative error is undefined).
    """
    if tuple(out_rows.shape) != tuple(ref_rows.shape):
        return math.inf
    diff = out_rows.to(torch.float64) - ref_rows
    denom = torch.linalg.vector_norm(ref_rows).item()
    if denom == 0.0:
        raise ValueError("rel_error: the reference rows are all zero; use random, non-zero inputs")
    err = torch.linalg.vector_norm(diff).item() / denom
    return err if math.isfinite(err) else math.inf
