"""Store mode's P in two tensors (`training.preact_split`): where it splits, every gradient against
float64 through the split backward (`ops._backward_split`), and what it frees.

The split runs from `SPLIT_MIN_TOKENS` tokens on; these tests lower that to 1 so the interpreter's
small shapes take it. The float64 reference and the pass rule are `mlp_check.py`'s.
"""

import pytest
import torch
from helpers import EPS, KERNEL_DTYPES, packed_of, rel_err
from training.mlp_check import (BACKEND, EPILOGUES, _describe, _strided, check_all, mlp_case, reference64, run_ours,
                                same_dtype)

from swiglu_patch import ops, training
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.kernels.layout import GATE_UP_BLOCK, PackedGateUp
from swiglu_patch.training import SPLIT_MIN_TOKENS, gated_mlp, gated_mlp_interleaved, preact_split


@pytest.fixture
def split_from_one_token(monkeypatch):
    monkeypatch.setattr(training, "SPLIT_MIN_TOKENS", 1)


@pytest.fixture
def splits(monkeypatch):
    """The split points the training op was called with, in order."""
    seen = []
    call = training.gated_mlp_autograd

    def recording(*args):
        seen.append(args[-3])  # split_at
        return call(*args)

    monkeypatch.setattr(training, "gated_mlp_autograd", recording)
    return seen


def test_the_rule():
    x = torch.empty(SPLIT_MIN_TOKENS, 8)
    assert preact_split(x, 14336) == 7168
    assert preact_split(x, 3584 + 8) == 1792  # a block boundary at or below I / 2
    assert preact_split(torch.empty(4 * SPLIT_MIN_TOKENS, 8), 40) == 0  # I / 2 = 20 holds one block; M > 2(I - s)
    assert preact_split(x, 30) == 0  # I / 2 = 15: no whole block
    assert preact_split(torch.empty(SPLIT_MIN_TOKENS - 1, 8), 14336) == 0  # too few tokens to pay two launches
    assert preact_split(torch.empty(2 * (14336 - 7168) + 1, 8), 14336) == 0  # dx's part would not fit in dW
    assert preact_split(x, 14336) % GATE_UP_BLOCK == 0


@pytest.mark.parametrize("m", [1, 7, 60])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_every_gradient_matches_float64(m, dtype, bias, split_from_one_token, splits):
    """I = 53 (K = 50): the split at 16 leaves a partial gate/up block in the second half."""
    case = mlp_case(m, 50, 53, dtype, bias)
    check_all(run_ours(*case, "silu", "store", BACKEND), case, "silu")
    assert splits == [16]


@pytest.mark.parametrize("epilogue", EPILOGUES, ids=_describe)
@pytest.mark.parametrize("backend", [BACKEND, "torch"])
def test_every_epilogue_at_large_inputs(epilogue, backend, split_from_one_token, splits):
    dtype = KERNEL_DTYPES[-1]
    case = mlp_case(9, 40, 48, dtype, bias=True, scale=30.0)
    check_all(run_ours(*case, epilogue, "store", backend), case, epilogue)
    assert splits == [16]


def test_non_contiguous_x_and_dy(split_from_one_token, splits):
    x, gate, up, bg, bu, wd, bd, dy = case = mlp_case(45, 40, 64, KERNEL_DTYPES[-1], bias=True)
    xs = _strided(x).requires_grad_()
    w, b, wd_, bd_ = (t.clone().requires_grad_() for t in (packed_of(gate, up), packed_of(bg, bu), wd, bd))
    y = gated_mlp(xs, PackedGateUp(w, b), wd_, bd_, "gelu", "store", BACKEND)
    y.backward(_strided(dy))
    check_all((y.detach(), xs.grad, w.grad, b.grad, wd_.grad, bd_.grad), case, "gelu")
    assert splits == [32]


