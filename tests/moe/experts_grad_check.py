"""The experts backward's gradient check, shared by `test_experts_backward.py` and
`test_experts_backward_hopper.py`: ours against float64 autograd of `experts_reference`, within
twice PyTorch's own error in the dtype; inputs, weights and routings drawn fresh; every
floating-point tensor the kernels allocate poisoned (NaN) by the `poisoned_allocations` fixture,
which a test module using the check imports; `recording`, what a kernel's `can_run` answered."""

from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.experts_backward import GRADIENTS, experts_backward, experts_forward_with_preact
from swiglu_patch.kernels.experts_reference import ExpertsEpilogue, ExpertsLayout, experts_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EPS = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
LAYOUTS = [ExpertsLayout(), ExpertsLayout(transposed=True, concatenated=False), ExpertsLayout(transposed=True),
           ExpertsLayout(concatenated=False)]
EPILOGUES = {
    "silu": ExpertsEpilogue(GatedEpilogue("silu")),
    "gelu_tanh": ExpertsEpilogue(GatedEpilogue("gelu_tanh")),
    "gelu": ExpertsEpilogue(GatedEpilogue("gelu")),
    "scaled": ExpertsEpilogue(GatedEpilogue("silu", gate_scale=0.8, out_scale=1.3)),
    "clamp_gate": ExpertsEpilogue(GatedEpilogue("silu", limit=1.5, clamp="gate")),
    "clamp_activation": ExpertsEpilogue(GatedEpilogue("silu", limit=0.5, clamp="activation")),
    "gpt_oss": ExpertsEpilogue(GatedEpilogue("silu", limit=1.5), alpha=1.702),
}


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    """Every floating-point tensor allocated with new_empty / empty_like during a test starts as NaN:
    an element a kernel should write and does not, or a row it should not read and does, shows."""
    new_empty, empty_like = torch.Tensor.new_empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poison(new_empty(self, *a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def recording(monkeypatch, module):
    """What `module.can_run` answers, call by call, from here on: the kernel a test asserts ran."""
    answers, can_run = [], module.can_run
    monkeypatch.setattr(module, "can_run", lambda *a: answers.append(can_run(*a)) or answers[-1])
    return answers


def expert_weights(e, k, i, layout, bias, dtype, scale=1.0):
    gate_up = torch.randn((e, k, 2 * i) if layout.transposed else (e, 2 * i, k)) * k ** -0.5
    down = torch.randn((e, i, k) if layout.transposed else (e, k, i)) * i ** -0.5
    gate_up_bias = torch.randn(e, 2 * i) * 0.3 if bias else None
    down_bias = torch.randn(e, k) * 0.3 if bias else None
    return tuple(None if t is None else (t * scale).to(DEVICE, dtype) for t in (gate_up, down, gate_up_bias, down_bias))


def routing(t, e, top_k, skew="uniform"):
    logits = torch.randn(t, e)
    if skew == "one_expert":  # every token's first choice is expert 0
        logits[:, 0] = 100.0
    if skew == "empty_expert":  # expert e-1 never chosen
        logits[:, -1] = -100.0
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return index.to(DEVICE), weights.to(DEVICE)


def named_case(case: str, t, e, top_k, k, i, skew, dtype):
    """(x [T, K], top_k_index, top_k_weights, (gate_up, down, None, None)) of one named case of the Hopper kernels'
    tests: SwiGLU experts in the [E, 2I, K] layout without biases; "large": inputs and weights of scale 8;
    "sentinels": every other token's second slot on an expert-parallel sentinel (id E)."""
    scale = 8.0 if case == "large" else 1.0
    w = expert_weights(e, k, i, LAYOUTS[0], False, dtype, scale)
    x = torch.randn(t, k).to(DEVICE, dtype) * scale
    index, weights = routing(t, e, top_k, skew)
    if case == "sentinels":
        index[::2, 1] = e
    return x, index, weights, w


def autograd_gradients(x, index, weights, w, epilogue, layout, dout):
    """Gradients in `GRADIENTS` order by autograd of the reference, in the inputs' dtype."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, *w, weights)]
    out = experts_reference(leaves[0], index, leaves[5], *leaves[1:3], epilogue, layout, *leaves[3:5])
    out.backward(dout)
    return [None if t is None else t.grad for t in leaves]


def check_gradients(x, index, weights, w, epilogue, layout, dtype, store=True, **kw):
    """Ours (store or recompute mode) against float64 autograd, within 2x torch's own error in dtype;
    kw (kernel, config) go to the backward."""
    dout = torch.randn(x.shape[0], w[1].shape[2] if layout.transposed else w[1].shape[1]).to(DEVICE, dtype)
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    ref = autograd_gradients(f64(x), index, f64(weights), [f64(t) for t in w], epilogue, layout, dout.double())
    theirs = autograd_gradients(x, index, weights, w, epilogue, layout, dout)
    preact = None
    if store:
        out, preact = experts_forward_with_preact(x, index, weights, *w[:2], epilogue, layout, *w[2:])
        out_ref = experts_reference(*(f64(t) for t in (x,)), index, f64(weights), *(f64(t) for t in w[:2]), epilogue,
                                    layout, *(f64(t) for t in w[2:]))
        assert rel_err(out, out_ref) <= 2 * rel_err(experts_reference(x, index, weights, *w[:2], epilogue, layout,
                                                                      *w[2:]), out_ref) + EPS[dtype]
    ours = experts_backward(dout, x, index, weights, *w[:2], epilogue, layout, *w[2:], preact=preact, **kw)
    for name, o, r, t in zip(GRADIENTS, ours, ref, theirs):
        if r is None:
            assert o is None, name
            continue
        assert o.shape == r.shape and o.dtype == t.dtype, name
        assert not o.isnan().any(), f"d{name}: an element was not written"
        err, bound = rel_err(o, r), 2 * rel_err(t, r) + EPS[dtype]
        assert err <= bound, f"d{name}: error {err:.3g} vs torch's own {rel_err(t, r):.3g} ({dtype})"
