"""The low-rank gated linear (`swiglu_patch.low_rank`): LoRA's update as a second K segment of the
packed gated GEMM, against the adapters written out in float64 with separate gate and up weights."""

import pytest
import torch
from helpers import ACTS, DEVICE, EPS, epilogue64, make_case, rel_err

from swiglu_patch import GatedEpilogue, pack_gate_up
from swiglu_patch.kernels.layout import gate_up_rows
from swiglu_patch.low_rank import (gated_linear_low_rank, gated_linear_low_rank_reference, pack_low_rank_b,
                                  pack_low_rank_bs)


def _adapters(k, i, ranks, dtype, chunked=False):
    """{half: (A [r, K], B [rows, r], scale)}: a gate and an up adapter, or one chunked [gate; up] adapter."""
    halves = {"gate_up": (ranks[0], 2 * i)} if chunked else {"gate": (ranks[0], i), "up": (ranks[1], i)}
    return {h: (torch.randn(r, k).to(dtype) / k**0.5, torch.randn(rows, r).to(dtype) / r**0.5, 0.5 + r / 4)
            for h, (r, rows) in halves.items()}


def _operands(x, adapters):
    """(x_lr, b_lr) for `adapters`, concatenated along r, gate first."""
    x_lr = torch.cat([(x @ a.T) * s for a, _, s in adapters.values()], -1)
    b_lr = torch.cat([pack_low_rank_b(b, h) for h, (_, b, _) in adapters.items()], -1)
    return x_lr, b_lr


def _reference64(x, gate, up, bg, bu, adapters, epilogue):
    """act(x Wg^T + bg + s_g x A_g^T B_g^T) * (x Wu^T + bu + s_u x A_u^T B_u^T), float64, nothing packed."""
    x = x.double()
    g = x @ gate.double().T + (bg.double() if bg is not None else 0)
    u = x @ up.double().T + (bu.double() if bu is not None else 0)
    for half, (a, b, s) in adapters.items():
        delta = s * (x @ a.double().T) @ b.double().T
        if half == "gate_up":
            dg, du = delta.chunk(2, -1)
            g, u = g + dg, u + du
        elif half == "gate":
            g = g + delta
        else:
            u = u + delta
    return epilogue64(g, u, epilogue)


def test_pack_low_rank_b_puts_b_on_its_half_and_zeros_on_the_other():
    i, r = 40, 3  # 40 = 2 full blocks of 16 and a partial block of 8
    b = torch.randn(i, r)
    gate_rows, up_rows = gate_up_rows(i)
    for half, on, off in (("gate", gate_rows, up_rows), ("up", up_rows, gate_rows)):
        packed = pack_low_rank_b(b, half)
        assert packed.shape == (2 * i, r)
        assert torch.equal(packed[on], b) and not packed[off].any()
    both = torch.randn(2 * i, r)
    packed = pack_low_rank_b(both, "gate_up")
    assert torch.equal(packed[gate_rows], both[:i]) and torch.equal(packed[up_rows], both[i:])
    with pytest.raises(ValueError, match="half"):
        pack_low_rank_b(b, "down")


@pytest.mark.parametrize("i", [40, 16, 7])  # whole and partial blocks, a partial block only
def test_pack_low_rank_bs_lays_adapters_side_by_side_in_one_buffer(i):
    adapters = [(torch.randn(i, 3), "gate"), (torch.randn(i, 5), "up"), (torch.randn(2 * i, 2), "gate_up")]
    for b, _ in adapters:
        b.requires_grad_(True)
    packed = pack_low_rank_bs(adapters)
    gate_rows, up_rows = gate_up_rows(i)
    assert packed.shape == (2 * i, 10)
    g, u = torch.zeros(i, 10), torch.zeros(i, 10)  # each adapter's columns, written out per half
    g[:, :3], u[:, 3:8], g[:, 8:], u[:, 8:] = adapters[0][0], adapters[1][0], adapters[2][0][:i], adapters[2][0][i:]
    assert torch.equal(packed[gate_rows], g) and torch.equal(packed[up_rows], u)
    assert torch.equal(pack_low_rank_bs(adapters[2:]), pack_low_rank_b(adapters[2][0], "gate_up"))
    weights = torch.randn(2 * i, 10)
    (packed * weights).sum().backward()  # each b's gradient: the weights at its own places
    assert torch.equal(adapters[0][0].grad, weights[gate_rows, :3])
    assert torch.equal(adapters[1][0].grad, weights[up_rows, 3:8])
    assert torch.equal(adapters[2][0].grad, torch.cat([weights[gate_rows, 8:], weights[up_rows, 8:]]))
    with pytest.raises(ValueError, match="different rows"):
        pack_low_rank_bs([(torch.randn(i, 3), "gate"), (torch.randn(i + 1, 3), "up")])


