"""The packed gate/up layout: gate rows and up rows interleaved in blocks of GATE_UP_BLOCK.

A gated MLP has gate and up weights of shape [I, K] (nn.Linear's [out, in]). The packed
weight ``gate_up_interleaved`` is [N, K] with N = 2*I, built block by block: block b holds
the w = min(G, I - b*G) gate rows b*G .. b*G+w-1, then the w matching up rows::

    rows 0   .. G-1   : gate rows 0 .. G-1
    rows G   .. 2G-1  : up   rows 0 .. G-1
    rows 2G  .. 3G-1  : gate rows G .. 2G-1
    rows 3G  .. 4G-1  : up   rows G .. 2G-1
    ...
    last block (I % G = r != 0): r gate rows, then r up rows

So gate row i sits at packed row 2*G*(i // G) + i % G and up row i at that plus w, where w
is the width of i's block. G = 16. Why 16:

- one GEMM tile over a whole number of blocks sees each gate row beside its up row, so the
  kernel computes act(gate) * up on its accumulators without touching memory;
- a column (output-dim) shard of the packed weight, as tensor parallelism cuts it, never
  separates a gate row from its up row when I / tp is a multiple of G: 16 divides I / 8 for
  every listed model (Qwen2.5-72B's I = 29568 is 8 * 3696 = 8 * 16 * 231, which a block
  of 128 would not divide);
- on Hopper, wgmma's accumulator gives each thread columns in groups of 8, so a block of 16
  keeps a gate value and its up partner in the same thread.

The packing is a pure permutation of rows: `deinterleave_gate_up(interleave_gate_up(g, u))`
returns tensors equal to g and u bit for bit, in their dtype and on their device. Biases
([I] each) pack the same way into [2*I].

`PackedGateUp` is the type the functional API takes: a packed weight (and bias) that
`pack_gate_up` made, so a tensor in another layout (Phi-3's chunked [gate; up], a
`torch.cat`) cannot be passed by mistake.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

GATE_UP_BLOCK = 16


def gate_up_rows(intermediate: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed-row index of every gate row and every up row.

    Args:
        intermediate: I, the number of gate (and of up) rows.
        device: where to build the index tensors.

    Returns:
        (gate_rows, up_rows): int64 tensors of shape [I]; ``packed[gate_rows[i]]`` is gate
        row i and ``packed[up_rows[i]]`` is up row i.
    """
    i = torch.arange(intermediate, device=device)
    block_start = (i // GATE_UP_BLOCK) * GATE_UP_BLOCK
    width = torch.clamp(intermediate - block_start, max=GATE_UP_BLOCK)
    gate = 2 * block_start + (i - block_start)
    return gate, gate + width


def _check_pair(fn: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"{fn}: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype or gate.device != up.device:
        raise TypeError(
            f"{fn}: gate and up must share dtype and device, got {gate.dtype} on {gate.device} "
            f"and {up.dtype} on {up.device}"
        )
    if gate.dim() not in (1, 2) or gate.shape[0] == 0:
        raise ValueError(f"{fn}: expected weights [I, K] or biases [I] with I >= 1, got shape {tuple(gate.shape)}")


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Interleave gate and up rows in blocks of GATE_UP_BLOCK (see the module docstring).

    Args:
        gate: [I, K] gate_proj weight (or [I] bias), any strides.
        up: [I, K] up_proj weight (or [I] bias), same dtype and device as gate.

    Returns:
        A new contiguous [2*I, K] (or [2*I]) tensor in gate's dtype and device.

    Raises:
        ValueError: shapes differ or are not 1-D/2-D.
        TypeError: dtypes or devices differ.
    """
    _check_pair("interleave_gate_up", gate, up)
    packed = torch.empty((2 * gate.shape[0], *gate.shape[1:]), dtype=gate.dtype, device=gate.device)
    copy_into_interleaved(packed, gate, up)
    return packed


def copy_into_interleaved(packed: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor | None) -> None:
    """Copy gate and up rows into their rows of an interleaved tensor, in place (one strided copy
    per half and per partial block; autograd records it as slice assignments).

    Args:
        packed: [2*I, ...] destination, any strides whose blocks `view` can split (a contiguous
            tensor or a column slice of one).
        gate, up: [I, ...] rows to write, packed's trailing shape, or None to leave that half as it is.
    """
    intermediate = packed.shape[0] // 2
    full = intermediate - intermediate % GATE_UP_BLOCK  # rows in whole blocks
    rest = intermediate - full  # the last, partial block: rest gate rows, then rest up rows
    if full:
        blocks = packed[: 2 * full].unflatten(0, (full // GATE_UP_BLOCK, 2, GATE_UP_BLOCK))
    for half, rows in enumerate((gate, up)):
        if rows is None:
            continue
        if full:
            blocks[:, half] = rows[:full].unflatten(0, (full // GATE_UP_BLOCK, GATE_UP_BLOCK))
        if rest:
            start = 2 * full + half * rest
            packed[start : start + rest] = rows[full:]


def split_interleaved(packed: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of an interleaved dimension, as new contiguous tensors.

    Uses views and one copy per half (no index tensors), so it is differentiable and safe
    under torch.inference_mode, torch.compile and CUDA graphs.

    Args:
        packed: a tensor whose dimension `dim` has size 2*I in the interleaved layout (a packed
            [2*I, K] weight with dim=0, a [M, 2*I] pre-activation with dim=-1, ...).
        dim: the interleaved dimension.

    Returns:
        (gate, up): tensors of packed's shape with size I at `dim`.
    """
    dim = dim % packed.dim()
    n = packed.shape[dim]
    intermediate = n // 2
    full = intermediate - intermediate % GATE_UP_BLOCK
    lead, rest_shape = packed.shape[:dim], packed.shape[dim + 1 :]
    gates, ups = [], []
    if full:
        blocks = packed.narrow(dim, 0, 2 * full).unflatten(dim, (full // GATE_UP_BLOCK, 2, GATE_UP_BLOCK))
        gates.append(blocks.select(dim + 1, 0).reshape(*lead, full, *rest_shape))
        ups.append(blocks.select(dim + 1, 1).reshape(*lead, full, *rest_shape))
    rest = intermediate - full
    if rest:
        gates.append(packed.narrow(dim, 2 * full, rest))
        ups.append(packed.narrow(dim, 2 * full + rest, rest))
    if len(gates) == 1:
        return gates[0].contiguous(), ups[0].contiguous()
    return torch.cat(gates, dim), torch.cat(ups, dim)


def deinterleave_gate_up(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact inverse of `interleave_gate_up`.

    Args:
        packed: [2*I, K] (or [2*I]) tensor in the interleaved layout.

    Returns:
        (gate, up): new contiguous [I, K] (or [I]) tensors, bit-identical to what was packed.

    Raises:
        ValueError: packed is not 1-D/2-D or its first dimension is odd.
    """
    if packed.dim() not in (1, 2) or packed.shape[0] % 2 or packed.shape[0] == 0:
        raise ValueError(
            f"deinterleave_gate_up: expected a packed [2*I, K] weight or [2*I] bias, got shape {tuple(packed.shape)}"
        )
    return split_interleaved(packed, 0)


class PackedGateUp(NamedTuple):
    """A gate/up weight (and bias) in the interleaved layout: what `gated_linear` takes.

    Make one with `pack_gate_up(gate_weight, up_weight, gate_bias, up_bias)`. Tensors that
    already hold the interleaved layout (a fused module's parameters) are wrapped with
    `PackedGateUp.from_interleaved`, which states that they do.

    Attributes:
        weight: [2*I, K] interleaved gate/up weight.
        bias: [2*I] interleaved gate/up bias, or None.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @classmethod
    def from_interleaved(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedGateUp":
        """Wrap tensors that are in the interleaved layout already (no copy, no check of the values)."""
        if weight.dim() != 2 or weight.shape[0] % 2 or weight.shape[0] == 0:
            raise ValueError(f"PackedGateUp: weight must be [2*I, K] with I >= 1, got shape {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"PackedGateUp: bias must be [{weight.shape[0]}], got shape {tuple(bias.shape)}")
        return cls(weight, bias)

    @property
    def intermediate_size(self) -> int:
        """I: output features of the gated linear."""
        return self.weight.shape[0] // 2

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(gate_weight [I, K], up_weight [I, K], gate_bias [I] | None, up_bias [I] | None), bit for bit."""
        gate, up = deinterleave_gate_up(self.weight)
        gate_b, up_b = deinterleave_gate_up(self.bias) if self.bias is not None else (None, None)
        return gate, up, gate_b, up_b


def pack_gate_up(
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
) -> PackedGateUp:
    """Pack a gated MLP's gate and up projections into the interleaved layout.

    Args:
        gate_weight: [I, K] (nn.Linear's [out, in]).
        up_weight: [I, K], gate_weight's dtype and device.
        gate_bias, up_bias: [I] each, or both None.

    Returns:
        A `PackedGateUp` of new contiguous tensors ([2*I, K] weight, [2*I] bias or None).

    Raises:
        ValueError: shapes that do not match, or only one of the biases given.
        TypeError: dtypes or devices that differ.
    """
    if (gate_bias is None) != (up_bias is None):
        raise ValueError("pack_gate_up: give both gate_bias and up_bias, or neither")
    weight = interleave_gate_up(gate_weight, up_weight)
    if gate_bias is None:
        return PackedGateUp(weight)
    if gate_bias.shape != (gate_weight.shape[0],):
        raise ValueError(f"pack_gate_up: biases must be [{gate_weight.shape[0]}] (I), got {tuple(gate_bias.shape)}")
    return PackedGateUp(weight, interleave_gate_up(gate_bias, up_bias))
