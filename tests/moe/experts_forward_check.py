"""The experts forward's checks against float64, shared by `test_experts_kernels.py` and
`test_experts_gemv.py`: seeded weights in any layout, routings (uniform, all tokens on one expert, an
expert with none), and `check_forward`: fresh inputs, a poisoned output, within twice the error of
PyTorch's own same-dtype computation (the reference in that dtype) against float64, plus a small epsilon.
"""

from __future__ import annotations

import torch

from helpers import rel_err
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.experts import experts_forward
from swiglu_patch.kernels.experts_reference import ExpertsEpilogue, ExpertsLayout, experts_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EPS = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 5e-3}
LAYOUTS = [ExpertsLayout(), ExpertsLayout(transposed=True, concatenated=False), ExpertsLayout(transposed=True),
           ExpertsLayout(concatenated=False)]
EPILOGUES = {
    "silu": ExpertsEpilogue(GatedEpilogue("silu")),
    "gelu_tanh": ExpertsEpilogue(GatedEpilogue("gelu_tanh")),
    "gelu": ExpertsEpilogue(GatedEpilogue("gelu")),
    "clamp_gate": ExpertsEpilogue(GatedEpilogue("silu", limit=1.5, clamp="gate")),
    "clamp_activation": ExpertsEpilogue(GatedEpilogue("silu", limit=0.5, clamp="activation")),
    "gpt_oss": ExpertsEpilogue(GatedEpilogue("silu", limit=1.5), alpha=1.702),
}


def expert_weights(e: int, k: int, i: int, layout: ExpertsLayout, bias: bool, dtype, scale: float = 1.0):
    gen = torch.Generator().manual_seed(e * 1000 + k + i)
    gate_up = torch.randn((e, k, 2 * i) if layout.transposed else (e, 2 * i, k), generator=gen) * k ** -0.5
    down = torch.randn((e, i, k) if layout.transposed else (e, k, i), generator=gen) * i ** -0.5
    gate_up_bias = torch.randn(e, 2 * i, generator=gen) * 0.3 if bias else None
    down_bias = torch.randn(e, k, generator=gen) * 0.3 if bias else None
    to = lambda t: None if t is None else (t * scale).to(DEVICE, dtype)  # noqa: E731
    return to(gate_up), to(down), to(gate_up_bias), to(down_bias)


def routing(t: int, e: int, top_k: int, skew: str = "uniform"):
    logits = torch.randn(t, e)
    if skew == "one_expert":  # every token's first choice is expert 0
        logits[:, 0] = 100.0
    if skew == "empty_expert":  # expert e-1 never chosen
        logits[:, -1] = -100.0
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return index.to(DEVICE), weights.to(DEVICE)


def check_forward(x, index, weights, w, epilogue, layout, kernel, dtype):
    gate_up, down, gate_up_bias, down_bias = w
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    ref = experts_reference(x.double(), index, weights.double(), f64(gate_up), f64(down), epilogue, layout,
                            f64(gate_up_bias), f64(down_bias))
    torch_err = rel_err(experts_reference(x, index, weights, gate_up, down, epilogue, layout, gate_up_bias,
                                          down_bias), ref)
    out = torch.full((x.shape[0], ref.shape[1]), float("nan"), dtype=dtype, device=DEVICE)  # poisoned
    experts_forward(x, index, weights, gate_up, down, epilogue, layout, gate_up_bias, down_bias, kernel=kernel,
                    out=out)
    assert not out.isnan().any(), "an output element was not written"
    err = rel_err(out, ref)
    assert err <= 2 * torch_err + EPS[dtype], f"error {err:.3g} vs torch's own {torch_err:.3g} ({dtype})"
