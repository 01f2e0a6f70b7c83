"""The numeric probe: shows that a module class computes the gated MLP a `FusedGatedMLP` would run.

For a module and the epilogue chosen for it, the probe builds two small copies of the module
(shallow copies whose gate/up/down projections are fresh fp32 nn.Linear layers of K = 24 inputs
and I = 40 intermediate rows, with the module's bias presence; a partial block of the packed
layout), runs the module class's own ``forward`` on one and a `FusedGatedMLP` (backend "torch")
built on the other, on random inputs [3, 5, K] at scales 1, 30 and 1000 (clamps show only on
large pre-activations), and compares. The user's weights are never read or touched, the
global RNG is not used (a private `torch.Generator`), and it costs about a millisecond.

Pass rule: max |fused - original| <= `TOLERANCE` * max |original| at every scale. In fp32 the
two differ by GEMM rounding only (about 1e-7 of the largest value); a dropped multiplier,
clamp, norm or bias moves outputs by far more than `TOLERANCE` (1e-5).

Refusals say what they mean (`refusal`): a forward that fails or returns the wrong thing on
the small copy is a structural mismatch, named with the module class; a numeric mismatch
(`NumericMismatch`) on a class the registry knows, whose structure is the one swiglu-patch
fuses, points at swiglu-patch itself, and the message says how to report it; on a class
matched by structure alone it means the class does more than the gated MLP.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from .kernels.epilogue import GatedEpilogue
from .module import FusedGatedMLP
from .registry import MLPFamily

PROBE_K, PROBE_I = 24, 40
SCALES = (1.0, 30.0, 1000.0)
TOLERANCE = 1e-5


class NotProven(ValueError):
    """The probe could not show that the module computes the fused epilogue; says why."""


class NumericMismatch(NotProven):
    """The module's forward ran and returned the right shape, but the fused module's numbers differ."""


def refusal(module: nn.Module, known: bool, error: ValueError) -> str:
    """The reason `apply_fused_mlp` gives for a module the probe refused, in words a user can act on.

    Args:
        module: the refused module.
        known: its class is in the registry (not only matched by structure).
        error: what `probe` raised.
    """
    if not isinstance(error, NumericMismatch):
        return str(error)
    cls = type(module).__name__
    if not known:
        return (f"{error}: {cls} is not in swiglu-patch's registry and its forward computes more (or other) math than "
                "the gated MLP act(gate(x)) * up(x) -> down that the fused module runs")
    import transformers

    model_type = getattr(getattr(module, "config", None), "model_type", None)
    return (f"{error}: the fused path disagrees with {cls}.forward although the module's structure is the one "
            f"swiglu-patch fuses for this family. This points at swiglu-patch itself (its epilogue or packing for "
            f"{cls}), not at your model. Please open an issue on swiglu-patch with the model type ({model_type}), the "
            f"transformers version ({transformers.__version__}) and this error")


def forward_arity_problem(module: nn.Module) -> str | None:
    """Why the module's forward cannot be replaced by one that takes a single tensor, or None."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]  # follows functools.wraps
    except (TypeError, ValueError) as e:
        return f"its forward's signature cannot be read ({e}); the fused module takes one input tensor"
    if len(params) != 1 or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        names = ", ".join(("**" if p.kind == p.VAR_KEYWORD else "*" if p.kind == p.VAR_POSITIONAL else "") + p.name
                          for p in params)
        return f"its forward takes ({names}); the fused module takes one input tensor"
    return None


def _small_linears(family: MLPFamily, bias: dict[str, bool], gen: torch.Generator) -> dict[str, dict]:
    """{projection name: {"weight": w, "bias": b | None}} of the probe's small layers."""
    shapes = {name: (PROBE_I, PROBE_K) for name in family.packed}
    if family.gate_up_chunked:
        shapes[family.gate_up_chunked] = (2 * PROBE_I, PROBE_K)
    shapes[family.down] = (PROBE_K, PROBE_I)
    out = {}
    for name, (n_out, n_in) in shapes.items():
        w = torch.randn(n_out, n_in, generator=gen) / n_in**0.5
        b = torch.randn(n_out, generator=gen) * 0.5 if bias[name] else None
        out[name] = {"weight": w, "bias": b}
    return out


def _small_copy(module: nn.Module, family: MLPFamily, tensors: dict[str, dict]) -> nn.Module:
    """A shallow copy of `module` whose projections are new small fp32 Linears (`module` untouched)."""
    small = copy.copy(module)
    small._parameters = dict(module._parameters)  # own dicts, so that setattr below leaves `module` alone
    small._buffers = dict(module._buffers)
    small._modules = dict(module._modules)
    for name, t in tensors.items():
        lin = nn.Linear(t["weight"].shape[1], t["weight"].shape[0], bias=t["bias"] is not None, device="meta")
        lin.weight = nn.Parameter(t["weight"].clone(), requires_grad=False)
        if t["bias"] is not None:
            lin.bias = nn.Parameter(t["bias"].clone(), requires_grad=False)
        setattr(small, name, lin)
    return small


def probe(module: nn.Module, family: MLPFamily, epilogue: GatedEpilogue, seed: int = 0) -> float:
    """Run the module class's forward and the fused module on small copies; the worst relative error.

    Args:
        module: the gated MLP module (only its class, config and plain attributes are used).
        family: where it keeps its projections.
        epilogue: what the fused module would compute.
        seed: the private generator's seed.

    Returns:
        max over scales of max |fused - original| / max |original|, at most `TOLERANCE`.

    Raises:
        NotProven: the forward failed or returned something other than one tensor of the input's
            shape (a structural mismatch).
        NumericMismatch: the forward differs from the fused module by more than `TOLERANCE`.
    """
    gen = torch.Generator().manual_seed(seed)
    bias = {name: getattr(getattr(module, name), "bias", None) is not None for name in family.projections}
    tensors = _small_linears(family, bias, gen)
    original = _small_copy(module, family, tensors)
    fused = FusedGatedMLP(_small_copy(module, family, tensors), family, epilogue, backend="torch")
    worst = 0.0
    for scale in SCALES:
        x = torch.randn(3, 5, PROBE_K, generator=gen) * scale
        with torch.no_grad():
            try:
                ref = type(module).forward(original, x)
            except Exception as e:  # noqa: BLE001 - any failure means "not proven", with its message
                raise NotProven(f"its forward failed on the probe's small copy ({type(e).__name__}: {e}): "
                                f"{type(module).__name__} is not built as the gated MLP the fused module replaces") from None
            if not isinstance(ref, torch.Tensor) or ref.shape != x.shape:
                what = type(ref).__name__ if not isinstance(ref, torch.Tensor) else f"shape {tuple(ref.shape)}"
                raise NotProven(f"its forward returns {what}, not one tensor of its input's shape: "
                                f"{type(module).__name__} is not built as the gated MLP the fused module replaces")
            out = fused(x)
        top = ref.abs().max().item()
        err = (out - ref).abs().max().item() / top if top > 0 else float("inf")
        if not err <= TOLERANCE:
            raise NumericMismatch(
                f"the numeric probe differs: the fused '{epilogue.describe()}' is off by {err:.2g} (relative, "
                f"tolerance {TOLERANCE:g}) from {type(module).__name__}.forward at input scale {scale:g}"
            )
        worst = max(worst, err)
    return worst
