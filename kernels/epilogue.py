"""The math of the gated epilogue, h = f(gate, up), as a spec every kernel and the reference share.

For pre-activations g (gate) and u (up), computed in fp32 from the packed GEMM:

    g' = gate_scale * g
    clamp == "gate":        h = out_scale * act(min(g', limit)) * clip(u, -limit, limit)
    clamp == "activation":  h = out_scale * min(act(g'), limit) * clip(u, -limit, limit)
    limit is None:          h = out_scale * act(g') * u

- activations (`ACTIVATIONS`): ``silu`` g * sigmoid(g) (Llama, Mistral, Qwen, Phi-3; HF
  ``silu``/``swish``); ``gelu_tanh`` 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) (Gemma's
  ``gelu_pytorch_tanh``, HF ``gelu_new``); ``gelu`` 0.5 g (1 + erf(g / sqrt(2))), exact.
- ``gate_scale``, ``out_scale``: Falcon-H1's ``mlp_multipliers`` (out_scale folds into h only
  where ``down_proj`` has no bias; the module applies it after down_proj otherwise).
- ``clamp="gate"`` with a ``limit``: DeepSeek-V4, GLM-5-next, gpt-oss (``swiglu_limit``);
  ``clamp="activation"``: Step-3.7 (``swiglu_limits_shared``), which clamps act(g), not g.

The Triton kernels evaluate the same formulas in fp32 on their accumulators and round once
to the output dtype; for bf16/fp16 inputs on the GPU silu and gelu_tanh take their tanh
from `tanh.approx.f32` (error at most 2^-11 of tanh, below a 16-bit output's rounding).
Each field is a compile-time constant of the kernels (`GatedEpilogue.constexprs`): the plain
epilogue (scales 1, no limit) compiles to the same code as one without these fields.

A clamp's derivative where its input equals the bound follows the installed torch's
`torch.clamp` backward (`CLIP_GRAD_AT_BOUND`, `MIN_GRAD_AT_BOUND`): torch up to 2.13 passes the
gradient there, 2.14 on passes none. The backward kernels and `ops.gated_epilogue_grad_reference`
read both, so a patched model's gradients are eager's under either torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
    "gelu": F.gelu,
}

# Integer codes passed to the kernels as constexprs.
ACTIVATION_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}
CLAMP_CODES = {None: 0, "gate": 1, "activation": 2}


def _clamp_grad_at_bound() -> tuple[bool, bool]:
    """Whether the installed torch's clamp backward passes the gradient where x equals the bound:
    (x.clamp(-L, L) at x = L, as up is clipped, and the same at -L; x.clamp(max=L) at x = L, as
    the gate or its activation is). True for torch <= 2.13, False from 2.14 (its closed interval became open).
    Asked of torch itself on two CPU scalars, whatever grad mode the importer is in."""
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.tensor([1.0, 1.0], dtype=torch.float64, requires_grad=True)
        grad = torch.autograd.grad(x[0].clamp(-1.0, 1.0) + x[1].clamp(max=1.0), x)[0].tolist()
    return grad[0] == 1.0, grad[1] == 1.0


# Where x equals the bound, does the derivative of clip(x, -L, L) (up) and of min(x, L) (the gate,
# or its activation) pass the gradient? As this process's torch.clamp does; two bools, fixed at import.
CLIP_GRAD_AT_BOUND, MIN_GRAD_AT_BOUND = _clamp_grad_at_bound()


@dataclass(frozen=True)
class GatedEpilogue:
    """What the gated GEMM computes from gate and up (see the module docstring).

    Attributes:
        activation: one of `ACTIVATIONS`.
        gate_scale: multiplies the gate pre-activation before anything else.
        out_scale: multiplies h.
        limit: the SwiGLU clamp bound (> 0), or None for no clamp.
        clamp: where the upper bound on the gate side applies: "gate" (the pre-activation)
            or "activation" (act of it); up is clipped to [-limit, limit] either way.
    """

    activation: str = "silu"
    gate_scale: float = 1.0
    out_scale: float = 1.0
    limit: float | None = None
    clamp: str = "gate"

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise NotImplementedError(
                f"GatedEpilogue: activation {self.activation!r} is not supported by the fused kernel; "
                f"supported: {', '.join(ACTIVATIONS)}"
            )
        for name in ("gate_scale", "out_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"GatedEpilogue: {name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.limit is not None:
            if not isinstance(self.limit, (int, float)) or not self.limit > 0:
                raise ValueError(f"GatedEpilogue: limit must be a positive number or None, got {self.limit!r}")
            object.__setattr__(self, "limit", None if math.isinf(self.limit) else float(self.limit))
        if self.clamp not in ("gate", "activation"):
            raise ValueError(f"GatedEpilogue: clamp must be 'gate' or 'activation', got {self.clamp!r}")

    def __hash__(self) -> int:
        # hashed on every eager kernel call (the dispatcher's plan key): computed once, on first use
        # (not in __post_init__, which torch.compile traces when code builds an epilogue)
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.activation, self.gate_scale, self.out_scale, self.limit, self.clamp))
            object.__setattr__(self, "_hash", cached)
        return cached

    @classmethod
    def of(cls, epilogue: "GatedEpilogue | str") -> "GatedEpilogue":
        """An epilogue from an activation name (the plain epilogue) or an epilogue itself."""
        return epilogue if isinstance(epilogue, GatedEpilogue) else cls(epilogue)

    @property
    def is_plain(self) -> bool:
        """act(g) * u with no scale and no clamp."""
        return self.gate_scale == 1.0 and self.out_scale == 1.0 and self.limit is None

    def constexprs(self) -> dict:
        """The kernels' compile-time epilogue arguments."""
        return dict(
            ACTIVATION=ACTIVATION_CODES[self.activation], GATE_SCALE=self.gate_scale, OUT_SCALE=self.out_scale,
            CLAMP=CLAMP_CODES[None if self.limit is None else self.clamp], LIMIT=self.limit or 0.0,
        )

    def apply(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """h from pre-activations, in their dtype (the reference upcasts to fp32 first); differentiable."""
        act = ACTIVATIONS[self.activation]
        if self.gate_scale != 1.0:
            gate = gate * self.gate_scale
        if self.limit is not None:
            up = up.clamp(-self.limit, self.limit)
            if self.clamp == "gate":
                gate = gate.clamp(max=self.limit)
        a = act(gate)
        if self.limit is not None and self.clamp == "activation":
            a = a.clamp(max=self.limit)
        h = a * up
        return h * self.out_scale if self.out_scale != 1.0 else h

    def describe(self) -> str:
        """A short human-readable form, e.g. "silu" or "silu, gate x 0.88, clamp(gate) 7"."""
        parts = [self.activation]
        if self.gate_scale != 1.0:
            parts.append(f"gate x {self.gate_scale:g}")
        if self.out_scale != 1.0:
            parts.append(f"out x {self.out_scale:g}")
        if self.limit is not None:
            parts.append(f"clamp({self.clamp}) {self.limit:g}")
        return ", ".join(parts)