@pytest.mark.parametrize("m", [1, 7, 199])
@pytest.mark.parametrize("k,i", [(48, 40), (64, 72), (33, 16)])
@pytest.mark.parametrize("chunked", [False, True], ids=["gate+up", "chunked"])
def test_float64_matches_separate_adapters(m, k, i, chunked):
    x, gate, up, bg, bu = make_case(m, k, i, torch.float64, bias=True, device="cpu")
    adapters = _adapters(k, i, (3, 5), torch.float64, chunked)
    packed = pack_gate_up(gate, up, bg, bu)
    x_lr, b_lr = _operands(x, adapters)
    ref = _reference64(x, gate, up, bg, bu, adapters, "silu")
    epilogue = GatedEpilogue.of("silu")
    spec = gated_linear_low_rank_reference(x, packed.weight, packed.bias, x_lr, b_lr, epilogue)
    ours = gated_linear_low_rank(x, packed.weight, packed.bias, x_lr, b_lr, epilogue, backend="torch")
    assert rel_err(spec, ref) < 1e-13 and rel_err(ours, ref) < 1e-13


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", list(ACTS))
def test_same_dtype_within_twice_torch_error(backend, dtype, act):
    """Inference in fp32/fp16 (the Triton kernel on the GPU, or under the interpreter on CPU)."""
    m, k, i = 37, 64, 72
    device = DEVICE if backend == "triton" else "cpu"
    x_full, gate, up, bg, bu = make_case(2 * m, k, i, dtype, bias=True, device=device)
    x = x_full[::2]  # non-contiguous rows
    adapters = {h: (a.to(device), b.to(device), s) for h, (a, b, s) in _adapters(k, i, (4, 4), dtype).items()}
    packed = pack_gate_up(gate, up, bg, bu)
    x_lr, b_lr = _operands(x, adapters)
    with torch.no_grad():
        ours = gated_linear_low_rank(x, packed.weight, packed.bias, x_lr, b_lr, GatedEpilogue.of(act), backend)
    ref = _reference64(x, gate, up, bg, bu, adapters, act)
    # PyTorch in the same dtype, nothing fused: each projection plus its adapter, then the epilogue
    g = torch.nn.functional.linear(x, gate, bg) + x_lr[:, :4] @ adapters["gate"][1].T
    u = torch.nn.functional.linear(x, up, bu) + x_lr[:, 4:] @ adapters["up"][1].T
    plain = GatedEpilogue.of(act).apply(g, u)
    bound = 2 * rel_err(plain, ref) + EPS[dtype]
    assert ours.dtype == dtype and rel_err(ours, ref) <= bound, f"{rel_err(ours, ref):.3g} > {bound:.3g}"


def test_gradients_reach_the_adapters_as_with_separate_linears():
    """float64: d/dA, d/dB, d/dx through the packed operands equal those through separate gate/up adapters."""
    m, k, i = 9, 24, 40
    x, gate, up, _, _ = make_case(m, k, i, torch.float64, bias=False, device="cpu")
    adapters = _adapters(k, i, (3, 2), torch.float64)
    leaves = [x] + [t for a, b, _ in adapters.values() for t in (a, b)]
    for t in leaves:
        t.requires_grad_()
    weight = pack_gate_up(gate, up).weight
    x_lr, b_lr = _operands(x, adapters)
    dy = torch.randn(m, i, dtype=torch.float64)
    ours = torch.autograd.grad((gated_linear_low_rank(x, weight, None, x_lr, b_lr, GatedEpilogue.of("gelu_tanh"),
                                                      "torch") * dy).sum(), leaves)
    ref = torch.autograd.grad((_reference64(x, gate, up, None, None, adapters, "gelu_tanh") * dy).sum(), leaves)
    for name, a, b in zip(["x", "A_gate", "B_gate", "A_up", "B_up"], ours, ref):
        assert b.abs().sum() > 0 and rel_err(a, b) < 1e-12, name


def test_mismatched_operands_are_refused():
    x, gate, up, _, _ = make_case(5, 16, 16, torch.float32, bias=False, device="cpu")
    weight = pack_gate_up(gate, up).weight
    epilogue = GatedEpilogue.of("silu")
    with pytest.raises(ValueError, match="x_lr must be"):
        gated_linear_low_rank(x, weight, None, torch.zeros(4, 2), torch.zeros(32, 2), epilogue, "torch")
    with pytest.raises(TypeError, match="b_lr must match"):
        gated_linear_low_rank(x, weight, None, torch.zeros(5, 2), torch.zeros(32, 2, dtype=torch.float64), epilogue,
                              "torch")
