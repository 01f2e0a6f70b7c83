"""benchmarks/bench_train.py: the targets' verdicts by hand, the whole script on CPU (--dry-run), its
one-line errors, its module of ours (harness/train_mlps.py) against HF eager on the same weights, and
the training step it times (harness/fwd_bwd.py)."""

import json

import pytest

from benchmarks.bench_train import FLOOR, MIB, Row, main, render, targets

ROW = Row("llama-3-8b", 4096, 14336, "silu", 4096, "bfloat16")


def test_targets_by_hand():
    ways = {"hf_eager": {"ms": 6.0, "peak_mib": 784}, "liger_swiglu (LigerSwiGLUMLP)": {"ms": 5.9, "peak_mib": 560},
            "ours_store": {"ms": 5.6, "saved_mib": 224, "peak_mib": 592},
            "ours_recompute": {"ms": 7.0, "saved_mib": 0}}
    t = targets(ROW, ways)
    assert t["store: time <= 0.95 x HF eager"] is True  # 5.6 <= 5.7
    assert t["store: faster than every other way"] is True
    assert t["store: saved <= 2*M*I*2 bytes"] is True  # 224 MiB is the budget exactly
    assert t["store: peak <= Liger elementwise's"] is False
    assert t["recompute: time <= 1.15 x HF eager"] is False  # 7.0 > 6.9
    assert t["recompute: saved <= 0.1*M*I elements"] is True
    ways["ours_store"]["saved_mib"] = 2 * 4096 * 14336 * 2 / MIB + 1
    ways["ours_store"]["ms"] = 5.95
    t = targets(ROW, ways)
    assert t["store: saved <= 2*M*I*2 bytes"] is False and t["store: faster than every other way"] is False
    assert targets(ROW, {"hf_eager": {"error": "x"}})["store: time <= 0.95 x HF eager"] is None


def test_the_floor_is_a_bound_not_a_way_and_the_report_names_its_ratio():
    ways = {"hf_eager": {"ms": 6.0, "vs_eager": 1.0}, "ours_store": {"ms": 5.6, "vs_eager": 5.6 / 6},
            FLOOR: {"ms": 5.4, "vs_eager": 0.9}}
    assert targets(ROW, ways)["store: faster than every other way"] is True  # the floor is not a rival
    results = {"environment": {"gpu": {"name": "g"}, "versions": {}, "git": {}},
               "table": [{"row": ROW.__dict__, "ways": ways, "targets": targets(ROW, ways)}]}
    assert "- floor: the six GEMMs alone (cuBLAS, no elementwise op) take 0.900 x HF eager's time" in render(results)


def test_the_floor_runs_the_six_gemms_of_the_mlp_and_nothing_else():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from benchmarks.harness.train_mlps import eager_module, gemm_floor_module

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    eager, _ = eager_module("silu", 32, 48, "cpu", torch.float32)
    floor = gemm_floor_module(eager)
    x = torch.randn(5, 32, requires_grad=True)
    with Ops() as ops:
        floor(x).backward(torch.randn(5, 32))
    gemms = [n for n in ops.names if n in ("mm", "addmm", "bmm", "matmul", "linear")]
    assert len(gemms) == 6, ops.names
    elementwise = {"silu", "gelu", "mul", "add", "sigmoid", "tanh", "cat"}
    assert not elementwise & set(ops.names), ops.names
    assert x.grad.shape == x.shape and floor.gate_up.grad.shape == (96, 32) and floor.down.grad.shape == (32, 48)


@pytest.mark.slow
def test_dry_run_writes_every_section(tmp_path):
    from swiglu_patch.kernels.device import interpreting

    if not interpreting():
        with pytest.raises(SystemExit) as e:  # one line: the dry run needs the interpreter
            main(["--dry-run", "--out", str(tmp_path)])
        assert e.value.code == 2
        return
    assert main(["--dry-run", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "train.json").read_text())
    assert results["correctness"] and all(
        e["pass"] for r in results["correctness"] for errs in r["modes"].values() for e in errs.values())
    assert results["parts"] and all("error" not in p for p in results["parts"].values())
    assert "tiles" not in results  # the tile sweeps are `tune --sweep backward / preact`
    for row in results["table"]:
        for way in ("hf_eager", "ours_store", "ours_recompute"):
            assert "ms" in row["ways"][way], (way, row["ways"][way])
    assert "| ours_store |" in (tmp_path / "train.md").read_text()


