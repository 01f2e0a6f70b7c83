"""Planted defects: the fused MLP made wrong on purpose, to measure what the verdicts can see.

`DefectPatcher(name, backend=...)` is a `Patcher`: it applies the real patch (backend "torch",
the PyTorch path of the packed layout, by default; "triton" or "auto" for the Triton kernels),
then breaks the fused modules' math in one way, and undoes both on `restore`. The probe at
patch time sees the correct class, as it would with a kernel bug that only shows on the GPU.
`DEFECTS` lists them, mildest last:

- ``swap_gate_up``: gate and up rows exchanged in every layer (act(up) * gate);
- ``zero_16`` / ``zero_1``: 16 / 1 of the I channels (the same ones in every layer, chosen with
  a fixed seed) always 0: their up rows zeroed;
- ``gate_1pct_all`` / ``gate_1pct_one``: the gate pre-activation x 1.01 in every layer / in the
  middle layer only (the epilogue's gate_scale);
- ``other_gelu``: the other GELU (exact erf for the tanh approximation, or the reverse); None
  for a silu model;
- ``preact_e4m3``: an extra rounding of the gate and up pre-activations to a 3-bit mantissa
  (float8 e4m3's precision, the range kept), before the activation.

On the Triton kernels each defect reaches the kernel itself: swapped and zeroed rows are in the
packed weight it reads, and the gate scale and the activation are compile-time constants of its
epilogue (`GatedEpilogue.constexprs`), so a planted epilogue compiles a planted kernel.
``preact_e4m3`` has no kernel form (the kernel rounds only its output) and is refused there.

Nothing here changes the model's own weights: `restore` puts back the packed weight and the
epilogue, then unpatches, so the original modules return bit for bit.
"""

from __future__ import annotations

import dataclasses

import torch

from .patching import Patcher

DEFECTS = {
    "swap_gate_up": "gate and up swapped, every layer",
    "zero_16": "16 channels zeroed, every layer",
    "zero_1": "1 channel zeroed, every layer",
    "gate_1pct_all": "gate x 1.01, every layer",
    "gate_1pct_one": "gate x 1.01, one layer",
    "other_gelu": "the other GELU variant",
    "preact_e4m3": "pre-activation rounded to 3 mantissa bits",
}
_OTHER_GELU = {"gelu_tanh": "gelu", "gelu": "gelu_tanh"}
# defects the Triton kernels cannot carry, and the refusal
KERNEL_LESS = {
    "preact_e4m3": "DefectPatcher: preact_e4m3 has no Triton kernel form (the kernel rounds only its output, "
                   "and its epilogue's constants hold no extra rounding); plant it with backend='torch'",
}


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x (any float dtype) rounded to `bits` explicit mantissa bits, to nearest even, as float32."""
    x = x.float()
    drop = 23 - bits
    if drop <= 0:
        return x
    i = x.view(torch.int32)
    half = (1 << (drop - 1)) - 1 + ((i >> drop) & 1)  # round half to even
    return ((i + half) & ~((1 << drop) - 1)).view(torch.float32)


def _gate_up_rows(intermediate: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed row of gate row i and of up row i (the layout of swiglu_patch's packed weight: blocks
    of GATE_UP_BLOCK gate rows, then as many up rows)."""
    from swiglu_patch import GATE_UP_BLOCK as G

    i = torch.arange(intermediate)
    width = torch.clamp(intermediate - (i // G) * G, max=G)
    gate = 2 * G * (i // G) + i % G
    return gate.to(device), (gate + width).to(device)


def _rounded_epilogue(epilogue, bits: int):
    """The epilogue with its inputs rounded first (a subclass: the PyTorch path calls `apply`)."""

    @dataclasses.dataclass(frozen=True)
    class Rounded(type(epilogue)):
        def apply(self, gate, up):
            return super().apply(round_mantissa(gate, bits).to(gate.dtype), round_mantissa(up, bits).to(up.dtype))

    return Rounded(**{f.name: getattr(epilogue, f.name) for f in dataclasses.fields(epilogue)})


class DefectPatcher(Patcher):
    """The real patch with one planted defect (see the module docstring).

    Args:
        defect: a key of `DEFECTS`.
        seed: chooses the zeroed channels.
        backend: the patch's backend: "torch" (the PyTorch path), "triton" (the Triton kernels;
            on CPU under TRITON_INTERPRET=1) or "auto" (Triton on CUDA, PyTorch elsewhere).

    Raises:
        ValueError: an unknown defect, one with no form on the backend (``preact_e4m3`` on the
            Triton kernels: at construction for "triton", at apply time for "auto" on CUDA), or
            one that does not apply to the model (apply time).
    """

    def __init__(self, defect: str, seed: int = 0, backend: str = "torch"):
        if defect not in DEFECTS:
            raise ValueError(f"DefectPatcher: unknown defect {defect!r}; known: {', '.join(DEFECTS)}")
        if backend not in ("torch", "triton", "auto"):
            raise ValueError(f"DefectPatcher: backend must be 'torch', 'triton' or 'auto', got {backend!r}")
        if backend == "triton" and defect in KERNEL_LESS:
            raise ValueError(KERNEL_LESS[defect])
        super().__init__(backend=backend)
        self.defect, self.seed, self._saved = defect, seed, []
        self.name = f"defect:{defect}"

    def apply(self, model: torch.nn.Module) -> str:
        from swiglu_patch import FusedGatedMLP

        d = self.defect
        if d in KERNEL_LESS and self.backend == "auto" and next(model.parameters()).device.type == "cuda":
            raise ValueError(KERNEL_LESS[d] + " (backend 'auto' runs the Triton kernels on CUDA)")
        text = super().apply(model)
        fused = [m for m in model.modules() if isinstance(m, FusedGatedMLP)]
        for k, m in enumerate(fused):
            w = m.gate_up_interleaved
            self._saved.append((m, w.detach().clone(), m.epilogue))
            gate_rows, up_rows = _gate_up_rows(w.shape[0] // 2, w.device)
            with torch.no_grad():
                if d == "swap_gate_up":
                    g, u = w[gate_rows].clone(), w[up_rows].clone()
                    w[gate_rows], w[up_rows] = u, g
                elif d.startswith("zero_"):
                    gen = torch.Generator().manual_seed(self.seed)
                    chosen = torch.randperm(len(up_rows), generator=gen)[: int(d[5:])].to(w.device)
                    w[up_rows[chosen]] = 0
                elif d == "gate_1pct_all" or (d == "gate_1pct_one" and k == len(fused) // 2):
                    m.epilogue = dataclasses.replace(m.epilogue, gate_scale=m.epilogue.gate_scale * 1.01)
                elif d == "other_gelu":
                    other = _OTHER_GELU.get(m.epilogue.activation)
                    if other is None:
                        self.restore(model)
                        raise ValueError(f"DefectPatcher: other_gelu needs a GELU model, {m.epilogue.activation} has no variant")
                    m.epilogue = dataclasses.replace(m.epilogue, activation=other)
                elif d == "preact_e4m3":
                    m.epilogue = _rounded_epilogue(m.epilogue, 3)
        return f"{text} + planted: {DEFECTS[d]}"

    def restore(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for m, w, epilogue in self._saved:
                m.gate_up_interleaved.copy_(w)
                m.epilogue = epilogue
        self._saved = []
        super().restore(model)

    def path(self, model: torch.nn.Module) -> str:
        return f"{super().path(model)} with a planted defect: {DEFECTS[self.defect]}"
