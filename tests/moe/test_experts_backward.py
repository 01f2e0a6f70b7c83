"""The experts block's backward (`kernels/experts_backward.py`) against float64 autograd of `experts_reference`.

On CPU the kernels run in Triton's interpreter (fp32 and fp16: the interpreter's bf16 dot is
wrong); on a GPU the compiled kernels, bf16 included. Every check draws fresh random inputs,
poisons every floating-point tensor the kernels allocate (NaN), and passes when each gradient
is within twice the error of PyTorch's own autograd in that dtype against float64, plus a small
epsilon. Then the registered op (`swiglu_patch::experts_train`) through autograd, and tiny
Qwen3-MoE and gpt-oss models trained a few steps on the kernels against eager.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import compiled_targets, rel_err
from moe.experts_grad_check import (DEVICE, DTYPES, EPILOGUES, LAYOUTS, check_gradients, expert_weights,
                                    poisoned_allocations, routing)
from swiglu_patch import apply_fused_mlp, experts_ops, ops
from swiglu_patch.experts import set_experts_mode
from swiglu_patch.kernels import dispatch
from swiglu_patch.kernels.experts_backward import experts_backward
from swiglu_patch.kernels.experts_backward_gemm import fit_wgrad_tile
from swiglu_patch.kernels.experts_reference import experts_reference
from swiglu_patch.kernels.rules import EXPERTS_BACKWARD_RULES
from zoo.tiny_zoo import build

__all__ = ["poisoned_allocations"]  # the autouse fixture, imported to apply here

@pytest.mark.parametrize("store", [True, False], ids=["store", "recompute"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe())
def test_every_gradient_in_both_modes_and_layouts(layout, dtype, store):
    """K and I off every block, biases, a sentinel slot (an expert-parallel id >= E)."""
    e, k, i, top_k, t = 5, 40, 24, 2, 7
    w = expert_weights(e, k, i, layout, True, dtype)
    x = torch.randn(t, k).to(DEVICE, dtype)
    index, weights = routing(t, e, top_k)
    index[2, 1] = e
    check_gradients(x, index, weights, w, EPILOGUES["silu"], layout, dtype, store)


@pytest.mark.parametrize("name", list(EPILOGUES))
def test_every_epilogue_at_large_magnitudes(name):
    """Inputs of scale 6 cross the clamps; gpt-oss on its own interleaved, transposed, biased layout."""
    layout = LAYOUTS[1] if name == "gpt_oss" else LAYOUTS[0]
    w = expert_weights(4, 24, 16, layout, name == "gpt_oss", torch.float32)
    x = torch.randn(6, 24).to(DEVICE) * 6.0
    index, weights = routing(6, 4, 2)
    check_gradients(x, index, weights, w, EPILOGUES[name], layout, torch.float32)


@pytest.mark.parametrize("case", ["one_token", "one_expert", "empty_expert", "sentinels", "non_contiguous", "large"])
def test_routing_and_operand_edge_cases(case):
    dtype, layout, e, k, i = torch.float32, LAYOUTS[0], 4, 32, 16
    t, top_k, skew = {"one_token": (1, 2, "uniform"), "one_expert": (21, 2, "one_expert"),
                      "empty_expert": (21, 2, "empty_expert")}.get(case, (9, 2, "uniform"))
    w = expert_weights(e, k, i, layout, True, dtype, scale=30.0 if case == "large" else 1.0)
    x = torch.randn(t, k).to(DEVICE, dtype) * (30.0 if case == "large" else 1.0)
    index, weights = routing(t, e, top_k, skew)
    if case == "sentinels":
        index[::2, 1] = e
        index[3, :] = e + 3  # a token with no local expert at all: zero gradient
    if case == "non_contiguous":
        x = torch.randn(2 * t, 2 * k).to(DEVICE, dtype)[::2, ::2]
        w = (w[0].transpose(1, 2).contiguous().transpose(1, 2), *w[1:])
    check_gradients(x, index, weights, w, EPILOGUES["silu"], layout, dtype)
    if case == "sentinels":
        grads = experts_backward(torch.randn(t, k, device=DEVICE), x, index, weights, *w[:2], EPILOGUES["silu"],
                                 layout, *w[2:])
        assert torch.equal(grads[0][3], torch.zeros_like(grads[0][3]))
        assert torch.equal(grads[5][index >= e], torch.zeros_like(grads[5][index >= e]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rule", range(len(EXPERTS_BACKWARD_RULES)))
def test_every_rule_tile(rule, dtype):
    layout = LAYOUTS[1]
    w = expert_weights(3, 40, 24, layout, True, dtype)
    x = torch.randn(11, 40).to(DEVICE, dtype)
    index, weights = routing(11, 3, 2)
    check_gradients(x, index, weights, w, EPILOGUES["gpt_oss"], layout, dtype, store=False,
           kernel="experts_backward_grouped", config=EXPERTS_BACKWARD_RULES[rule].config)


@pytest.mark.parametrize("rows", [16, 64])
def test_the_weight_gradients_reduce_a_block_in_parts(rows):
    """wgrad_rows < block_m: each block's rows reduced in block_m / rows steps, the same sums."""
    layout = LAYOUTS[0]
    w = expert_weights(5, 40, 24, layout, True, torch.float16)
    x = torch.randn(70, 40).to(DEVICE, torch.float16)
    index, weights = routing(70, 5, 2)
    config = dataclasses.replace(EXPERTS_BACKWARD_RULES[-1].config, wgrad_rows=rows)
    check_gradients(x, index, weights, w, EPILOGUES["silu"], layout, torch.float16, store=False,
           kernel="experts_backward_grouped", config=config)


