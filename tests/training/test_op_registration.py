"""The registered ops around `gated_mlp`: opcheck, what the forward saves, torch.compile, the eager
path beside the registered op, errors.

What each mode may save for the backward, beyond x and the weights (the issue's budget):
store the interleaved pre-activation P [M, 2*I] and nothing else; recompute nothing.
"""

import pytest
import torch
from helpers import DEVICE, KERNEL_DTYPES, compiled_targets, make_case, packed_of
from torch.utils.checkpoint import checkpoint

from swiglu_patch import training
from swiglu_patch.kernels.layout import PackedGateUp
from swiglu_patch.ops import GatedMlp, GatedMlpDown, gated_gemm_low_rank_op, gated_mlp_dpreact_op, gated_mlp_op
from swiglu_patch.training import gated_mlp

BACKEND = "triton"  # under the interpreter on CPU


def _leaves(m=9, k=32, i=24, dtype=None, bias=True, requires_grad=True):
    dtype = dtype or KERNEL_DTYPES[-1]
    x, gate, up, bg, bu = make_case(m, k, i, dtype, bias)
    wd = (torch.randn(k, i, device=DEVICE) / i**0.5).to(dtype)
    bd = torch.randn(k, device=DEVICE).to(dtype) if bias else None
    tensors = [x, packed_of(gate, up), packed_of(bg, bu), wd, bd]
    return [t.requires_grad_(requires_grad) if t is not None else None for t in tensors]


# (store, split_at, low_rank): P stored (in two tensors from h's column split_at), the LoRA segment
OP_CASES = [(True, 0, False), (False, 0, False), (True, 0, True), (False, 0, True), (True, 16, False)]


@pytest.mark.parametrize("backend", ["torch", BACKEND])
@pytest.mark.parametrize("store, split_at, low_rank", OP_CASES)
def test_opcheck_gated_mlp(backend, store, split_at, low_rank):
    """Schema, fake tensor and autograd registration; AOT dispatch (what torch.compile traces)
    where P is not an output the caller keeps: store mode's backward writes dP over the P it
    returned, which a caller holding P would see (the functional never hands P out; its
    compile is tested below). low_rank: a LoRA segment (x_lr, b_lr) and h returned too.
    I = 40: a split at 16 leaves a partial gate/up block in the second half."""
    x, w, b, wd, bd = _leaves(i=40, dtype=torch.float32)
    x_lr = torch.randn(x.shape[0], 5, device=DEVICE, requires_grad=True) if low_rank else None
    b_lr = torch.randn(w.shape[0], 5, device=DEVICE, requires_grad=True) if low_rank else None
    args = (x, w, b, wd, x_lr, b_lr, "silu", 1.0, 1.0, 0, 0.0, store, split_at, low_rank, backend)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    if not store:
        utils += ("test_aot_dispatch_dynamic",)
    result = torch.library.opcheck(gated_mlp_op, args, test_utils=utils)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("bias", [True, False])
def test_down_computes_y_and_hands_dy_back(bias):
    """GatedMlpDown: y = h @ Wd^T + bd; its backward gives dbd and passes dY to dy_route unchanged,
    nothing to h or Wd (the gated op's backward computes dWd and dH)."""
    x, w, b, wd, bd = _leaves(dtype=torch.float32, bias=bias)
    h = torch.randn(x.shape[0], wd.shape[1], device=DEVICE, requires_grad=True)
    route = x.new_zeros(()).expand(x.shape[0], wd.shape[0]).requires_grad_(True)
    y = GatedMlpDown.apply(h, wd, bd, route)
    torch.testing.assert_close(y, torch.nn.functional.linear(h, wd, bd), rtol=0, atol=0)
    dy = torch.randn_like(y)
    inputs = [t for t in (h, wd, bd, route) if t is not None]
    grads = dict(zip(("h", "wd", "bd", "route") if bias else ("h", "wd", "route"),
                     torch.autograd.grad(y, inputs, dy, allow_unused=True)))
    assert grads["h"] is None and grads["wd"] is None
    assert torch.equal(grads["route"], dy)
    if bias:
        torch.testing.assert_close(grads["bd"], dy.sum(0))


