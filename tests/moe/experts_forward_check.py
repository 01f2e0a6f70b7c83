"""The experts forward's check against float64, shared by `test_experts_kernels.py` and
`test_experts_gemv.py`: `check_forward`, a poisoned output, within twice the error of PyTorch's own
same-dtype computation (the reference in that dtype) against float64, plus a small epsilon. The
cases (device, dtypes, layouts, epilogues, weights, routings) are the gradient check's
(`experts_grad_check.py`), re-exported here.
"""

from __future__ import annotations

import torch

from helpers import rel_err
from moe.experts_grad_check import DEVICE, DTYPES, EPILOGUES, LAYOUTS, expert_weights, routing
from swiglu_patch.kernels.experts import experts_forward
from swiglu_patch.kernels.experts_reference import experts_reference

__all__ = ["DEVICE", "DTYPES", "EPILOGUES", "EPS", "LAYOUTS", "check_forward", "expert_weights", "routing"]
EPS = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 5e-3}


def check_forward(x, index, weights, w, epilogue, layout, kernel, dtype, config=None):
    gate_up, down, gate_up_bias, down_bias = w
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    ref = experts_reference(x.double(), index, weights.double(), f64(gate_up), f64(down), epilogue, layout,
                            f64(gate_up_bias), f64(down_bias))
    torch_err = rel_err(experts_reference(x, index, weights, gate_up, down, epilogue, layout, gate_up_bias,
                                          down_bias), ref)
    out = torch.full((x.shape[0], ref.shape[1]), float("nan"), dtype=dtype, device=DEVICE)  # poisoned
    experts_forward(x, index, weights, gate_up, down, epilogue, layout, gate_up_bias, down_bias, kernel=kernel,
                    config=config, out=out)
    assert not out.isnan().any(), "an output element was not written"
    err = rel_err(out, ref)
    assert err <= 2 * torch_err + EPS[dtype], f"error {err:.3g} vs torch's own {torch_err:.3g} ({dtype})"