@pytest.mark.parametrize("trainable", ["x only", "weights only"])
def test_one_side_frozen(trainable, split_from_one_token, splits):
    """dx alone (LoRA on a frozen base; dx accumulates in place) or the weights alone (dW's halves)."""
    dtype = KERNEL_DTYPES[-1]
    x, gate, up, bg, bu, wd, bd, dy = case = mlp_case(7, 40, 48, dtype, bias=True)
    xg = x.clone().requires_grad_(trainable == "x only")
    w, b = packed_of(gate, up).requires_grad_(trainable != "x only"), packed_of(bg, bu)
    gated_mlp(xg, PackedGateUp(w, b), wd, bd, "silu", "store", BACKEND).backward(dy)
    got, index = (xg.grad, 1) if trainable == "x only" else (w.grad, 2)
    assert (w.grad is None) == (trainable == "x only") and (xg.grad is None) == (trainable != "x only")
    ref, same = reference64(*case, "silu")[index], same_dtype(*case, "silu")[index]
    assert rel_err(got, ref) <= 2 * rel_err(same, ref) + EPS[dtype]
    assert splits == [16]


def test_low_rank_down_gradient_reaches_both_halves(splits, monkeypatch):
    """return_h: a gradient on h (adapters on down_proj) enters each half's backward GEMM; the
    result equals the unsplit op's to fp32 rounding."""
    dtype = torch.float32
    x, gate, up, bg, bu, wd, bd, dy = mlp_case(9, 40, 48, dtype, bias=True)
    dh = torch.randn(9, 48, device=x.device)
    grads = []
    for minimum in (1, 10**9):
        monkeypatch.setattr(training, "SPLIT_MIN_TOKENS", minimum)
        leaves = [t.clone().requires_grad_() for t in (x, packed_of(gate, up), packed_of(bg, bu), wd)]
        y, h = gated_mlp_interleaved(leaves[0], leaves[1], leaves[2], leaves[3], bd, GatedEpilogue("silu"), "store",
                                     BACKEND, return_h=True)
        torch.autograd.backward((y, h), (dy, dh))
        grads.append([t.grad for t in leaves])
    assert splits == [16, 0]
    for name, split, whole in zip(("dx", "dW", "db", "dWd"), *grads):
        assert rel_err(split, whole) < 1e-5, name  # fp32: only the order of the sums differs


def test_the_first_half_is_freed_and_a_second_backward_raises(split_from_one_token, monkeypatch):
    """The backward frees dP_lo's storage before dx, and a second backward through the graph
    raises on P's bumped version before it could read the freed half."""
    x, gate, up, _, _, wd, _, dy = mlp_case(5, 40, 48, KERNEL_DTYPES[-1], bias=False)
    w = packed_of(gate, up).requires_grad_()
    xg = x.clone().requires_grad_()
    freed = []
    split = ops._backward_split

    def recording(x_, weight, lo, hi, *needs):
        out = split(x_, weight, lo, hi, *needs)
        freed.append((lo.untyped_storage().nbytes(), hi.untyped_storage().nbytes()))
        return out

    monkeypatch.setattr(ops, "_backward_split", recording)
    y = gated_mlp(xg, PackedGateUp(w), wd, None, "silu", "store", BACKEND)
    torch.autograd.grad(y, (xg, w), dy, retain_graph=True)
    assert freed == [(0, 5 * 2 * 32 * x.element_size())]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y, (xg, w), dy)


def test_never_under_torch_compile(split_from_one_token, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert preact_split(torch.empty(8, 4), 64) == 0


def test_store_saves_the_two_halves_only(split_from_one_token):
    """Beyond x and the weights, exactly P's two halves: [M, 2s] and [M, 2(I - s)], 2*M*I elements."""
    x, gate, up, bg, bu, wd, bd, _ = mlp_case(7, 40, 53, KERNEL_DTYPES[-1], bias=True)
    leaves = [t.clone().requires_grad_() for t in (x, packed_of(gate, up), packed_of(bg, bu), wd, bd)]
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        gated_mlp(leaves[0], PackedGateUp(leaves[1], leaves[2]), leaves[3], leaves[4], "silu", "store", BACKEND)
    extra = [tuple(t.shape) for t in packed if not any(t.data_ptr() == s.data_ptr() for s in leaves)]
    assert extra == [(7, 32), (7, 74)], extra
