"""LoRA on the experts inside the grouped GEMMs (`kernels/experts_low_rank.py`) against float64 autograd of
`experts_reference` with the same `ExpertsLowRank` (which equals PEFT's materialized W + s B A: see
test_the_reference_is_peft_materialized_math).

On CPU the kernels run in Triton's interpreter (fp32 and fp16); each gradient (x, routing weights, the
3-D weights, both adapters' A and B) must be within twice the error of PyTorch's own autograd in that
dtype against float64, plus a small epsilon. Tensors the kernels allocate start as NaN.
"""

from __future__ import annotations

import pytest
import torch

from helpers import compiled_targets, rel_err
from swiglu_patch import experts_lora_ops, ops
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.experts_backward import GRADIENTS
from swiglu_patch.kernels.experts_low_rank import (LOW_RANK_GRADIENTS, experts_low_rank_backward,
                                                   experts_low_rank_forward)
from swiglu_patch.kernels.experts_reference import ExpertsEpilogue, ExpertsLayout, ExpertsLowRank, experts_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EPS = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
LAYOUTS = [ExpertsLayout(), ExpertsLayout(transposed=True, concatenated=False)]
SILU = ExpertsEpilogue(GatedEpilogue("silu"))
GPT_OSS = ExpertsEpilogue(GatedEpilogue("silu", limit=1.5), alpha=1.702)
NAMES = GRADIENTS + LOW_RANK_GRADIENTS