def test_no_gpu_and_no_dry_run_is_one_line_and_exit_2(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the command would run")
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err and "--dry-run" in err


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_ours_module_trains_like_hf_eager_on_its_weights(act):
    import torch

    from benchmarks.harness.train_mlps import eager_module, ours_module
    from swiglu_patch.kernels.layout import interleave_gate_up

    torch.manual_seed(0)
    eager, _ = eager_module(act, 32, 48, "cpu", torch.float32)
    x, dy = torch.randn(5, 32), torch.randn(5, 32)
    xe = x.clone().requires_grad_()
    eager(xe).backward(dy)
    want_dw = interleave_gate_up(eager.gate_proj.weight.grad, eager.up_proj.weight.grad)
    for mode in ("store", "recompute"):
        ours = ours_module(eager, act, mode)
        xo = x.clone().requires_grad_()
        y = ours(xo)
        y.backward(dy)
        torch.testing.assert_close(y, eager(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xo.grad, xe.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.gate_up_interleaved.grad, want_dw, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.down.grad, eager.down_proj.weight.grad, rtol=1e-5, atol=1e-5)


def test_a_step_clears_the_gradients_and_the_errors_see_a_wrong_one():
    import torch

    from benchmarks.harness.fwd_bwd import grad_errors, memory_of, step_fn

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 4, generator=gen).requires_grad_()
    x = torch.randn(3, 4, generator=gen).requires_grad_()
    dout = torch.randn(3, 8, generator=gen)
    leaves = {"w": w, "x": x}
    ref = {"w": (dout.T @ x).detach().double(), "x": (dout @ w).detach().double()}
    step = step_fn(lambda: x @ w.T, leaves, dout)
    step()
    step()  # a second step replaces the gradients, as a Trainer's zero_grad(set_to_none=True) makes it
    assert max(grad_errors(leaves, ref).values()) < 1e-6
    w.grad[0].mul_(1.01)
    assert 1e-4 < grad_errors(leaves, ref)["w"] < 1e-2
    assert memory_of(lambda: x @ w.T, leaves, dout) == {"saved_mib": None, "peak_mib": None}  # CUDA only


def test_batched_hands_a_3d_only_module_a_batch_of_one():
    import torch

    from benchmarks.harness.train_mlps import Batched

    class ThreeDOnly(torch.nn.Module):  # as LigerMLP: B, S, K = x.shape
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            b, s, k = x.shape
            return x @ self.w.T

    inner = ThreeDOnly()
    mod = Batched(inner)
    x = torch.randn(5, 3)
    torch.testing.assert_close(mod(x), x @ inner.w.T)
    assert mod(x[None]).shape == (1, 5, 4) and [n for n, _ in mod.named_parameters()] == ["inner.w"]


def _fake_quack(monkeypatch, swap: bool) -> list:
    """A stand-in `quack.mlp` whose mlp_func is quack's math in PyTorch (its fallback path: the
    fc1 output's even columns are gate, its odd ones up), or that math with gate and up swapped.
    Returns the list of the `tuned` flags it is called with."""
    import sys
    import types

    import torch

    acts = {"swiglu": lambda g, u: torch.nn.functional.silu(g) * u,
            "geglu": lambda g, u: torch.nn.functional.gelu(g, approximate="tanh") * u}

    calls = []

    def mlp_func(x, weight1, weight2, activation, tuned=True):
        calls.append(tuned)
        p = x @ weight1.T
        gate, up = (p[..., 1::2], p[..., ::2]) if swap else (p[..., ::2], p[..., 1::2])
        return acts[activation](gate, up) @ weight2.T

    quack, mlp = types.ModuleType("quack"), types.ModuleType("quack.mlp")
    mlp.mlp_func = mlp_func
    quack.mlp = mlp
    monkeypatch.setitem(sys.modules, "quack", quack)
    monkeypatch.setitem(sys.modules, "quack.mlp", mlp)
    return calls


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_quack_module_is_checked_against_hf_eager_before_it_is_timed(monkeypatch, act):
    import torch

    from benchmarks.harness.train_mlps import eager_module, quack_module

    torch.manual_seed(0)
    eager, _ = eager_module(act, 32, 48, "cpu", torch.float32)
    _fake_quack(monkeypatch, swap=False)
    module = quack_module(act, eager, check_tokens=7)
    assert isinstance(module, torch.nn.Module)
    x = torch.randn(5, 32)
    torch.testing.assert_close(module(x), eager(x), rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for p in (*module.parameters(), *eager.parameters()))  # the check leaves no gradient
    _fake_quack(monkeypatch, swap=True)
    message = quack_module(act, eager, check_tokens=7)
    assert isinstance(message, str) and "differs from HF eager" in message
    calls = _fake_quack(monkeypatch, swap=False)
    assert isinstance(quack_module(act, eager, check_tokens=7, tuned=True), torch.nn.Module) and calls == [True]


def test_quack_module_names_a_missing_install(monkeypatch):
    import sys

    import torch

    from benchmarks.harness.train_mlps import eager_module, quack_module

    monkeypatch.setitem(sys.modules, "quack", None)  # import quack raises ImportError
    eager, _ = eager_module("silu", 32, 48, "cpu", torch.float32)
    message = quack_module("silu", eager)
    assert isinstance(message, str) and message.startswith("quack-kernels not installed")