def _counted(fn, name, calls):
    def counted(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return counted


@pytest.mark.parametrize("mode", ["store", "recompute"])
@pytest.mark.parametrize("after", ["nothing", "a square"])
def test_checkpoint_recomputation_stops_before_the_down_gemm(mode, after, monkeypatch):
    """Under non-reentrant checkpointing the recomputation runs the gated GEMM again but not y's:
    the down op saves nothing, so recomputation stops once the gated op has saved its tensors.
    With an op after the MLP that saves a tensor made from y (a square), recomputation must go
    on through the down GEMM, and the gradients still equal those without checkpointing."""
    x, w, b, wd, bd = _leaves(dtype=torch.float32)

    def layer(x, w, b, wd, bd):
        y = gated_mlp(x, PackedGateUp(w, b), wd, bd, "silu", mode, BACKEND)
        return y.square() if after == "a square" else y

    leaves = (x, w, b, wd, bd)
    dy = torch.randn(x.shape[0], wd.shape[0], device=DEVICE)
    want = torch.autograd.grad(layer(*leaves), leaves, dy)
    calls = []
    monkeypatch.setattr(training, "gated_mlp_autograd", _counted(training.gated_mlp_autograd, "gated_mlp_op", calls))
    monkeypatch.setattr(GatedMlpDown, "forward", staticmethod(_counted(GatedMlpDown.forward, "down", calls)))
    y = checkpoint(layer, *leaves, use_reentrant=False)
    got = torch.autograd.grad(y, leaves, dy)
    assert calls.count("gated_mlp_op") == 2, calls
    assert calls.count("down") == (2 if after == "a square" else 1), calls
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", BACKEND])
def test_opcheck_dpreact(backend):
    m, k, i = 9, 32, 24
    for dh_in in (None, torch.randn(m, i, device=DEVICE)):
        for split_at in (0, 16):
            preact = torch.randn(m, 2 * i, device=DEVICE)
            halves = (preact[:, :2 * split_at].clone(), preact[:, 2 * split_at:].clone()) if split_at else (preact, None)
            args = (torch.randn(m, k, device=DEVICE), torch.randn(k, i, device=DEVICE), *halves, dh_in, "gelu_tanh",
                    1.0, 1.0, 0, 0.0, backend)
            result = torch.library.opcheck(gated_mlp_dpreact_op, args)
            assert set(result.values()) == {"SUCCESS"}, result


def _saved_by_forward(mode, requires_grad=True, no_grad=False, bias=True):
    x, w, b, wd, bd = _leaves(bias=bias, requires_grad=requires_grad)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.set_grad_enabled(not no_grad):
            y = gated_mlp(x, PackedGateUp(w, b), wd, bd, "silu", mode, BACKEND)
    inputs = [t for t in (x, w, b, wd, bd) if t is not None]
    extra = [t for t in packed if not any(t.data_ptr() == s.data_ptr() and t.shape == s.shape for s in inputs)]
    return x, y, extra


def test_store_saves_the_preactivation_only():
    x, y, extra = _saved_by_forward("store")
    assert [tuple(t.shape) for t in extra] == [(x.shape[0], 2 * 24)], "store must save P [M, 2*I] and nothing else"
    assert extra[0].dtype == x.dtype


def test_recompute_saves_nothing_beyond_x_and_the_weights():
    _, _, extra = _saved_by_forward("recompute")
    assert extra == []


def test_only_the_down_bias_trainable_saves_nothing(monkeypatch):
    """dbd needs dY alone: with every other input frozen P is neither written nor saved, and dbd
    is the sum of dY's rows."""
    x, w, b, wd, bd = _leaves(requires_grad=False)
    bd.requires_grad_(True)
    store_flags = []

    eager_op = training.gated_mlp_autograd

    def recording(*args):
        store_flags.append(args[11])
        return eager_op(*args)

    monkeypatch.setattr(training, "gated_mlp_autograd", recording)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = gated_mlp(x, PackedGateUp(w, b), wd, bd, "silu", "store", BACKEND)
    assert packed == [] and store_flags == [False]
    dy = torch.randn_like(y)
    (dbd,) = torch.autograd.grad(y, bd, dy)
    torch.testing.assert_close(dbd, dy.sum(0))


@pytest.mark.parametrize("mode", ["store", "recompute"])
def test_nothing_saved_without_grad(mode):
    assert _saved_by_forward(mode, requires_grad=False)[2] == []
    assert _saved_by_forward(mode, no_grad=True)[2] == []


def test_torch_compile_store_mode_gradients_equal_eager():
    """aot_eager: the graph torch.compile builds (the op, its registered backward, the in-place
    dP) gives eager's gradients; inductor's compile of the same graph is the GPU suite's."""
    x, w, b, wd, bd = _leaves(dtype=torch.float32)

    def loss(x, w, b, wd, bd):
        return gated_mlp(x, PackedGateUp(w, b), wd, bd, "gelu_tanh", "store", BACKEND).square().sum()

    eager = torch.autograd.grad(loss(x, w, b, wd, bd), (x, w, b, wd, bd))
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(x, w, b, wd, bd), (x, w, b, wd, bd))
    for a, e in zip(got, eager):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", BACKEND])