@pytest.mark.parametrize("rows", [8, 48, 256])
def test_weight_gradient_rows_must_split_the_block(rows):
    with pytest.raises(ValueError, match="wgrad_rows must be a multiple of 16 that divides block_m"):
        dataclasses.replace(EXPERTS_BACKWARD_RULES[-1].config, wgrad_rows=rows)


@pytest.mark.parametrize("rule", EXPERTS_BACKWARD_RULES, ids=lambda r: r.config.short())
def test_every_rule_fits_its_shared_memory_budget(rule):
    """Each kernel's pipelined operand tiles, at the stages it launches with, fit the rule's budget for 16-bit
    and fp32 operands (fp32 halves the dH and dX block_k, as the planner does, and cuts the weight-gradient tile)."""
    c = rule.config
    budget = c.smem_budget_kib * 1024
    for size in (2, 4):
        bk = c.block_k if size == 2 else max(16, c.block_k // 2)
        dx_k = c.dx_block_k if size == 2 else max(16, c.dx_block_k // 2)
        stages = c.num_stages if c.wgrad_num_stages is None else c.wgrad_num_stages
        rows = c.wgrad_rows or c.block_m
        a, b = fit_wgrad_tile(rows, c.wgrad_block_a, c.wgrad_block_b, size, stages, budget)
        assert (a, b) == (c.wgrad_block_a, c.wgrad_block_b) or size == 4  # 16-bit runs the rule's tile
        launched_stages = max(1, min(stages, budget // (rows * (a + b) * size)))
        assert launched_stages * rows * (a + b) * size <= budget
        assert launched_stages >= min(2, stages)
        dh_stages = c.num_stages if c.dh_num_stages is None else c.dh_num_stages
        assert min(dh_stages, budget // ((c.block_m * bk + bk * c.block_n) * size)) >= 2
        assert min(c.num_stages, budget // ((c.block_m * dx_k + dx_k * c.dx_block_n) * size)) >= 2


def test_only_the_gradients_asked_for_and_the_routing_weights_dtype():
    dtype = torch.float16
    w = expert_weights(4, 32, 16, LAYOUTS[0], False, dtype)
    x = torch.randn(5, 32).to(DEVICE, dtype)
    index, weights = routing(5, 4, 2)  # fp32 routing weights beside fp16 experts
    dout = torch.randn(5, 32).to(DEVICE, dtype)
    grads = experts_backward(dout, x, index, weights, *w[:2], EPILOGUES["silu"], needs=(True, False, False, True,
                                                                                         True, True))
    assert grads[1] is grads[2] is grads[3] is grads[4] is None  # not asked for, or no bias
    assert grads[0].dtype == dtype and grads[5].dtype == torch.float32
    with pytest.raises(ValueError, match="dout must be"):
        experts_backward(dout[:, :8], x, index, weights, *w[:2], EPILOGUES["silu"])
    with pytest.raises(ValueError, match="preact must be"):
        experts_backward(dout, x, index, weights, *w[:2], EPILOGUES["silu"], preact=x)
    with pytest.raises(ValueError, match="mode must be one of"):
        set_experts_mode(torch.nn.Linear(1, 1), "keep")


def test_the_planner_names_the_backward_rule():
    text = dispatch.explain("NVIDIA H100 80GB HBM3", torch.bfloat16, 16384, 2048, 768, op="experts_backward")
    assert "experts_backward_grouped CHOSEN" in text and "on Hopper" in text
    hopper = dispatch.choose("NVIDIA H100 80GB HBM3", torch.bfloat16, 16384, 2048, 768, op="experts_backward")[1]
    other = dispatch.choose("NVIDIA A100-SXM4-80GB", torch.bfloat16, 16384, 2048, 768, op="experts_backward")[1]
    assert hopper.gpus and hopper.config.smem_budget_kib > 200 and not other.gpus and other.m == hopper.m
    assert dispatch.choose("cpu", torch.float32, 3, 40, 24, op="experts_backward")[1] is EXPERTS_BACKWARD_RULES[0]


@pytest.mark.parametrize("store", [True, False], ids=["store", "recompute"])
def test_the_registered_op_through_autograd(store):
    """`swiglu_patch::experts_train`: every input's gradient by autograd, as float64 autograd of the reference."""
    layout, epilogue = LAYOUTS[1], EPILOGUES["gpt_oss"]
    w = expert_weights(4, 24, 16, layout, True, torch.float32)
    x = torch.randn(6, 24, device=DEVICE)
    index, weights = routing(6, 4, 2)
    dout = torch.randn(6, 24, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (x, weights, *w)]
    args = (*ops.epilogue_args(epilogue.gated), epilogue.alpha, layout.transposed, layout.concatenated, store)
    out, preact = experts_ops.experts_train_op(leaves[0], index, *leaves[1:], *args)
    assert preact.shape == ((12, 32) if store else (0,))
    out.backward(dout)
    ref = [t.double().requires_grad_() for t in (x, weights, *w)]
    experts_reference(ref[0], index, ref[1], *ref[2:4], epilogue, layout, *ref[4:]).backward(dout.double())
    for mine, theirs in zip(leaves, ref):
        assert rel_err(mine.grad, theirs.grad) < 1e-5


def _train(model, ids, steps, lr=0.5):
    """Losses and router auxiliary losses of `steps` SGD steps."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        out = model(ids, labels=ids, output_router_logits=True)
        (out.loss + (0 if out.aux_loss is None else 0.01 * out.aux_loss)).backward()
        opt.step()
        opt.zero_grad()
        losses.append((out.loss.item(), None if out.aux_loss is None else out.aux_loss.item()))
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("model_type, mode", [("qwen3_moe", "store"), ("gpt_oss", "recompute")])
def test_a_tiny_moe_trains_as_eager_on_the_kernels(model_type, mode):
    """A few SGD steps, fp32: the loss and the router's auxiliary loss equal eager's to 1e-5 at every step."""
    ids = torch.randint(3, 100, (2, 9), device=DEVICE)
    runs = []
    for patched in (False, True):
        model = build(model_type).model.to(DEVICE).train()
        if patched:
            apply_fused_mlp(model, backend="triton")
            assert set_experts_mode(model, mode) > 0
        runs.append(_train(model, ids, 3))
    for (loss0, aux0), (loss1, aux1) in zip(*runs):
        assert abs(loss1 - loss0) <= 1e-5 * abs(loss0)
        assert aux0 is not None and abs(aux1 - aux0) <= 1e-5 * abs(aux0)


def _op_case(store):
    layout, epilogue = LAYOUTS[1], EPILOGUES["gpt_oss"]
    w = [t.requires_grad_() for t in expert_weights(4, 24, 16, layout, True, torch.float32)]
    x = torch.randn(6, 24, device=DEVICE, requires_grad=True)
    index, weights = routing(6, 4, 2)
    args = (*ops.epilogue_args(epilogue.gated), epilogue.alpha, layout.transposed, layout.concatenated, store)
    return x, index, weights.requires_grad_(), w, args


@pytest.mark.parametrize("store", [True, False], ids=["store", "recompute"])
def test_opcheck_the_experts_ops(store):
    """Schema, fake tensors, autograd registration; AOT dispatch (what torch.compile traces) where P is not an
    output a caller keeps (store mode's backward writes dP over the P the forward returned, as the dense op's)."""
    x, index, weights, w, args = _op_case(store)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    result = torch.library.opcheck(experts_ops.experts_train_op, (x, index, weights, *w, *args),
                                   test_utils=utils + (() if store else ("test_aot_dispatch_dynamic",)))
    assert set(result.values()) == {"SUCCESS"}, result
    if store:
        pre = torch.randn(12, 32, device=DEVICE)
        detached = [t.detach() for t in (x, weights, *w)]
        dout = torch.randn(6, 24, device=DEVICE)
        result = torch.library.opcheck(experts_ops.experts_backward_op,
                                       (dout, detached[0], index, *detached[1:], pre, *args[:-1], [True] * 6))
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("store", [True, False], ids=["store", "recompute"])
def test_torch_compile_sees_one_op_and_its_backward(store):
    x, index, weights, w, args = _op_case(store)

    def loss(x, weights, *w):
        return experts_ops.experts_train_op(x, index, weights, *w, *args)[0].square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    leaves = (x, weights, *w)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    want = torch.autograd.grad(loss(*leaves), leaves)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.slow
def test_thirty_steps_on_the_pytorch_path_as_eager():
    """The issue's convergence check on CPU through the reference (the torch backend, differentiable): a tiny
    Qwen3-MoE trained 30 SGD steps in fp32, losses and the router's auxiliary loss equal eager's to 1e-5."""
    ids = torch.randint(3, 100, (2, 9), device=DEVICE)
    runs = []
    for patched in (False, True):
        model = build("qwen3_moe").model.to(DEVICE).train()
        if patched:
            apply_fused_mlp(model, backend="torch")
        runs.append(_train(model, ids, 30, lr=0.2))
    for (loss0, aux0), (loss1, aux1) in zip(*runs):
        assert abs(loss1 - loss0) <= 1e-5 * abs(loss0) and abs(aux1 - aux0) <= 1e-5 * abs(aux0)


@pytest.mark.parametrize("store", [True, False], ids=["store", "recompute"])
def test_the_eager_function_equals_the_registered_op(store, monkeypatch):
    """`experts_ops.ExpertsTrain` (what eager calls run) gives the registered op's output and gradients bit
    for bit, and never enters torch.library's dispatch; under torch.compile the graph holds the op."""
    x, index, weights, w, args = _op_case(store)
    leaves = (x, weights, *w)
    dout = torch.randn(6, 24, device=DEVICE)

    def run(fn):
        out = fn(x, index, weights, *w, *args)[0]
        return out.detach(), torch.autograd.grad(out, leaves, dout)

    want = run(experts_ops.experts_train_op)
    with monkeypatch.context() as patch:
        patch.setattr(torch._library.custom_ops.CustomOpDef, "__call__", None)  # no registered op may run
        got = run(experts_ops.ExpertsTrain.apply)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    targets = compiled_targets(lambda *t: experts_ops.experts_train_autograd(t[0], index, t[1], *t[2:], *args)[0].sum(),
                               *leaves)
    assert "swiglu_patch.experts_train.default" in targets, targets


@pytest.mark.parametrize("train", ["registered op", "eager function"])
def test_store_mode_backpropagates_a_graph_once(train):
    """The backward writes dP over the saved P: a second backward through a store-mode graph raises
    autograd's in-place error on either path instead of reading dP as P; recompute's runs."""
    fn = experts_ops.experts_train_op if train == "registered op" else experts_ops.ExpertsTrain.apply
    for store in (True, False):
        x, index, weights, w, args = _op_case(store)
        out = fn(x, index, weights, *w, *args)[0]
        dout = torch.randn_like(out)
        first = torch.autograd.grad(out, x, dout, retain_graph=True)[0]
        if store:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                torch.autograd.grad(out, x, dout)
        else:
            assert torch.equal(torch.autograd.grad(out, x, dout)[0], first)
