"""LoRA inside the gated GEMM: low-rank updates of gate and up as a second K segment.

A LoRA adapter on a projection W ([I, K]) adds s * (x @ A^T) @ B^T, with A [r, K], B [I, r] and
scale s. Written as one GEMM over operands concatenated along K::

    x @ W^T + s * (x @ A^T) @ B^T  =  [x | s * x @ A^T] @ [W | B]^T

so the gated GEMM on the packed weight takes the adapters as r more K columns: the
low-rank input ``x_lr = s * dropout(x) @ A^T`` ([M, r], one column block per adapter) and the
low-rank weight ``b_lr`` ([2*I, r]) in the packed row layout of `kernels/layout.py`:

    gate adapter:          b_lr = interleave_gate_up(B, 0)         (its columns are zero on up rows)
    up adapter:            b_lr = interleave_gate_up(0, B)         (zero on gate rows)
    chunked [gate; up] one (Phi-3's gate_up_proj): b_lr = interleave_gate_up(B[:I], B[I:])

Adapters stack along K: with a gate adapter of rank r_g and an up adapter of rank r_u, x_lr is
[M, r_g + r_u] and b_lr [2*I, r_g + r_u]. Then

    out = epilogue(gate(P), up(P)),   P = [x | x_lr] @ [W | b_lr]^T + bias     ([M, 2*I], interleaved)

`gated_linear_low_rank_reference` is that formula on the concatenated operands (the spec);
`gated_linear_low_rank` computes the same without copying W: P = x @ W^T + x_lr @ b_lr^T + bias
with the torch backend (differentiable: A and B get their gradients through x_lr and b_lr), and
the kernels' low-rank segment with the Triton backend (GEMV, TMA or pointer kernel; the registered
op ``swiglu_patch::gated_gemm_low_rank`` in `swiglu_patch.ops`; inference: training runs the whole MLP through
`swiglu_patch.training.gated_mlp_interleaved`, whose op takes x_lr and b_lr the same way).

Adapters on the down projection (`down_adapters`, `down_update`) are PEFT's own LoRA layer run
on h: the fused module gets h from the gated op and adds their update as PEFT's forward does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch import nn

from .kernels.epilogue import GatedEpilogue
from .kernels.layout import copy_into_interleaved, split_interleaved
from .kernels.reference import gated_linear_reference
from . import ops
from .ops import epilogue_args, gated_gemm_low_rank_op, resolve_backend

HALVES = ("gate", "up", "gate_up")


def pack_low_rank_b(b: torch.Tensor, half: str) -> torch.Tensor:
    """An adapter's B in the packed row layout, zero on the rows of the other half.

    Args:
        b: [I, r] for half "gate" or "up"; [2*I, r] chunked [gate; up] for "gate_up".
        half: which rows of the packed weight the adapter updates.

    Returns:
        [2*I, r] tensor in b's dtype and device (differentiable in b).

    Raises:
        ValueError: unknown half, or b not 2-D (or not of even rows for "gate_up").
    """
    return pack_low_rank_bs([(b, half)])


def pack_low_rank_bs(adapters: list[tuple[torch.Tensor, str]]) -> torch.Tensor:
    """Several adapters' B side by side along r in the packed row layout: `pack_low_rank_b` of each,
    concatenated, built in one buffer (one fill, one strided copy per half; no temporaries).

    Args:
        adapters: [(b, half)] as `pack_low_rank_b` takes them, all of one I, dtype and device.

    Returns:
        [2*I, sum of r] tensor in their dtype and device (differentiable in every b).

    Raises:
        ValueError: an unknown half, a b not 2-D (or not of even rows for "gate_up"), or
            adapters of different I.
    """
    rows = set()
    for b, half in adapters:
        if half not in HALVES:
            raise ValueError(f"pack_low_rank_b: half must be one of {HALVES}, got {half!r}")
        if b.dim() != 2 or (half == "gate_up" and b.shape[0] % 2):
            raise ValueError(f"pack_low_rank_b: b must be [I, r] (or [2*I, r] for 'gate_up'), got {tuple(b.shape)}")
        rows.add(b.shape[0] if half == "gate_up" else 2 * b.shape[0])
    if len(rows) != 1:
        raise ValueError(f"pack_low_rank_b: the adapters update packed weights of different rows {sorted(rows)}")
    first = adapters[0][0]
    fill = torch.empty if all(half == "gate_up" for _, half in adapters) else torch.zeros
    packed = fill((rows.pop(), sum(b.shape[1] for b, _ in adapters)), dtype=first.dtype, device=first.device)
    col = 0
    for b, half in adapters:
        gate, up = b.chunk(2) if half == "gate_up" else ((b, None) if half == "gate" else (None, b))
        copy_into_interleaved(packed[:, col : col + b.shape[1]], gate, up)
        col += b.shape[1]
    return packed


def check_low_rank(fn: str, x: torch.Tensor, weight: torch.Tensor, x_lr: torch.Tensor, b_lr: torch.Tensor) -> None:
    """Raise an error naming the problem and the fix (`fn`: the caller) unless x_lr is [..., r]
    with x's leading dims and b_lr [2*I, r], both in x's dtype and on its device."""
    if x_lr.shape[:-1] != x.shape[:-1] or b_lr.dim() != 2 or b_lr.shape != (weight.shape[0], x_lr.shape[-1]):
        raise ValueError(
            f"{fn}: x_lr must be [..., r] with x's leading dims {tuple(x.shape[:-1])} and b_lr "
            f"[2*I, r] = [{weight.shape[0]}, r]; got x_lr {tuple(x_lr.shape)}, b_lr {tuple(b_lr.shape)}"
        )
    for name, t in (("x_lr", x_lr), ("b_lr", b_lr)):
        if t.dtype != x.dtype or t.device != x.device:
            raise TypeError(f"{fn}: {name} must match x's dtype and device ({x.dtype} on "
                            f"{x.device}), got {t.dtype} on {t.device}; cast it with .to()")


def gated_linear_low_rank_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    x_lr: torch.Tensor,
    b_lr: torch.Tensor,
    epilogue: GatedEpilogue | str = "silu",
) -> torch.Tensor:
    """The spec: `gated_linear_reference` on [x | x_lr] against [W | b_lr] (copies W).

    Args:
        x: [M, K]; weight: [2*I, K] interleaved; bias: [2*I] or None;
        x_lr: [M, r] low-rank input; b_lr: [2*I, r] low-rank weight (packed rows); all x's dtype.

    Returns:
        [M, I] in x's dtype.
    """
    check_low_rank("gated_linear_low_rank", x, weight, x_lr, b_lr)
    return gated_linear_reference(torch.cat([x, x_lr], -1), torch.cat([weight, b_lr], -1), bias, epilogue)


def gated_linear_low_rank(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    x_lr: torch.Tensor,
    b_lr: torch.Tensor,
    epilogue: GatedEpilogue,
    backend: str = "auto",
) -> torch.Tensor:
    """epilogue(gate(P), up(P)) with P = x @ W^T + x_lr @ b_lr^T + bias: the gated linear plus low-rank updates.

    Args:
        x: [..., K] input.
        weight: [2*I, K] packed gate/up weight (interleaved), x's dtype.
        bias: [2*I] packed bias or None.
        x_lr: [..., r] low-rank input (s * dropout(x) @ A^T per adapter, concatenated), x's dtype.
        b_lr: [2*I, r] low-rank weight in the packed row layout (`pack_low_rank_b`, concatenated).
        epilogue: the gated epilogue.
        backend: "torch" (two GEMMs summed in fp32, differentiable), "triton" (the kernels'
            low-rank segment; inference only) or "auto" (Triton on CUDA).

    Returns:
        [..., I] in x's dtype.

    Raises:
        ValueError, TypeError: operands that do not fit.
        NotImplementedError: the Triton backend asked for a gradient.
    """
    check_low_rank("gated_linear_low_rank", x, weight, x_lr, b_lr)
    backend = resolve_backend(backend, x.device, "gated_linear_low_rank")
    if backend != "torch":
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, x_lr, b_lr)):
            raise NotImplementedError(
                "gated_linear_low_rank: the Triton path is for inference and an input requires grad; train through "
                "the whole MLP (swiglu_patch.training.gated_mlp_interleaved with x_lr and b_lr, what a patched "
                "model's FusedGatedMLP does), run under torch.no_grad(), or use backend='torch'"
            )
        x2d, xlr2d = x.reshape(-1, x.shape[-1]), x_lr.reshape(-1, x_lr.shape[-1])
        if torch.compiler.is_compiling():
            out = gated_gemm_low_rank_op(x2d, weight, bias, xlr2d, b_lr, *epilogue_args(epilogue))
        else:  # eager: skip the op's overhead on the hot path
            out = (ops.DISPATCH or ops.dispatcher()).gated_gemm_low_rank(x2d, weight, xlr2d, b_lr, epilogue, bias)[0]
        return out.view(*x.shape[:-1], out.shape[-1])
    acc = torch.promote_types(x.dtype, torch.float32)
    x2d, xlr2d = x.reshape(-1, x.shape[-1]), x_lr.reshape(-1, x_lr.shape[-1])
    preact = F.linear(x2d, weight, bias).to(acc) + F.linear(xlr2d, b_lr).to(acc)
    gate, up = split_interleaved(preact, -1)
    out = epilogue.apply(gate, up).to(x.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])


def low_rank_operands(wrappers, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(x_lr [..., r], b_lr [2*I, r]) of every active adapter of the layers wrapping packed projections.

    Each wrapper (`swiglu_patch.lora.PackedLoraLinear`) lists its active, unmerged adapters as
    (x_lr, b, half) through ``low_rank_operands(x)``: x_lr in x's dtype, the adapter's B in x's
    dtype and the half of the packed rows it updates (`pack_low_rank_b`). They are concatenated
    along r in the wrappers' order (gate before up), which is also the order plain PEFT draws
    their dropout masks in; b_lr is built in one buffer (`pack_low_rank_bs`).

    Returns:
        The concatenated pair, or (None, None) when no adapter is active.

    Raises:
        TypeError: a wrapper that cannot say what it adds.
    """
    adapters = []
    for w in wrappers:
        operands = getattr(w, "low_rank_operands", None)
        if operands is None:
            raise TypeError(
                f"FusedGatedMLP: a packed projection is wrapped by {type(w).__module__}.{type(w).__name__}, which "
                "the fused GEMM cannot run; LoRA layers over it come from swiglu_patch.lora (get_peft_model on "
                "the patched model makes them)"
            )
        adapters += operands(x)
    if not adapters:
        return None, None
    b_lr = pack_low_rank_bs([(b, half) for _, b, half in adapters])
    x_lr = adapters[0][0] if len(adapters) == 1 else torch.cat([a[0] for a in adapters], -1)
    return x_lr, b_lr