@pytest.mark.parametrize("store, split_at, low_rank", OP_CASES)
def test_the_eager_function_equals_the_registered_op(backend, store, split_at, low_rank, monkeypatch):
    """`GatedMlp` (what eager calls run) gives the registered op's outputs and gradients bit for
    bit, and its forward and backward never enter torch.library's dispatch."""
    x, w, b, wd, _ = _leaves(i=40, dtype=torch.float32)
    x_lr = torch.randn(x.shape[0], 5, device=DEVICE, requires_grad=True) if low_rank else None
    b_lr = torch.randn(w.shape[0], 5, device=DEVICE, requires_grad=True) if low_rank else None
    leaves = [t for t in (x, w, b, wd, x_lr, b_lr) if t is not None]
    args = (x, w, b, wd, x_lr, b_lr, "gelu_tanh", 0.9, 1.1, 0, 0.0, store, split_at, low_rank, backend)
    dy = torch.randn(x.shape[0], wd.shape[0], device=DEVICE)
    dh = torch.randn(x.shape[0], wd.shape[1], device=DEVICE)

    def run(fn):
        h, preact, preact_hi, route = fn(*args)
        y = GatedMlpDown.apply(h, wd, None, route)
        outs = (y, h) if low_rank else (y,)
        grads = torch.autograd.grad(outs, leaves, (dy, dh) if low_rank else (dy,))
        return [h.detach(), preact.detach().clone(), preact_hi.detach().clone()] if not store else [h.detach()], grads

    want = run(gated_mlp_op)
    monkeypatch.setattr(torch._library.custom_ops.CustomOpDef, "__call__", None)  # no registered op may run
    got = run(GatedMlp.apply)
    for a, e in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        assert torch.equal(a, e)


def test_torch_compile_traces_the_registered_op():
    """Under torch.compile `gated_mlp` is one opaque op, ``swiglu_patch::gated_mlp``, in the graph."""
    x, w, b, wd, bd = _leaves(dtype=torch.float32)

    def loss(x, w, b, wd, bd):
        return gated_mlp(x, PackedGateUp(w, b), wd, bd, "silu", "store", BACKEND).square().sum()

    targets = compiled_targets(loss, x, w, b, wd, bd)
    assert "swiglu_patch.gated_mlp.default" in targets, targets


def test_errors_name_the_problem():
    x, w, b, wd, bd = _leaves(requires_grad=False)
    with pytest.raises(TypeError, match="must be a PackedGateUp"):
        gated_mlp(x, w, wd)
    with pytest.raises(ValueError, match="mode must be one of"):
        gated_mlp(x, PackedGateUp(w, b), wd, bd, mode="stash")
    with pytest.raises(ValueError, match="backend must be one of"):
        gated_mlp(x, PackedGateUp(w, b), wd, bd, backend="cuda")
    with pytest.raises(ValueError, match=r"down weight must be \[K, I\]"):
        gated_mlp(x, PackedGateUp(w, b), wd.t(), bd)
    with pytest.raises(ValueError, match="x must be"):
        gated_mlp(x[:, :-1], PackedGateUp(w, b), wd, bd)
    with pytest.raises(ValueError, match="down bias must be"):
        gated_mlp(x, PackedGateUp(w, b), wd, bd[:-1])
    with pytest.raises(TypeError, match="down weight must match x's dtype"):
        gated_mlp(x, PackedGateUp(w, b), wd.double(), bd)
    with pytest.raises(NotImplementedError, match="relu"):
        gated_mlp(x, PackedGateUp(w, b), wd, bd, epilogue="relu")


def test_opcheck_low_rank_inference_op():
    """``swiglu_patch::gated_gemm_low_rank`` (LoRA inference through the kernel's low-rank segment)."""

    x, w, b, _, _ = _leaves(dtype=torch.float32, requires_grad=False)
    args = (x, w, b, torch.randn(x.shape[0], 5, device=DEVICE), torch.randn(w.shape[0], 5, device=DEVICE),
            "silu", 1.0, 1.0, 0, 0.0)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    result = torch.library.opcheck(gated_gemm_low_rank_op, args, test_utils=utils)
    assert set(result.values()) == {"SUCCESS"}, result