@pytest.fixture(autouse=True)
def _poisoned_allocations(monkeypatch):
    new_empty, empty_like = torch.Tensor.new_empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poison(new_empty(self, *a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def _operands(e, k, i, r, layout, bias, dtype, which=("gate_up", "down")):
    """(weights, ExpertsLowRank): the 3-D weights (and biases) and adapters of ranks r (gate_up) and r + 3 (down)."""
    w = [torch.randn((e, k, 2 * i) if layout.transposed else (e, 2 * i, k)) * k ** -0.5,
         torch.randn((e, i, k) if layout.transposed else (e, k, i)) * i ** -0.5,
         torch.randn(e, 2 * i) * 0.3 if bias else None, torch.randn(e, k) * 0.3 if bias else None]
    rd = r + 3
    lr = [torch.randn(e, r, k) * k ** -0.5, torch.randn(e, 2 * i, r) * 0.3, 1.5,
          torch.randn(e, rd, i) * i ** -0.5, torch.randn(e, k, rd) * 0.3, 0.75]
    if "gate_up" not in which:
        lr[0] = lr[1] = None
    if "down" not in which:
        lr[3] = lr[4] = None
    cast = lambda t: t if t is None or isinstance(t, float) else t.to(DEVICE, dtype)  # noqa: E731
    return [cast(t) for t in w], ExpertsLowRank(*(cast(t) for t in lr))


def _routing(t, e, top_k, skew="uniform"):
    logits = torch.randn(t, e)
    if skew == "one_expert":
        logits[:, 0] = 100.0
    if skew == "empty_expert":
        logits[:, -1] = -100.0
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return index.to(DEVICE), weights.to(DEVICE)


def _tensors(lr: ExpertsLowRank):
    return [lr.gate_up_a, lr.gate_up_b, lr.down_a, lr.down_b]


def _autograd(x, index, weights, w, lr, epilogue, layout, dout):
    """Gradients in `NAMES` order by autograd of the reference, in the inputs' dtype."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, *w, weights, *_tensors(lr))]
    a_gu, b_gu, a_d, b_d = leaves[6:]
    low_rank = ExpertsLowRank(a_gu, b_gu, lr.gate_up_scale, a_d, b_d, lr.down_scale)
    out = experts_reference(leaves[0], index, leaves[5], *leaves[1:3], epilogue, layout, *leaves[3:5], low_rank)
    out.backward(dout)
    return [None if t is None else t.grad for t in leaves], out.detach()


def _f64(lr: ExpertsLowRank) -> ExpertsLowRank:
    return ExpertsLowRank(*(t.double() if isinstance(t, torch.Tensor) else t for t in lr))


def _check(x, index, weights, w, lr, epilogue, layout, dtype, store=True):
    """Forward and every gradient against float64 autograd, within 2x torch's own error in dtype."""
    k_out = w[1].shape[2] if layout.transposed else w[1].shape[1]
    dout = torch.randn(x.shape[0], k_out).to(DEVICE, dtype)
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    ref, out_ref = _autograd(f64(x), index, f64(weights), [f64(t) for t in w], _f64(lr), epilogue, layout,
                             dout.double())
    theirs, out_theirs = _autograd(x, index, weights, w, lr, epilogue, layout, dout)
    out, preact, x_lr, h_lr = experts_low_rank_forward(x, index, weights, *w[:2], lr, epilogue, layout, *w[2:],
                                                       store_preact=store)
    assert rel_err(out, out_ref) <= 2 * rel_err(out_theirs, out_ref) + EPS[dtype]
    ours = experts_low_rank_backward(dout, x, index, weights, *w[:2], lr, x_lr, h_lr, epilogue, layout, *w[2:],
                                     preact=preact)
    for name, o, r, t in zip(NAMES, ours, ref, theirs):
        if r is None:
            assert o is None, name
            continue
        assert o.shape == r.shape and o.dtype == t.dtype, name
        assert not o.isnan().any(), f"d{name}: an element was not written"
        err, bound = rel_err(o, r), 2 * rel_err(t, r) + EPS[dtype]
        assert err <= bound, f"d{name}: error {err:.3g} vs torch's own {rel_err(t, r):.3g} ({dtype})"


@pytest.mark.parametrize("store", [True, False], ids=["store", "recompute"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe())
def test_every_gradient_in_both_modes_and_layouts(layout, dtype, store):
    """Odd sizes (K, I, r off every block), biases, a sentinel slot."""
    e, k, i, top_k, t = 5, 40, 24, 2, 7
    w, lr = _operands(e, k, i, 5, layout, True, dtype)
    x = torch.randn(t, k).to(DEVICE, dtype)
    index, weights = _routing(t, e, top_k)
    index[2, 1] = e
    _check(x, index, weights, w, lr, GPT_OSS if layout.transposed else SILU, layout, dtype, store)


@pytest.mark.parametrize("case", ["one_token", "one_expert", "empty_expert", "gate_up_only", "down_only", "rank_64",
                                  "non_contiguous"])
def test_routing_and_adapter_edge_cases(case):
    dtype, layout, e, k, i = torch.float32, LAYOUTS[0], 4, 32, 16
    t, skew = {"one_token": (1, "uniform"), "one_expert": (21, "one_expert"),
               "empty_expert": (21, "empty_expert")}.get(case, (9, "uniform"))
    which = {"gate_up_only": ("gate_up",), "down_only": ("down",)}.get(case, ("gate_up", "down"))
    w, lr = _operands(e, k, i, 61 if case == "rank_64" else 4, layout, False, dtype, which)
    x = torch.randn(t, k).to(DEVICE, dtype)
    if case == "non_contiguous":
        x = torch.randn(2 * t, 2 * k).to(DEVICE, dtype)[::2, ::2]
    index, weights = _routing(t, e, 2, skew)
    _check(x, index, weights, w, lr, SILU, layout, dtype, store=case != "one_token")


def test_peft_strided_views_are_read_in_place():
    """Adapters as PEFT's weights give them (A a view, B a permuted view): no copy needed, same result."""
    e, k, i, r = 3, 24, 16, 4
    w, lr = _operands(e, k, i, r, LAYOUTS[0], False, torch.float32)
    b_gu = lr.gate_up_b.permute(1, 2, 0).contiguous().permute(2, 0, 1)  # [E, 2I, r] with E innermost, as PEFT's B
    b_d = lr.down_b.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    strided = lr._replace(gate_up_b=b_gu, down_b=b_d)
    x = torch.randn(5, k, device=DEVICE)
    index, weights = _routing(5, e, 2)
    _check(x, index, weights, w, strided, SILU, LAYOUTS[0], torch.float32)


def test_the_reference_is_peft_materialized_math():
    """experts_reference with adapters equals it on W + s * B_e @ A_e (float64)."""
    for layout in LAYOUTS:
        w, lr = _operands(4, 24, 16, 3, layout, True, torch.float64)
        x = torch.randn(6, 24, device=DEVICE, dtype=torch.float64)
        index, weights = _routing(6, 4, 2)
        delta_gu = lr.gate_up_scale * lr.gate_up_b @ lr.gate_up_a  # [E, 2I, K]
        delta_d = lr.down_scale * lr.down_b @ lr.down_a  # [E, K, I]
        if layout.transposed:
            delta_gu, delta_d = delta_gu.transpose(1, 2), delta_d.transpose(1, 2)
        merged = experts_reference(x, index, weights, w[0] + delta_gu, w[1] + delta_d, SILU, layout, *w[2:])
        assert rel_err(experts_reference(x, index, weights, *w[:2], SILU, layout, *w[2:], lr), merged) < 1e-12


def test_errors_name_the_fix():
    w, lr = _operands(3, 24, 16, 4, LAYOUTS[0], False, torch.float32)
    x = torch.randn(5, 24, device=DEVICE)
    index, weights = _routing(5, 3, 2)
    with pytest.raises(ValueError, match="needs both A and B"):
        experts_low_rank_forward(x, index, weights, *w[:2], lr._replace(gate_up_b=None), SILU)
    with pytest.raises(ValueError, match=r"must be A \[E=3, r, 24\]"):
        experts_low_rank_forward(x, index, weights, *w[:2], lr._replace(gate_up_a=lr.gate_up_a[:, :, :8]), SILU)
    with pytest.raises(TypeError, match="cast it with"):
        experts_low_rank_forward(x, index, weights, *w[:2], lr._replace(down_a=lr.down_a.double()), SILU)


@pytest.mark.parametrize("store", [True, False], ids=["store", "recompute"])
def test_the_registered_op_through_autograd(store):
    """`swiglu_patch::experts_lora_train`: every input's gradient by autograd, as float64 autograd of the reference."""
    layout, epilogue = LAYOUTS[1], GPT_OSS
    w, lr = _operands(4, 24, 16, 4, layout, True, torch.float32)
    x = torch.randn(6, 24, device=DEVICE)
    index, weights = _routing(6, 4, 2)
    dout = torch.randn(6, 24, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (x, weights, *w, *_tensors(lr))]
    args = (*ops.epilogue_args(epilogue.gated), epilogue.alpha, layout.transposed, layout.concatenated, store)
    out = _train_op(leaves, index, lr, args)
    out.backward(dout)
    ref = [t.double().requires_grad_() for t in (x, weights, *w, *_tensors(lr))]
    low_rank = ExpertsLowRank(ref[6], ref[7], lr.gate_up_scale, ref[8], ref[9], lr.down_scale)
    experts_reference(ref[0], index, ref[1], *ref[2:4], epilogue, layout, *ref[4:6], low_rank).backward(dout.double())
    for mine, theirs in zip(leaves, ref):
        assert rel_err(mine.grad, theirs.grad) < 1e-5


def _train_op(leaves, index, lr, args):
    x, weights, gu, d, gub, db, a_gu, b_gu, a_d, b_d = leaves
    return experts_lora_ops.experts_lora_train_op(x, index, weights, gu, d, gub, db, a_gu, b_gu, a_d, b_d,
                                                  lr.gate_up_scale, lr.down_scale, *args)[0]


def _lora_op_case(store):
    layout, epilogue = LAYOUTS[1], GPT_OSS
    w, lr = _operands(4, 24, 16, 4, layout, True, torch.float32)
    index, weights = _routing(6, 4, 2)
    leaves = [t.clone().requires_grad_() for t in (torch.randn(6, 24, device=DEVICE), weights, *w, *_tensors(lr))]
    args = (*ops.epilogue_args(epilogue.gated), epilogue.alpha, layout.transposed, layout.concatenated, store)
    x, weights, gu, d, gub, db, a_gu, b_gu, a_d, b_d = leaves
    return leaves, (x, index, weights, gu, d, gub, db, a_gu, b_gu, a_d, b_d, lr.gate_up_scale, lr.down_scale, *args)


@pytest.mark.parametrize("store", [True, False], ids=["store", "recompute"])
def test_the_eager_function_equals_the_registered_op(store, monkeypatch):
    """`ExpertsLoraTrain` (what eager calls run) gives the registered op's output and gradients bit
    for bit and never enters torch.library's dispatch; a second backward through a store-mode graph
    raises on both paths (the backward writes dP over the saved P); the compiled graph holds the op."""
    leaves, call = _lora_op_case(store)
    dout = torch.randn(6, 24, device=DEVICE)

    def run(fn):
        out = fn(*call)[0]
        grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
        if store:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                torch.autograd.grad(out, leaves, dout)
        return out.detach(), grads

    want = run(experts_lora_ops.experts_lora_train_op)
    with monkeypatch.context() as patch:
        patch.setattr(torch._library.custom_ops.CustomOpDef, "__call__", None)  # no registered op may run
        got = run(experts_lora_ops.ExpertsLoraTrain.apply)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    targets = compiled_targets(lambda *t: experts_lora_ops.experts_lora_train_autograd(*t)[0].sum(), *call)
    assert "swiglu_patch.experts_lora_train.default" in targets, targets