_CACHE = "_swiglu_low_rank_cache"  # on the fused module: (key, weights, a_cat, scale, b_lr) of its last inference call


def inference_low_rank_operands(owner: nn.Module, wrappers, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`low_rank_operands` for a call without autograd, in fewer launches: x_lr = (x @ A_cat^T) * s
    with the adapters' A stacked into one [sum r, K] weight, and b_lr packed once; both kept on
    `owner` (the fused module, in its ``__dict__``: not a parameter, buffer or state-dict entry)
    and rebuilt when an adapter, its weights (identity, storage or in-place version), its scaling,
    the active set or x's dtype change.

    Falls back to `low_rank_operands` where a wrapper cannot list plain weights (a dropout that
    is active, a non-linear A or B, a wrapper other than swiglu_patch's).

    Returns:
        (x_lr [..., sum r] in x's dtype, b_lr [2*I, sum r] in x's dtype), or (None, None) when no
        adapter is active.
    """
    entries = []
    for w in wrappers:
        weights = getattr(w, "low_rank_weights", None)
        listed = None if weights is None else weights()
        if listed is None:
            return low_rank_operands(wrappers, x)
        entries += listed
    if not entries:
        return None, None
    # ids are unique while the cache holds the weights themselves (cached[1])
    key = (x.dtype, *((id(a), a._version, a.data_ptr(), id(b), b._version, b.data_ptr(), s, half)
                      for a, b, s, half in entries))
    cached = owner.__dict__.get(_CACHE)
    if cached is None or cached[0] != key:
        a0 = entries[0][0]
        if any(a.dtype != a0.dtype or a.device != a0.device for a, *_ in entries):
            return low_rank_operands(wrappers, x)
        with torch.no_grad():
            a_cat = a0.detach() if len(entries) == 1 else torch.cat([a.detach() for a, *_ in entries])
            scales = [s for _, _, s, _ in entries]
            scale = scales[0] if len(set(scales)) == 1 else torch.cat(
                [torch.full((a.shape[0],), s, dtype=a0.dtype, device=a0.device) for a, _, s, _ in entries])
            b_lr = pack_low_rank_bs([(b.detach().to(x.dtype), half) for _, b, _, half in entries])
        cached = (key, [(a, b) for a, b, _, _ in entries], a_cat, scale, b_lr)
        owner.__dict__[_CACHE] = cached
    _, _, a_cat, scale, b_lr = cached
    x_lr = F.linear(x if x.dtype == a_cat.dtype else x.to(a_cat.dtype), a_cat) * scale
    return x_lr.to(x.dtype), b_lr


_PEFT_LORA_LINEAR = ("peft.tuners.lora.layer", "Linear")


def down_adapters(down: nn.Module) -> tuple[nn.Module, tuple[str, ...]] | None:
    """(base layer, adapter names to add) when `down` is PEFT's plain LoRA Linear, whose forward is
    ``base_layer(h) + sum_a lora_B[a](lora_A[a](dropout[a](h))) * scaling[a]`` over the names; None
    for anything else (a LoRA variant such as DoRA, hooks on the layer, another wrapper), which
    the caller runs as a module.

    A merged layer adds nothing (its update is in the base weight), as PEFT's forward does; a
    disabled one that is still merged returns None (PEFT's forward unmerges it first).
    """
    kind = type(down)
    if (kind.__module__, kind.__name__) != _PEFT_LORA_LINEAR:
        return None
    if down._forward_hooks or down._forward_pre_hooks or "forward" in down.__dict__:
        return None
    modules = down._modules  # direct reads: nn.Module.__getattr__ costs host time on this per-call path
    base = modules["base_layer"]
    if down.disable_adapters:
        return None if down.merged else (base, ())
    if down.merged:
        return base, ()
    lora_a = modules["lora_A"]._modules
    names = tuple(a for a in down.active_adapters if a in lora_a)
    if any(a in down.lora_variant for a in names):
        return None
    return base, names


def down_update(down: nn.Module, names: tuple[str, ...], h: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """`result` (the base layer's output on h) plus the update of each named adapter of PEFT's
    LoRA Linear `down`, computed and cast back to result's dtype as its forward does."""
    dtype = result.dtype
    modules = down._modules  # direct reads: nn.Module.__getattr__ costs host time on this per-call path
    for name in names:
        lora_a, lora_b, drop = (modules[n]._modules[name] for n in ("lora_A", "lora_B", "lora_dropout"))
        if type(lora_a) is nn.Linear and type(lora_b) is nn.Linear and not (
                lora_a._forward_hooks or lora_a._forward_pre_hooks or lora_b._forward_hooks or lora_b._forward_pre_hooks):
            a, b = lora_a._parameters, lora_b._parameters
            h = down._cast_input_dtype(h, a["weight"].dtype)
            if type(drop) is not nn.Identity and drop.training:
                h = drop(h)
            update = F.linear(F.linear(h, a["weight"], a["bias"]), b["weight"], b["bias"])  # their forward
        else:
            h = down._cast_input_dtype(h, lora_a.weight.dtype)
            update = lora_b(lora_a(drop(h)))
        result = result + update * down.scaling[name]
    return result.to(dtype)
